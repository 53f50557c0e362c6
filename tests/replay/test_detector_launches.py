"""The runner's entry points for a detector's own launches (split-merge's): `run_derived`, one eager
run of an adapter the detector configured, and `merge`, a backend's merge kernel on crafted partial
states, guarded; both announced under the detector's own name for the launch. Batch-invariance's
sub-batches replay through the context too (`replay_sub_batch`): the step's adapter, each launch
announced with the sub-batch. And `graph_options`, the one rule for a detector's graph replays."""

from __future__ import annotations

import pytest
import torch

from attndbg.backends import registry
from attndbg.backends.base import KernelUnsupported, PartialStates
from attndbg.backends.options import BackendOptions
from attndbg.backends.triton import TritonBackend, TritonOptions
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detectors.batch_invariance import detect as batch_invariance
from attndbg.backends.triton_kernels import decode
from attndbg import machine
from attndbg.replay import activity, runner
from attndbg.replay.runner import ReplayOptions, RunStatus
from tests.checks.shapes import SMALL
from tests.factories import make_trace

TRACE = ("decode-gqa", *SMALL, "kv_lens=5,70")


@pytest.fixture
def launches():
    """What the process announces while it runs: (backend, what) of each launch."""
    seen: list[tuple[str, str]] = []

    def note(text: str) -> None:
        launch = activity.parse(text)
        if launch is not None and launch.backend:
            seen.append((launch.backend, launch.what))

    activity.set_sink(note)
    yield seen
    activity.set_sink(None)


def test_run_derived_is_the_replays_eager_run_announced_under_the_callers_name(launches: list[tuple[str, str]]) -> None:
    ctx = CheckContext(trace=make_trace(*TRACE, plan=True), path="t")
    forced = BackendOptions(((TritonBackend.name, TritonOptions(num_kv_splits=2)),))
    run = ctx.run_derived(TritonBackend.name, forced, what="num_kv_splits=2")
    assert launches == [("triton", "num_kv_splits=2")]
    # Compared with the reference, so the step's report names the backend (no replay of the step ran).
    assert ctx.backends_consulted() == (TritonBackend.name,)
    replayed = ctx.replay(ReplayOptions(backend_options=forced), (TritonBackend.name,)).runs[0]
    assert run.status is RunStatus.PASSED and run.variant == replayed.variant
    assert torch.equal(run.result.output, replayed.result.output) and torch.equal(run.result.lse, replayed.result.lse)
    assert run.comparison.max_abs == replayed.comparison.max_abs


def test_run_derived_does_not_launch_a_step_the_adapter_cannot_take(launches: list[tuple[str, str]]) -> None:
    trace = make_trace(*TRACE, plan=True)
    data = CheckContext(trace=trace, path="t").data()

    class Unsupported(TritonBackend):
        def unsupported_reason(self, trace):
            return "not this step"

    run = runner.run_derived(trace, Unsupported(), data=data, what="probe")
    assert (run.status, run.reason, run.comparison) == (RunStatus.UNSUPPORTED, "not this step", None)
    assert launches == []


def _states(num_splits: list[int], kv_lens: list[int], parts: int = 2, dv: int = 8) -> PartialStates:
    g = torch.Generator().manual_seed(1)
    rows = len(kv_lens)
    return PartialStates(
        torch.randn(rows, 1, parts, dv, generator=g),
        torch.randn(rows, 1, parts, generator=g),
        kv_lens=torch.tensor(kv_lens),
        num_splits=torch.tensor(num_splits),
    )


def test_merge_runs_our_stage_2_announced_under_the_callers_name(launches: list[tuple[str, str]]) -> None:
    states = _states([2, 1], [64, 20])  # row 0: two 32-token splits; row 1: one split
    merged = runner.merge(registry.create(TritonBackend.name), states, what="stage 2 probe")
    assert launches == [("triton", "stage 2 probe")]
    lse = states.lse.double()
    w = torch.softmax(lse[0, 0], 0)
    assert torch.allclose(merged.output[0, 0].double(), (w[:, None] * states.output[0, 0].double()).sum(0), atol=1e-5)
    assert torch.allclose(merged.lse[0].double(), torch.logsumexp(lse[0, 0], 0).view(1), atol=1e-5)
    assert torch.allclose(merged.output[1, 0], states.output[1, 0, 0], atol=1e-6)  # one split: itself


@pytest.mark.parametrize(
    ("states", "problem"),
    [
        (_states([3, 1], [64, 20]), "num_splits[0] = 3 is outside [1, 3): split counts the states hold (2 per row)"),
        (_states([2, 0], [64, 20]), "num_splits[1] = 0 is outside [1, 3)"),
        (_states([2], [64, 20]), "num_splits.numel() = 1, expected 2 (one split count per row)"),
        (PartialStates(torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 3)), "lse (2, 1, 3) does not hold one LSE per state of output (2, 1, 2, 8)"),
        (PartialStates(torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2), kv_lens=torch.tensor([1, 2])), "the split rule needs both"),
    ],
)
def test_merge_never_launches_states_the_kernel_would_read_outside_of(
    states: PartialStates, problem: str, launches: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def launched(**kwargs):
        raise AssertionError("stage 2 launched")

    monkeypatch.setattr(decode, "decode_stage2", launched)
    with pytest.raises(ValueError, match="triton merge not launched") as refused:
        runner.merge(registry.create(TritonBackend.name), states, what="probe")
    assert problem in str(refused.value) and launches == []


def test_merge_of_a_backend_without_one_is_unsupported() -> None:
    with pytest.raises(KernelUnsupported, match="reference has no merge of partial states"):
        runner.merge(registry.create("reference"), _states([2, 1], [64, 20]), what="probe")


def test_batch_invariances_sub_batches_run_the_steps_adapter_announced_with_the_sub_batch(
    launches: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    create = registry.create

    def counted(name, **kwargs):
        made.append(name)
        return create(name, **kwargs)

    monkeypatch.setattr(registry, "create", counted)
    ctx = CheckContext(trace=make_trace(*TRACE), path="t", options=CheckOptions(backends=(TritonBackend.name,)))
    assert batch_invariance.detect(ctx) == []
    # The whole batch's eager run, then each request alone, each launch naming it (a crash there
    # is the step's backend-crash finding, naming the sub-batch), all on the step's one adapter.
    assert launches == [("triton", "eager"), ("triton", "eager, request 0 alone"), ("triton", "eager, request 1 alone")]
    assert made == [TritonBackend.name] and ctx.backends_consulted() == (TritonBackend.name,)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_graph_replays_capture_only_under_cuda_graph_on_a_gpu(cuda_graph: bool) -> None:
    ctx = CheckContext(trace=make_trace(*TRACE), path="t", options=CheckOptions(cuda_graph=cuda_graph, layer=None))
    options = ctx.graph_options(capture_bs=8, fill_value=1)
    assert (options.cuda_graph, options.capture_bs, options.fill_value) == (True, 8, 1)
    assert options.graph_capture is (cuda_graph and machine.cuda_available())
