"""The short text a `--timeline` run prints: per kind of range, how many kernels it launched and
their GPU time, and what could not be placed.

Ranges of one kind (same phase, backend, variant, detector) are one line whatever their step, so a
recording of a thousand steps reads like one step: `run · triton · eager  ×6  12 kernels  0.21 ms`.
Counts are the range's own launches (a `backend/triton` line counts what ran in it outside its
`run` and `plan` ranges), so the lines add up to the total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from attndbg.plural import counted
from attndbg.timeline.matching import Matched


@dataclass
class Line:
    label: str  # "run · triton · eager"
    detector: str
    ranges: int = 0
    kernels: int = 0
    gpu_ns: int = 0
    captured: int = 0  # kernel launches recorded into a graph being captured (no kernel ran then)
    graph_launches: int = 0


@dataclass
class Summary:
    lines: list[Line] = field(default_factory=list)
    kernels: int = 0
    gpu_ns: int = 0
    outside: int = 0  # kernels launched outside every attndbg range
    disagreements: int = 0  # kernels whose NVTX range (markers) is not the range the external id names
    markers: int = 0  # NVTX range edges CUPTI delivered (0: the NVTX injection did not reach CUPTI)
    processes: int = 0
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "kernels": self.kernels,
            "gpu_time_us": round(self.gpu_ns / 1e3, 3),
            "outside_ranges": self.outside,
            "nvtx_disagreements": self.disagreements,
            "nvtx_markers": self.markers,
            "processes": self.processes,
            "notes": list(self.notes),
            "ranges": [
                {"range": ln.label, "detector": ln.detector, "count": ln.ranges, "kernels": ln.kernels, "gpu_time_us": round(ln.gpu_ns / 1e3, 3),
                 "captured_launches": ln.captured, "graph_launches": ln.graph_launches}
                for ln in self.lines
            ],
        }


def summarize(processes: Sequence[Matched]) -> Summary:
    summary = Summary(processes=len(processes))
    lines: dict[tuple[str, str], Line] = {}
    for matched in processes:
        summary.markers += len(matched.records.markers)
        summary.notes.extend(n for n in matched.records.notes if n not in summary.notes)
        line_of: dict[int, Line] = {}  # range id -> its line: a range's names are read once, not once per kernel
        for range_ in matched.records.ranges:
            names = matched.names(range_)
            key = (names.label(), names.detector)
            line = lines.setdefault(key, Line(label=key[0], detector=key[1]))
            line.ranges += 1
            line_of[range_.id] = line
        # Per kernel: summed into locals, each line's once (a dataclass field's += per kernel cost
        # more than the rest of the loop: bench/timeline_processing.py).
        gpu_ns, disagreements, outside = 0, 0, 0
        per_range: dict[int, list[int]] = {}  # range id -> [kernels, GPU ns]
        for launched in matched.launched:
            kernel, range_ = launched.kernel, launched.range
            duration = kernel.end - kernel.start
            if duration < 0:
                duration = 0
            gpu_ns += duration
            if not launched.agrees:
                disagreements += 1
            if range_ is None:
                outside += 1
                continue
            counts = per_range.get(range_.id)
            if counts is None:
                per_range[range_.id] = [1, duration]
            else:
                counts[0] += 1
                counts[1] += duration
        summary.kernels += len(matched.launched)
        summary.gpu_ns += gpu_ns
        summary.disagreements += disagreements
        summary.outside += outside
        for range_id, (kernels, ns) in per_range.items():
            line_of[range_id].kernels += kernels
            line_of[range_id].gpu_ns += ns
        for range_id, calls in matched.unexecuted.items():
            if range_id is not None and range_id in line_of:
                line_of[range_id].captured += len(calls)
        for launch in matched.graph_launches:
            if launch.range is not None:
                line_of[launch.range.id].graph_launches += 1
    summary.lines = _sorted(lines.values())
    return summary


def merge(parts: Sequence[Summary]) -> Summary:
    """One summary of the processes that `parts` summarise (each `summarize` of some of them), as
    `summarize` of all of them gives it."""
    merged = Summary()
    lines: dict[tuple[str, str], Line] = {}
    for part in parts:
        merged.processes += part.processes
        merged.markers += part.markers
        merged.kernels += part.kernels
        merged.gpu_ns += part.gpu_ns
        merged.outside += part.outside
        merged.disagreements += part.disagreements
        merged.notes.extend(n for n in part.notes if n not in merged.notes)
        for ln in part.lines:
            line = lines.setdefault((ln.label, ln.detector), Line(label=ln.label, detector=ln.detector))
            line.ranges += ln.ranges
            line.kernels += ln.kernels
            line.gpu_ns += ln.gpu_ns
            line.captured += ln.captured
            line.graph_launches += ln.graph_launches
    merged.lines = _sorted(lines.values())
    return merged


def _sorted(lines: Iterable[Line]) -> list[Line]:
    return sorted(lines, key=lambda ln: (-ln.gpu_ns, -ln.kernels, ln.detector, ln.label))


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def render(summary: Summary, path: str, *, limit: int = 24) -> list[str]:
    """The lines printed after the run: the file, the totals, the busiest kinds of range."""
    lines = [
        f"timeline: {path} (open in https://ui.perfetto.dev or chrome://tracing): {counted(summary.kernels, 'kernel')}, "
        f"{_ms(summary.gpu_ns)} GPU time, {counted(summary.processes, 'process', 'processes')}"
    ]
    shown = [ln for ln in summary.lines if ln.kernels or ln.captured or ln.graph_launches][:limit]
    width = max((len(_prefixed(ln)) for ln in shown), default=0)
    for ln in shown:
        extra = []
        if ln.graph_launches:
            extra.append(counted(ln.graph_launches, "graph launch", "graph launches"))
        if ln.captured:
            extra.append(f"{counted(ln.captured, 'launch', 'launches')} captured")
        lines.append(f"  {_prefixed(ln):<{width}}  ×{ln.ranges:<4} {ln.kernels:>6} kernels  {_ms(ln.gpu_ns):>12}" + (f"  ({', '.join(extra)})" if extra else ""))
    rest = len([ln for ln in summary.lines if ln.kernels or ln.captured or ln.graph_launches]) - len(shown)
    if rest > 0:
        lines.append(f"  ... {rest} more kinds of range in the file's otherData.attndbg.ranges")
    if summary.outside:
        lines.append(f"  {counted(summary.outside, 'kernel')} {'was' if summary.outside == 1 else 'were'} launched outside every attndbg range")
    if summary.kernels and not summary.markers:
        lines.append("  no NVTX range reached CUPTI (NVTX_INJECTION64_PATH names another library?): ranges are attndbg's own, not nsys's")
    elif summary.disagreements:
        lines.append(f"  {counted(summary.disagreements, 'kernel')} {'sits' if summary.disagreements == 1 else 'sit'} in another NVTX range than the range attndbg pushed for them")
    lines.extend(f"  note: {n}" for n in summary.notes)
    return lines


def _prefixed(line: Line) -> str:
    return f"{line.detector} › {line.label}" if line.detector else line.label
