"""An output left from an earlier step (SGLang #5404: a merge launched outside the captured graph
returns the capture's output at every replay), judged across a recording's steps: named on the
step whose output is bit for bit an earlier one's though its inputs differ, and on no recording
whose steps computed their own outputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attndbg.detector_api.context import CheckContext
from attndbg.detectors.split_merge.stale import RecordingState, recording_digest
from attndbg.trace.schema import Trace
from tests.checks.shapes import SMALL
from tests.diagnose.test_diagnose import engine_said, recorded

GRAPH_DECODE = ("decode-gqa", *SMALL, "kv_lens=5,100,130", "shared_prefix=0", "capture_bs=4")


def replays(stale: bool) -> list[Trace]:
    """Two replays of one decode graph with different inputs; with `stale`, the second's output is
    the first's (its kernel ran outside the graph: the output buffer kept the earlier launch's)."""
    first = recorded(*GRAPH_DECODE)
    second = recorded(*GRAPH_DECODE, "seed=7")
    second = replace(second, source=replace(second.source, step=first.source.step + 1))
    if stale:
        second = engine_said(second, first.tensors[0].output)
    return [first, second]


def stale_findings(traces: list[Trace]) -> list:
    state = RecordingState()
    found = []
    for trace in traces:
        digest = recording_digest(CheckContext(trace=trace, path="rec"))
        found += state.observe(digest) if digest is not None else []
    return found


def test_an_output_left_from_the_previous_replay() -> None:
    traces = replays(stale=True)
    assert not torch.equal(traces[0].tensors[0].q, traces[1].tensors[0].q)
    [f] = stale_findings(traces)
    assert (f.check, f.location.step, f.data["earlier_step"]) == ("recorded-output-stale", traces[1].source.step, traces[0].source.step)
    assert f.data["reproductions"][0]["mechanism"] == "stale-output"
    assert "a replay of the DECODE graph captured at bs=4" in f.evidence


def test_replays_with_their_own_outputs_are_not_stale() -> None:
    assert stale_findings(replays(stale=False)) == []
    same = recorded(*GRAPH_DECODE)
    assert stale_findings([same, replace(same, source=replace(same.source, step=same.source.step + 1))]) == []  # one step recorded twice


def test_check_names_the_stale_step_of_a_recording(tmp_path) -> None:
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import parse_only
    from attndbg.detector_api.context import CheckOptions
    from attndbg.trace import io

    for i, trace in enumerate(replays(stale=True)):
        io.append_to_recording(tmp_path, trace, f"step_{i:06d}.pt")
    reports = list(check_steps(str(tmp_path), parse_only("split-merge"), CheckOptions(backends=("reference",))))
    across = [f for r in reports if r.mode == "recording" for f in r.findings]
    assert [(f.check, f.location.step) for f in across] == [("recorded-output-stale", 1)]
