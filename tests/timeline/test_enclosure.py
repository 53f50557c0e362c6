"""The GPU test's reading of a timeline file, on files built from hand-made records."""

from __future__ import annotations

from attndbg.timeline import chrome, summary
from attndbg.timeline.matching import match
from attndbg.timeline.records import ApiCall, Kernel
from tests.timeline import enclosure
from tests.timeline.factory import replay_step


def _doc(records):
    matched = [match(records)]
    return chrome.document(matched, summary.summarize(matched), command="replay")


def test_a_clean_step_passes() -> None:
    report = enclosure.check(_doc(replay_step()))
    assert report.problems == [] and report.kernels == 7 and report.graph_replays == 2
    assert report.kernels_by_phase == {"data": 1, "run": 2, "replay": 4}


def test_each_broken_claim_is_named() -> None:
    records = replay_step()
    records.external_ids = records.external_ids[1:]  # the data kernel: outside every range
    launch = next(c for c in records.api_calls if c.name.startswith("cudaGraphLaunch"))
    # A second graph launch in the decoy replay range, running one node only.
    extra = ApiCall(correlation_id=999, name="cudaGraphLaunch_v10000", start=launch.start + 1, end=launch.end + 1, thread_id=launch.thread_id)
    records.api_calls.append(extra)
    ext = next(e for e in records.external_ids if e.correlation_id == launch.correlation_id)
    records.external_ids.append(type(ext)(correlation_id=999, external_id=ext.external_id))
    records.kernels.append(Kernel(name="k", correlation_id=999, device=0, stream=7, start=extra.end + 10, end=extra.end + 20, graph_id=5, graph_node_id=1))
    records.markers = []
    problems = enclosure.check(_doc(records)).problems
    assert any("launched outside every attndbg range" in p for p in problems)
    assert any("holds 2 graph launches, not one" in p for p in problems)
    assert any("no NVTX marker reached CUPTI" in p for p in problems)
