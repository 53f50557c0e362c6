"""attndbg repro: the scripts import no attndbg. The Triton one runs isolated (python -I, an import
of attndbg refused) under the Triton interpreter and reproduces an injected mistake (exit 1) and
passes a clean step (exit 0); the FlashInfer one compiles and makes the plan() calls the adapter
makes, read back from the script. The GPU test runs a FlashInfer script of a failing and a clean step."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.cli import main
from attndbg.detectors import registry
from attndbg.repro.script import build, write
from attndbg.trace import io
from tests.factories import make_trace

DECODE = ("decode-mha", "heads=4:2", "head_dim=64", "kv_lens=5,20,33,9")
# Runs a script with every import of attndbg refused (the venv's editable install would find it).
ISOLATED = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "attndbg" or name.startswith("attndbg."):
            raise ImportError("a repro script must not import attndbg")
sys.meta_path.insert(0, Refuse())
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run_isolated(script: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", ""), "TRITON_INTERPRET": "1", "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, "-I", "-c", ISOLATED, str(script)], capture_output=True, text=True, env=env, cwd=script.parent, timeout=300)


def _imports(text: str) -> set[str]:
    tree = ast.parse(text)
    names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    return names | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize(("mistake", "code"), [(None, 0), ("invariants:wrong-req-row", 1)], ids=["clean", "wrong-req-row"])
def test_triton_script_runs_alone_and_reproduces(tmp_path: Path, mistake: str | None, code: int) -> None:
    trace = make_trace(*DECODE, plan=True)
    if mistake:
        trace = registry.inject(trace, mistake)
    trace_file = io.save(trace, tmp_path / "step.pt")
    script = tmp_path / "repro.py"
    result = CliRunner().invoke(main, ["repro", str(trace_file), "--backend", "triton", "-o", str(script)])
    assert result.exit_code == 0, result.output
    assert "attndbg" not in _imports(script.read_text())
    ran = _run_isolated(script)
    assert ran.returncode == code, ran.stdout + ran.stderr
    assert "torch " in ran.stdout and "triton " in ran.stdout  # the versions
    assert ("reproduced: 1 of 4 rows" if code else "not reproduced") in ran.stdout
    if code:
        assert "FAIL request" in ran.stdout


class _PlanCalls:
    """A FlashInfer wrapper that keeps what plan() is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)  # a tensor or dtype: by its expression


@pytest.mark.parametrize("spec", [DECODE, ("verify", "heads=4:2", "head_dim=64", "prefix_lens=5,12,7")], ids=["decode", "verify"])
def test_flashinfer_script_makes_the_adapters_plan_call(tmp_path: Path, spec: tuple[str, ...]) -> None:
    trace = make_trace(*spec)
    trace = replace(trace, plan=FlashInferBackend().derive_plan(trace))
    repro = build(trace, "flashinfer")
    script = write(repro, tmp_path / "repro.py")[0]
    subprocess.run([sys.executable, "-m", "py_compile", str(script)], check=True)
    assert "attndbg" not in _imports(repro.text) and "flashinfer" in _imports(repro.text)
    tree = ast.parse(repro.text)
    plan_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "plan"]
    assert len(plan_calls) == 1
    # What the adapter's own plan helper passes a wrapper, beside what the script passes.
    from attndbg.backends import flashinfer as adapter

    wrapper = _PlanCalls()
    with mock.patch.object(adapter, "wait_for_pending_plans", lambda: None), mock.patch.object(torch.Tensor, "to", lambda self, *a, **k: self):
        helper = adapter._plan_decode if trace.batch.forward_mode.value == "DECODE" else adapter._plan_paged
        helper(wrapper, trace.model, trace.plan, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    (args, kwargs), = wrapper.calls
    call = plan_calls[0]
    assert sorted(k.arg for k in call.keywords) == sorted(kwargs)
    assert len(call.args) == len(args)
    for node, value in [*zip(call.args, args), *((k.value, kwargs[k.arg]) for k in call.keywords)]:
        if isinstance(value, torch.Tensor):
            name = ast.unparse(node)
            assert torch.equal(repro.tensors[name], value), name
        elif isinstance(value, torch.dtype):
            assert ast.unparse(node) == str(value)
        else:
            assert _literal(node) == value


def test_bad_input(tmp_path: Path) -> None:
    trace_file = io.save(make_trace(*DECODE, plan=True), tmp_path / "step.pt")
    for args, words in [
        (["--backend", "fa3"], "not yet for fa3"),
        (["--plan", "recorded", "--backend", "flashinfer"], "no plan recorded by flashinfer"),
    ]:
        result = CliRunner().invoke(main, ["repro", str(trace_file), "-o", str(tmp_path / "r.py"), *args])
        assert result.exit_code == 2 and words in result.output, result.output


@pytest.mark.gpu
@pytest.mark.parametrize(("mistake", "code"), [(None, 0), ("invariants:wrong-req-row", 1)], ids=["clean", "wrong-req-row"])
def test_flashinfer_script_on_the_gpu(tmp_path: Path, mistake: str | None, code: int) -> None:
    """The FlashInfer script of a clean step passes, of a step whose recorded plan reads another
    request's row fails; each run isolated, with attndbg unimportable."""
    trace = make_trace(*("decode-gqa", "kv_lens=5,40,300,17"))
    trace = replace(trace, plan=FlashInferBackend().derive_plan(trace))
    if mistake:
        trace = registry.inject(trace, mistake)
    script = write(build(trace, "flashinfer"), tmp_path / "repro.py")[0]
    # Not -I: the GPU image puts FlashInfer on PYTHONPATH. The repository is taken off it, and the
    # import hook refuses attndbg wherever else it could be found.
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(root))
    env = {**os.environ, "PYTHONPATH": path}
    ran = subprocess.run([sys.executable, "-c", ISOLATED, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert ran.returncode == code, ran.stdout + ran.stderr
    assert "flashinfer " in ran.stdout and "GPU " in ran.stdout
