"""Crash isolation for every launch a step makes, not only the runner's: a CUDA
fault in a detector's own work (inside a launch it announces, in its own code, or swallowed by it)
is one backend-crash finding on its own step, and the poisoned worker never takes another step.
The fault is simulated (tests/checks/cuda_fault_detector.py: a context that stays poisoned in its
process, as a real one does); tests/gpu/test_detector_crash.py makes a real one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.checks.step import StepReport
from attndbg.cli import main
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.detectors import registry as detectors
from attndbg.replay import activity
from tests.checks import cuda_fault_detector
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")
FAULT_STEP = 1  # of steps 0-3: two later steps that the same worker would take


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch):
    """Register the fault detector and put this process's context back afterwards (the detector
    poisons the process it runs in: in-process tests run it here)."""
    monkeypatch.setenv("ATTNDBG_DETECTORS", "cuda-fault=tests.checks.cuda_fault_detector:DETECTOR")
    monkeypatch.setenv("ATTNDBG_TEST_FAULT_STEP", str(FAULT_STEP))
    monkeypatch.setattr(activity, "probe", activity.probe)

    def how(way: str) -> None:
        monkeypatch.setenv("ATTNDBG_TEST_FAULT", way)

    yield how
    cuda_fault_detector.reset()
    monkeypatch.undo()
    activity.start_check()
    assert activity.lost() is None


def _recording(directory: Path) -> Path:
    """Four decode steps; the faulting one also carries a metadata mistake, which its re-check must still find."""
    from attndbg.trace import io

    for step in range(4):
        trace = make_trace("decode-mha", "kv_lens=3,20,7", *SMALL, f"seed={step}", plan=True)
        if step == FAULT_STEP:
            trace = detectors.inject(trace, "invariants:decreasing-indptr")
        io.append_to_recording(directory, replace(trace, source=replace(trace.source, step=step)))
    return directory


def _check(rec: Path, *, isolate: bool) -> list[StepReport]:
    only = parse_only("invariants,cuda-fault")
    return [r for r in check_steps(str(rec), only, CheckOptions(backends=("reference",)), jobs=1, isolate=isolate) if r.mode != "recording"]


def _crashes(report: StepReport) -> list:
    return [f for f in report.findings if f.kind is FindingClass.BACKEND_CRASH]


@pytest.mark.parametrize(
    ("way", "backend", "what", "rechecked"),
    [
        ("launch", "triton", "cuda-fault sweep", "without-backend"),  # inside a launch the detector announces
        ("detector", "", "", "without-detector"),  # in the detector's own code, outside any launch
        ("swallowed", "", "", "without-detector"),  # caught by the detector: only the probe of the context finds it
    ],
)
def test_a_fault_in_a_detectors_own_work_is_one_crash_on_its_step_and_the_worker_is_replaced(
    fault, tmp_path: Path, way: str, backend: str, what: str, rechecked: str
) -> None:
    """One worker (--jobs 1): had it taken steps 2 and 3 with its poisoned context, the fault detector
    would have failed on both ("not checked"). Every step is checked; only step 1 has the crash."""
    fault(way)
    reports = _check(_recording(tmp_path / "rec"), isolate=True)
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert all(r.checked for r in reports), [r.error for r in reports]
    [crash] = _crashes(reports[FAULT_STEP])
    assert reports[FAULT_STEP].findings[0] is crash and crash.location.step == FAULT_STEP
    assert (crash.data["backend"], crash.data["variant"], crash.data["detector"]) == (backend, what, "cuda-fault")
    assert crash.data["rechecked"] == rechecked
    assert crash.data["death"] == "left its CUDA context unusable" and "an illegal memory access was encountered" in crash.data["error"]
    assert "in the cuda-fault detector" in crash.evidence
    # The re-check still found the step's own mistake, and no other step saw a crash or a failure.
    assert any(f.kind is FindingClass.INVARIANT for f in reports[FAULT_STEP].findings)
    assert all(not r.findings for i, r in enumerate(reports) if i != FAULT_STEP)


def test_a_fault_that_follows_the_step_into_the_next_detector_costs_the_step_and_one_finding(fault, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Left out after its fault, the first detector's fault comes back in the next one (as a fault in
    the data every detector shares would): the step is not checked again, one crash finding, and
    the later steps are still checked."""
    detectors_env = "cuda-fault=tests.checks.cuda_fault_detector:DETECTOR,cuda-fault-again=tests.checks.cuda_fault_detector:SECOND"
    monkeypatch.setenv("ATTNDBG_DETECTORS", detectors_env)
    fault("detector")
    only = parse_only("invariants,cuda-fault,cuda-fault-again")
    reports = [r for r in check_steps(str(_recording(tmp_path / "rec")), only, CheckOptions(backends=("reference",)), jobs=1, isolate=True) if r.mode != "recording"]
    crashed = reports[FAULT_STEP]
    assert not crashed.checked and crashed.error == (
        "not checked: the worker checking this step again left its CUDA context unusable (in the cuda-fault-again detector)"
    )
    [crash] = _crashes(crashed)
    assert (crash.data["detector"], crash.data["rechecked"]) == ("cuda-fault", "without-detector")
    assert crashed.step == crash.location.step == FAULT_STEP  # read from the file: the worker never reported it
    assert all(r.checked and not r.findings for i, r in enumerate(reports) if i != FAULT_STEP)


def test_in_one_process_the_crash_is_a_finding_and_the_later_steps_are_not_checked_for_that_one_reason(fault, tmp_path: Path) -> None:
    """No worker to replace: the context is lost for good. The step gets the crash finding (naming
    the detectors that did not run after it), and the later steps are reported as not checked, each
    with the one reason, without being run."""
    fault("launch")
    reports = _check(_recording(tmp_path / "rec"), isolate=False)
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert reports[0].checked and not reports[0].findings
    crashed = reports[FAULT_STEP]
    assert crashed.checked  # its verdict is the crash (a defect), and the findings made before it
    [crash] = _crashes(crashed)
    assert (crash.data["backend"], crash.data["detector"], crash.data["rechecked"]) == ("triton", "cuda-fault", "in-process")
    assert any(f.kind is FindingClass.INVARIANT for f in crashed.findings)  # invariants ran before the fault
    assert "check without --in-process" in crash.cause
    reasons = {r.error for r in reports[FAULT_STEP + 1 :]}
    assert len(reasons) == 1 and all(not r.checked and not r.findings for r in reports[FAULT_STEP + 1 :])
    [reason] = reasons
    assert reason.startswith("not checked: this process's CUDA context was lost to a crash on step 1 (triton (cuda-fault sweep) in the cuda-fault detector")
    assert "illegal memory access" in reason


def test_check_in_process_names_the_crash_and_counts_the_steps_it_cost(fault, tmp_path: Path) -> None:
    fault("detector")
    rec = _recording(tmp_path / "rec")
    result = CliRunner().invoke(main, ["check", str(rec), "--only", "invariants,cuda-fault", "--backend", "reference", "--in-process", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 1, result.output
    steps = json.loads((tmp_path / "r.json").read_text())["steps"]
    assert [s["checked"] for s in steps] == [True, True, False, False]
    crash = steps[FAULT_STEP]["findings"][0]
    assert crash["class"] == "backend-crash" and crash["data"]["detector"] == "cuda-fault" and crash["data"]["backend"] == ""
    assert "checked 2 of 4 steps" in result.output


@pytest.fixture
def illegal_backend(monkeypatch: pytest.MonkeyPatch):
    from tests.checks import illegal_access_backend

    monkeypatch.setenv("ATTNDBG_BACKENDS", "illegal_access=tests.checks.illegal_access_backend:IllegalAccessBackend")
    monkeypatch.setenv("ATTNDBG_TEST_FAULT_STEP", str(FAULT_STEP))
    monkeypatch.setattr(activity, "probe", activity.probe)
    yield
    illegal_access_backend.reset()
    monkeypatch.undo()
    activity.start_check()
    assert activity.lost() is None


def test_a_kernel_fault_the_adapter_wraps_as_a_kernel_error_still_ends_the_worker(illegal_backend, tmp_path: Path) -> None:
    """The runner once reported such a KernelError as the backend's error on the step and
    the worker went on with its poisoned context; now the step gets the crash, and the later steps,
    taken by a fresh worker, compare the backend normally."""
    rec = _recording(tmp_path / "rec")
    options = CheckOptions(backends=("illegal_access",))
    reports = [r for r in check_steps(str(rec), parse_only("fill-value"), options, jobs=1, isolate=True) if r.mode != "recording"]
    assert all(r.checked for r in reports), [r.error for r in reports]
    [crash] = _crashes(reports[FAULT_STEP])
    assert (crash.data["backend"], crash.data["variant"], crash.data["detector"]) == ("illegal_access", "eager", "fill-value")
    assert "illegal_access crashed on this step (eager) in the fill-value detector" in crash.evidence
    # Named as a library defect: the library's release, the shape, the command that reproduces it.
    assert crash.data["library"] == "attndbg's Triton kernels on Triton" and crash.data["shape"].startswith("DECODE bs ")
    assert crash.data["repro"].startswith(f"attndbg repro {reports[FAULT_STEP].path} --backend illegal_access --plan derived --eager -o ")
    assert f"`{crash.data['repro']}` reproduces it standalone" in crash.cause
    assert [r.backends for r in reports] == [("illegal_access",), (), ("illegal_access",), ("illegal_access",)]
    assert all(not _crashes(r) for i, r in enumerate(reports) if i != FAULT_STEP)


def test_a_fault_in_a_batch_invariance_sub_batch_is_its_steps_crash_naming_the_sub_batch(illegal_backend, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Batch-invariance replays each request alone through the runner: a kernel that faults only
    there is the step's one crash, announced with the sub-batch; the step is checked again without it."""
    monkeypatch.setenv("ATTNDBG_BACKENDS", "illegal_alone=tests.checks.illegal_access_backend:IllegalAloneBackend")
    rec = _recording(tmp_path / "rec")
    options = CheckOptions(backends=("illegal_alone",))
    reports = [r for r in check_steps(str(rec), parse_only("batch-invariance"), options, jobs=1, isolate=True) if r.mode != "recording"]
    assert all(r.checked for r in reports), [r.error for r in reports]
    [crash] = _crashes(reports[FAULT_STEP])
    assert (crash.data["backend"], crash.data["variant"], crash.data["detector"], crash.data["rechecked"]) == ("illegal_alone", "eager, request 0 alone", "batch-invariance", "without-backend")
    assert [r.backends for r in reports] == [("illegal_alone",), (), ("illegal_alone",), ("illegal_alone",)]
    assert all(not r.findings for i, r in enumerate(reports) if i != FAULT_STEP)


def test_replay_stops_in_one_line_when_the_context_is_lost(illegal_backend, tmp_path: Path) -> None:
    rec = _recording(tmp_path / "rec")
    result = CliRunner().invoke(main, ["replay", str(rec), "--backend", "illegal_access"])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())  # as wrapped at the terminal's width
    assert "step_000001.pt: CUDA context unusable after illegal_access (eager): RuntimeError: Triton Error [CUDA]: an illegal memory access" in said
    assert "replay stopped here" in said and "step_000002.pt" not in said and "Traceback" not in said


@pytest.fixture
def dead_context(monkeypatch: pytest.MonkeyPatch):
    """This process's CUDA context as after a real sticky error: the probe fails (simulated)."""
    monkeypatch.setattr(activity, "probe", lambda: cuda_fault_detector.ILLEGAL)
    yield
    monkeypatch.undo()
    activity.start_check()
    assert activity.lost() is None


def _lost_in(call) -> activity.Launch:
    """The crash `call` loses this process's context to (in one process: raised and recorded)."""
    with pytest.raises(activity.CudaContextLost) as lost, activity.detector("split-merge"):
        call()
    assert activity.lost() == lost.value.crash
    return lost.value.crash


def test_split_merges_own_launches_are_announced(dead_context: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its probes launch merge kernels through the runner's `merge`: a fault in them names the backend."""
    import sys
    import types

    import torch

    from attndbg.backends.triton_kernels import decode
    from attndbg.detectors.split_merge import gpu, stage2

    def fault(*args, **kwargs):
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    def merge_state(*args):
        raise torch.AcceleratorError(cuda_fault_detector.ILLEGAL)

    monkeypatch.setattr(decode, "decode_stage2", fault)
    crash = _lost_in(lambda: stage2.stage2_probe.__wrapped__(64))
    assert (crash.backend, crash.what, crash.detector) == ("triton", "decode_stage2 on crafted partials", "split-merge")

    # FlashInfer's merge_state, without FlashInfer or a GPU: the library faults, tensors stay on the CPU.
    from attndbg.backends.flashinfer import FlashInferBackend

    flashinfer = types.SimpleNamespace(cascade=types.SimpleNamespace(merge_state=merge_state))
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setattr(FlashInferBackend, "device", lambda self: "cpu")
    crash = _lost_in(lambda: gpu.merge_state_probe.__wrapped__(torch.float16))
    assert (crash.backend, crash.what, crash.error) == ("flashinfer", "cascade.merge_state on crafted states", cuda_fault_detector.ILLEGAL)


def test_a_worker_says_what_the_awaited_step_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_steps' `now`: a step checked in a worker (on a GPU machine, even a single file) is not
    silent: its activity record, read while the parent waits, names detector, backend and launch."""
    monkeypatch.setenv("ATTNDBG_DETECTORS", "slow=tests.checks.slow_detector:DETECTOR")
    monkeypatch.setenv("ATTNDBG_TEST_SLOW_S", "2")
    rec = tmp_path / "rec"
    from attndbg.trace import io

    for step in range(2):
        trace = make_trace("decode-mha", "kv_lens=3,20,7", *SMALL, f"seed={step}", plan=True)
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    said: list[tuple[int, str]] = []
    reports = list(check_steps(str(rec), parse_only("slow"), CheckOptions(backends=("reference",)), jobs=1, isolate=True, now=lambda i, text: said.append((i, text))))
    assert [r.step for r in reports if r.mode != "recording"] == [0, 1]
    for index in (0, 1):
        assert (index, "slow › triton › slow sweep") in said, said
