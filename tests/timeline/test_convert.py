"""CUPTI's records into ours. The records are plain objects carrying the attributes cupti-python's
record classes have (ActivityKernel10, ActivityAPI, ActivityExternalCorrelation, ActivityMarker2),
and the enum values are stand-in numbers: the conversion reads both as given."""

from __future__ import annotations

import ctypes
import enum
import json
from types import SimpleNamespace as Record
from typing import Any

import pytest

from attndbg.timeline.convert import MARKER_END, MARKER_START, Converter, Kinds, RecordTypes
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords, to_json

KINDS = Kinds(kernel=10, runtime=5, driver=6, external_correlation=20, marker=30, external_kind=7, thread_object=2)
NAMES = {(True, 211): "cudaLaunchKernel_v7000", (True, 311): "cudaGraphLaunch_v10000", (True, 41): "cudaMemcpyAsync_v3020", (False, 307): "cuLaunchKernelEx"}


def _convert(*activities: Record) -> tuple[ProcessRecords, list[tuple[bool, int]]]:
    asked: list[tuple[bool, int]] = []

    def name(runtime: bool, cbid: int) -> str:
        asked.append((runtime, cbid))
        return NAMES[(runtime, cbid)]

    out = ProcessRecords(pid=1, label="t")
    Converter(KINDS, callback_name=name).convert(list(activities), out)
    return out, asked


def _thread(tid: int) -> Record:
    return Record(pt=Record(thread_id=tid))


def test_each_kind_is_copied() -> None:
    out, _ = _convert(
        Record(kind=10, name="_fwd_kernel", correlation_id=3, device_id=0, stream_id=7, start=100, end=180, graph_id=4, graph_node_id=9),
        Record(kind=5, cbid=211, correlation_id=3, start=90, end=95, thread_id=77),
        Record(kind=6, cbid=307, correlation_id=4, start=96, end=97, thread_id=77),
        Record(kind=20, external_kind=7, correlation_id=3, external_id=12),
        Record(kind=30, flags_=MARKER_START, id=5, timestamp=80, name="attndbg/run step=0", domain="attndbg", object_kind=2, object_id=_thread(77)),
        Record(kind=30, flags_=MARKER_END, id=5, timestamp=99, name=None, domain=None, object_kind=2, object_id=_thread(77)),
        Record(kind=99),  # MARKER_DATA and any other kind: not a timeline's
    )
    assert out.kernels == [Kernel(name="_fwd_kernel", correlation_id=3, device=0, stream=7, start=100, end=180, graph_id=4, graph_node_id=9)]
    assert out.api_calls == [ApiCall(3, "cudaLaunchKernel_v7000", 90, 95, 77), ApiCall(4, "cuLaunchKernelEx", 96, 97, 77)]
    assert out.external_ids == [ExternalId(3, 12)]
    assert out.markers == [Marker(5, Edge.START, 80, 77, "attndbg/run step=0", "attndbg"), Marker(5, Edge.END, 99, 77, "", "")]


def test_only_launches_and_our_ranges_are_kept() -> None:
    out, asked = _convert(
        Record(kind=5, cbid=41, correlation_id=1, start=1, end=2, thread_id=1),  # a memcpy places no kernel
        Record(kind=5, cbid=41, correlation_id=2, start=3, end=4, thread_id=1),
        Record(kind=5, cbid=311, correlation_id=5, start=5, end=6, thread_id=1),
        Record(kind=20, external_kind=3, correlation_id=5, external_id=1),  # another tool's external id
        Record(kind=30, flags_=MARKER_START, id=1, timestamp=1, name="torch/op", domain="", object_kind=2, object_id=_thread(1)),
        Record(kind=30, flags_=MARKER_START, id=2, timestamp=1, name="x", domain="other", object_kind=2, object_id=_thread(1)),
        Record(kind=30, flags_=MARKER_START, id=3, timestamp=2, name="", domain="", object_kind=9, object_id=None),  # an unresolved name: kept
    )
    assert [c.name for c in out.api_calls] == ["cudaGraphLaunch_v10000"]
    assert asked == [(True, 41), (True, 311)]  # a call's name is asked once
    assert out.external_ids == []
    assert out.markers == [Marker(3, Edge.START, 2, 0, "", "")]


def test_kinds_as_cupti_enums_and_records_as_tuples() -> None:
    # cupti-python hands its enum members (IntEnum) as `kind`; the records are named tuples, written
    # to JSON as the lists they are.
    class Kind(enum.IntEnum):
        RUNTIME = 5
        KERNEL = 10

    out, asked = _convert(
        Record(kind=Kind.KERNEL, name="k", correlation_id=3, device_id=0, stream_id=7, start=100, end=180, graph_id=0, graph_node_id=0),
        Record(kind=Kind.RUNTIME, cbid=211, correlation_id=3, start=90, end=95, thread_id=77),
        Record(kind=Kind.RUNTIME, cbid=211, correlation_id=4, start=96, end=97, thread_id=77),
    )
    assert out.kernels == [Kernel("k", 3, 0, 7, 100, 180)] and [c.correlation_id for c in out.api_calls] == [3, 4]
    assert asked == [(True, 211)]
    written = json.loads(json.dumps(to_json(out)))
    assert written["kernels"] == [[0, 3, 0, 7, 100, 180, 0, 0]] and written["kernel_names"] == ["k"]


# A C layout like cupti-python's dtypes for ActivityAPI and ActivityMarker2 (object_id: a union of
# a thread's and a stream's ids; name, domain: char pointers), for the memory path without cupti.
_PT = {"names": ["process_id", "thread_id"], "formats": ["<u4", "<u4"], "offsets": [0, 4], "itemsize": 8}
_DCS = {"names": ["device_id", "context_id", "stream_id"], "formats": ["<u4", "<u4", "<u4"], "offsets": [0, 4, 8], "itemsize": 12}
_API = {"names": ["kind", "cbid", "start", "end", "process_id", "thread_id", "correlation_id", "return_value"],
        "formats": ["<i4", "<u4", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4"], "offsets": [0, 4, 8, 16, 24, 28, 32, 36], "itemsize": 40}


def _marker_dtype(np: Any) -> Any:
    object_id = np.dtype({"names": ["pt", "dcs"], "formats": [np.dtype(_PT), np.dtype(_DCS)], "offsets": [0, 0], "itemsize": 12})
    return np.dtype({"names": ["kind", "flags_", "timestamp", "id", "object_kind", "object_id", "pad", "name", "domain"],
                     "formats": ["<i4", "<i4", "<u8", "<u4", "<i4", object_id, "<u4", "<i8", "<i8"], "offsets": [0, 4, 8, 16, 20, 24, 36, 40, 48], "itemsize": 56})


class Held:
    """A record class keeping its C struct in `_data`, as cupti-python's do."""

    __slots__ = ("_data",)

    def __init__(self, data: Any):
        self._data = data


class Addressed:
    """A record class giving only its struct's address."""

    def __init__(self, data: Any):
        self.ptr, self.data = data.ctypes.data, data


def test_a_class_with_a_layout_is_read_from_its_memory() -> None:
    np = pytest.importorskip("numpy")
    marker_dtype, api_dtype = _marker_dtype(np), np.dtype(_API)
    strings = [ctypes.create_string_buffer(text) for text in (b"attndbg/run step=0", b"attndbg", b"torch/op")]
    name, domain, other = (ctypes.addressof(s) for s in strings)
    markers = np.zeros(3, dtype=marker_dtype)
    markers[["kind", "flags_", "id", "timestamp", "object_kind", "name", "domain"]] = [
        (30, MARKER_START, 5, 80, 2, name, domain), (30, MARKER_END, 5, 99, 2, 0, 0), (30, MARKER_START, 6, 81, 2, other, 0)]
    markers["object_id"]["pt"]["thread_id"] = 77
    calls = np.zeros(2, dtype=api_dtype)
    calls[["kind", "cbid", "correlation_id", "start", "end", "thread_id"]] = [(5, 211, 3, 90, 95, 77), (5, 41, 4, 96, 97, 77)]
    expected = ([ApiCall(3, "cudaLaunchKernel_v7000", 90, 95, 77)], [Marker(5, Edge.START, 80, 77, "attndbg/run step=0", "attndbg"), Marker(5, Edge.END, 99, 77, "", "")])
    for held in (Held, Addressed):
        api, marker = type("Api", (held,), {}), type("Marker", (held,), {})  # a class per struct, as cupti-python's
        out = ProcessRecords(pid=1, label="t")
        records = [marker(markers[0:1]), api(calls[0:1]), api(calls[1:2]), marker(markers[1:2]), marker(markers[2:3])]
        types = RecordTypes(api=(api, api_dtype), marker=(marker, marker_dtype))
        Converter(KINDS, callback_name=lambda runtime, cbid: NAMES[(runtime, cbid)], record_types=types).convert(records, out)
        assert (out.api_calls, out.markers) == expected, held.__name__


def test_a_layout_the_dtype_cannot_give_leaves_the_class_to_its_attributes() -> None:
    np = pytest.importorskip("numpy")
    renamed = np.dtype({"names": ["kind", "callback_id"], "formats": ["<i4", "<u4"], "offsets": [0, 4], "itemsize": 8})
    out = ProcessRecords(pid=1, label="t")
    Converter(KINDS, callback_name=lambda runtime, cbid: NAMES[(runtime, cbid)], record_types=RecordTypes(api=(Record, renamed))).convert(
        [Record(kind=5, cbid=211, correlation_id=3, start=90, end=95, thread_id=77)], out)
    assert out.api_calls == [ApiCall(3, "cudaLaunchKernel_v7000", 90, 95, 77)]


_KERNEL = {"names": ["kind", "start", "end", "device_id", "stream_id", "correlation_id", "graph_id", "graph_node_id", "name"],
           "formats": ["<i4", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<i8"], "offsets": [0, 8, 16, 24, 28, 32, 40, 48, 56], "itemsize": 64}
_EXTERNAL = {"names": ["kind", "external_kind", "external_id", "correlation_id"], "formats": ["<i4", "<i4", "<u8", "<u4"], "offsets": [0, 4, 8, 16], "itemsize": 24}


def test_a_buffer_of_records_reads_as_its_record_objects() -> None:
    """convert_buffer (CUPTI's buffer as bytes and record offsets, buffers.py) gives what convert gives
    for the same records as cupti-python's objects; a record of a kind without a layout is skipped."""
    np = pytest.importorskip("numpy")
    dtypes = {"kernel": np.dtype(_KERNEL), "api": np.dtype(_API), "external": np.dtype(_EXTERNAL), "marker": _marker_dtype(np)}
    strings = [ctypes.create_string_buffer(text) for text in (b"_fwd_kernel", b"attndbg/run step=0", b"attndbg")]
    kernel_name, name, domain = (ctypes.addressof(s) for s in strings)
    rows: list[tuple[str, Any]] = []

    def row(what: str, **values: Any) -> None:
        data = np.zeros(1, dtype=dtypes[what])
        for path, value in values.items():
            *outer, last = path.split("__")
            view = data
            for part in outer:
                view = view[part]
            view[last] = value
        rows.append((what, data))

    row("marker", kind=30, flags_=MARKER_START, id=5, timestamp=80, object_kind=2, object_id__pt__thread_id=77, name=name, domain=domain)
    row("api", kind=5, cbid=211, correlation_id=3, start=90, end=95, thread_id=77)
    row("api", kind=6, cbid=307, correlation_id=4, start=96, end=97, thread_id=77)
    row("api", kind=5, cbid=41, correlation_id=9, start=96, end=97, thread_id=77)  # a memcpy: not kept
    row("external", kind=20, external_kind=7, correlation_id=3, external_id=12)
    row("external", kind=20, external_kind=3, correlation_id=3, external_id=1)  # another tool's
    row("kernel", kind=10, name=kernel_name, correlation_id=3, device_id=0, stream_id=7, start=100, end=180, graph_id=4, graph_node_id=9)
    row("kernel", kind=99, correlation_id=8)  # a kind without a layout (MARKER_DATA, say): skipped
    row("marker", kind=30, flags_=MARKER_END, id=5, timestamp=99, object_kind=2, object_id__pt__thread_id=77)
    classes = {what: type(what, (Held,), {}) for what in dtypes}
    types = RecordTypes(**{("external_correlation" if w == "external" else w): (classes[w], dtypes[w]) for w in dtypes})
    converter = Converter(KINDS, callback_name=lambda runtime, cbid: NAMES[(runtime, cbid)], record_types=types)
    assert converter.reads_buffers
    by_objects = ProcessRecords(pid=1, label="t")
    converter.convert([classes[w](d) if d["kind"][0] != 99 else Record(kind=99) for w, d in rows], by_objects)
    data = b"".join(d.tobytes() for _, d in rows)
    offsets = list(np.cumsum([0] + [d.dtype.itemsize for _, d in rows[:-1]]))
    from_buffer = ProcessRecords(pid=1, label="t")
    converter.convert_buffer(data, [int(o) for o in offsets], from_buffer)
    assert to_json(from_buffer) == to_json(by_objects)
    assert from_buffer.kernels == [Kernel("_fwd_kernel", 3, 0, 7, 100, 180, 4, 9)]
    assert [c.correlation_id for c in from_buffer.api_calls] == [3, 4] and from_buffer.external_ids == [ExternalId(3, 12)]
    assert from_buffer.markers == [Marker(5, Edge.START, 80, 77, "attndbg/run step=0", "attndbg"), Marker(5, Edge.END, 99, 77, "", "")]
    # Without a layout for one kind placed, a buffer cannot be read: the collector keeps cupti-python's objects.
    assert not Converter(KINDS, callback_name=lambda runtime, cbid: "", record_types=RecordTypes(api=types.api, marker=types.marker)).reads_buffers
