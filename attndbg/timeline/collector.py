"""Collect CUPTI activity records in this process: the one module that touches `cupti`
(cupti-python, NVIDIA's Python bindings of CUPTI's C API: `pip install 'attndbg[timeline]'`).

What it enables: CONCURRENT_KERNEL (each kernel's GPU start/end, stream, graph and node id),
RUNTIME and DRIVER (the API calls, whose correlation id the kernel carries), EXTERNAL_CORRELATION
(which attndbg range each call was made in) and MARKER / MARKER_DATA (the NVTX ranges, as nsys would
see them). Each attndbg phase (`profiling.phase`) pushes its own external correlation id while it
is open, so every API call made in it is tied to it by CUPTI itself (`matching.py`).

NVTX reaches CUPTI only through `NVTX_INJECTION64_PATH`, read by NVTX at the process's first NVTX
call, and it must name the very libcupti.so that cupti-python loaded: torch's environment ships its
own copy, and naming the system one gave zero range records (measured on the H100, issue 25). So
the path is taken from this process's mappings (/proc/self/maps) once CUPTI is loaded, and set
before the first phase pushes its range.

Records arrive in buffers (`activity_register_callbacks`); each is copied into our dataclasses
(`records.py`) inside the callback, since its buffer is reused afterwards. Only kernel and graph
launches are kept of the API calls (a replay makes tens of thousands of other calls).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from attndbg import profiling
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, Range, launches_graph, launches_kernel

BUFFER_BYTES = 8 << 20  # per CUPTI buffer; CUPTI asks for another when one fills
INJECTION_VARIABLE = "NVTX_INJECTION64_PATH"

# CUPTI's CUpti_ActivityFlag values for markers (cupti.h: INSTANTANEOUS 1 << 0, START 1 << 1,
# END 1 << 2); cupti-python 13.0's ActivityFlag enum has no MARKER_END member.
_MARKER_START = 1 << 1
_MARKER_END = 1 << 2


def loaded_cupti() -> str | None:
    """The path of the libcupti.so mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libcupti.so"):
                    return parts[5].strip()
    except OSError:
        return None
    return None


class LaunchExternalIds:
    """CUPTI writes an external-correlation record for every API call made inside a range (tens of
    thousands a step), and a placed kernel needs only its launch's: keep those. One whose launch
    record has not arrived yet (another buffer) waits for the next batch, once."""

    def __init__(self) -> None:
        self._launches: set[int] = set()  # correlation ids of the launches seen so far
        self._waiting: list[ExternalId] = []

    def keep(self, external_ids: list[ExternalId], launch_ids: list[int]) -> list[ExternalId]:
        self._launches.update(launch_ids)
        waited = {e.correlation_id for e in self._waiting}
        kept, waiting = [], []
        for e in self._waiting + external_ids:
            if e.correlation_id in self._launches:
                kept.append(e)
            elif e.correlation_id not in waited:
                waiting.append(e)
        self._waiting = waiting
        return kept


class Collector:
    """One process's collection: `start()` before the first phase, then `profiling.observe(it)`;
    `take()` whenever the records so far are wanted (flushes CUPTI first), `stop()` at the end."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Lock()
        self._batch = ProcessRecords(pid=os.getpid(), label=label)
        self._open: list[Range] = []  # this process's open ranges (attndbg launches from one thread)
        self._next_id = 1
        self._cupti: Any = None
        self._kinds: list[Any] = []
        self._launch_names: dict[tuple[int, int], str | None] = {}  # (kind, cbid) -> the call's name if it launches
        self._external = LaunchExternalIds()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        from cupti import cupti  # the optional dependency: imported here only

        self._cupti = cupti
        kinds = cupti.ActivityKind
        self._external_kind = int(cupti.ExternalCorrelationKind.CUSTOM0)
        self._kind_of = {
            int(kinds.CONCURRENT_KERNEL): self._kernel,
            int(kinds.RUNTIME): self._api,
            int(kinds.DRIVER): self._api,
            int(kinds.EXTERNAL_CORRELATION): self._external,
            int(kinds.MARKER): self._marker,
        }
        self._runtime = int(kinds.RUNTIME)
        # Callbacks before enabling: CUPTI asks for a buffer as soon as a kind is on.
        cupti.activity_register_callbacks(self._requested, self._completed)
        self._kinds = [kinds.CONCURRENT_KERNEL, kinds.RUNTIME, kinds.DRIVER, kinds.EXTERNAL_CORRELATION, kinds.MARKER, kinds.MARKER_DATA]
        for kind in self._kinds:
            cupti.activity_enable(kind)
        self._inject_nvtx()

    def _inject_nvtx(self) -> None:
        path = loaded_cupti()
        current = os.environ.get(INJECTION_VARIABLE)
        if path is None:
            self._note("CUPTI's library is not mapped in this process: NVTX ranges will not reach it")
        elif current is None:
            os.environ[INJECTION_VARIABLE] = path
        elif os.path.realpath(current) != os.path.realpath(path):
            self._note(f"{INJECTION_VARIABLE}={current} is not the libcupti cupti-python loaded ({path}): NVTX ranges go there, not here")

    def take(self) -> ProcessRecords:
        """The records collected since the last take (CUPTI flushed first; ranges still open stay)."""
        if self._cupti is not None:
            self._cupti.activity_flush_all(int(self._cupti.ActivityFlag.FLUSH_FORCED))  # buffers not yet full too
        with self._lock:
            batch, self._batch = self._batch, ProcessRecords(pid=os.getpid(), label=self.label)
            batch.external_ids = self._external.keep(batch.external_ids, [c.correlation_id for c in batch.api_calls])
        return batch

    @property
    def depth(self) -> int:
        """How many phases are open now."""
        return len(self._open)

    def stop(self) -> ProcessRecords:
        batch = self.take()
        if self._cupti is not None:
            for kind in self._kinds:
                self._cupti.activity_disable(kind)
        return batch

    def _note(self, text: str) -> None:
        with self._lock:
            if text not in self._batch.notes:
                self._batch.notes.append(text)

    # -- profiling observer: one external correlation id per open phase --------------------------

    def push(self, message: str) -> None:
        cupti = self._cupti
        range_id = self._next_id
        self._next_id += 1
        parent = self._open[-1].id if self._open else None
        cupti.activity_push_external_correlation_id(self._external_kind, range_id)
        self._open.append(Range(id=range_id, parent=parent, message=message, thread_id=threading.get_native_id(), start=cupti.get_timestamp(), end=0))

    def pop(self) -> None:
        cupti = self._cupti
        end = cupti.get_timestamp()
        cupti.activity_pop_external_correlation_id(self._external_kind)
        opened = self._open.pop()
        closed = Range(id=opened.id, parent=opened.parent, message=opened.message, thread_id=opened.thread_id, start=opened.start, end=end)
        with self._lock:
            self._batch.ranges.append(closed)

    # -- CUPTI buffers ------------------------------------------------------------------------------

    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0  # 0: as many records as fit

    def _completed(self, activities: list) -> None:
        kept = ProcessRecords(pid=os.getpid(), label=self.label)
        for activity in activities:
            convert = self._kind_of.get(int(activity.kind))
            if convert is not None:
                convert(activity, kept)
        with self._lock:
            self._batch.extend(kept)

    def _kernel(self, a: Any, out: ProcessRecords) -> None:
        out.kernels.append(
            Kernel(
                name=str(a.name), correlation_id=int(a.correlation_id), device=int(a.device_id), stream=int(a.stream_id),
                start=int(a.start), end=int(a.end), graph_id=int(a.graph_id), graph_node_id=int(a.graph_node_id),
            )
        )

    def _api(self, a: Any, out: ProcessRecords) -> None:
        key = (int(a.kind), int(a.cbid))
        if key not in self._launch_names:
            domain = self._cupti.CallbackDomain.RUNTIME_API if key[0] == self._runtime else self._cupti.CallbackDomain.DRIVER_API
            name = str(self._cupti.get_callback_name(domain, key[1]))
            self._launch_names[key] = name if launches_kernel(name) or launches_graph(name) else None
        name = self._launch_names[key]
        if name is not None:  # only launches: the other calls are most of the records and place no kernel
            out.api_calls.append(ApiCall(correlation_id=int(a.correlation_id), name=name, start=int(a.start), end=int(a.end), thread_id=int(a.thread_id)))

    def _external(self, a: Any, out: ProcessRecords) -> None:
        if int(a.external_kind) == self._external_kind:
            out.external_ids.append(ExternalId(correlation_id=int(a.correlation_id), external_id=int(a.external_id)))

    def _marker(self, a: Any, out: ProcessRecords) -> None:
        flags = int(a.flags_)
        edge = Edge.START if flags & _MARKER_START else Edge.END if flags & _MARKER_END else Edge.INSTANT
        name = str(a.name or "")
        if edge is Edge.START and not name.startswith(profiling.PREFIX):
            return  # another library's NVTX range: not ours to match
        thread = 0
        if int(a.object_kind) == int(self._cupti.ActivityObjectKind.THREAD):
            thread = int(a.object_id.pt.thread_id)
        out.markers.append(Marker(id=int(a.id), edge=edge, timestamp=int(a.timestamp), thread_id=thread, name=name, domain=str(a.domain or "")))
