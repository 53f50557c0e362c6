"""`record --timeline`'s reading (the GPU test's, on a live engine), on files built from hand-made
records of an engine's process: the ranges around recorded steps, against the recording's manifest."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from attndbg import profiling
from attndbg.timeline import chrome, session, summary
from attndbg.timeline.matching import match
from attndbg.timeline.records import ApiCall, Kernel, to_json
from attndbg.trace.io import ManifestEntry
from tests.timeline import engine_enclosure
from tests.timeline.factory import engine_steps

ENTRIES = [
    ManifestEntry(file=f"step_{s:06d}.pt", step=s, mode=mode, batch_size=bs, graph=False, layers=[])
    for s, mode, bs in ((0, "DECODE", 3), (1, "DECODE", 3), (2, "DECODE", 3), (3, "EXTEND", 1))
]


def _doc(records):
    matched = [match(records)]
    return chrome.document(matched, summary.summarize(matched), command="record")


def test_clean_engine_steps_pass() -> None:
    doc = _doc(engine_steps())
    report = engine_enclosure.check(doc, ENTRIES)
    assert report.problems == [], report.problems
    assert report.steps == 4 and dict(report.by_variant) == {"graph capture": 1, "graph replay": 2, "eager": 1}
    assert report.kernels == 2 + 2 * 2 + 1 and report.outside == 2  # the engine's own kernels between steps
    named = chrome.range_names(doc)
    engine = {named[(e["pid"], e["args"]["range_id"])].step: (named[(e["pid"], e["args"]["range_id"])], e["args"]) for e in doc["traceEvents"] if e.get("cat") == "attndbg"}
    assert engine["1"][0].variant == "graph replay bs=8" and engine["0"][0].variant == "graph capture bs=8" and engine["3"][0].variant == "eager"
    assert (engine["3"][0].mode, engine["3"][0].batch_size) == ("EXTEND", "1") and engine["0"][1]["captured_launches"] == 2


def test_each_broken_claim_is_named() -> None:
    records = engine_steps()
    # Step 2's replay range also holds a second graph launch; a graph node runs outside every range.
    launch = [c for c in records.api_calls if c.name.startswith("cudaGraphLaunch")][-1]
    ext = next(e for e in records.external_ids if e.correlation_id == launch.correlation_id)
    extra = ApiCall(correlation_id=999, name="cudaGraphLaunch_v10000", start=launch.start + 1, end=launch.end + 1, thread_id=launch.thread_id)
    records.api_calls.append(extra)
    records.external_ids.append(type(ext)(correlation_id=999, external_id=ext.external_id))
    records.kernels.append(Kernel(name="k", correlation_id=999, device=0, stream=7, start=extra.end + 10, end=extra.end + 20, graph_id=5, graph_node_id=1))
    stray = ApiCall(correlation_id=998, name="cudaGraphLaunch_v10000", start=launch.end + 5, end=launch.end + 6, thread_id=launch.thread_id)
    records.api_calls.append(stray)
    records.kernels.append(Kernel(name="lost", correlation_id=998, device=0, stream=7, start=stray.end + 10, end=stray.end + 20, graph_id=5, graph_node_id=2))
    # The eager step's only kernel moved out of its range: an eager range with no kernel.
    eager_call = [c for c in records.api_calls if c.correlation_id in {k.correlation_id for k in records.kernels if k.name == "attention_prefill"}][0]
    records.external_ids = [e for e in records.external_ids if e.correlation_id != eager_call.correlation_id]
    records.markers = []
    entries = [dataclasses.replace(ENTRIES[0], mode="EXTEND"), *ENTRIES[1:3]]  # step 0 recorded as a prefill; step 3 not recorded
    problems = engine_enclosure.check(_doc(records), entries).problems
    assert any("step 0: the range says mode=DECODE bs=3, the recorded file step_000000.pt mode=EXTEND" in p for p in problems), problems
    assert any("recorded steps without a range: []" in p and "ranges for steps [3]" in p for p in problems), problems
    assert any("holding 2 graph launches, not one" in p for p in problems), problems
    assert any("graph node lost" in p and "outside every replay range" in p for p in problems), problems
    assert any("an eager step whose range launched no kernel" in p for p in problems), problems
    assert any("no NVTX marker reached CUPTI" in p for p in problems), problems


class _NoCollector:
    def __init__(self, label: str):
        raise AssertionError("record's own process must not collect: it launches no kernel")


def test_record_collects_only_in_the_engine_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(session, "Collector", _NoCollector)
    monkeypatch.delenv(profiling.TIMELINE_VARIABLE, raising=False)
    monkeypatch.setenv(profiling.TIMELINE_LABEL_VARIABLE, "before")
    out = tmp_path / "timeline.json"
    recording = session.start(str(out), command="record", spawned_label="engine process", collect_here=False)
    directory = Path(os.environ[profiling.TIMELINE_VARIABLE])
    assert os.environ[profiling.TIMELINE_LABEL_VARIABLE] == "engine process"
    (directory / "worker-4321.jsonl").write_text(json.dumps(to_json(engine_steps(pid=4321))) + "\n")
    recording.finish()
    assert profiling.TIMELINE_VARIABLE not in os.environ and os.environ[profiling.TIMELINE_LABEL_VARIABLE] == "before"
    doc = json.loads(out.read_text())
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert names == ["engine process (pid 4321)"]
    assert engine_enclosure.check(doc, ENTRIES).problems == []
    err = capsys.readouterr().err
    assert ": 9 kernels" in err and "engine · graph replay bs=8" in err and "2 kernels were launched outside every attndbg range" in err


def test_record_with_no_engine_range_says_nothing_was_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(session, "Collector", _NoCollector)
    monkeypatch.delenv(profiling.TIMELINE_VARIABLE, raising=False)
    out = tmp_path / "timeline.json"
    session.start(str(out), command="record", spawned_label="engine process", collect_here=False).finish()
    doc = json.loads(out.read_text())
    assert doc["otherData"]["attndbg"]["kernels"] == 0 and doc["otherData"]["attndbg"]["processes"] == 0
    assert "no process the command started opened an attndbg range" in capsys.readouterr().err


def test_a_replay_running_fewer_nodes_than_its_capture_recorded_is_named() -> None:
    records = engine_steps()
    lost = next(k for k in records.kernels if k.name == "lm_head" and k.graph_node_id == 2)
    records.kernels.remove(lost)  # step 1's replay: one of its graph's 2 nodes missing
    problems = engine_enclosure.check(_doc(records), ENTRIES).problems
    assert any("step 1" in p and "the replay ran 1 nodes, the recorded capture of its size recorded 2 launches" in p for p in problems), problems
