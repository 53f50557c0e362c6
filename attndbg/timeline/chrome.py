"""The timeline as a Chrome trace-event JSON file (what https://ui.perfetto.dev and chrome://tracing
open; gzip-compressed when its name ends in .gz): per process, the host thread's attndbg ranges and
the CUDA-graph launches made in them, and one row per GPU stream with the kernels; an arrow (flow
event) from each graph launch to its first kernel. Eager launches are counted and timed in their
range's args, and each kernel names its range (SIZE below says why).

Format: the JSON object form of the Trace Event Format (Google, "Trace Event Format" document):
complete events `ph: "X"` with `ts`/`dur` in microseconds, `pid`/`tid` integers, `args` free;
metadata events `ph: "M"` name the processes and rows; flow events `ph: "s"` / `ph: "f"` (with
`bp: "e"`: bind to the enclosing slice) draw the arrows. Times are CUPTI's, relative to the
earliest record of all processes (CUPTI timestamps share the host's clock across processes).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from attndbg.timeline import names as kernel_names
from attndbg.timeline import ranges as range_names_
from attndbg.timeline.matching import Launched, Matched
from attndbg.timeline.records import Range
from attndbg.timeline.summary import Summary

SCHEMA = "attndbg.timeline/2"


def _us(ns: int, origin: int) -> float:
    return round((ns - origin) / 1e3, 3)


def earliest(matched: Matched) -> int | None:
    """The process's earliest time (ns) that an event is placed at; None: it has no such record."""
    records = matched.records
    stamps = [min(r.start for r in records.ranges)] if records.ranges else []
    stamps += [min(k.start for k in records.kernels)] if records.kernels else []
    stamps += [min(c.start for c in records.api_calls)] if records.api_calls else []
    return min(stamps, default=None)


def _origin(processes: Sequence[Matched]) -> int:
    return min((t for t in map(earliest, processes) if t is not None), default=0)


def _drawn(launched: Launched) -> bool:
    """Whether a kernel's launch call is drawn, with an arrow to the kernel: a CUDA-graph launch
    made in a range (one call for a whole replay). An eager launch is one call per kernel: it is
    counted in its range's args (`launch_calls`, `launch_us`), not drawn (see SIZE below)."""
    call = launched.launch
    return call is not None and launched.range is not None and call.launches_graph


def arrows(matched: Matched) -> int:
    """How many launch arrows (flow events) `process_part` draws for the process: one per drawn launch call."""
    return len({k.launch.correlation_id for k in matched.launched if _drawn(k)})  # type: ignore[union-attr]


# SIZE. A server step launches hundreds of kernels; what is written once per kernel decides the
# file's size. Written out in full (its launch call, an arrow to it, the kernel's demangled and
# mangled names, its range's message), a kernel cost 945 bytes on average (H100, 50 server steps,
# 23,632 kernels: 450 kB a step). The trace-event format has no string table, so what repeats is
# written once beside the events (otherData) instead:
# - a kernel's event is named by `kernel_naming` (its name without namespaces, template arguments
#   and argument list, numbered where instances of one template share it) and says only its
#   range's id; the file's kernel table (otherData.kernels, `KernelTable`) holds each event name's
#   demangled and mangled names and its launch calls, once for all processes;
# - a range's event carries its NVTX message; what that names (step, step file, backend, variant)
#   is read from it and its parents' (`range_names`), not written out per range;
# - eager launch calls are timed per range (`launch_us`), not drawn one per kernel; a graph
#   launch (one per replay) is drawn, with its arrow;
# - processes and rows are small numbers (the process's name gives its pid, each row's name its
#   thread, or its device and stream).
# bench/timeline_size.py measures it on real CUPTI records (an H200's replays of traces/, 779 and
# 1,377 kernels, repeated 30 times as a longer run): 154 and 163 bytes a kernel (kernel events
# 117-121, range events 33-35, the kernel table 1.5-2.5), against 947-957 as written before; 16-18
# once gzipped. A short run weighs more per kernel (213-226 at 1x): the table and the summary are
# written once per distinct kernel and kind of range.
#
# The events there is one of per kernel are written from templates instead of a dict each (74-100
# ms per 1,000 kernels down to 22-29 on a loaded 2-core CPU, bench/timeline_processing.py): what
# is the same for many kernels (a kernel event's head, per kernel name and row) is formatted once.
# `events()` reads the text back, so there is one definition of the format, and
# tests/timeline/test_chrome.py checks each kernel event against its fields written out one by one.
# Times: "%.3f" of (ns - origin) / 1e3 reads back as round(..., 3) does: ns are integers.
_KERNEL_HEAD = '{"ph":"X",%s"name":%s,"pid":%d,"tid":%d,'  # cat for graph nodes, event name, process, row
_KERNEL = '%s"ts":%s,"dur":%.3f,"args":{"range":%s%s}}'  # head, ts, dur, range id, graph fields
_GRAPH_ARGS = ',"correlation_id":%d,"graph_id":%d,"graph_node_id":%d'
_LAUNCH_HEAD = '{"ph":"X","cat":"cuda_api","name":%s,"pid":%d,"tid":%d,'
# A graph launch call, and the arrow from it to its first kernel: head, ts, dur, correlation id, range id; flow id, tid, ts; flow id, kernel row, kernel ts
_LAUNCH = (
    ',%s"ts":%s,"dur":%.3f,"args":{"correlation_id":%d,"range_id":%d}}'
    ',{"ph":"s","cat":"launch","name":"launch","id":%d,"pid":%d,"tid":%d,"ts":%s}'
    ',{"ph":"f","bp":"e","cat":"launch","name":"launch","id":%d,"pid":%d,"tid":%d,"ts":%s}'
)
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # the file is UTF-8: '·' in 2 bytes, not 6


def kernel_naming(raw_names: Iterable[str]) -> dict[str, str]:
    """What each kernel's events are called (CUPTI's name -> event name), over every process of a
    file: its name without namespaces, template arguments and argument list; where several kernels
    share that (instances of one template: 'vectorized_elementwise_kernel'), each gets a number,
    in the order of CUPTI's names ('vectorized_elementwise_kernel#3'), the same in every process."""
    by_name: dict[str, list[str]] = {}
    for raw in sorted(set(raw_names)):
        by_name.setdefault(kernel_names.unqualified(raw), []).append(raw)
    return {raw: name if len(raws) == 1 else f"{name}#{i}" for name, raws in by_name.items() for i, raw in enumerate(raws, start=1)}


Tables = dict[str, dict[str, Any]]  # event name -> the kernel so called


class KernelTable:
    """The kernels a file's events name (otherData.kernels): per event name, CUPTI's name for the
    kernel, demangled without its argument list where it was mangled (the template arguments tell
    instances apart; the argument list, which repeats their types, is left to `c++filt`), and the
    calls that launched it."""

    def __init__(self, naming: dict[str, str]) -> None:
        self.naming = naming
        self._launches: dict[str, set[str]] = {}  # CUPTI's name -> launch calls

    def add(self, raw: str, launch: str | None) -> None:
        calls = self._launches.setdefault(raw, set())
        if launch is not None:
            calls.add(launch)

    def as_json(self) -> Tables:
        table: Tables = {}
        for raw, calls in self._launches.items():
            readable = kernel_names.without_arguments(raw)
            table[self.naming[raw]] = {"cupti_name": raw, **({"demangled": readable} if readable != raw else {}), "launches": sorted(calls)}
        return table


def merge_tables(tables: Iterable[Tables]) -> Tables:
    """Processes' tables as one, sorted by event name, each kernel's launch calls joined."""
    merged: Tables = {}
    for table in tables:
        for name, entry in table.items():
            kept = merged.setdefault(name, {**entry, "launches": []})
            kept["launches"] = sorted(set(kept["launches"]) | set(entry["launches"]))
    return dict(sorted(merged.items()))


def kernels_of(matched: Matched) -> set[str]:
    """CUPTI's names of a process's kernels (what `kernel_naming` numbers, over all processes)."""
    return {k.name for k in matched.records.kernels}


def events(processes: Sequence[Matched]) -> list[dict[str, Any]]:
    return json.loads("[" + event_parts(processes)[0] + "]")


def event_parts(processes: Sequence[Matched]) -> tuple[str, Tables]:
    """The trace events in file order, as JSON texts joined by commas (the inside of a list), and
    the kernel table (otherData.kernels). Processes are numbered 1, 2, ... in file order."""
    origin = _origin(processes)
    naming = kernel_naming(name for m in processes for name in kernels_of(m))
    texts: list[str] = []
    tables: list[Tables] = []
    flow = 0
    for number, matched in enumerate(processes, start=1):
        text, table = process_part(matched, origin, flow, number, naming)
        flow += arrows(matched)
        texts.append(text)
        tables.append(table)
    return ",".join(texts), merge_tables(tables)


def process_part(matched: Matched, origin: int, first_flow: int, number: int, naming: dict[str, str]) -> tuple[str, Tables]:
    """One process's part of `event_parts`, given what the file's processes decide together: the
    origin of all (the earliest `earliest`), how many arrows come before its own (`arrows`), its
    number, the kernels' names (`kernel_naming`). Joined by commas in file order, the texts are
    `event_parts`' text, and the tables merged its table (merge.py writes them so)."""
    out: list[str] = []
    table = KernelTable(naming)
    _process(matched, origin, first_flow, number, out, table)
    return ",".join(out), table.as_json()


def _rows(matched: Matched) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Row numbers: the host threads that opened ranges first (by thread id), then each GPU
    stream a kernel ran on (in launch order)."""
    host = {tid: row for row, tid in enumerate(sorted({r.thread_id for r in matched.records.ranges}), start=1)}
    gpu: dict[tuple[int, int], int] = {}
    for launched in matched.launched:
        kernel = launched.kernel
        if (kernel.device, kernel.stream) not in gpu:
            gpu[(kernel.device, kernel.stream)] = len(host) + len(gpu) + 1
    return host, gpu


def _process(matched: Matched, origin: int, flow: int, pid: int, out: list[str], table: KernelTable) -> None:
    """One process's events, as process `pid` of the file, appended to `out` (an item may hold a
    kernel's several), its arrows numbered from `flow` + 1."""
    records = matched.records
    host_rows, gpu_rows = _rows(matched)
    out.append(_encode({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{records.label} (pid {records.pid})"}}))
    for tid, row in host_rows.items():
        out.append(_encode({"ph": "M", "name": "thread_name", "pid": pid, "tid": row, "args": {"name": f"host thread {tid}: attndbg ranges, launches"}}))
    for (device, stream), row in gpu_rows.items():
        out.append(_encode({"ph": "M", "name": "thread_name", "pid": pid, "tid": row, "args": {"name": f"GPU {device} stream {stream}"}}))
    for row in (*host_rows.values(), *gpu_rows.values()):
        out.append(_encode({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": row, "args": {"sort_index": row}}))
    heads: dict[tuple[str, int, bool], str] = {}  # (CUPTI's kernel name, row, graph node?) -> the event's head
    launch_heads: dict[tuple[str, int], str] = {}  # (call name, range id) -> a graph launch event's head
    drawn: set[int] = set()
    launches: dict[int, dict[int, int]] = {}  # range id -> eager launch call (correlation id) -> its duration (ns)
    append = out.append
    for launched in matched.launched:
        kernel, call, range_ = launched.kernel, launched.launch, launched.range
        name, correlation_id, device, stream, start, end, graph_id, graph_node_id = kernel
        row = gpu_rows[(device, stream)]
        key = (name, row, graph_id != 0)
        head = heads.get(key)
        if head is None:
            head = heads[key] = _KERNEL_HEAD % ('"cat":"kernel,graph",' if graph_id else "", _encode(table.naming[name]), pid, row)
        table.add(name, call.name if call is not None else None)
        ts = "%.3f" % ((start - origin) / 1e3)
        graph = _GRAPH_ARGS % (correlation_id, graph_id, graph_node_id) if graph_id else ""
        text = _KERNEL % (head, ts, (end - start) / 1e3, "null" if range_ is None else range_.id, graph)
        if call is not None and range_ is not None:
            if _drawn(launched):
                if call.correlation_id not in drawn:  # the replay's first kernel: the arrow ends there
                    drawn.add(call.correlation_id)
                    tid = host_rows[range_.thread_id]
                    launch_head = launch_heads.get((call.name, range_.id))
                    if launch_head is None:
                        launch_head = launch_heads[(call.name, range_.id)] = _LAUNCH_HEAD % (_encode(call.name), pid, tid)
                    call_ts = "%.3f" % ((call.start - origin) / 1e3)
                    flow += 1
                    text += _LAUNCH % (launch_head, call_ts, (call.end - call.start) / 1e3, call.correlation_id, range_.id, flow, pid, tid, call_ts, flow, pid, row, ts)
            else:
                launches.setdefault(range_.id, {})[call.correlation_id] = call.end - call.start
        append(text)
    for range_ in records.ranges:
        out.append(_encode(_range_event(matched, range_, pid, origin, host_rows[range_.thread_id], launches.get(range_.id, {}))))
    for range_id, calls in matched.unexecuted.items():
        captured_in = matched.ranges.get(range_id) if range_id is not None else None
        if captured_in is None:
            continue
        for c in calls:  # recorded into a graph under capture: its replays run the kernel
            out.append(_encode({
                "ph": "X", "cat": "cuda_api,captured", "name": c.name, "pid": pid, "tid": host_rows[captured_in.thread_id],
                "ts": _us(c.start, origin), "dur": _us(c.end, c.start), "args": {"correlation_id": c.correlation_id, "range_id": captured_in.id, "captured": True},
            }))


def _range_event(matched: Matched, range_: Range, pid: int, origin: int, row: int, launches: dict[int, int]) -> dict[str, Any]:
    """A range: its label as the name; in its args the NVTX message (what it names, with its
    enclosing ranges' words: `range_names`), its id and its parent's (unique in the process:
    messages are not, a graph replay's `replay batch=real` reads the same under every backend),
    the time its eager launch calls took, the launches captured in it. What the file holds per
    kernel of it (each kernel's range_id) counts its kernels."""
    named = matched.names(range_)
    args: dict[str, Any] = {"message": range_.message, "range_id": range_.id}
    if range_.parent is not None:
        args["parent_id"] = range_.parent
    if launches:  # its eager kernel launches: timed here, not drawn (SIZE above)
        args["launch_us"] = round(sum(launches.values()) / 1e3, 3)
    captured = matched.unexecuted.get(range_.id, [])
    if captured:
        args["captured_launches"] = len(captured)
    # The step range is named for its file: it is what tells the steps of a folder apart.
    name = f"{named.label()} · {named.trace}" if named.phase == "step" and named.trace else named.label()
    return {
        "ph": "X", "cat": "attndbg", "name": name, "pid": pid, "tid": row,
        "ts": _us(range_.start, origin), "dur": _us(range_.end, range_.start), "args": args,
    }


def document(processes: Sequence[Matched], summary: Summary, *, command: str) -> dict[str, Any]:
    text, tables = event_parts(processes)
    return {
        "traceEvents": json.loads("[" + text + "]"),
        "displayTimeUnit": "ms",
        "otherData": {"schema": SCHEMA, "command": command, "attndbg": summary.as_json(), "kernels": tables},
    }


def text(processes: Sequence[Matched], summary: Summary, *, command: str) -> str:
    """`document(...)` as the file's JSON text, without building a dict per event."""
    events_text, tables = event_parts(processes)
    return assemble(events_text, tables, summary, command=command)


def assemble(events_text: str, tables: Tables, summary: Summary, *, command: str) -> str:
    """The file's JSON text around `event_parts`' (or merge.py's) events and kernel tables."""
    other = _encode({"schema": SCHEMA, "command": command, "attndbg": summary.as_json(), "kernels": tables})
    return '{"traceEvents":[' + events_text + '],"displayTimeUnit":"ms","otherData":' + other + "}"


def range_names(doc: dict[str, Any]) -> dict[tuple[int, int], range_names_.Names]:
    """What each range of a timeline names ((pid, range_id) -> ranges.Names: step, step file,
    backend, variant, ...), read from its message and its enclosing ranges' as attndbg reads them."""
    by_pid: dict[int, dict[int, Range]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e.get("cat") == "attndbg":
            a = e["args"]
            by_pid.setdefault(e["pid"], {})[a["range_id"]] = Range(id=a["range_id"], parent=a.get("parent_id"), message=a["message"], thread_id=0, start=0, end=0)
    return {(pid, rid): range_names_.names(r, ranges) for pid, ranges in by_pid.items() for rid, r in ranges.items()}


def kernel_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A timeline's kernel events (on the GPU rows), each with `kernel`: the kernel table's entry for
    its name (its demangled and mangled names, its launch calls). What a reader of the file uses
    instead of the short names."""
    gpu_rows = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"].startswith("GPU ")}
    table = doc["otherData"]["kernels"]
    return [{**e, "kernel": table[e["name"]]} for e in doc["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) in gpu_rows]


def write(path: str | Path, doc: dict[str, Any] | str) -> None:
    """A document (or its `text`), written whole, then renamed into place: a reader never sees half a
    file. A path ending in .gz is written gzip-compressed (Perfetto and chrome://tracing open
    .json.gz), with no time or name in its header: the same records give the same bytes."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # dumps, then one write: json.dump encodes chunk by chunk through Python (measured 2-3x slower
    # on an 80 MB timeline, bench/timeline_processing.py).
    body = (doc if isinstance(doc, str) else _encode(doc)).encode("utf-8")
    with open(tmp, "wb") as f:
        if target.name.endswith(".gz"):
            with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=GZIP_LEVEL, mtime=0) as zipped:
                zipped.write(body)
        else:
            f.write(body)
    os.replace(tmp, target)


# zlib's default: on 20 MB of trace events about a sixth of level 9's time for a file a few per cent larger.
GZIP_LEVEL = 6
