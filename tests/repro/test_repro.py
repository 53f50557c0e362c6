"""attndbg repro: the scripts import no attndbg. The Triton one runs isolated (python -I, an import
of attndbg refused) under the Triton interpreter and reproduces an injected mistake (exit 1) and
passes a clean step (exit 0); the FlashInfer one compiles and makes the plan() calls the adapter
makes, read back from the script. The GPU test runs a FlashInfer script of a failing and a clean step."""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from click.testing import CliRunner

from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.cli import main
from attndbg.detectors import registry
from attndbg.repro import padded
from attndbg.repro.script import Mode, build, write
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


def _run_on_gpu(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    # Not -I: the GPU image puts FlashInfer on PYTHONPATH. The repository is taken off it, and the
    # import hook refuses attndbg wherever else it could be found.
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(root))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", ISOLATED, str(script)], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


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


GRAPH_CASES = [(None, "--graph", 0), ("fill-value:padded-kv-write", "--graph", 1), ("fill-value:padded-kv-write", "--eager", 0)]


@pytest.mark.parametrize(("mistake", "mode", "code"), GRAPH_CASES, ids=["clean-graph", "padded-kv-write-graph", "padded-kv-write-eager"])
def test_triton_graph_script_replays_the_padded_batch(tmp_path: Path, mistake: str | None, mode: str, code: int) -> None:
    """A step recorded as a graph replay (capture_bs 6, 2 padded rows) is scripted through the
    Triton graph state's static buffers, padded as recorded: the padded rows' K/V writes land
    where the engine put them, so a runner that left padded out_cache_loc stale overwrites live KV
    and the real rows fail in the graph (exit 1) while the same step passes eagerly (--eager).
    Without a GPU the graph sequence runs eagerly on the static buffers, as replay/graph.py does."""
    trace = make_trace(*DECODE, "capture_bs=6", plan=True)
    if mistake:
        trace = registry.inject(trace, mistake)
    trace_file = io.save(trace, tmp_path / "step.pt")
    script = tmp_path / "repro.py"
    result = CliRunner().invoke(main, ["repro", str(trace_file), "--backend", "triton", mode, "-o", str(script)])
    assert result.exit_code == 0, result.output
    assert f"({mode[2:]}, recorded plan" in result.output
    text = script.read_text()
    assert "attndbg" not in _imports(text) and ("def forward():" in text) == (mode == "--graph")
    ran = _run_isolated(script)
    assert ran.returncode == code, ran.stdout + ran.stderr
    if mode == "--graph":
        assert "padded rows: 0 NaN/Inf output values" in ran.stdout
    assert ("reproduced: 2 of 4 rows" if code else "not reproduced") in ran.stdout


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


def _calls_named(text: str, attr: str) -> list[ast.Call]:
    tree = ast.parse(text)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def _assert_same_call(node: ast.Call, args: tuple, kwargs: dict, tensors: dict[str, torch.Tensor], nested: dict[str, ast.Call]) -> None:
    """The script's call `node` passes what the adapter passed (`args`, `kwargs`): tensors by their
    saved values, dtypes by name, objects made by an earlier call (`nested`: variable -> its call)
    by that call's arguments, the rest as literals."""
    assert sorted(k.arg for k in node.keywords) == sorted(kwargs)
    assert len(node.args) == len(args)
    for expr, value in [*zip(node.args, args), *((k.value, kwargs[k.arg]) for k in node.keywords)]:
        if isinstance(value, torch.Tensor):
            name = ast.unparse(expr)
            assert torch.equal(tensors[name], value.to(tensors[name].dtype)) and tensors[name].dtype == value.dtype, name
        elif isinstance(value, torch.dtype):
            assert ast.unparse(expr) == str(value)
        elif isinstance(value, _Made):
            _assert_same_call(nested[ast.unparse(expr)], (), value.kwargs, tensors, nested)
        else:
            assert _literal(expr) == value, ast.unparse(expr)


class _Made:
    """What a library factory (MLAPlanMetadata.csr) returned to the adapter: its arguments."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


def _fake_flashinfer() -> types.ModuleType:
    """flashinfer.mla as far as the mla adapter's plan helper reads it (FlashInfer 0.7.2's canonical form)."""
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.mla = types.ModuleType("flashinfer.mla")
    flashinfer.mla.MLAPlanMetadata = types.SimpleNamespace(csr=lambda **kwargs: _Made(**kwargs))
    return flashinfer


def _adapter_plan_call(backend: str, trace, plan) -> tuple[tuple, dict]:
    """What the adapter's own plan helper passes a wrapper for `plan`, run against a recording wrapper."""
    from attndbg.backends import fa3, mla
    from attndbg.backends import flashinfer as adapter

    wrapper = _PlanCalls()
    m = trace.model
    fake = _fake_flashinfer()
    with contextlib.ExitStack() as stack:
        for module in (adapter, fa3, mla):
            stack.enter_context(mock.patch.object(module, "wait_for_pending_plans", lambda: None))
        original = torch.Tensor.to
        stack.enter_context(mock.patch.object(torch.Tensor, "to", lambda self, *a, **k: self if a and a[0] == "cuda" else original(self, *a, **k)))
        stack.enter_context(mock.patch.dict(sys.modules, {"flashinfer": fake, "flashinfer.mla": fake.mla}))
        if backend == "fa3":
            fa3._flashinfer_plan(wrapper, m, fa3.FA3Call.from_plan(plan))
        elif backend == "mla":
            mla._flashinfer_plan(wrapper, m, plan)
        else:
            helper = adapter._plan_decode if trace.batch.forward_mode.value == "DECODE" else adapter._plan_paged
            helper(wrapper, m, plan, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    (args, kwargs), = wrapper.calls
    return args, kwargs


def _plan_of(backend: str, trace, padding=None):
    from attndbg.backends import registry as backends
    from attndbg.repro.capture import pinned

    adapter = backends.create(backend)
    with pinned(adapter):
        return adapter.derive_plan(trace, padding)


MLA_DECODE = ("mla-decode", "heads=4:1", "kv_lens=5,20,33")
LIBRARY_CASES = [
    ("flashinfer", DECODE),
    ("flashinfer", ("verify", "heads=4:2", "head_dim=64", "prefix_lens=5,12,7")),
    ("fa3", ("decode-gqa", "heads=4:2", "head_dim=64", "kv_lens=5,20,33,9")),
    ("fa3", ("verify-chain", "heads=4:2", "head_dim=64", "prefix_lens=5,12,7")),
    ("mla", MLA_DECODE),
]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("backend", "spec"), LIBRARY_CASES, ids=[f"{b}-{s[0]}" for b, s in LIBRARY_CASES])
def test_library_script_makes_the_adapters_plan_call(tmp_path: Path, backend: str, spec: tuple[str, ...], graph: bool) -> None:
    """FlashInfer, fa3 (FlashInfer's backend='fa3') and mla (BatchMLAPagedAttentionWrapper) scripts
    compile, import no attndbg, and make the plan() call the adapter's own plan helper makes, for
    the step's plan (eager) or for the batch padded to the recorded capture size (graph), where
    the wrapper is built with use_cuda_graph=True over static buffers sized for the capture."""
    if graph:
        spec = (*spec, "capture_bs=6" if spec[0] != "verify" else "capture_bs=4")
    trace = make_trace(*spec)
    trace = replace(trace, plan=_plan_of(backend, trace))
    repro = build(trace, backend)
    assert repro.mode is (Mode.GRAPH if graph else Mode.EAGER)
    script = write(repro, tmp_path / "repro.py")[0]
    subprocess.run([sys.executable, "-m", "py_compile", str(script)], check=True)
    assert "attndbg" not in _imports(repro.text) and "flashinfer" in _imports(repro.text)
    plan = trace.plan
    if graph:
        plan = _plan_of(backend, trace, padded.padding_of(trace))
        (wrapper,) = [n for n in ast.walk(ast.parse(repro.text)) if isinstance(n, ast.Call) and any(k.arg == "use_cuda_graph" for k in n.keywords)]
        assert {k.arg: _literal(k.value) for k in wrapper.keywords}["use_cuda_graph"] is True
        assert "torch.cuda.graph(graph)" in repro.text and "graph.replay()" in repro.text
    (call,) = _calls_named(repro.text, "plan")
    nested = {ast.unparse(n.targets[0]): n.value for n in ast.walk(ast.parse(repro.text)) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)}
    _assert_same_call(call, *_adapter_plan_call(backend, trace, plan), repro.tensors, nested)


def test_fa3_two_call_verify_script_makes_both_calls_and_merges_them(tmp_path: Path) -> None:
    """fa3's tree verify (SGLang's FA3 backend: a prefix call and a draft call, merged): both plan()
    calls are the adapter's, and the script merges them with attndbg's merge_states source."""
    from attndbg.backends import fa3

    trace = make_trace("verify", "heads=4:2", "head_dim=64", "prefix_lens=5,12,0")
    trace = replace(trace, plan=_plan_of("fa3", trace))
    assert trace.plan.scalars["verify_path"] == "two-call"
    repro = build(trace, "fa3")
    script = write(repro, tmp_path / "repro.py")[0]
    subprocess.run([sys.executable, "-m", "py_compile", str(script)], check=True)
    assert "attndbg" not in _imports(repro.text) and "def merge_states(" in repro.text
    calls = _calls_named(repro.text, "plan")
    assert len(calls) == 2
    for node, prefix in zip(calls, ("", "expand_")):
        wrapper = _PlanCalls()
        with mock.patch.object(fa3, "wait_for_pending_plans", lambda: None):
            fa3._flashinfer_plan(wrapper, trace.model, fa3.FA3Call.from_plan(trace.plan, prefix))
        _assert_same_call(node, *wrapper.calls[0], repro.tensors, {})


def _case_script(tmp_path: Path, backend: str, spec: tuple[str, ...], mistake: str | None, mode: Mode | None) -> Path:
    """The script of a synth step carrying the adapter's plan (with `mistake` injected into it)."""
    trace = make_trace(*spec)
    trace = replace(trace, plan=_plan_of(backend, trace))
    if mistake:
        trace = registry.inject(trace, mistake)
    return write(build(trace, backend, mode=mode), tmp_path / "repro.py")[0]


def test_bad_input(tmp_path: Path) -> None:
    trace_file = io.save(make_trace(*DECODE, plan=True), tmp_path / "step.pt")
    for args, words in [
        (["--backend", "mla"], "not an MLA model"),
        (["--graph", "--backend", "triton"], "not recorded as a CUDA-graph replay"),
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
    ran = _run_on_gpu(script, tmp_path)
    assert ran.returncode == code, ran.stdout + ran.stderr
    assert "flashinfer " in ran.stdout and "GPU " in ran.stdout


GPU_CASES = [
    ("flashinfer", ("decode-gqa", "kv_lens=5,40,300,17", "capture_bs=8"), "fill-value:padded-kv-write", Mode.EAGER, 0),
    ("flashinfer", ("decode-gqa", "kv_lens=5,40,300,17", "capture_bs=8"), None, Mode.GRAPH, 0),
    ("flashinfer", ("decode-gqa", "kv_lens=5,40,300,17", "capture_bs=8"), "fill-value:padded-kv-write", Mode.GRAPH, 1),
    ("flashinfer", ("verify", "heads=8:2", "head_dim=128", "prefix_lens=5,40,17", "capture_bs=4"), None, Mode.GRAPH, 0),
    ("fa3", ("decode-gqa", "kv_lens=5,40,300,17"), None, Mode.EAGER, 0),
    ("fa3", ("decode-gqa", "kv_lens=5,40,300,17"), "invariants:wrong-req-row", Mode.EAGER, 1),
    ("fa3", ("verify-chain", "heads=8:2", "head_dim=128", "prefix_lens=5,40,17"), None, Mode.EAGER, 0),
    ("fa3", ("verify", "heads=8:2", "head_dim=128", "prefix_lens=5,40,0"), None, Mode.EAGER, 0),
    ("fa3", ("verify", "heads=8:2", "head_dim=128", "prefix_lens=5,40,0"), "tree-mask:sibling-visible", Mode.EAGER, 1),
    ("fa3", ("decode-gqa", "kv_lens=5,40,300,17", "capture_bs=8"), None, Mode.GRAPH, 0),
    ("fa3", ("decode-gqa", "kv_lens=5,40,300,17", "capture_bs=8"), "fill-value:padded-kv-write", Mode.GRAPH, 1),
    ("mla", ("mla-decode", "kv_lens=5,40,300"), None, Mode.EAGER, 0),
    ("mla", ("mla-decode", "kv_lens=5,40,300"), "invariants:wrong-req-row", Mode.EAGER, 1),
    ("mla", ("mla-decode", "kv_lens=5,40,300", "capture_bs=4"), None, Mode.GRAPH, 0),
    ("mla", ("mla-decode", "kv_lens=5,40,300", "capture_bs=4"), "fill-value:padded-kv-write", Mode.GRAPH, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "spec", "mistake", "mode", "code"), GPU_CASES, ids=[f"{c[0]}-{c[1][0]}-{c[2] or 'clean'}-{c[3].value}" for c in GPU_CASES])
def test_library_scripts_on_the_gpu(tmp_path: Path, backend: str, spec: tuple[str, ...], mistake: str | None, mode: Mode, code: int) -> None:
    """flashinfer, fa3 and mla scripts, eager and as CUDA-graph replays (captured with
    torch.cuda.graph, replayed after the padded plan is loaded again): clean steps pass; a plan
    reading another request's row fails eagerly; padded tokens writing over live KV fail in the
    graph only. Each run isolated, with attndbg unimportable."""
    ran = _run_on_gpu(_case_script(tmp_path, backend, spec, mistake, mode), tmp_path)
    assert ran.returncode == code, ran.stdout + ran.stderr
    assert "flashinfer " in ran.stdout and "GPU " in ran.stdout
    assert ("padded rows: 0 NaN/Inf" in ran.stdout) == (mode is Mode.GRAPH)


def test_a_graph_step_the_backend_cannot_capture_is_written_eagerly_and_says_why(tmp_path: Path) -> None:
    """FlashInfer's graph wrappers merge splits for some head dims only: a graph step of head_dim
    16 is scripted eagerly by default, with the reason on stderr; asked for --graph, exit 2."""
    trace_file = io.save(make_trace(*DECODE[:-2], "head_dim=16", "kv_lens=5,20", "capture_bs=4"), tmp_path / "step.pt")
    script = tmp_path / "repro.py"
    result = CliRunner().invoke(main, ["repro", str(trace_file), "--backend", "flashinfer", "-o", str(script)])
    assert result.exit_code == 0 and "(eager, derived plan" in result.stdout, result.output
    assert "a graph replay written as an eager run" in result.stderr and "head_dim" in result.stderr
    forced = CliRunner().invoke(main, ["repro", str(trace_file), "--backend", "flashinfer", "--graph", "-o", str(script)])
    assert forced.exit_code == 2 and "--graph:" in forced.output, forced.output
