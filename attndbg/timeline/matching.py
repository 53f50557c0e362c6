"""Which attndbg range launched each kernel, judged on the launch, never on GPU time.

A kernel runs after its range may have closed (without a sync, only 1-2 of 6 replayed kernels had
finished when their range popped: measured on the H100, issue 25), so "range encloses kernel" is
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
from collections.abc import Iterable
from dataclasses import dataclass, field

from attndbg.timeline.records import ApiCall, Edge, Kernel, Marker, ProcessRecords, Range


@dataclass(frozen=True)
class Span:
    """One NVTX range rebuilt from its START and END markers."""

    id: int
    name: str
    thread_id: int
    start: int
    end: int


@dataclass(frozen=True)
class Launched:
    kernel: Kernel
    launch: ApiCall | None  # the API call with the kernel's correlation id (None: its record is missing)
    range: Range | None  # the attndbg range it was launched in (external correlation); None: outside every range
    nvtx: Span | None  # the innermost NVTX range enclosing the launch call on its thread (MARKER records)

    @property
    def agrees(self) -> bool:
        """The NVTX range and the external id name the same range (or neither has one)."""
        if self.range is None or self.nvtx is None:
            return self.range is None and self.nvtx is None
        return self.nvtx.name == self.range.message


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

    def in_range(self, range_id: int) -> list[Launched]:
        return [k for k in self.launched if k.range is not None and k.range.id == range_id]

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


def _innermost(calls: list[ApiCall], spans_: list[Span]) -> dict[int, Span]:
    """For each call (by correlation id), the innermost span on its thread that encloses it: one
    sweep over time per thread, spans pushed at their start and popped at their end."""
    found: dict[int, Span] = {}
    by_thread: dict[int, list[Span]] = defaultdict(list)
    for s in spans_:
        by_thread[s.thread_id].append(s)
    calls_by_thread: dict[int, list[ApiCall]] = defaultdict(list)
    for c in calls:
        calls_by_thread[c.thread_id].append(c)
    for thread, thread_calls in calls_by_thread.items():
        # Order at equal times: a span opens before a call in it starts, and closes after it ends.
        events: list[tuple[int, int, object]] = []
        for s in by_thread.get(thread, []):
            events.append((s.start, 0, s))
            events.append((s.end, 2, s))
        for c in thread_calls:
            events.append((c.start, 1, c))
        events.sort(key=lambda e: (e[0], e[1]))
        stack: list[Span] = []
        for _, order, item in events:
            if order == 0:
                stack.append(item)  # type: ignore[arg-type]
            elif order == 2:
                if item in stack:
                    stack.remove(item)  # type: ignore[arg-type]
            else:
                call: ApiCall = item  # type: ignore[assignment]
                inner = next((s for s in reversed(stack) if s.end >= call.end), None)
                if inner is not None:
                    found[call.correlation_id] = inner
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
    nvtx = _innermost(list(calls.values()), spans(records.markers))

    def range_of(correlation_id: int) -> Range | None:
        rid = external.get(correlation_id)
        return ranges.get(rid) if rid is not None else None

    launched = [Launched(k, calls.get(k.correlation_id), range_of(k.correlation_id), nvtx.get(k.correlation_id)) for k in records.kernels]
    by_call: dict[int, list[Kernel]] = defaultdict(list)
    for k in records.kernels:
        by_call[k.correlation_id].append(k)
    graph_launches = [
        GraphLaunch(call, range_of(call.correlation_id), tuple(sorted(by_call.get(call.correlation_id, []), key=lambda k: k.start)))
        for call in sorted(calls.values(), key=lambda c: c.start)
        if call.launches_graph
    ]
    unexecuted: dict[int | None, list[ApiCall]] = defaultdict(list)
    for call in sorted(calls.values(), key=lambda c: c.start):
        if call.launches_kernel and call.correlation_id not in by_call:
            r = range_of(call.correlation_id)
            unexecuted[r.id if r is not None else None].append(call)
    return Matched(records=records, ranges=ranges, launched=launched, graph_launches=graph_launches, unexecuted=dict(unexecuted))
