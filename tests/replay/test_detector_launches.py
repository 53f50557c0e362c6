"""The runner's entry points for a detector's own launches (split-merge's): `run_derived`, one eager
run of an adapter the detector configured, announced under the detector's own name for it."""

from __future__ import annotations

import pytest
import torch

from attndbg.backends.options import BackendOptions
from attndbg.backends.triton import TritonBackend, TritonOptions
from attndbg.detector_api.context import CheckContext
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
    # The detector's own run is not one of the step's replays, whose backends the report names.
    assert ctx.backends_consulted() == ()
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
