"""What a timeline is built from: CUPTI's activity records, copied into plain records.

The collector (`collector.py`) is the only code that touches the `cupti` module; it copies each
record it keeps into one of these, so matching, summary and trace writing run (and are tested)
without CUPTI or a GPU. Timestamps are CUPTI's: nanoseconds on one clock for API calls, kernels,
NVTX markers and our own ranges (`cupti.get_timestamp()`), so they can be compared directly.

A process's records travel as JSON lines (a check worker writes them, the parent merges them):
`to_json` / `from_json` below, each record as a list of its fields in declaration order.

The records a timeline has one of per kernel (`Kernel`, `ApiCall`, `ExternalId`: ~85,000 each in a
200-step check) are named tuples, the others frozen dataclasses: a named tuple is built from the
tuple of a cupti record's attributes in one call (0.6 us, against 2.9 us for a frozen dataclass's
__init__ on the 2-core CPU), written to JSON as the list it is and read back with `_make`, and
that cost is paid per kernel in the buffer callback (bench/timeline_processing.py). As tuples they
also compare equal to a plain tuple of the same fields: compare records with records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

# Runtime and driver API names (CUPTI's callback names, versioned: cudaLaunchKernel_v7000,
# cuLaunchKernelEx, cudaGraphLaunch_v10000, cuGraphLaunch_ptsz, ...) by what the call does.
_KERNEL_LAUNCH_PREFIXES = ("cudaLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchKernel", "cuLaunchCooperativeKernel")
_GRAPH_LAUNCH_PREFIXES = ("cudaGraphLaunch", "cuGraphLaunch")


def launches_kernel(name: str) -> bool:
    return name.startswith(_KERNEL_LAUNCH_PREFIXES)


def launches_graph(name: str) -> bool:
    return name.startswith(_GRAPH_LAUNCH_PREFIXES)


class ApiCall(NamedTuple):
    """One CUDA runtime or driver API call (CUPTI's RUNTIME / DRIVER records)."""

    correlation_id: int  # the kernel records it launched carry the same id
    name: str  # CUPTI's callback name: "cudaLaunchKernel_v7000", "cuLaunchKernelEx", "cudaGraphLaunch_v10000"
    start: int  # ns
    end: int  # ns
    thread_id: int  # as CUPTI reports it (the same numbering as the NVTX markers' thread)

    @property
    def launches_kernel(self) -> bool:
        return launches_kernel(self.name)

    @property
    def launches_graph(self) -> bool:
        return launches_graph(self.name)


class Kernel(NamedTuple):
    """One kernel execution on the GPU (CUPTI's CONCURRENT_KERNEL records)."""

    name: str  # as the driver names it (C++ kernels mangled: see names.py)
    correlation_id: int  # the launching API call's; every kernel of one graph replay carries its cudaGraphLaunch's
    device: int
    stream: int
    start: int  # ns, GPU time on CUPTI's clock
    end: int  # ns
    graph_id: int = 0  # 0: launched eagerly; else the graph it was a node of
    graph_node_id: int = 0  # the node; the same node id repeats from replay to replay of one graph

    @property
    def duration(self) -> int:
        return max(0, self.end - self.start)


class ExternalId(NamedTuple):
    """CUPTI's EXTERNAL_CORRELATION record: API call `correlation_id` was made while
    `external_id` (an attndbg range's id) was the innermost id we had pushed on its thread."""

    correlation_id: int
    external_id: int


class Edge(enum.Enum):
    START = "start"
    END = "end"
    INSTANT = "instant"


@dataclass(frozen=True)
class Marker:
    """One edge of an NVTX range (CUPTI's MARKER records): what `nsys` would draw. The START and END
    edges of a range share `id`; the END carries no name."""

    id: int
    edge: Edge
    timestamp: int  # ns
    thread_id: int
    name: str = ""
    domain: str = ""


@dataclass(frozen=True)
class Range:
    """An attndbg phase (`profiling.phase`) as the collector saw it: its NVTX message, and the
    external correlation id pushed while it was open, which CUPTI ties to every API call made in it."""

    id: int  # the external correlation id pushed for it; unique in its process
    parent: int | None  # the enclosing range's id
    message: str  # the NVTX message: "attndbg/run step=0 mode=DECODE bs=3 backend=triton variant=eager"
    thread_id: int  # the Python thread's native id
    start: int  # ns, cupti.get_timestamp() at the push
    end: int  # ns, at the pop


@dataclass
class ProcessRecords:
    """Everything one process collected. Built up batch by batch (`extend`), then read."""

    pid: int
    label: str  # "attndbg replay", "check worker"
    ranges: list[Range] = field(default_factory=list)
    api_calls: list[ApiCall] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    external_ids: list[ExternalId] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the collector could not do, for people

    def extend(self, other: ProcessRecords) -> None:
        for name in _LISTS:
            getattr(self, name).extend(getattr(other, name))
        self.notes.extend(n for n in other.notes if n not in self.notes)

    def empty(self) -> bool:
        return not any(getattr(self, name) for name in _LISTS)


_LISTS = {"ranges": Range, "api_calls": ApiCall, "kernels": Kernel, "external_ids": ExternalId, "markers": Marker}
_TUPLES = (ApiCall, Kernel, ExternalId)  # written as they are: a named tuple is its own JSON row
# Each kind's field names in declaration order, read once: a worker writes tens of thousands of
# records a second, and dataclasses.astuple (a deep copy) per record cost more than the records.
_FIELDS = {kind: kind._fields if kind in _TUPLES else tuple(f.name for f in fields(kind)) for kind in _LISTS.values()}


def _row(record: Any) -> list[Any]:
    values = [getattr(record, name) for name in _FIELDS[type(record)]]
    return [value.value if isinstance(value, enum.Enum) else value for value in values]


def _record(kind: type, row: list[Any]) -> Any:
    names = _FIELDS[kind]
    if len(row) != len(names):
        raise ValueError(f"{kind.__name__} record has {len(row)} fields, expected {len(names)} ({', '.join(names)})")
    if kind is Marker:
        row = list(row)
        row[names.index("edge")] = Edge(row[names.index("edge")])
    return kind(*row)


def to_json(records: ProcessRecords) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": records.pid, "label": records.label, "notes": list(records.notes)}
    for name, kind in _LISTS.items():
        out[name] = list(getattr(records, name)) if kind in _TUPLES else [_row(r) for r in getattr(records, name)]
    # Each kernel name once, in `kernel_names`, and a kernel's row its index there: a run's few
    # hundred names (~170 characters each, mangled C++) were 60% of a worker's JSON lines.
    table: dict[str, int] = {}
    out["kernels"] = [(table.setdefault(k[0], len(table)), *k[1:]) for k in records.kernels]
    out["kernel_names"] = list(table)
    return out


def from_json(data: dict[str, Any]) -> ProcessRecords:
    """Records from `to_json`'s form (or the one before `kernel_names`: each kernel row its name)."""
    records = ProcessRecords(pid=int(data["pid"]), label=str(data.get("label", "")), notes=list(data.get("notes", [])))
    for name, kind in _LISTS.items():
        rows = data.get(name, [])
        if kind in _TUPLES:
            width = len(kind._fields)
            bad = next((row for row in rows if len(row) != width), None)
            if bad is not None:
                _record(kind, bad)  # raises, naming the fields
            if kind is Kernel and "kernel_names" in data:
                rows = _named(rows, data["kernel_names"])
            getattr(records, name).extend(map(kind._make, rows))
        else:
            getattr(records, name).extend(_record(kind, row) for row in rows)
    return records


def _named(rows: list[list[Any]], table: list[str]) -> list[list[Any]]:
    try:
        for row in rows:
            row[0] = table[row[0]]
    except (IndexError, TypeError):
        raise ValueError(f"a Kernel record names entry {row[0]!r} of {len(table)} kernel_names") from None
    return rows
