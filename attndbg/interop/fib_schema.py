"""flashinfer-bench's FlashInfer Trace schema, checked as their loader checks it, without their code.

Written from flashinfer_bench/data/{definition,workload,trace}.py and data/validate.py
(flashinfer-ai/flashinfer-bench @ 40e6ca7844b5): a Definition (name, op_type, axes const|var,
inputs/outputs with a shape of axis names or null for a scalar and a dtype of `DTYPES`, a
`reference` that parses and defines a top-level `run`, constraints that parse as expressions,
input and output names disjoint, every shape's axes defined); a workload Trace line (definition,
workload {uuid, axes, inputs: random | scalar | safetensors}, solution and evaluation null); an
Evaluation whose status allows what it carries (correctness for PASSED and INCORRECT_NUMERICAL,
performance for PASSED only; TIMEOUT is a status); and the dataset checks of `validate.py`: paths
`definitions/<op_type>/<name>.json`, `workloads/<op_type>/<name>.jsonl`, every variable axis given
and positive, no extra axis, input names exactly the definition's, scalars where the definition
has a null shape, blobs that exist, hold the key and match the inferred shape.

`definition_problems`, `workload_problems` and `check_trace_set` return the problems found (empty
when valid): the importer turns the first into an error, the tests hold exports to none.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1", "int64", "int32", "int16", "int8", "bool")
STATUSES = ("PASSED", "INCORRECT_SHAPE", "INCORRECT_NUMERICAL", "INCORRECT_DTYPE", "RUNTIME_ERROR", "COMPILE_ERROR", "TIMEOUT")


def _name(value: Any) -> bool:
    return isinstance(value, str) and len(value) >= 1


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def definition_problems(d: Any) -> list[str]:
    """What makes `d` (a parsed definition JSON) fail their `Definition` model."""
    if not isinstance(d, dict):
        return [f"definition: expected an object, found {type(d).__name__}"]
    out = [f"{key}: missing or empty" for key in ("name", "op_type", "reference") if not _name(d.get(key))]
    axes = d.get("axes")
    if not isinstance(axes, dict):
        return out + ["axes: expected an object"]
    for name, axis in axes.items():
        if not _name(name) or not isinstance(axis, dict):
            out.append(f"axes.{name}: expected an object under a non-empty name")
        elif axis.get("type") == "const":
            if not _nonneg_int(axis.get("value")):
                out.append(f"axes.{name}.value: expected a non-negative int")
        elif axis.get("type", "var") != "var":
            out.append(f"axes.{name}.type: {axis.get('type')!r}, expected const or var")
    for section in ("inputs", "outputs"):
        specs = d.get(section)
        if not isinstance(specs, dict):
            out.append(f"{section}: expected an object")
            continue
        for name, spec in specs.items():
            where = f"{section}.{name}"
            if not _name(name) or not isinstance(spec, dict):
                out.append(f"{where}: expected a tensor spec")
                continue
            if spec.get("dtype") not in DTYPES:
                out.append(f"{where}.dtype: {spec.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
            shape = spec.get("shape", ...)
            if shape is ...:
                out.append(f"{where}.shape: missing (null for a scalar)")
            elif shape is not None:
                if not isinstance(shape, list) or not all(_name(a) for a in shape):
                    out.append(f"{where}.shape: expected a list of axis names or null")
                else:
                    out += [f"{where}.shape: axis {a!r} is not defined in axes" for a in shape if a not in axes]
    if isinstance(d.get("inputs"), dict) and isinstance(d.get("outputs"), dict) and set(d["inputs"]) & set(d["outputs"]):
        out.append("inputs/outputs: names overlap")
    if _name(d.get("reference")):
        try:
            tree = ast.parse(d["reference"], mode="exec")
            if not any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in tree.body):
                out.append("reference: defines no top-level function run")
        except SyntaxError as e:
            out.append(f"reference: not valid Python ({e.msg})")
    constraints = d.get("constraints", [])
    if not isinstance(constraints, list):
        out.append("constraints: expected a list")
    else:
        for i, c in enumerate(constraints):
            try:
                if not _name(c):
                    raise SyntaxError("empty")
                ast.parse(c, mode="eval")
            except SyntaxError:
                out.append(f"constraints[{i}]: not a Python expression")
    tags = d.get("tags", [])
    if not isinstance(tags, list) or not all(_name(t) for t in tags):
        out.append("tags: expected a list of non-empty strings")
    return out


def trace_problems(t: Any) -> list[str]:
    """What makes one JSONL line fail their `Trace` model (workload lines and evaluated traces)."""
    if not isinstance(t, dict):
        return [f"expected an object, found {type(t).__name__}"]
    out = [] if _name(t.get("definition")) else ["definition: missing or empty"]
    w = t.get("workload")
    if not isinstance(w, dict):
        return out + ["workload: expected an object"]
    if not _name(w.get("uuid")):
        out.append("workload.uuid: missing or empty")
    axes = w.get("axes")
    if not isinstance(axes, dict) or not all(_nonneg_int(v) for v in axes.values()):
        out.append("workload.axes: expected an object of non-negative ints")
    inputs = w.get("inputs")
    if not isinstance(inputs, dict):
        return out + ["workload.inputs: expected an object"]
    for name, spec in inputs.items():
        where = f"workload.inputs.{name}"
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "scalar":
            value = spec.get("value")
            if not isinstance(value, (int, float, bool)) or isinstance(value, float) and not math.isfinite(value):
                out.append(f"{where}.value: expected an int, float or bool")
        elif kind == "safetensors":
            out += [f"{where}.{k}: missing or empty" for k in ("path", "tensor_key") if not _name(spec.get(k))]
        elif kind != "random":
            out.append(f"{where}.type: {kind!r}, expected random, scalar or safetensors")
    if t.get("solution") is not None and not isinstance(t.get("solution"), str):
        out.append("solution: expected a string or null")
    if t.get("evaluation") is not None:
        out += evaluation_problems(t["evaluation"])
    return out


def evaluation_problems(e: Any) -> list[str]:
    if not isinstance(e, dict):
        return ["evaluation: expected an object or null"]
    status = e.get("status")
    out = [] if status in STATUSES else [f"evaluation.status: {status!r}, expected one of {', '.join(STATUSES)}"]
    env = e.get("environment")
    if not isinstance(env, dict) or not _name(env.get("hardware")):
        out.append("evaluation.environment.hardware: missing or empty")
    if not _name(e.get("timestamp")):
        out.append("evaluation.timestamp: missing or empty")
    has_c, has_p = e.get("correctness") is not None, e.get("performance") is not None
    if status == "PASSED" and not (has_c and has_p):
        out.append("evaluation: PASSED needs correctness and performance")
    elif status == "INCORRECT_NUMERICAL" and (not has_c or has_p):
        out.append("evaluation: INCORRECT_NUMERICAL needs correctness and no performance")
    elif status not in ("PASSED", "INCORRECT_NUMERICAL") and (has_c or has_p):
        out.append(f"evaluation: {status} carries neither correctness nor performance")
    return out


def workload_problems(t: dict, d: dict, root: Path, read_shape: Any = None) -> list[str]:
    """validate.py's workload checks of one line against its definition. `read_shape(path, key)`
    returns a blob tensor's shape (None: key absent) for the blob checks."""
    w, uuid = t["workload"], t["workload"].get("uuid")
    out = []
    if t.get("solution") is not None or t.get("evaluation") is not None:
        out.append(f"{uuid}: a workload line has no solution or evaluation")
    var = {n for n, a in d["axes"].items() if a.get("type", "var") == "var"}
    given = set(w["axes"])
    out += [f"{uuid}: missing axes {sorted(var - given)}"] if var - given else []
    out += [f"{uuid}: extra axes {sorted(given - var)}"] if given - var else []
    out += [f"{uuid}: axis {n} = {v}, must be positive" for n, v in w["axes"].items() if v <= 0]
    names = set(d["inputs"])
    out += [f"{uuid}: missing inputs {sorted(names - set(w['inputs']))}"] if names - set(w["inputs"]) else []
    out += [f"{uuid}: extra inputs {sorted(set(w['inputs']) - names)}"] if set(w["inputs"]) - names else []
    if out:
        return out
    values = {**{n: a["value"] for n, a in d["axes"].items() if a.get("type") == "const"}, **w["axes"]}
    for name, spec in d["inputs"].items():
        source = w["inputs"][name]
        if source["type"] == "scalar" and spec["shape"] is not None:
            out.append(f"{uuid}: {name} is a scalar but the definition expects a tensor")
        elif source["type"] != "scalar" and spec["shape"] is None:
            out.append(f"{uuid}: {name} is {source['type']} but the definition expects a scalar")
        elif source["type"] == "safetensors":
            blob = root / source["path"]
            if not blob.exists():
                out.append(f"{uuid}: blob missing at {source['path']}")
            elif read_shape is not None:
                shape = read_shape(blob, source["tensor_key"])
                expected = tuple(values[a] for a in spec["shape"])
                if shape is None:
                    out.append(f"{uuid}: tensor key {source['tensor_key']!r} not found in {source['path']}")
                elif tuple(shape) != expected:
                    out.append(f"{uuid}: {name} shape mismatch: expected {expected}, got {tuple(shape)}")
    return out
