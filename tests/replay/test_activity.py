"""The launch a worker names for its parent: set while a kernel runs, cleared however it ends."""

from __future__ import annotations

import pytest
import torch

from attndbg.replay import activity


def test_a_launch_is_named_while_it_runs_and_cleared_after_an_error() -> None:
    seen: list[str] = []
    activity.set_sink(seen.append)
    try:
        with activity.launching("triton", "eager"):
            assert seen[-1] == "triton\teager"
        assert seen[-1] == ""
        # An error the runner reports (not a poisoned context) is no crash: a worker that dies
        # later must not be blamed on this backend.
        with pytest.raises(ValueError), activity.launching("flashinfer", "graph bs=8 fill=1"):
            raise ValueError("plan refused")
        assert seen[-1] == ""
    finally:
        activity.set_sink(None)
    assert activity.parse("fa3\teager\tCUDA error: an illegal memory access") == activity.Launch("fa3", "eager", "CUDA error: an illegal memory access")
    assert activity.parse("") is None


# As torch words an illegal memory access (torch.AcceleratorError), and as our adapters wrap it.
ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.fixture
def sink():
    seen: list[str] = []
    activity.set_sink(seen.append)
    yield seen
    activity.set_sink(None)


@pytest.fixture
def dead_context(monkeypatch: pytest.MonkeyPatch):
    """This process's CUDA context as after a real sticky error: the probe fails (simulated)."""
    monkeypatch.setattr(activity, "probe", lambda: ILLEGAL)
    yield
    monkeypatch.undo()
    activity.start_check()  # no CUDA here: the simulated crash is forgotten
    assert activity.lost() is None


def test_the_detector_running_is_named_and_a_launch_says_which_detector_made_it(sink: list[str]) -> None:
    with activity.detector("split-merge"):
        assert activity.parse(sink[-1]) == activity.Launch(detector="split-merge")
        with activity.launching("flashinfer", "extend_path=cascade"):
            assert activity.parse(sink[-1]) == activity.Launch("flashinfer", "extend_path=cascade", detector="split-merge")
        assert activity.parse(sink[-1]) == activity.Launch(detector="split-merge")
    assert sink[-1] == ""
    assert activity.Launch("flashinfer", "extend_path=cascade", detector="split-merge").where() == "flashinfer (extend_path=cascade) in the split-merge detector"
    assert activity.Launch(error=ILLEGAL).where() == "outside any announced launch"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(ILLEGAL),
        RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
        RuntimeError("BatchPrefillWithPagedKVCache failed with error: unspecified launch failure"),
        RuntimeError("CUDA error: misaligned address\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("CUDA error: device-side assert triggered"),
        torch.AcceleratorError(ILLEGAL),
    ],
)
def test_cuda_sticky_errors_poison_the_context_whatever_wraps_them(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    assert activity.is_cuda_error(error)
    monkeypatch.setattr(activity, "probe", lambda: ILLEGAL)
    assert activity.poisoned(error)
    # The same words on a context that still works (a simulated fault, as tests/checks/test_fill_value.py
    # plants): the launch's own error, which the runner reports; nothing is lost.
    monkeypatch.setattr(activity, "probe", lambda: None)
    assert not activity.poisoned(error)


@pytest.mark.parametrize(
    "error",
    [
        # Our own words about crashes are not crashes (a plan guard, a declared library defect).
        RuntimeError("known FlashInfer 0.7.2 defect: tensor-core path: illegal memory access or wrong outputs"),
        ValueError("a kernel given this plan reads past one of its tensors (an illegal memory access)"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("expected scalar type Float but found Half"),
    ],
)
def test_other_errors_leave_the_context_alone(error: Exception, dead_context: None) -> None:
    assert not activity.is_cuda_error(error) and not activity.poisoned(error)


def test_in_one_process_a_poisoned_context_is_recorded_and_raised(dead_context: None) -> None:
    """No sink (one process): the crash is kept, and CudaContextLost (not a KernelError the runner
    would report as one backend's error) carries it up to the check."""
    with pytest.raises(activity.CudaContextLost) as lost, activity.detector("split-merge"), activity.launching("flashinfer", "extend_path=cascade"):
        raise RuntimeError(f"AcceleratorError: {ILLEGAL}")
    crash = activity.Launch("flashinfer", "extend_path=cascade", f"AcceleratorError: {ILLEGAL}", "split-merge")
    assert lost.value.crash == crash and activity.lost() == crash
    activity.start_check()
    assert activity.lost() == crash  # a context that is still dead stays lost
    # Outside a launch (a detector's own code), attributed to the detector.
    with pytest.raises(activity.CudaContextLost) as lost:
        activity.check_error(torch.AcceleratorError(ILLEGAL), "batch-invariance")
    assert lost.value.crash == activity.Launch(error=ILLEGAL, detector="batch-invariance")
    activity.check_error(ValueError("plan refused"), "invariants")  # not CUDA: nothing happens


def test_a_fault_found_after_a_detector_is_blamed_on_the_last_launch_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch whose CUDA error was not sticky by its message (and swallowed by whoever called it),
    then a dead context at the end of the step: the crash names that launch."""
    activity.begin_step()
    with pytest.raises(RuntimeError), activity.launching("fa3", "eager"):
        raise RuntimeError("CUDA error: unknown error")
    monkeypatch.setattr(activity, "probe", lambda: ILLEGAL)
    try:
        with pytest.raises(activity.CudaContextLost) as lost:
            activity.check_context()
        assert lost.value.crash == activity.Launch("fa3", "eager", "CUDA error: unknown error")
    finally:
        monkeypatch.undo()
        activity.start_check()


def test_a_fault_pending_when_a_launch_raises_is_blamed_on_that_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that queued a faulting kernel and then raised on the host (FlashInfer 0.7.2's
    tensor-core decode at head_dim 80: an illegal memory access, then "Unsupported head_dim" from its
    merge): the fault is surfaced inside the launch and named with it, not with whatever launch
    synchronises next. Without a pending fault the host-side error is the launch's own."""

    def pending() -> None:
        raise torch.AcceleratorError(ILLEGAL)

    monkeypatch.setattr(activity, "_synchronize", pending)
    monkeypatch.setattr(activity, "probe", lambda: ILLEGAL)
    try:
        with pytest.raises(activity.CudaContextLost) as lost, activity.launching("flashinfer", "eager"):
            raise RuntimeError("Unsupported head_dim: 80")
        assert lost.value.crash == activity.Launch("flashinfer", "eager", ILLEGAL)
    finally:
        monkeypatch.undo()
        activity.start_check()
    assert activity.lost() is None
    with pytest.raises(RuntimeError, match="Unsupported head_dim"), activity.launching("flashinfer", "eager"):
        raise RuntimeError("Unsupported head_dim: 80")  # no CUDA here: nothing pending, the error is the launch's
    assert activity.lost() is None
