"""Which attndbg range launched each kernel, judged on the launch, never on GPU time.

A kernel runs after its range may have closed (without a sync, only 1-2 of 6 replayed kernels had
finished when their range popped: measured on the H100), so "range encloses kernel" is
decided where the kernel was launched: the kernel record carries the correlation id of the API call
that launched it, and CUPTI's external-correlation record of that call names the attndbg range
whose id was pushed on the thread at the time (`cuptiActivityPushExternalCorrelationId`). Every
kernel of one CUDA-graph replay carries the correlation id of its cudaGraphLaunch.

Independently, the NVTX ranges CUPTI recorded (MARKER edges: what nsys draws) are matched to the
same launch call by time on its thread; a kernel whose innermost NVTX range is not the range the
external id names is a disagreement between the two, reported, never hidden.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from attndbg.timeline import ranges as range_names
from attndbg.timeline.records import ApiCall, Edge, Kernel, Marker, ProcessRecords, Range

T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    """One NVTX range rebuilt from its START and END markers."""

    id: int
    name: str
    thread_id: int
    start: int
    end: int


class Launched(NamedTuple):
    """One kernel with where it was launched. A named tuple: there is one per kernel (records.py)."""

    kernel: Kernel
    launch: ApiCall | None  # the API call with the kernel's correlation id (None: its record is missing)
    range: Range | None  # the attndbg range it was launched in (external correlation); None: outside every range
    nvtx: Span | None  # the innermost NVTX range enclosing the launch call on its thread (MARKER records)
    nvtx_range: Range | None = None  # the attndbg range that NVTX range was pushed for (the tightest enclosing it in time)

    @property
    def agrees(self) -> bool:
        """The NVTX range and the external id place the launch in the same range (or in none).
        Told by time, not by name alone: CUPTI may leave a registered string's name empty."""
        if self.range is None or self.nvtx is None:
            return self.range is None and self.nvtx is None
        same = self.nvtx_range is not None and self.nvtx_range.id == self.range.id
        return same and (not self.nvtx.name or self.nvtx.name == self.range.message)


@dataclass(frozen=True)
class GraphLaunch:
    """One replay of a CUDA graph: its cudaGraphLaunch and the kernels that carry its correlation id."""

    call: ApiCall
    range: Range | None
    kernels: tuple[Kernel, ...]

    @property
    def nodes(self) -> frozenset[tuple[int, int]]:
        """(graph id, node id) of each kernel: the same set for every replay of one graph."""
        return frozenset((k.graph_id, k.graph_node_id) for k in self.kernels)


@dataclass
class Matched:
    """One process's kernels, each with the range that launched it."""

    records: ProcessRecords
    ranges: dict[int, Range]
    launched: list[Launched]
    graph_launches: list[GraphLaunch]
    # Kernel launches that ran no kernel, by the range they were made in: launches recorded into
    # a graph being captured (the graph's replays run them), or kernels whose records were lost.
    unexecuted: dict[int | None, list[ApiCall]] = field(default_factory=dict)

    _by_range: dict[int, list[Launched]] | None = field(default=None, repr=False)
    _names: dict[int, range_names.Names] = field(default_factory=dict, repr=False)

    def names(self, range_: Range) -> range_names.Names:
        """What `range_` names (ranges.names), read once: the summary and the trace events both ask."""
        found = self._names.get(range_.id)
        if found is None:
            found = self._names[range_.id] = range_names.names(range_, self.ranges)
        return found

    def in_range(self, range_id: int) -> list[Launched]:
        # Indexed once: asked for every range, a scan of every kernel was ranges x kernels (22 s of
        # trace writing for 86k kernels in 13k ranges: bench/timeline_processing.py).
        if self._by_range is None:
            self._by_range = defaultdict(list)
            for k in self.launched:
                if k.range is not None:
                    self._by_range[k.range.id].append(k)
        return self._by_range.get(range_id, [])

    def outside(self) -> list[Launched]:
        return [k for k in self.launched if k.range is None]

    def disagreements(self) -> list[Launched]:
        return [k for k in self.launched if not k.agrees]


def spans(markers: Iterable[Marker]) -> list[Span]:
    """NVTX ranges from their START/END edges (an edge without its pair is left out: a range still
    open when the records were taken, or one whose edge CUPTI dropped)."""
    starts: dict[int, Marker] = {}
    out: list[Span] = []
    for marker in sorted(markers, key=lambda m: m.timestamp):
        if marker.edge is Edge.START:
            starts[marker.id] = marker
        elif marker.edge is Edge.END and marker.id in starts:
            begin = starts.pop(marker.id)
            out.append(Span(id=marker.id, name=begin.name, thread_id=begin.thread_id, start=begin.timestamp, end=marker.timestamp))
    return out


def _enclosing(items: Sequence[tuple[Hashable, int, int]], intervals: Sequence[tuple[int, int, T]]) -> dict[Hashable, T]:
    """For each item (key, start, end), the innermost of the properly nested `intervals` (start,
    end, value) that encloses it: one sweep over time, intervals pushed at their start and popped
    at their end. At equal times an interval opens before an item in it starts, and closes after."""
    events: list[tuple[int, int, int]] = []
    for i, (start, end, _) in enumerate(intervals):
        events += [(start, 0, i), (end, 2, i)]
    events += [(start, 1, j) for j, (_, start, _) in enumerate(items)]
    events.sort()
    stack: list[int] = []
    found: dict[Hashable, T] = {}
    for _, order, index in events:
        if order == 0:
            stack.append(index)
        elif order == 2:
            stack.remove(index)
        else:
            key, _, end = items[index]
            for i in reversed(stack):  # the innermost first; usually the top encloses
                if intervals[i][1] >= end:
                    found[key] = intervals[i][2]
                    break
    return found


def _nvtx_of_calls(calls: list[ApiCall], spans_: list[Span]) -> dict[int, Span]:
    """The innermost NVTX span enclosing each call on its thread (all spans where CUPTI named no
    thread for them that the calls carry)."""
    by_thread: dict[int, list[Span]] = defaultdict(list)
    for s in spans_:
        by_thread[s.thread_id].append(s)
    calls_by_thread: dict[int, list[ApiCall]] = defaultdict(list)
    for c in calls:
        calls_by_thread[c.thread_id].append(c)
    found: dict[int, Span] = {}
    for thread, thread_calls in calls_by_thread.items():
        candidates = by_thread.get(thread) or spans_
        found.update(_enclosing([(c.correlation_id, c.start, c.end) for c in thread_calls], [(s.start, s.end, s) for s in candidates]))  # type: ignore[misc]
    return found


def match(records: ProcessRecords) -> Matched:
    ranges = {r.id: r for r in records.ranges}
    calls: dict[int, ApiCall] = {}
    for call in records.api_calls:
        # A runtime call and the driver call it makes can share one correlation id: keep the
        # runtime's (the one the program made), and a launch over anything else.
        known = calls.get(call.correlation_id)
        if known is None or (call.name.startswith("cuda") and not known.name.startswith("cuda")):
            calls[call.correlation_id] = call
    external = {e.correlation_id: e.external_id for e in records.external_ids}
    nvtx_spans = spans(records.markers)
    nvtx = _nvtx_of_calls(list(calls.values()), nvtx_spans)
    # Each NVTX range sits inside the attndbg range it was pushed for: the observer's timestamps
    # are taken just outside NVTX's push and pop (profiling.phase).
    pushed_for = _enclosing([(s.id, s.start, s.end) for s in nvtx_spans], [(r.start, r.end, r) for r in records.ranges])

    # correlation id -> the range its call was made in (the external id names no range: None)
    range_of = {correlation_id: ranges.get(range_id) for correlation_id, range_id in external.items()}
    launched = []
    for k in records.kernels:
        correlation_id = k.correlation_id
        span = nvtx.get(correlation_id)
        launched.append(Launched(k, calls.get(correlation_id), range_of.get(correlation_id), span, pushed_for.get(span.id) if span is not None else None))
    by_call: dict[int, list[Kernel]] = defaultdict(list)
    for k in records.kernels:
        by_call[k.correlation_id].append(k)
    graph_launches = [
        GraphLaunch(call, range_of.get(call.correlation_id), tuple(sorted(by_call.get(call.correlation_id, []), key=lambda k: k.start)))
        for call in sorted(calls.values(), key=lambda c: c.start)
        if call.launches_graph
    ]
    unexecuted: dict[int | None, list[ApiCall]] = defaultdict(list)
    for call in sorted(calls.values(), key=lambda c: c.start):
        if call.launches_kernel and call.correlation_id not in by_call:
            r = range_of.get(call.correlation_id)
            unexecuted[r.id if r is not None else None].append(call)
    return Matched(records=records, ranges=ranges, launched=launched, graph_launches=graph_launches, unexecuted=dict(unexecuted))
