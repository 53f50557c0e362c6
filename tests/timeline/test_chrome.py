"""The trace-event file: what Perfetto and chrome://tracing load (JSON object form, complete
events in microseconds, integer pid/tid, metadata naming processes and rows, flow arrows paired)."""

from __future__ import annotations

import json
from pathlib import Path

from attndbg.timeline import chrome, names, summary
from attndbg.timeline.matching import Matched, match
from attndbg.timeline.records import from_json
from tests.timeline.factory import replay_step

DATA = Path(__file__).parent / "data"


def _doc(*processes):
    matched = [match(p) for p in processes]
    return chrome.document(matched, summary.summarize(matched), command="replay")


def test_schema_perfetto_accepts(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    chrome.write(path, _doc(replay_step(pid=11), replay_step(pid=12, step=1)))
    doc = json.loads(path.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"} and doc["otherData"]["schema"] == "attndbg.timeline/1"
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in {"X", "M", "s", "f"}, e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M" or e["name"] != "process_name":
            assert isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert isinstance(e["args"], dict)
        if e["ph"] == "M":
            assert isinstance(e["args"], dict)
    assert {e["pid"] for e in events} == {11, 12}
    starts = sorted(e["id"] for e in events if e["ph"] == "s")
    assert starts and starts == sorted(e["id"] for e in events if e["ph"] == "f")
    assert all(e["bp"] == "e" for e in events if e["ph"] == "f")
    assert not list(tmp_path.glob(".*.tmp"))


def test_events_carry_ranges_kernels_and_graph_nodes() -> None:
    events = _doc(replay_step())["traceEvents"]
    ranges = [e for e in events if e["ph"] == "X" and e["cat"] == "attndbg"]
    kernels = [e for e in events if e["ph"] == "X" and e["cat"].startswith("kernel")]
    run = next(e for e in ranges if e["args"]["phase"] == "run")
    assert run["name"] == "run · triton · eager" and run["args"]["step"] == "0" and run["args"]["kernels"] == 2
    capture = next(e for e in ranges if e["args"]["phase"] == "capture")
    assert capture["args"]["captured_launches"] == 2 and capture["args"]["kernels"] == 0
    graph = [e for e in kernels if e["cat"] == "kernel,graph"]
    assert len(graph) == 4 and {(e["args"]["graph_id"], e["args"]["graph_node_id"]) for e in graph} == {(5, 1), (5, 2)}
    assert all(e["args"]["range"].startswith("attndbg/replay ") for e in graph)
    elementwise = next(e for e in kernels if "elementwise" in e["name"])
    assert elementwise["name"].startswith("at::native::elementwise_kernel") and elementwise["args"]["mangled"].startswith("_ZN")
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert rows[kernels[0]["tid"]] == "GPU 0 stream 7"
    # Microseconds from the earliest record: the factory's first range starts 1 µs after its clock origin.
    first = min(e["ts"] for e in events if e["ph"] == "X")
    assert first == 0.0 and run["dur"] == round(run["dur"], 3)
    launches = [e for e in events if e["ph"] == "X" and e["cat"] == "cuda_api"]
    assert sum(e["name"].startswith("cudaGraphLaunch") for e in launches) == 2  # one per replay, not one per kernel


def test_summary_lines_add_up_and_group_steps() -> None:
    matched = [match(replay_step(pid=1, step=0)), match(replay_step(pid=1, step=1))]
    result = summary.summarize(matched)
    assert result.kernels == 14 and result.outside == 0 and sum(ln.kernels for ln in result.lines) == 14
    run = next(ln for ln in result.lines if ln.label == "run · triton · eager")
    assert run.ranges == 2 and run.kernels == 4 and run.gpu_ns == 4 * 3_000
    replay_real = next(ln for ln in result.lines if ln.label == "replay · triton · graph bs=8 fill=1 · real")
    assert replay_real.graph_launches == 2 and replay_real.kernels == 4
    text = summary.render(result, "t.json")
    assert text[0].startswith("timeline: t.json (open in https://ui.perfetto.dev or chrome://tracing): 14 kernels, 0.042 ms GPU time, 2 processes")
    assert any("run · triton · eager" in line and "×2" in line for line in text)
    assert not any("outside" in line or "NVTX" in line for line in text)


def test_summary_says_what_could_not_be_placed() -> None:
    records = replay_step()
    records.external_ids = records.external_ids[1:]  # the data phase's launch lost its range
    records.markers = []
    text = summary.render(summary.summarize([match(records)]), "t.json")
    assert "  1 kernels were launched outside every attndbg range" in text
    assert any(line.startswith("  no NVTX range reached CUPTI") for line in text)


def _kernel_events_as_dicts(processes: list[Matched]) -> list[dict]:
    """What each kernel's event is, written out field by field (chrome.py formats them from templates)."""
    origin = min([r.start for m in processes for r in m.records.ranges] + [k.start for m in processes for k in m.records.kernels] + [c.start for m in processes for c in m.records.api_calls])
    out = []
    for m in processes:
        for launched in m.launched:
            k, r = launched.kernel, launched.range
            args = {"correlation_id": k.correlation_id, "device": k.device, "stream": k.stream, "range": r.message if r else None, "range_id": r.id if r else None}
            if k.graph_id:
                args |= {"graph_id": k.graph_id, "graph_node_id": k.graph_node_id}
            if launched.launch is not None:
                args["launch"] = launched.launch.name
            if names.demangle(k.name) != k.name:
                args["mangled"] = k.name
            out.append({"ph": "X", "cat": "kernel,graph" if k.graph_id else "kernel", "name": names.short(k.name, width=120), "pid": m.records.pid,
                        "ts": round((k.start - origin) / 1e3, 3), "dur": round((k.end - k.start) / 1e3, 3), "args": args})
    return out


def test_the_text_reads_back_as_each_event_written_out(tmp_path: Path) -> None:
    records = [from_json(json.loads(line)) for file in sorted(DATA.glob("*.jsonl")) for line in file.read_text().splitlines()]
    odd = replay_step(pid=5)
    odd.kernels[0] = odd.kernels[0]._replace(name='k<"a\\b">\t…')  # escaped, not pasted
    odd.external_ids = odd.external_ids[1:]  # a kernel outside every range: "range": null
    matched = [match(p) for p in [*records, odd]]
    result = summary.summarize(matched)
    chrome.write(tmp_path / "t.json", chrome.text(matched, result, command="check"))
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc == chrome.document(matched, result, command="check")
    kernels = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"].startswith("kernel")]
    assert [{key: e[key] for key in e if key != "tid"} for e in kernels] == _kernel_events_as_dicts(matched)
    assert any(e["name"] == 'k<"a\\b">\t…' for e in kernels) and any(e["args"]["range"] is None for e in kernels)
    launches = {(e["pid"], e["args"]["correlation_id"]): e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "cuda_api"}
    for m in matched:
        for launched in m.launched:
            if launched.launch is not None and launched.range is not None:
                e = launches[(m.records.pid, launched.launch.correlation_id)]
                assert e["name"] == launched.launch.name and e["tid"] == launched.range.thread_id and e["args"]["range_id"] == launched.range.id
