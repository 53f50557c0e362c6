"""A user's FlashInfer evidence kept from import to repro, on the CPU (the dumps written as
FlashInfer 0.7.2's api_logging.py writes them, tests/interop/fi_dumps.py; the GPU test with the
real library is tests/gpu/test_user_evidence.py): a correct decode, a correct causal prefill, a
decode whose last_page_len is seq_len % page_size, a call that crashed, and a graph decode replayed
with a correct and a wrong plan. Everything imports; check judges the wrong plans (naming
last_page_len) and leaves the correct steps clean with their plans read; the crash is a step
marked crashed that check says it cannot run here (no GPU); minimize keeps a wrong plan's finding;
repro writes scripts of the recorded calls that say exit 2 here (FlashInfer is not installed)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from tests.interop import fi_dumps
from tests.repro.test_repro import _run_isolated

ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evidence")
    w = fi_dumps.DumpWriter(root / "dump")
    fi_dumps.write_decode(w, kv_lens=(5, 9, 3), layers=1)  # step 0: correct
    fi_dumps.write_paged_extend(w)  # step 1: correct causal prefill
    fi_dumps.write_decode(w, ident=0x1100, kv_lens=(5, 8, 3), seed=3, last_page_mod=True, layers=1)  # step 2: last_page_len[1] = 0
    fi_dumps.write_graph_decode(w)  # steps 3, 4: graph replays, correct
    fi_dumps.write_graph_decode(w, ident=0x6100, seed=9, last_page_mod=True)  # steps 5, 6: graph replays, step 6 wrong
    fi_dumps.write_decode(w, ident=0x1200, kv_lens=(6, 9), seed=4, crash=ILLEGAL, layers=1)  # step 7: crashed
    result = CliRunner().invoke(main, ["import", "flashinfer", str(root / "dump"), "--log", str(w.log), "-o", str(root / "rec")])
    assert result.exit_code == 0, result.output
    assert f"the call did not return: {ILLEGAL}: imported as a crashed step" in result.output
    return root / "rec"


def test_every_call_is_a_step(rec: Path) -> None:
    steps = [io.load(p) for p in io.trace_paths(rec)]
    assert [t.batch.forward_mode.value for t in steps] == ["DECODE", "EXTEND"] + ["DECODE"] * 6
    assert [bool(t.graph and t.graph.is_graph_replay) for t in steps] == [False] * 3 + [True] * 4 + [False]
    assert [t.source.crash for t in steps] == [None] * 7 + [ILLEGAL]
    assert steps[2].plan.tensors["kv_last_page_len"].tolist() == [1, 0, 3] and steps[6].plan.tensors["kv_last_page_len"].tolist() == [2, 0]


@pytest.fixture(scope="module")
def checked(rec: Path) -> tuple[int, dict]:
    report = rec.parent / "check.json"
    # The plan detectors, and the recorded outputs against Triton and the float64 reference.
    result = CliRunner().invoke(main, ["check", str(rec), "--backend", "triton", "--only", "invariants,split-merge", "--json", str(report)])
    return result.exit_code, json.loads(report.read_text())


def test_check_judges_the_wrong_plans_and_leaves_the_correct_steps_clean(checked: tuple[int, dict]) -> None:
    code, report = checked
    assert code == 1
    steps = report["steps"]
    for wrong in (2, 6):
        found = {(f["class"], f["check"]) for f in steps[wrong]["findings"] if f["severity"] == "defect"}
        assert ("invariants", "kv-last-page-len") in found, steps[wrong]["findings"]
        assert any("kv_last_page_len[1] = 0" in f["evidence"] for f in steps[wrong]["findings"])
        # FlashInfer read request 1's listed pages but its last: the engine's output is wrong there.
        (output,) = [f for f in steps[wrong]["findings"] if f["check"] == "recorded-output-mismatch"]
        assert "requests [1]" in output["evidence"]
    for correct in (0, 1, 3, 4, 5):
        assert steps[correct]["findings"] == [], steps[correct]
    verdict = report["verdict"]
    assert verdict["plans_unread"] == {}  # every plan read, defaults filled as FlashInfer fills them
    # The crash cannot be run again without a GPU: said, never passed, never a finding.
    assert steps[7]["findings"] == [] and verdict["crashes_not_run"] == {"no CUDA GPU: FlashInfer's kernels run only on NVIDIA GPUs": 1}


def test_minimize_keeps_a_wrong_plans_finding(rec: Path, tmp_path: Path) -> None:
    small = tmp_path / "small.pt"
    result = CliRunner().invoke(main, ["minimize", str(rec / "step_000002.pt"), "--backend", "triton", "--finding", "invariants/kv-last-page-len", "-o", str(small)])
    assert result.exit_code == 0, result.output
    trace = io.load(small)
    assert trace.batch.batch_size == 1 and trace.plan.tensors["kv_last_page_len"].tolist() == [0]
    assert trace.tensors[0].output.shape[0] == 1  # the engine's output went along with the request


@pytest.mark.parametrize(("step", "crashed"), [(2, False), (7, True)], ids=["wrong-plan", "crash"])
def test_repro_writes_the_recorded_call_and_says_it_cannot_run_here(rec: Path, tmp_path: Path, step: int, crashed: bool) -> None:
    script = tmp_path / "repro.py"
    result = CliRunner().invoke(main, ["repro", str(rec), "--step", str(step), "--backend", "flashinfer", "-o", str(script)])
    assert result.exit_code == 0, result.output
    assert "recorded plan" in result.output
    text = script.read_text()
    assert ("CRASHED = " + repr(ILLEGAL)) in text if crashed else "CRASHED = None" in text
    done = _run_isolated(script)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == "could not run here: No module named 'flashinfer' (pip install flashinfer-python)"


def test_a_crashed_steps_repro_passes_where_the_call_returns(rec: Path, tmp_path: Path) -> None:
    """The same crashed step scripted through Triton (which runs here): the call returns, so the
    script says the crash did not come back (exit 0, not 1)."""
    script = tmp_path / "repro.py"
    assert CliRunner().invoke(main, ["repro", str(rec), "--step", "7", "--backend", "triton", "-o", str(script)]).exit_code == 0
    done = _run_isolated(script)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"where the step was recorded the call crashed ({ILLEGAL}); here it returned" in done.stdout


def test_minimize_keeps_a_recorded_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed step whose call crashes again (a CPU stand-in library): the crash is the failure
    kept, each smaller step's call run again in a worker of its own."""
    from attndbg.detector_api.context import CheckOptions
    from attndbg.minimize.search import MinimizeOptions, minimize
    from tests.factories import make_trace

    monkeypatch.setenv("ATTNDBG_BACKENDS", "crashing_call=tests.checks.crashing_call_backend:CrashingCallBackend")
    trace = make_trace("decode-mha", "kv_lens=3,5", "heads=1:1", "head_dim=32", plan=True)
    trace = replace(trace, plan=replace(trace.plan, backend="crashing_call"), source=replace(trace.source, crash=ILLEGAL))
    path = io.save(trace, tmp_path / "crashed.pt")
    outcome = minimize(str(path), MinimizeOptions("crashing_call", ("backend-crash", None), CheckOptions(backends=("crashing_call",)), only=("invariants",)))
    assert str(outcome.target) == "backend-crash/recorded-crash (crash: crashing_call: KernelError: RuntimeError: CUDA error: an illegal memory access was encountered)"
    assert outcome.trace.batch.batch_size == 1 and outcome.trace.source.crash == ILLEGAL
