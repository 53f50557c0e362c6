"""The trace-event file: what Perfetto and chrome://tracing load (JSON object form, complete
events in microseconds, integer pid/tid, metadata naming processes and rows, flow arrows paired)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

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
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"} and doc["otherData"]["schema"] == "attndbg.timeline/2"
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
    # Processes numbered in file order; each one's name keeps its pid.
    assert {e["pid"] for e in events} == {1, 2}
    assert sorted(e["args"]["name"] for e in events if e["name"] == "process_name") == ["attndbg replay (pid 11)", "attndbg replay (pid 12)"]
    starts = sorted(e["id"] for e in events if e["ph"] == "s")
    assert starts and starts == sorted(e["id"] for e in events if e["ph"] == "f")
    assert all(e["bp"] == "e" for e in events if e["ph"] == "f")
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_gz_timeline_is_gzip_and_the_same_bits_every_time(tmp_path: Path) -> None:
    text = chrome.text([match(replay_step())], summary.summarize([match(replay_step())]), command="replay")
    chrome.write(tmp_path / "a.json.gz", text)
    chrome.write(tmp_path / "b.json.gz", text)
    chrome.write(tmp_path / "t.json", text)
    raw = (tmp_path / "a.json.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b" and gzip.decompress(raw).decode() == text == (tmp_path / "t.json").read_text()
    assert raw == (tmp_path / "b.json.gz").read_bytes()  # no time or file name in the gzip header
    assert len(raw) < len(text) / 3


def test_events_carry_ranges_kernels_and_graph_nodes() -> None:
    doc = _doc(replay_step())
    events = doc["traceEvents"]
    ranges = [e for e in events if e["ph"] == "X" and e.get("cat") == "attndbg"]
    named = chrome.range_names(doc)
    kernels = chrome.kernel_events(doc)
    run = next(e for e in ranges if named[(e["pid"], e["args"]["range_id"])].phase == "run")
    assert run["name"] == "run · triton · eager" and named[(run["pid"], run["args"]["range_id"])].step == "0"
    assert sum(k["args"]["range"] == run["args"]["range_id"] for k in kernels) == 2
    capture = next(e for e in ranges if named[(e["pid"], e["args"]["range_id"])].phase == "capture")
    assert capture["args"]["captured_launches"] == 2 and not any(k["args"]["range"] == capture["args"]["range_id"] for k in kernels)
    graph = [e for e in kernels if e.get("cat") == "kernel,graph"]
    assert len(graph) == 4 and {(e["args"]["graph_id"], e["args"]["graph_node_id"]) for e in graph} == {(5, 1), (5, 2)}
    assert all(named[(e["pid"], e["args"]["range"])].phase == "replay" for e in graph)
    elementwise = next(e for e in kernels if "elementwise" in e["name"])
    assert elementwise["name"] == "elementwise_kernel"  # no namespace, no template arguments: in the table
    assert elementwise["kernel"]["demangled"].startswith("at::native::elementwise_kernel<") and elementwise["kernel"]["cupti_name"].startswith("_ZN")
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert rows[kernels[0]["tid"]] == "GPU 0 stream 7" and rows[run["tid"]].startswith("host thread 4242")
    # Microseconds from the earliest record: the factory's first range starts 1 µs after its clock origin.
    first = min(e["ts"] for e in events if e["ph"] == "X")
    assert first == 0.0 and run["dur"] == round(run["dur"], 3)
    launches = [e for e in events if e["ph"] == "X" and e.get("cat") == "cuda_api"]
    assert [e["name"][:15] for e in launches] == ["cudaGraphLaunch"] * 2  # one per replay; eager launches are timed in their range
    eager_calls = {ln.launch for ln in match(replay_step()).launched if ln.launch is not None and ln.range is not None and not ln.launch.launches_graph}
    assert len(eager_calls) == 3  # the data phase's and the eager run's; captured launches ran no kernel
    assert run["args"]["launch_us"] > 0 and sum(r["args"].get("launch_us", 0) for r in ranges) == pytest.approx(sum(c.end - c.start for c in eager_calls) / 1e3)


def test_instances_of_one_template_get_one_name_each_in_every_process() -> None:
    one = replay_step(pid=1)
    two = replay_step(pid=2)
    float_fill = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"
    int_fill = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIiEESt5arrayIPcLm1EEEEviT0_T1_"
    one.kernels[0] = one.kernels[0]._replace(name=float_fill)
    two.kernels[0] = two.kernels[0]._replace(name=int_fill)
    two.kernels[1] = two.kernels[1]._replace(name=float_fill)
    doc = _doc(one, two)
    by_name = {(k["pid"], k["name"]): k["kernel"]["cupti_name"] for k in chrome.kernel_events(doc) if "vectorized" in k["name"]}
    assert by_name == {(1, "vectorized_elementwise_kernel#1"): float_fill, (2, "vectorized_elementwise_kernel#2"): int_fill, (2, "vectorized_elementwise_kernel#1"): float_fill}
    table = doc["otherData"]["kernels"]
    assert table["vectorized_elementwise_kernel#2"]["demangled"] == "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >"


def test_a_kernel_event_carries_name_times_and_range_only() -> None:
    """What keeps a server run's timeline small (chrome.py, SIZE): on the recorded CUPTI records of
    tests/timeline/data, an eager kernel's event is its short name, process, row, times and range id."""
    records = [from_json(json.loads(line)) for file in sorted(DATA.glob("*.jsonl")) for line in file.read_text().splitlines()]
    matched = [match(r) for r in records]
    doc = chrome.document(matched, summary.summarize(matched), command="check")
    eager = [e for e in chrome.kernel_events(doc) if "cat" not in e]
    assert eager and all(set(e) == {"ph", "name", "pid", "tid", "ts", "dur", "args", "kernel"} and set(e["args"]) == {"range"} for e in eager)
    sizes = [len(json.dumps({k: v for k, v in e.items() if k != "kernel"}, separators=(",", ":"), ensure_ascii=False)) for e in eager]
    assert sum(sizes) / len(sizes) < 120, sum(sizes) / len(sizes)


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
    assert "  1 kernel was launched outside every attndbg range" in text
    assert any(line.startswith("  no NVTX range reached CUPTI") for line in text)


def _kernel_events_as_dicts(processes: list[Matched]) -> list[dict]:
    """What each kernel's event is, written out field by field (chrome.py formats them from templates)."""
    origin = min([r.start for m in processes for r in m.records.ranges] + [k.start for m in processes for k in m.records.kernels] + [c.start for m in processes for c in m.records.api_calls])
    naming = chrome.kernel_naming(k.name for m in processes for k in m.records.kernels)
    out = []
    for number, m in enumerate(processes, start=1):
        for launched in m.launched:
            k, r = launched.kernel, launched.range
            args = {"range": r.id if r else None}
            if k.graph_id:
                args |= {"correlation_id": k.correlation_id, "graph_id": k.graph_id, "graph_node_id": k.graph_node_id}
            event = {"ph": "X", "name": naming[k.name], "pid": number, "ts": round((k.start - origin) / 1e3, 3), "dur": round((k.end - k.start) / 1e3, 3), "args": args}
            out.append({"cat": "kernel,graph", **event} if k.graph_id else event)
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
    kernels = chrome.kernel_events(doc)
    assert [{key: e[key] for key in e if key not in ("tid", "kernel")} for e in kernels] == _kernel_events_as_dicts(matched)
    assert any(e["kernel"]["cupti_name"] == 'k<"a\\b">\t…' and e["name"] == "k\t…" for e in kernels) and any(e["args"]["range"] is None for e in kernels)
    for e in kernels:  # the table names each kernel's launch calls
        launched = {ln.launch.name for m in matched for ln in m.launched if ln.launch is not None and ln.kernel.name == e["kernel"]["cupti_name"]}
        assert set(e["kernel"]["launches"]) == launched
    launches = {(e["pid"], e["args"]["correlation_id"]): e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "cuda_api"}
    rows = {(e["pid"], e["args"]["name"]): e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    for number, m in enumerate(matched, start=1):
        for launched in m.launched:
            if launched.launch is not None and launched.range is not None and launched.launch.launches_graph:
                e = launches[(number, launched.launch.correlation_id)]
                assert e["name"] == launched.launch.name and e["args"]["range_id"] == launched.range.id
                assert e["tid"] == rows[(number, f"host thread {launched.range.thread_id}: attndbg ranges, launches")]
