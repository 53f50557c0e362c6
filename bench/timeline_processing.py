"""The Python side of `--timeline`, timed on the CPU from a real timeline file.

A `--timeline` file keeps the records it placed (ranges, kernels, their launch calls), so they can
be rebuilt as the collector's records (`records_from_chrome`) and pushed through what runs after
the command: matching, summary, trace events, the JSON write; and, per record, the conversion the
collector's buffer callback makes (`convert.Converter`, on stand-in record objects) and a worker's
JSON-lines round trip. `--scale N` repeats each process's records N times (fresh ids, later times)
to reach a server-shaped run's size (the 200-step cost run placed 84,875 kernels, over 4 workers:
a cost that grows with a process's ranges times its kernels is ~4x smaller there than in the 2
processes of a scaled check_traces_jobs2.json).

    python bench/timeline_processing.py OUT/check_traces_jobs2.json --scale 60
    python bench/timeline_processing.py      # no file: tests/timeline/data's records, scaled to --kernels 85000

Without a file, the records are the trimmed real ones of tests/timeline/data (a check worker's
and a graph replay's, 208 kernels, 200 launch calls, 29 ranges) repeated to ~85,000 kernels, the
200-step cost run's count, so the numbers need no GPU run's file. Each stage says its time per
1,000 kernels; the totals split what a process pays while the command runs (the buffer callback's
conversion, the collector's take, a worker's JSON lines; spread over the check's workers) from
what the parent pays alone once it ends (reading the workers' lines, match, summary, trace events,
the write). The code timed is the checkout's: run this file from another
checkout's root (`cp bench/timeline_processing.py OLD/bench/; cd OLD; python bench/...`) for a
before/after (a checkout without `chrome.text` has its document built and json-dumped instead).

`--fixture OUT` instead writes a trimmed copy of a file's records, in the worker's JSON-lines
format (records.to_json), for tests/timeline/data/.

The NVTX markers are not in the file (only counted), so the rebuilt records carry a START and END
edge at each range's own times: what CUPTI delivered when nothing disagreed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.timeline import chrome, summary  # noqa: E402
from attndbg.timeline.convert import Converter, Kinds, LaunchExternalIds  # noqa: E402
from attndbg.timeline.matching import match  # noqa: E402
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, Range, from_json, to_json  # noqa: E402

MARKER_ID_BASE = 1 << 20  # marker ids apart from range ids, as CUPTI's own numbering is
DATA = Path(__file__).resolve().parents[1] / "tests" / "timeline" / "data"


def _ns(us: float) -> int:
    return round(us * 1000)


def records_from_chrome(doc: dict) -> list[ProcessRecords]:
    """The records a `--timeline` file was written from, one per process (see the module's note on
    markers). Files of schema attndbg.timeline/1 only: they hold every launch call and each kernel's
    correlation id; a /2 file keeps graph launches only (timeline/chrome.py, SIZE)."""
    schema = doc["otherData"]["schema"]
    if schema != "attndbg.timeline/1":
        raise SystemExit(f"records_from_chrome reads attndbg.timeline/1 files, with every launch call; this one is {schema}")
    events = doc["traceEvents"]
    labels = {e["pid"]: e["args"]["name"].rsplit(" (pid", 1)[0] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    out = {pid: ProcessRecords(pid=pid, label=label) for pid, label in labels.items()}
    for e in events:
        if e["ph"] != "X":
            continue
        records, a = out[e["pid"]], e["args"]
        start, end = _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])
        if e["cat"] == "attndbg":
            records.ranges.append(Range(id=a["range_id"], parent=a["parent_id"], message=a["message"], thread_id=e["tid"], start=start, end=end))
            records.markers += [
                Marker(id=MARKER_ID_BASE + a["range_id"], edge=Edge.START, timestamp=start, thread_id=e["tid"], name=a["message"], domain="attndbg"),
                Marker(id=MARKER_ID_BASE + a["range_id"], edge=Edge.END, timestamp=end, thread_id=e["tid"]),
            ]
        elif e["cat"].startswith("kernel"):
            records.kernels.append(Kernel(
                name=a.get("mangled", e["name"]), correlation_id=a["correlation_id"], device=a["device"], stream=a["stream"],
                start=start, end=end, graph_id=a.get("graph_id", 0), graph_node_id=a.get("graph_node_id", 0),
            ))
            if a["range_id"] is not None:
                records.external_ids.append(ExternalId(correlation_id=a["correlation_id"], external_id=a["range_id"]))
        elif e["cat"].startswith("cuda_api"):
            records.api_calls.append(ApiCall(correlation_id=a["correlation_id"], name=e["name"], start=start, end=end, thread_id=e["tid"]))
            records.external_ids.append(ExternalId(correlation_id=a["correlation_id"], external_id=a["range_id"]))
    for records in out.values():
        records.ranges.sort(key=lambda r: r.start)
        records.external_ids = list({(x.correlation_id, x.external_id): x for x in records.external_ids}.values())
    return [out[pid] for pid in sorted(out)]


def trimmed(records: ProcessRecords, keep: set[int]) -> ProcessRecords:
    """`records` cut to the ranges `keep` (with their ancestors and everything inside them), what
    was launched in them, and every kernel launched outside all ranges."""
    by_id = {r.id: r for r in records.ranges}
    ids: set[int] = set()
    for rid in keep:
        while rid is not None and rid not in ids:
            ids.add(rid)
            rid = by_id[rid].parent
    grew = True
    while grew:
        inside = {r.id for r in records.ranges if r.parent in keep}
        grew = not inside <= keep
        keep = keep | inside
    ids |= keep
    external = {x.correlation_id: x.external_id for x in records.external_ids}
    corrs = {c for c, rid in external.items() if rid in ids} | {k.correlation_id for k in records.kernels if k.correlation_id not in external}
    return ProcessRecords(
        pid=records.pid, label=records.label,
        ranges=[r for r in records.ranges if r.id in ids],
        api_calls=[c for c in records.api_calls if c.correlation_id in corrs],
        kernels=[k for k in records.kernels if k.correlation_id in corrs],
        external_ids=[x for x in records.external_ids if x.correlation_id in corrs],
        markers=[m for m in records.markers if m.id - MARKER_ID_BASE in ids],
    )


def scaled(records: ProcessRecords, times: int) -> ProcessRecords:
    """`records` repeated `times` times, each copy with fresh range and correlation ids, later in time."""
    span = max([r.end for r in records.ranges] + [k.end for k in records.kernels], default=0) + 1
    rid, corr = max((r.id for r in records.ranges), default=0) + 1, max((k.correlation_id for k in records.kernels), default=0) + 1
    out = ProcessRecords(pid=records.pid, label=records.label)
    for i in range(times):
        dt, dr, dc = i * span, i * rid, i * corr
        out.ranges += [Range(r.id + dr, None if r.parent is None else r.parent + dr, r.message, r.thread_id, r.start + dt, r.end + dt) for r in records.ranges]
        out.api_calls += [ApiCall(c.correlation_id + dc, c.name, c.start + dt, c.end + dt, c.thread_id) for c in records.api_calls]
        out.kernels += [Kernel(k.name, k.correlation_id + dc, k.device, k.stream, k.start + dt, k.end + dt, k.graph_id, k.graph_node_id) for k in records.kernels]
        out.external_ids += [ExternalId(x.correlation_id + dc, x.external_id + dr) for x in records.external_ids]
        out.markers += [Marker(m.id + dr, m.edge, m.timestamp + dt, m.thread_id, m.name, m.domain) for m in records.markers]
    return out


def _timed(what: str, fn, per: int, totals: list[float] | None = None):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    if totals is not None:
        totals.append(seconds)
    print(f"  {what:<46} {seconds:8.3f} s  {seconds / max(per, 1) * 1e6:8.2f} ms per 1,000 kernels")
    return result


def recorded(kernels: int) -> tuple[str, list[ProcessRecords]]:
    """tests/timeline/data's processes, each repeated to reach about `kernels` kernels in all."""
    processes = [from_json(json.loads(line)) for file in sorted(DATA.glob("*.jsonl")) for line in file.read_text().splitlines() if line.strip()]
    times = max(1, round(kernels / max(sum(len(p.kernels) for p in processes), 1)))
    return f"tests/timeline/data x{times}", [scaled(p, times) for p in processes]


def _activities(records: ProcessRecords, kinds: Kinds, api_per_launch: int) -> list[SimpleNamespace]:
    """Stand-ins of cupti-python's record objects for `records`: per launch, `api_per_launch` API
    records (the launch and calls that launch nothing) and as many external-correlation records."""
    acts = []
    for k in records.kernels:
        acts.append(SimpleNamespace(kind=kinds.kernel, name=k.name, correlation_id=k.correlation_id, device_id=k.device, stream_id=k.stream, start=k.start, end=k.end, graph_id=k.graph_id, graph_node_id=k.graph_node_id))
    for c in records.api_calls:
        for j in range(api_per_launch):
            acts.append(SimpleNamespace(kind=kinds.runtime, cbid=211 if j == 0 else 1, correlation_id=c.correlation_id, start=c.start, end=c.end, thread_id=c.thread_id))
            acts.append(SimpleNamespace(kind=kinds.external_correlation, external_kind=kinds.external_kind, correlation_id=c.correlation_id, external_id=1))
    return acts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path, nargs="?", help="a --timeline file (default: tests/timeline/data's records, scaled to --kernels)")
    parser.add_argument("--scale", type=int, default=1, help="with a file: repeat each process's records this many times")
    parser.add_argument("--kernels", type=int, default=85_000, help="without a file: about this many kernels in all")
    parser.add_argument("--api-per-launch", type=int, default=10, help="API records CUPTI delivers per kernel launch when every call is recorded")
    parser.add_argument("--fixture", type=Path, help="write a trimmed copy of the records here instead (JSON lines)")
    parser.add_argument("--keep", default="", help="with --fixture: pid:range_id,... to keep (default: all)")
    args = parser.parse_args()
    if args.fixture:
        processes = records_from_chrome(json.loads(args.timeline.read_text()))
        keep: dict[int, set[int]] = {}
        for item in filter(None, args.keep.split(",")):
            pid, rid = item.split(":")
            keep.setdefault(int(pid), set()).add(int(rid))
        with open(args.fixture, "w") as f:
            for records in processes:
                if keep and records.pid not in keep:
                    continue
                cut = trimmed(records, keep[records.pid]) if keep else records
                f.write(json.dumps(to_json(cut), separators=(",", ":")) + "\n")
        print(f"{args.fixture}: {args.fixture.stat().st_size} bytes")
        return
    if args.timeline:
        source, processes = f"{args.timeline.name} x{args.scale}", [scaled(p, args.scale) for p in records_from_chrome(json.loads(args.timeline.read_text()))]
    else:
        source, processes = recorded(args.kernels)
    kernels = sum(len(p.kernels) for p in processes)
    print(f"{source}: {kernels} kernels, {sum(len(p.api_calls) for p in processes)} launch calls, {sum(len(p.ranges) for p in processes)} ranges, {len(processes)} processes")
    kinds = Kinds(kernel=10, runtime=5, driver=6, external_correlation=20, marker=30, external_kind=7, thread_object=2)
    names = {211: "cudaLaunchKernel_v7000", 1: "cudaGetDevice_v3020"}
    worker: list[float] = []
    for per_launch in (args.api_per_launch, 1):
        acts = [a for p in processes for a in _activities(p, kinds, per_launch)]
        converter = Converter(kinds, callback_name=lambda runtime, cbid: names[cbid])
        _timed(f"convert {len(acts)} records ({per_launch} API a launch)", lambda: converter.convert(acts, ProcessRecords(pid=1, label="b")), kernels, worker if per_launch == 1 else None)

    def take() -> None:  # Collector.take's work on a batch: keep the launches' external ids
        for p in processes:
            LaunchExternalIds().keep(p.external_ids, [c.correlation_id for c in p.api_calls] + [k.correlation_id for k in p.kernels])

    _timed("collector take (external ids of launches)", take, kernels, worker)
    written = _timed("worker JSON lines: write", lambda: [json.dumps(to_json(p), separators=(",", ":")) for p in processes], kernels, worker)
    parent: list[float] = []
    lines = _timed("worker JSON lines: read (the parent)", lambda: [from_json(json.loads(line)) for line in written], kernels, parent)
    matched = _timed("match", lambda: [match(p) for p in lines], kernels, parent)
    result = _timed("summarize", lambda: summary.summarize(matched), kernels, parent)
    fast = hasattr(chrome, "text")
    doc = _timed("trace events" + (" (as text)" if fast else ""), lambda: chrome.text(matched, result, command="check") if fast else chrome.document(matched, result, command="check"), kernels, parent)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "t.json"
        _timed("write JSON", lambda: chrome.write(target, doc), kernels, parent)
        size = target.stat().st_size
    print(f"  file: {size / 1e6:.1f} MB, {size / max(kernels, 1):.0f} bytes per kernel")
    per = 1e6 / max(kernels, 1)
    print(f"  while the command runs, in each process (convert, 1 API a launch; take; JSON write): {sum(worker) * per:8.2f} ms per 1,000 kernels")
    print(f"  after it ends, in the parent (JSON read, match, summarize, trace events, write):     {sum(parent) * per:8.2f} ms per 1,000 kernels")
    print(f"  in all:                                                                             {(sum(worker) + sum(parent)) * per:8.2f} ms per 1,000 kernels")


if __name__ == "__main__":
    main()
