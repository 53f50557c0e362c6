"""CUPTI's activity records (cupti-python objects, read by attribute) copied into ours
(`records.py`), inside the buffer callback: its buffer is reused afterwards.

Only what a timeline places is kept: kernels, the API calls that launch kernels or graphs (the other
calls are most of the records and place nothing), attndbg's external correlation ids, and attndbg's
NVTX range edges. `Kinds` carries the enum values the collector reads from `cupti`, so this module
never imports it.

This runs once per record, on the run's critical path (the callback holds the GIL while the
command's thread waits for it), so a kernel, launch or external id costs one C-level read of its
attributes (`operator.attrgetter`, a tuple) and one named-tuple build, nothing per field: cupti-python's
attributes are Python ints and strs already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from attndbg.profiling import DOMAIN, PREFIX
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, launches_graph, launches_kernel

# CUPTI's CUpti_ActivityFlag values for markers (cupti.h: INSTANTANEOUS 1 << 0, START 1 << 1,
# END 1 << 2); cupti-python 13.0's ActivityFlag enum has no MARKER_END member.
MARKER_START = 1 << 1
MARKER_END = 1 << 2

# cupti-python's attribute names, in the order of our records' fields.
_KERNEL_FIELDS = attrgetter("name", "correlation_id", "device_id", "stream_id", "start", "end", "graph_id", "graph_node_id")
_API_FIELDS = attrgetter("cbid", "correlation_id", "start", "end", "thread_id")
_EXTERNAL_FIELDS = attrgetter("external_kind", "correlation_id", "external_id")


@dataclass(frozen=True)
class Kinds:
    """The cupti enum values a conversion needs, as ints."""

    kernel: int  # ActivityKind.CONCURRENT_KERNEL
    runtime: int  # ActivityKind.RUNTIME
    driver: int  # ActivityKind.DRIVER
    external_correlation: int  # ActivityKind.EXTERNAL_CORRELATION
    marker: int  # ActivityKind.MARKER
    external_kind: int  # ExternalCorrelationKind.CUSTOM0: the kind attndbg pushes its range ids as
    thread_object: int  # ActivityObjectKind.THREAD: a marker whose object is a thread


@dataclass
class Converter:
    kinds: Kinds
    # (is_runtime, cbid) -> CUPTI's name of the call ("cudaLaunchKernel_v7000"): cupti.get_callback_name
    callback_name: Callable[[bool, int], str]
    _launch_names: dict[tuple[int, int], str | None] = field(default_factory=dict)

    def convert(self, activities: list[Any], out: ProcessRecords) -> None:
        k = self.kinds
        kernel, runtime, driver, external_correlation, marker, ours = k.kernel, k.runtime, k.driver, k.external_correlation, k.marker, k.external_kind
        kernels, calls, external_ids = out.kernels.append, out.api_calls.append, out.external_ids.append
        names = self._launch_names
        new = tuple.__new__
        for a in activities:
            kind = a.kind
            if kind == kernel:
                kernels(new(Kernel, _KERNEL_FIELDS(a)))
            elif kind == runtime or kind == driver:
                cbid, correlation_id, start, end, thread_id = _API_FIELDS(a)
                key = (kind, cbid)
                name = names[key] if key in names else self._launch_name(*key)
                if name is not None:
                    calls(new(ApiCall, (correlation_id, name, start, end, thread_id)))
            elif kind == external_correlation:
                external_kind, correlation_id, external_id = _EXTERNAL_FIELDS(a)
                if external_kind == ours:
                    external_ids(new(ExternalId, (correlation_id, external_id)))
            elif kind == marker:
                found = self._marker(a)
                if found is not None:
                    out.markers.append(found)

    def _launch_name(self, kind: int, cbid: int) -> str | None:
        key = (kind, cbid)
        if key not in self._launch_names:
            name = str(self.callback_name(kind == self.kinds.runtime, cbid))
            self._launch_names[key] = name if launches_kernel(name) or launches_graph(name) else None
        return self._launch_names[key]

    def _marker(self, a: Any) -> Marker | None:
        flags = int(a.flags_)
        edge = Edge.START if flags & MARKER_START else Edge.END if flags & MARKER_END else Edge.INSTANT
        name, domain = str(a.name or ""), str(a.domain or "")
        # Another library's range is not ours to match. A start without a name is kept: CUPTI may
        # leave a registered string unresolved, and matching tells ranges by time too.
        if edge is Edge.START and ((name and not name.startswith(PREFIX)) or (domain and domain != DOMAIN)):
            return None
        thread = int(a.object_id.pt.thread_id) if int(a.object_kind) == self.kinds.thread_object else 0
        return Marker(id=int(a.id), edge=edge, timestamp=int(a.timestamp), thread_id=thread, name=name, domain=domain)


class LaunchExternalIds:
    """CUPTI writes an external-correlation record for every API call made inside a range (tens of
    thousands a step), and a placed kernel needs only its launch's: keep those of the launch calls
    and kernels seen. One whose launch or kernel has not arrived yet (another buffer) waits for the
    next batch, once."""

    def __init__(self) -> None:
        self._launches: set[int] = set()  # correlation ids of the launches and kernels seen so far
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
