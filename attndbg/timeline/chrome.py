"""The timeline as a Chrome trace-event JSON file (what https://ui.perfetto.dev and chrome://tracing
open): per process, the host thread's attndbg ranges and the launches made in them, and one row per
GPU stream with the kernels; an arrow (flow event) from each launch to its kernel.

Format: the JSON object form of the Trace Event Format (Google, "Trace Event Format" document):
complete events `ph: "X"` with `ts`/`dur` in microseconds, `pid`/`tid` integers, `args` free;
metadata events `ph: "M"` name the processes and rows; flow events `ph: "s"` / `ph: "f"` (with
`bp: "e"`: bind to the enclosing slice) draw the arrows. Times are CUPTI's, relative to the
earliest record of all processes (CUPTI timestamps share the host's clock across processes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attndbg.timeline import names as kernel_names
from attndbg.timeline.matching import Matched
from attndbg.timeline.records import Range
from attndbg.timeline.summary import Summary

# GPU rows sit above every Linux thread id (pid_max is at most 2**22), so they never share a row
# with a host thread of the same process.
GPU_ROW_BASE = 1 << 30
SCHEMA = "attndbg.timeline/1"


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


def arrows(matched: Matched) -> int:
    """How many launch arrows (flow events) `process_text` draws for the process: one per launch
    call with a kernel, made inside a range."""
    return len({k.launch.correlation_id for k in matched.launched if k.launch is not None and k.range is not None})


# The events there is one of per kernel (the kernel, its launch call, the flow arrow's two ends:
# ~4 x 85,000 in a 200-step check) are written from templates instead of a dict each and json.dumps
# of the whole list (bench/timeline_processing.py, events and write: 74-100 ms per 1,000 kernels
# down to 22-29 on the loaded 2-core CPU, bench/results/timeline_processing_cpu_session9.txt). What
# is the same for many kernels is formatted once: a kernel event's head (name, row) and the end of
# its args (launch, device, stream, mangled name) per kernel name, stream and launch call's name; a
# range's args and its launch events' head per range. `events()` reads the text back, so there is
# one definition of the format, and tests/timeline/test_chrome.py checks each kernel event against
# its fields written out one by one.
# Times: "%.3f" of (ns - origin) / 1e3 reads back as round(..., 3) does: ns are integers.
_KERNEL_HEAD = '{"ph":"X","cat":"%s","name":%s,"pid":%d,"tid":%d,'
_KERNEL_TAIL = '%s,"device":%d,"stream":%d%s}}'  # launch, device, stream, mangled
_KERNEL = '%s"ts":%s,"dur":%.3f,"args":{"correlation_id":%d,%s%s%s'  # head, ts, dur, correlation id, range, graph, tail
_GRAPH_ARGS = ',"graph_id":%d,"graph_node_id":%d'
_LAUNCH_HEAD = '{"ph":"X","cat":"cuda_api","name":%s,"pid":%d,"tid":%d,'
# A launch call, and the arrow from it to its kernel: head, ts, dur, correlation id, range id; flow id, tid, ts; flow id, kernel row, kernel ts
_LAUNCH = (
    ',%s"ts":%s,"dur":%.3f,"args":{"correlation_id":%d,"range_id":%d}}'
    ',{"ph":"s","cat":"launch","name":"launch","id":%d,"pid":%d,"tid":%d,"ts":%s}'
    ',{"ph":"f","bp":"e","cat":"launch","name":"launch","id":%d,"pid":%d,"tid":%d,"ts":%s}'
)
_OUTSIDE = '"range":null,"range_id":null'
_encode = json.JSONEncoder(separators=(",", ":")).encode


def events(processes: Sequence[Matched]) -> list[dict[str, Any]]:
    return json.loads("[" + event_text(processes) + "]")


def event_text(processes: Sequence[Matched]) -> str:
    """The trace events in file order, as JSON texts joined by commas (the inside of a list)."""
    origin = _origin(processes)
    out: list[str] = []
    flow = 0
    for matched in processes:
        flow = _process(matched, origin, flow, out)
    return ",".join(out)


def process_text(matched: Matched, origin: int, first_flow: int) -> str:
    """One process's part of `event_text`, given what the processes before it in the file decide:
    the origin of all (the earliest `earliest`) and how many arrows come before its own (`arrows`).
    Joined by commas in file order, the parts are `event_text`'s text (merge.py writes them so)."""
    out: list[str] = []
    _process(matched, origin, first_flow, out)
    return ",".join(out)


def _process(matched: Matched, origin: int, flow: int, out: list[str]) -> int:
    """One process's events appended to `out` (an item may hold a kernel's several); returns the last flow arrow's id."""
    records = matched.records
    pid = records.pid
    out.append(_encode({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{records.label} (pid {pid})"}}))
    host_threads = sorted({r.thread_id for r in records.ranges})
    for tid in host_threads:
        out.append(_encode({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "host: attndbg ranges, launches"}}))
    for range_ in records.ranges:
        out.append(_encode(_range_event(matched, range_, pid, origin)))
    rows: dict[tuple[int, int], int] = {}
    # Launches sit on the host row of the range they were made in (CUPTI's thread numbering is
    # not Python's, so the range's row is the one to use), a kernel on its stream's row.
    launched_calls: set[int] = set()
    range_args: dict[int, str] = {}  # range id -> '"range":"attndbg/run ...","range_id":7'
    pieces: dict[tuple[str, int, int, int, str | None], tuple[str, str]] = {}  # (kernel name, device, stream, graph?, call name) -> head, tail
    launch_heads: dict[tuple[str, int], str] = {}  # (call name, range id) -> the launch event's head
    append = out.append
    for kernel, call, range_, _, _ in matched.launched:
        name, correlation_id, device, stream, start, end, graph_id, graph_node_id = kernel
        call_name = call.name if call is not None else None
        key = (name, device, stream, graph_id != 0, call_name)
        piece = pieces.get(key)
        if piece is None:
            row = rows.get((device, stream))
            if row is None:
                row = rows[(device, stream)] = GPU_ROW_BASE + len(rows)
            mangled = f',"mangled":{_encode(name)}' if kernel_names.demangle(name) != name else ""
            piece = pieces[key] = (
                _KERNEL_HEAD % ("kernel,graph" if graph_id else "kernel", _encode(kernel_names.short(name, width=120)), pid, row),
                _KERNEL_TAIL % (f',"launch":{_encode(call_name)}' if call_name is not None else "", device, stream, mangled),
            )
        if range_ is None:
            in_range = _OUTSIDE
        else:
            in_range = range_args.get(range_.id) or range_args.setdefault(range_.id, f'"range":{_encode(range_.message)},"range_id":{range_.id}')
        ts = "%.3f" % ((start - origin) / 1e3)
        text = _KERNEL % (piece[0], ts, (end - start) / 1e3, correlation_id, in_range, _GRAPH_ARGS % (graph_id, graph_node_id) if graph_id else "", piece[1])
        if call is not None and range_ is not None and call.correlation_id not in launched_calls:
            launched_calls.add(call.correlation_id)
            tid = range_.thread_id
            head = launch_heads.get((call.name, range_.id))
            if head is None:
                head = launch_heads[(call.name, range_.id)] = _LAUNCH_HEAD % (_encode(call.name), pid, tid)
            call_ts = "%.3f" % ((call.start - origin) / 1e3)
            flow += 1
            text += _LAUNCH % (head, call_ts, (call.end - call.start) / 1e3, call.correlation_id, range_.id, flow, pid, tid, call_ts, flow, pid, rows[(device, stream)], ts)
        append(text)
    for range_id, calls in matched.unexecuted.items():
        captured_in = matched.ranges.get(range_id) if range_id is not None else None
        if captured_in is None:
            continue
        for c in calls:  # recorded into a graph under capture: its replays run the kernel
            out.append(_encode({
                "ph": "X", "cat": "cuda_api,captured", "name": c.name, "pid": pid, "tid": captured_in.thread_id,
                "ts": _us(c.start, origin), "dur": _us(c.end, c.start), "args": {"correlation_id": c.correlation_id, "range_id": captured_in.id, "captured": True},
            }))
    for (device, stream), row in rows.items():
        out.append(_encode({"ph": "M", "name": "thread_name", "pid": pid, "tid": row, "args": {"name": f"GPU {device} stream {stream}"}}))
        out.append(_encode({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": row, "args": {"sort_index": row}}))
    return flow


def _range_event(matched: Matched, range_: Range, pid: int, origin: int) -> dict[str, Any]:
    named = matched.names(range_)
    # range_id / parent_id: unique in their process (pid); messages are not (a graph replay's
    # `replay batch=real` reads the same under every backend).
    args = {
        "message": range_.message, "range_id": range_.id, "parent_id": range_.parent,
        "phase": named.phase, "step": named.step, "backend": named.backend, "variant": named.variant,
    }
    if named.trace:
        args["trace"] = named.trace
    if named.mode:
        args["mode"] = named.mode
    if named.batch_size:
        args["bs"] = named.batch_size
    if named.probe:
        args["probe"] = named.probe
    if named.detector:
        args["detector"] = named.detector
    if named.batch:
        args["batch"] = named.batch
    launched = matched.in_range(range_.id)
    args["kernels"] = len(launched)
    args["kernel_time_us"] = round(sum(k.kernel.duration for k in launched) / 1e3, 3)
    captured = matched.unexecuted.get(range_.id, [])
    if captured:
        args["captured_launches"] = len(captured)
    # The step range is named for its file: it is what tells the steps of a folder apart.
    name = f"{named.label()} · {named.trace}" if named.phase == "step" and named.trace else named.label()
    return {
        "ph": "X", "cat": "attndbg", "name": name, "pid": pid, "tid": range_.thread_id,
        "ts": _us(range_.start, origin), "dur": _us(range_.end, range_.start), "args": args,
    }


def document(processes: Sequence[Matched], summary: Summary, *, command: str) -> dict[str, Any]:
    return {
        "traceEvents": events(processes),
        "displayTimeUnit": "ms",
        "otherData": {"schema": SCHEMA, "command": command, "attndbg": summary.as_json()},
    }


def text(processes: Sequence[Matched], summary: Summary, *, command: str) -> str:
    """`document(...)` as the file's JSON text, without building a dict per event."""
    return assemble(event_text(processes), summary, command=command)


def assemble(events_text: str, summary: Summary, *, command: str) -> str:
    """The file's JSON text around `event_text`'s (or merge.py's) events."""
    other = _encode({"schema": SCHEMA, "command": command, "attndbg": summary.as_json()})
    return '{"traceEvents":[' + events_text + '],"displayTimeUnit":"ms","otherData":' + other + "}"


def write(path: str | Path, doc: dict[str, Any] | str) -> None:
    """A document (or its `text`), written whole, then renamed into place: a reader never sees half a file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # dumps, then one write: json.dump encodes chunk by chunk through Python (measured 2-3x slower
    # on an 80 MB timeline, bench/timeline_processing.py).
    body = doc if isinstance(doc, str) else _encode(doc)
    with open(tmp, "w") as f:
        f.write(body)
    os.replace(tmp, target)
