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
from attndbg.timeline import ranges as range_names
from attndbg.timeline.matching import Matched
from attndbg.timeline.summary import Summary

# GPU rows sit above every Linux thread id (pid_max is at most 2**22), so they never share a row
# with a host thread of the same process.
GPU_ROW_BASE = 1 << 30
SCHEMA = "attndbg.timeline/1"


def _us(ns: int, origin: int) -> float:
    return round((ns - origin) / 1e3, 3)


def _origin(processes: Sequence[Matched]) -> int:
    stamps = [r.start for m in processes for r in m.records.ranges]
    stamps += [k.start for m in processes for k in m.records.kernels]
    stamps += [c.start for m in processes for c in m.records.api_calls]
    return min(stamps, default=0)


def events(processes: Sequence[Matched]) -> list[dict[str, Any]]:
    origin = _origin(processes)
    out: list[dict[str, Any]] = []
    flow = 0
    for matched in processes:
        records = matched.records
        pid = records.pid
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{records.label} (pid {pid})"}})
        host_threads = sorted({r.thread_id for r in records.ranges})
        for tid in host_threads:
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": "host: attndbg ranges, launches"}})
        for range_ in records.ranges:
            named = range_names.names(range_, matched.ranges)
            # range_id / parent_id: unique in their process (pid); messages are not (a graph replay's
            # `replay batch=real` reads the same under every backend).
            args = {
                "message": range_.message, "range_id": range_.id, "parent_id": range_.parent,
                "phase": named.phase, "step": named.step, "backend": named.backend, "variant": named.variant,
            }
            if named.trace:
                args["trace"] = named.trace
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
            out.append({
                "ph": "X", "cat": "attndbg", "name": name, "pid": pid, "tid": range_.thread_id,
                "ts": _us(range_.start, origin), "dur": _us(range_.end, range_.start), "args": args,
            })
        rows: dict[tuple[int, int], int] = {}
        # Launches sit on the host row of the range they were made in (CUPTI's thread numbering is
        # not Python's, so the range's row is the one to use), a kernel on its stream's row.
        launch_rows: dict[int, int] = {}
        for launched in matched.launched:
            kernel = launched.kernel
            row = rows.setdefault((kernel.device, kernel.stream), GPU_ROW_BASE + len(rows))
            args = {
                "correlation_id": kernel.correlation_id, "device": kernel.device, "stream": kernel.stream,
                "range": launched.range.message if launched.range is not None else None,
                "range_id": launched.range.id if launched.range is not None else None,
            }
            if kernel.graph_id:
                args["graph_id"] = kernel.graph_id
                args["graph_node_id"] = kernel.graph_node_id
            if launched.launch is not None:
                args["launch"] = launched.launch.name
            demangled = kernel_names.demangle(kernel.name)
            if demangled != kernel.name:
                args["mangled"] = kernel.name
            out.append({
                "ph": "X", "cat": "kernel,graph" if kernel.graph_id else "kernel", "name": kernel_names.short(kernel.name, width=120),
                "pid": pid, "tid": row, "ts": _us(kernel.start, origin), "dur": _us(kernel.end, kernel.start), "args": args,
            })
            call = launched.launch
            if call is None or launched.range is None:
                continue
            if call.correlation_id not in launch_rows:
                launch_rows[call.correlation_id] = launched.range.thread_id
                out.append({
                    "ph": "X", "cat": "cuda_api", "name": call.name, "pid": pid, "tid": launched.range.thread_id,
                    "ts": _us(call.start, origin), "dur": _us(call.end, call.start),
                    "args": {"correlation_id": call.correlation_id, "range_id": launched.range.id},
                })
                flow += 1
                out.append({"ph": "s", "cat": "launch", "name": "launch", "id": flow, "pid": pid, "tid": launched.range.thread_id, "ts": _us(call.start, origin)})
                out.append({"ph": "f", "bp": "e", "cat": "launch", "name": "launch", "id": flow, "pid": pid, "tid": row, "ts": _us(kernel.start, origin)})
        for range_id, calls in matched.unexecuted.items():
            range_ = matched.ranges.get(range_id) if range_id is not None else None
            if range_ is None:
                continue
            for call in calls:  # recorded into a graph under capture: its replays run the kernel
                out.append({
                    "ph": "X", "cat": "cuda_api,captured", "name": call.name, "pid": pid, "tid": range_.thread_id,
                    "ts": _us(call.start, origin), "dur": _us(call.end, call.start), "args": {"correlation_id": call.correlation_id, "range_id": range_.id, "captured": True},
                })
        for (device, stream), row in rows.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": row, "args": {"name": f"GPU {device} stream {stream}"}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": row, "args": {"sort_index": row}})
    return out


def document(processes: Sequence[Matched], summary: Summary, *, command: str) -> dict[str, Any]:
    return {
        "traceEvents": events(processes),
        "displayTimeUnit": "ms",
        "otherData": {"schema": SCHEMA, "command": command, "attndbg": summary.as_json()},
    }


def write(path: str | Path, doc: dict[str, Any]) -> None:
    """Written whole, then renamed into place: a reader never sees half a file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    # dumps, then one write: json.dump encodes chunk by chunk through Python (measured 2-3x slower
    # on an 80 MB timeline, bench/timeline_processing.py).
    text = json.dumps(doc, separators=(",", ":"))
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, target)
