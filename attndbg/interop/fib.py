"""`attndbg import fib WORKLOAD.jsonl`: flashinfer-bench workloads as steps.

A workload file sits in a trace set (`<root>/workloads/<op_type>/<definition>.jsonl`); its
definition is `<root>/definitions/<op_type>/<definition>.json` and its safetensors blobs are
relative to `<root>` (interop.md §2). Their own workloads keep the integer structure (indptrs, page
ids) and replace activations with `random`: those steps replay seeded data. A workload that holds
q and the caches (attndbg's `export fib` writes them) keeps them as the step's recorded tensors.
Definitions the importer reads:
paged GQA decode and prefill (causal), ragged GQA prefill, paged MLA decode (`fib_definitions.py`
and FlashInfer's trace templates).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.interop.fib_schema import definition_problems, trace_problems
from attndbg.interop.files import index_tensor, json_lines, load_tensors, read_json
from attndbg.interop.steps import DUMMY_PAGE_NOTE, StepParts, default_sm_scale, imported_source, layer_from_pool, make_trace, mha_model, off_dummy_page, paged_rows
from attndbg.trace.build import mode_from_lengths
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, ForwardMode, LseBase, Model, Trace

ENGINE = "flashinfer-bench"
# sanitize_dumps.py writes this when a dump gave no sm_scale (interop.md §2.2): not a measured value.
FIB_FALLBACK_SCALE = 1 / math.sqrt(128)


def import_workloads(path: Path) -> Iterator[Trace | str]:
    root, definition = _definition(path)
    kind = _kind(definition, path)
    blobs: dict[Path, dict[str, Tensor]] = {}
    step = 0
    for number, line in json_lines(path):
        problems = trace_problems(line)
        if problems:
            raise TraceError(f"line {number}", problems[0], str(path))
        if line["definition"] != definition["name"]:
            raise TraceError(f"line {number}.definition", f"= {line['definition']!r}, the file is {definition['name']!r}'s", str(path))
        inputs = {name: _input(spec, root, blobs, f"line {number}.workload.inputs.{name}", path) for name, spec in line["workload"]["inputs"].items()}
        yield make_trace(_step(kind, definition, inputs, line["workload"]["axes"], step, number, path), seed=step, path=path)
        step += 1


def _definition(path: Path) -> tuple[Path, dict[str, Any]]:
    """The trace-set root and the definition of the workload file at `path`."""
    parts = path.resolve().parts
    if len(parts) < 4 or parts[-3] != "workloads":
        raise TraceError("file", "is not at <trace set>/workloads/<op_type>/<definition>.jsonl, where its definition and blobs are found", str(path))
    root = Path(*parts[:-3])
    def_path = root / "definitions" / parts[-2] / f"{path.stem}.json"
    if not def_path.exists():
        raise TraceError("definition", f"{def_path} does not exist (the workload's definition)", str(path))
    d = read_json(def_path)
    problems = definition_problems(d)
    if problems:
        raise TraceError(problems[0].split(":")[0], problems[0].split(":", 1)[-1].strip(), str(def_path))
    if d["name"] != path.stem:
        raise TraceError("name", f"= {d['name']!r}, but the file is {path.stem}.json", str(def_path))
    return root, d


def _kind(d: dict[str, Any], path: Path) -> str:
    inputs = set(d["inputs"])
    if {"q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices"} <= inputs:
        return "mla"
    if {"q", "k", "v", "qo_indptr", "kv_indptr"} <= inputs:
        return "ragged"
    if {"q", "k_cache", "v_cache", "kv_indptr", "kv_indices"} <= inputs:
        return "prefill" if "qo_indptr" in inputs else "decode"
    raise TraceError("definition", f"{d['name']!r} ({d['op_type']}) is not a paged/ragged GQA or paged MLA attention attndbg imports", str(path))


def _input(spec: dict[str, Any], root: Path, cache: dict[Path, dict[str, Tensor]], where: str, path: Path) -> Any:
    if spec["type"] == "scalar":
        return spec["value"]
    if spec["type"] == "random":
        return None
    blob = (root / spec["path"]).resolve()
    if root.resolve() not in blob.parents:
        raise TraceError(f"{where}.path", f"= {spec['path']!r} leaves the trace set", str(path))
    if not blob.exists():
        raise TraceError(f"{where}.path", f"blob {spec['path']} does not exist", str(path))
    if blob not in cache:
        cache[blob] = load_tensors(blob)
    if spec["tensor_key"] not in cache[blob]:
        raise TraceError(f"{where}.tensor_key", f"{spec['tensor_key']!r} is not in {spec['path']}", str(path))
    return cache[blob][spec["tensor_key"]]


def _const(d: dict[str, Any], name: str, path: Path) -> int:
    axis = d["axes"].get(name)
    if not isinstance(axis, dict) or axis.get("type") != "const" or not axis.get("value"):
        raise TraceError(f"axes.{name}", "missing or not a positive const axis", str(path))
    return int(axis["value"])


def _dtype(d: dict[str, Any], name: str, allowed: tuple[str, ...], path: Path) -> str:
    dtype = d["inputs"][name]["dtype"]
    if dtype not in allowed:
        raise TraceError(f"inputs.{name}.dtype", f"= {dtype}, attndbg replays {', '.join(allowed)}", str(path))
    return dtype


def _step(kind: str, d: dict[str, Any], inputs: dict[str, Any], axes: dict[str, int], step: int, number: int, path: Path) -> StepParts:
    where = f"line {number}.workload.inputs"
    inferred: dict[str, str] = {"values": "a flashinfer-bench workload keeps no activations: q and the KV are drawn from the trace's seed"}

    def index(name: str) -> Tensor:
        return index_tensor(inputs.get(name), f"{where}.{name}", path)

    scale = inputs.get("sm_scale")
    mla = kind == "mla"  # not a backend name: flashinfer-bench's definition kind (op_type)
    if mla:
        heads, ckv, kpe = _const(d, "num_qo_heads", path), _const(d, "head_dim_ckv", path), _const(d, "head_dim_kpe", path)
        dim = ckv + kpe
    else:
        heads, kv_heads, dim = _const(d, "num_qo_heads", path), _const(d, "num_kv_heads", path), _const(d, "head_dim", path)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0 or (math.isclose(scale, FIB_FALLBACK_SCALE) and dim != 128):
        scale = default_sm_scale(dim)
        inferred["model.sm_scale"] = "the workload gives none, or flashinfer-bench's 1/sqrt(128) fallback at another head_dim: 1/sqrt(head_dim)"
    q_name = "q_nope" if mla else "q"
    q_dtype = _dtype(d, q_name, Q_DTYPES, path)
    if kind == "ragged":
        qo, kv_indptr = index("qo_indptr"), index("kv_indptr")
        if qo.numel() != kv_indptr.numel():
            raise TraceError(f"{where}.kv_indptr", f"has {kv_indptr.numel()} entries, qo_indptr {qo.numel()}", str(path))
        q_lens, kv_lens = qo.diff(), kv_indptr.diff()
        rows = [torch.arange(1 + int(kv_indptr[b]), 1 + int(kv_indptr[b + 1])) for b in range(q_lens.numel())]
        size, ps = int(kv_indptr[-1]) + 1, 1
        pools = ()
        inferred["batch.slot_ids"] = "a ragged workload has no KV cache: each request's keys laid out in slots from 1"
        kv_dtype = _dtype(d, "k", tuple(DTYPES), path)
    else:
        ps = _const(d, "page_size", path)
        kv_indptr, kv_indices = index("kv_indptr"), index("kv_indices")
        pages = axes.get("num_pages") or (int(kv_indices.max()) + 1 if kv_indices.numel() else 1)
        counts = kv_indptr.diff()
        if mla:
            kv_lens = index("kv_len_arr")
        elif "kv_last_page_len" in d["inputs"]:
            kv_lens = torch.where(counts > 0, (counts - 1) * ps + index("kv_last_page_len")[: counts.numel()], 0)
        else:
            kv_lens = counts * ps
            if ps > 1:
                inferred["batch.kv_lens"] = "the definition has no kv_last_page_len: every last page taken as full"
        rows = paged_rows(indptr=kv_indptr, indices=kv_indices, kv_lens=kv_lens, page_size=ps, num_pages=pages, names=(f"{where}.kv_indptr", f"{where}.kv_indices", f"{where}.kv_last_page_len"), path=path)
        pools = _pools(inputs, mla=mla, page_size=ps, pages=pages, where=where, path=path)
        rows, pools, shifted = off_dummy_page(rows, pools, ps)
        pages += int(shifted)
        if shifted:
            inferred["batch.slot_ids"] = DUMMY_PAGE_NOTE
        size = pages * ps
        q_lens = index("qo_indptr").diff() if kind == "prefill" else torch.ones(len(rows), dtype=torch.int64)
        if q_lens.numel() != len(rows):
            raise TraceError(f"{where}.qo_indptr", f"lists {q_lens.numel()} requests, kv_indptr {len(rows)}", str(path))
        kv_dtype = _dtype(d, "ckv_cache" if mla else "k_cache", tuple(DTYPES), path)
    if bool((q_lens > kv_lens).any()):
        b = int(torch.nonzero(q_lens > kv_lens)[0, 0])
        raise TraceError(f"{where}", f"request {b} has {int(q_lens[b])} queries but {int(kv_lens[b])} keys", str(path))
    if kind != "decode" and not mla and "causal" not in d["name"]:
        inferred["causal"] = "the definition does not say: causal, as FlashInfer's prefill trace templates compute it"
    prefix = (kv_lens - q_lens).tolist()
    decode = kind in ("decode", "mla")  # not a backend name: flashinfer-bench's definition kinds
    if decode and bool((kv_lens < 1).any()):
        raise TraceError(f"{where}.kv_indptr", "a decode request without KV", str(path))
    mode = ForwardMode.DECODE if decode else mode_from_lengths(q_lens, prefix, path=str(path))
    if mla:
        model = Model(num_qo_heads=heads, num_kv_heads=1, head_dim=dim, v_head_dim=ckv, attention=AttentionKind.MLA, kv_lora_rank=ckv, qk_rope_head_dim=kpe,
                      sm_scale=float(scale), logit_cap=0.0, sliding_window=-1, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=ps)  # fmt: skip
    else:
        model = mha_model(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=dim, v_head_dim=dim, sm_scale=float(scale), logit_cap=0.0, window=-1, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=ps)
    inferred["model.sliding_window"] = "flashinfer-bench definitions carry no window or soft-cap: off"
    tensors = {}
    q = _values_q(inputs, mla=mla, shape=(int(q_lens.sum()), heads, dim), where=where, path=path)
    if q is not None and pools:
        # The workload holds values (attndbg's export writes them): kept, as the recorded tensors.
        inferred.pop("values")
        tensors[0] = layer_from_pool(rows=rows, extend_lens=q_lens.tolist(), q=q, k_pool=pools[0], v_pool=pools[1] if len(pools) > 1 else None, output=None, lse=None, lse_base=LseBase.TWO)
    return StepParts(
        source=imported_source(engine=ENGINE, version="workload", backend="flashinfer_mla" if mla else "flashinfer", step=step), model=model, mode=mode,
        prefix_lens=prefix, extend_lens=q_lens.tolist(), rows=rows, kv_cache_size=size, tensors=tensors, inferred=inferred,
    )  # fmt: skip


def _pools(inputs: dict[str, Any], *, mla: bool, page_size: int, pages: int, where: str, path: Path) -> tuple[Tensor, ...]:
    """The paged caches as slot-indexed pools ([pages * page_size, heads, dim]; MLA: one pool of
    [ckv | kpe] keys), when the workload holds their values; () when any is `random`."""
    names = ("ckv_cache", "kpe_cache") if mla else ("k_cache", "v_cache")
    caches = [inputs.get(n) for n in names]
    if not all(isinstance(c, Tensor) for c in caches):
        return ()
    for name, cache in zip(names, caches):
        if cache.dim() != (3 if mla else 4) or cache.shape[0] < pages or cache.shape[1] != page_size or cache.dtype not in DTYPES.values():
            raise TraceError(f"{where}.{name}", f"is a {str(cache.dtype).replace('torch.', '')} tensor of shape {list(cache.shape)}, expected [>= {pages} pages, {page_size}, ...]", str(path))
    if mla:
        keys = torch.cat([c.reshape(-1, c.shape[-1]) for c in caches], dim=-1)
        return (keys[:, None],)
    return tuple(c.reshape(-1, *c.shape[2:]) for c in caches)


def _values_q(inputs: dict[str, Any], *, mla: bool, shape: tuple[int, int, int], where: str, path: Path) -> Tensor | None:
    """The queries when the workload holds them ([tokens, heads, dim]; MLA: [q_nope | q_pe]), else None."""
    parts = [inputs.get(n) for n in (("q_nope", "q_pe") if mla else ("q",))]
    if not all(isinstance(p, Tensor) for p in parts):
        return None
    q = torch.cat(parts, dim=-1) if mla else parts[0]
    if tuple(q.shape) != shape or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TraceError(f"{where}.{'q_nope' if mla else 'q'}", f"is a {str(q.dtype).replace('torch.', '')} tensor of shape {list(q.shape)}, expected {list(shape)}", str(path))
    return q
