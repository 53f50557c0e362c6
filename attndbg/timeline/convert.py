"""CUPTI's activity records (cupti-python objects) copied into ours (`records.py`), inside the
buffer callback: its buffer is reused afterwards.

Only what a timeline places is kept: kernels, the API calls that launch kernels or graphs (the other
calls are most of the records and place nothing), attndbg's external correlation ids, and attndbg's
NVTX range edges. `Kinds` carries the enum values the collector reads from `cupti`, and
`RecordTypes` its record classes with their C layouts, so this module never imports it.

This runs once per record, on the run's critical path (the callback holds the GIL while the
command's thread waits for it). A cupti-python record object keeps its C struct as a one-row numpy
record array, and each attribute read goes through numpy's recarray field access (~4 us: on the
H200's server mix, --timeline cost +40 % per step, the profile all numpy's records.py). So a record
of a class `RecordTypes` names is read from its memory in one `struct` unpack, at the offsets of
cupti-python's own numpy dtype for it (`_Layout`: converting a kernel, launch call or external id
costs 1-4 us instead of 15-55, bench/cupti_convert_cost.py); its
`const char*` fields (a kernel's or marker's name, a marker's domain) are resolved with
`ctypes.string_at`, decoded as cupti-python decodes them. Any other class (another struct version, a
test's stand-in) is read by attribute, as before, so no record is dropped for its class.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from struct import Struct
from typing import Any

from attndbg.profiling import DOMAIN, PREFIX
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, launches_graph, launches_kernel

# CUPTI's CUpti_ActivityFlag values for markers (cupti.h: INSTANTANEOUS 1 << 0, START 1 << 1,
# END 1 << 2); cupti-python 13.0's ActivityFlag enum has no MARKER_END member.
MARKER_START = 1 << 1
MARKER_END = 1 << 2

# cupti-python's field names (attributes, and its dtypes' fields; dotted: a nested struct's), each
# record's kind first, then in the order of our records' fields. Both reading paths give these.
KERNEL_FIELDS = ("kind", "name", "correlation_id", "device_id", "stream_id", "start", "end", "graph_id", "graph_node_id")
API_FIELDS = ("kind", "cbid", "correlation_id", "start", "end", "thread_id")
EXTERNAL_FIELDS = ("kind", "external_kind", "correlation_id", "external_id")
# object_id is a union (CUpti_ActivityObjectKindId): its pt.thread_id means a thread only when
# object_kind is THREAD, which `Converter._marker` checks.
MARKER_FIELDS = ("kind", "flags_", "id", "timestamp", "object_kind", "object_id.pt.thread_id", "name", "domain")
_STRINGS = {"name", "domain"}  # const char* in the C structs: a pointer in the dtype

# the attribute path's reads after `kind` (read first, to choose them)
_KERNEL_ATTRIBUTES = attrgetter(*KERNEL_FIELDS[1:])
_API_ATTRIBUTES = attrgetter(*API_FIELDS[1:])
_EXTERNAL_ATTRIBUTES = attrgetter(*EXTERNAL_FIELDS[1:])

# Every CUPTI activity record starts with its CUpti_ActivityKind, a 32-bit enum.
_KIND = Struct("=I")
# struct codes of the integer fields CUPTI's records hold, by numpy's (kind, itemsize)
_CODES = {("i", 1): "b", ("u", 1): "B", ("i", 2): "h", ("u", 2): "H", ("i", 4): "i", ("u", 4): "I", ("i", 8): "q", ("u", 8): "Q"}


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


@dataclass(frozen=True)
class RecordTypes:
    """cupti-python's record classes a conversion reads from memory, each with its numpy dtype (the
    C struct's layout: `dtype.fields[name] -> (dtype, offset)`); None: read by attribute."""

    kernel: tuple[type, Any] | None = None  # ActivityKernel10, activity_kernel10_dtype
    api: tuple[type, Any] | None = None  # ActivityAPI, activity_api_dtype (RUNTIME and DRIVER)
    external_correlation: tuple[type, Any] | None = None  # ActivityExternalCorrelation, activity_external_correlation_dtype
    marker: tuple[type, Any] | None = None  # ActivityMarker2, activity_marker2_dtype


def _text(pointer: int) -> str:
    # cupti-python reads a NULL char* as "" and decodes strictly as UTF-8 (an invalid name raises
    # there too). Not cached by pointer: CUPTI shares a kernel's name between its records, but a
    # string freed with its module could come back at the same address as another kernel's.
    return ctypes.string_at(pointer).decode() if pointer else ""


def _field(dtype: Any, path: str) -> tuple[int, str]:
    """A (possibly nested) field's offset in the struct and its struct code."""
    offset = 0
    for name in path.split("."):
        dtype, at = dtype.fields[name][:2]
        offset += at
    if not dtype.isnative or (dtype.kind, dtype.itemsize) not in _CODES:
        raise ValueError(f"{path}: {dtype} is not a native integer")
    return offset, _CODES[(dtype.kind, dtype.itemsize)]


class _Layout:
    """Reads `paths` of one record class from its memory: one unpack at the dtype's offsets (which
    go up in struct order, not ours: `order` puts them back), strings resolved."""

    def __init__(self, cls: type, dtype: Any, paths: tuple[str, ...]):
        located = sorted((*_field(dtype, path), index) for index, path in enumerate(paths))
        codes, end = [], 0
        for offset, code, _ in located:
            codes.append(f"{offset - end}x{code}" if offset > end else code)
            end = offset + Struct(code).size
        self._unpack = Struct("=" + "".join(codes)).unpack_from  # "=": native order, no padding of its own
        self._order = itemgetter(*(located.index(item) for item in sorted(located, key=itemgetter(2))))
        self._strings = [i for i, path in enumerate(paths) if path in _STRINGS]
        # The record's memory: cupti-python keeps it in `_data`, the numpy record array its
        # attributes read (a plain attribute, 0.03 us); a class without it, at its public address
        # (`ptr`: `_data`'s address, itself a numpy read of ~2 us, and a copy).
        size = dtype.itemsize
        self._memory: Callable[[Any], Any] = attrgetter("_data") if hasattr(cls, "_data") else lambda a: ctypes.string_at(a.ptr, size)

    def __call__(self, record: Any) -> tuple:
        return self._finish(self._unpack(self._memory(record)))

    def at(self, data: Any, offset: int) -> tuple:
        """The record at `offset` in a buffer of records (CUPTI's own: buffers.py)."""
        return self._finish(self._unpack(data, offset))

    def _finish(self, unpacked: tuple) -> tuple:
        values = self._order(unpacked)
        if not self._strings:
            return values
        values = list(values)
        for i in self._strings:
            values[i] = _text(values[i])
        return tuple(values)


@dataclass
class Converter:
    kinds: Kinds
    # (is_runtime, cbid) -> CUPTI's name of the call ("cudaLaunchKernel_v7000"): cupti.get_callback_name
    callback_name: Callable[[bool, int], str]
    record_types: RecordTypes = field(default_factory=RecordTypes)
    _launch_names: dict[tuple[int, int], str | None] = field(default_factory=dict)
    # record class -> its reader (cupti-python's field values, in the order of the *_FIELDS above)
    _readers: dict[type, Callable[[Any], tuple]] = field(default_factory=dict, init=False)
    # activity kind -> the layout of the record CUPTI writes for it (a buffer's records: convert_buffer)
    _by_kind: dict[int, _Layout] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        t, k = self.record_types, self.kinds
        for known, paths, kinds in (
            (t.kernel, KERNEL_FIELDS, (k.kernel,)), (t.api, API_FIELDS, (k.runtime, k.driver)),
            (t.external_correlation, EXTERNAL_FIELDS, (k.external_correlation,)), (t.marker, MARKER_FIELDS, (k.marker,)),
        ):
            if known is not None:
                try:
                    layout = _Layout(known[0], known[1], paths)
                except (KeyError, ValueError):  # a dtype without one of our fields, or not as ints: by attribute
                    continue
                self._readers[known[0]] = layout
                self._by_kind.update(dict.fromkeys(kinds, layout))

    @property
    def reads_buffers(self) -> bool:
        """Whether a buffer's records can be read (`convert_buffer`): a layout for every kind placed."""
        k = self.kinds
        return all(kind in self._by_kind for kind in (k.kernel, k.runtime, k.driver, k.external_correlation, k.marker))

    def convert(self, activities: list[Any], out: ProcessRecords) -> None:
        """cupti-python's record objects (its buffer callback's list)."""
        readers, by_attribute = self._readers.get, self._by_attribute
        self._place((readers(type(a), by_attribute)(a) for a in activities), out)

    def convert_buffer(self, data: Any, offsets: list[int], out: ProcessRecords) -> None:
        """The records of one CUPTI buffer (`data`, its bytes), at `offsets` (buffers.py): each read
        by its kind's layout, a record of another kind (MARKER_DATA) by its kind alone. Needs
        `reads_buffers`."""
        by_kind = self._by_kind
        kind_of = _KIND.unpack_from

        def values() -> Any:
            for offset in offsets:
                kind = kind_of(data, offset)
                layout = by_kind.get(kind[0])
                yield layout.at(data, offset) if layout is not None else kind

        self._place(values(), out)

    def _place(self, records: Any, out: ProcessRecords) -> None:
        """Keep what a timeline places of `records`: each the values of the *_FIELDS above (kind first)."""
        k = self.kinds
        kernel, runtime, driver, external_correlation, marker, ours = k.kernel, k.runtime, k.driver, k.external_correlation, k.marker, k.external_kind
        kernels, calls, external_ids = out.kernels.append, out.api_calls.append, out.external_ids.append
        names = self._launch_names
        new = tuple.__new__
        for values in records:
            kind = values[0]
            if kind == kernel:
                kernels(new(Kernel, values[1:]))
            elif kind == runtime or kind == driver:
                _, cbid, correlation_id, start, end, thread_id = values
                key = (kind, cbid)
                name = names[key] if key in names else self._launch_name(*key)
                if name is not None:
                    calls(new(ApiCall, (correlation_id, name, start, end, thread_id)))
            elif kind == external_correlation:
                _, external_kind, correlation_id, external_id = values
                if external_kind == ours:
                    external_ids(new(ExternalId, (correlation_id, external_id)))
            elif kind == marker:
                found = self._marker(values)
                if found is not None:
                    out.markers.append(found)

    def _by_attribute(self, a: Any) -> tuple:
        """A record of a class without a layout, by cupti-python's attributes: the same values."""
        kind = a.kind
        k = self.kinds
        if kind == k.kernel:
            return (kind, *_KERNEL_ATTRIBUTES(a))
        if kind == k.runtime or kind == k.driver:
            return (kind, *_API_ATTRIBUTES(a))
        if kind == k.external_correlation:
            return (kind, *_EXTERNAL_ATTRIBUTES(a))
        if kind == k.marker:
            object_kind = int(a.object_kind)
            # object_id means a thread only for a THREAD marker (a stand-in may carry none otherwise)
            thread = int(a.object_id.pt.thread_id) if object_kind == k.thread_object else 0
            return (kind, int(a.flags_), int(a.id), int(a.timestamp), object_kind, thread, str(a.name or ""), str(a.domain or ""))
        return (kind,)

    def _launch_name(self, kind: int, cbid: int) -> str | None:
        key = (kind, cbid)
        if key not in self._launch_names:
            name = str(self.callback_name(kind == self.kinds.runtime, cbid))
            self._launch_names[key] = name if launches_kernel(name) or launches_graph(name) else None
        return self._launch_names[key]

    def _marker(self, values: tuple) -> Marker | None:
        _, flags, marker_id, timestamp, object_kind, thread, name, domain = values
        edge = Edge.START if flags & MARKER_START else Edge.END if flags & MARKER_END else Edge.INSTANT
        # Another library's range is not ours to match. A start without a name is kept: CUPTI may
        # leave a registered string unresolved, and matching tells ranges by time too.
        if edge is Edge.START and ((name and not name.startswith(PREFIX)) or (domain and domain != DOMAIN)):
            return None
        return Marker(id=marker_id, edge=edge, timestamp=timestamp, thread_id=thread if object_kind == self.kinds.thread_object else 0, name=name, domain=domain)


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
