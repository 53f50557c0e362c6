"""The conversion of real cupti-python record objects (no GPU: built with `from_data` from numpy
records of cupti-python's own dtypes, strings through C buffers), read from memory at the dtypes'
offsets: the same records as through the objects' attributes, field for field. Skipped where
cupti-python is not installed (CI)."""

from __future__ import annotations

import ctypes
from operator import attrgetter
from typing import Any

import pytest

pytest.importorskip("cupti")
np = pytest.importorskip("numpy")

from cupti import cupti  # noqa: E402

from attndbg.profiling import DOMAIN  # noqa: E402
from attndbg.timeline.collector import _record_types  # noqa: E402
from attndbg.timeline.convert import API_FIELDS, EXTERNAL_FIELDS, KERNEL_FIELDS, MARKER_END, MARKER_FIELDS, MARKER_START, Converter, Kinds, RecordTypes  # noqa: E402
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker, ProcessRecords  # noqa: E402

K = cupti.ActivityKind
KINDS = Kinds(
    kernel=int(K.CONCURRENT_KERNEL), runtime=int(K.RUNTIME), driver=int(K.DRIVER), external_correlation=int(K.EXTERNAL_CORRELATION),
    marker=int(K.MARKER), external_kind=int(cupti.ExternalCorrelationKind.CUSTOM0), thread_object=int(cupti.ActivityObjectKind.THREAD),
)
NAMES = {(True, 211): "cudaLaunchKernel_v7000", (True, 41): "cudaMemcpyAsync_v3020", (False, 307): "cuLaunchKernelEx"}
MANGLED = "_ZN7flashinfer24BatchPrefillWithPagedKVCacheKernelILb0ELNS_9MaskModeE0EEEvNS_6ParamsE"


_STRINGS: list[ctypes.Array] = []  # the C strings records point to, for the whole run


def _never_freed(record: Any) -> Any:
    # cupti-python's __dealloc__ releases the object's share of a CUPTI buffer, which an object
    # made by from_data has none of: it prints a KeyError's traceback, even at interpreter exit.
    # One reference more than anyone will drop keeps it (and its numpy record) from ever running.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(record))
    return record


class Records:
    """cupti-python objects over numpy records."""

    def string(self, text: bytes) -> int:
        buffer = ctypes.create_string_buffer(text)
        _STRINGS.append(buffer)
        return ctypes.addressof(buffer)

    def make(self, cls: type, dtype: Any, **fields: Any) -> Any:
        data = np.zeros(1, dtype=dtype)
        for path, value in fields.items():  # object_id__pt__thread_id: a nested field
            *outer, name = path.split("__")
            view = data
            for part in outer:
                view = view[part]
            view[name] = self.string(value) if isinstance(value, bytes) else value
        return _never_freed(cls.from_data(data))

    def kernel(self, **fields: Any) -> Any:
        return self.make(cupti.ActivityKernel10, cupti.activity_kernel10_dtype, **{"kind": KINDS.kernel, **fields})

    def api(self, **fields: Any) -> Any:
        return self.make(cupti.ActivityAPI, cupti.activity_api_dtype, **fields)

    def external(self, **fields: Any) -> Any:
        return self.make(cupti.ActivityExternalCorrelation, cupti.activity_external_correlation_dtype, **{"kind": KINDS.external_correlation, **fields})

    def marker(self, **fields: Any) -> Any:
        return self.make(cupti.ActivityMarker2, cupti.activity_marker2_dtype, **{"kind": KINDS.marker, **fields})


def _convert(activities: list[Any], record_types: RecordTypes | None) -> ProcessRecords:
    out = ProcessRecords(pid=1, label="t")
    Converter(KINDS, callback_name=lambda runtime, cbid: NAMES.get((runtime, cbid), ""), record_types=record_types or RecordTypes()).convert(activities, out)
    return out


def _step(r: Records) -> list[Any]:
    """One step's records as CUPTI writes them, with each case the conversion tells apart."""
    thread = int(cupti.ActivityObjectKind.THREAD)
    big = (1 << 63) + 12345  # a timestamp past int64: read unsigned
    return [
        r.marker(flags_=MARKER_START, id=5, timestamp=80, object_kind=thread, object_id__pt__process_id=9, object_id__pt__thread_id=140001,
                 name=b"attndbg/run step=0 mode=DECODE bs=3", domain=DOMAIN.encode()),
        r.api(kind=KINDS.runtime, cbid=211, correlation_id=3, start=90, end=95, process_id=9, thread_id=140001, return_value=0),
        r.api(kind=KINDS.runtime, cbid=41, correlation_id=4, start=96, end=97, thread_id=140001),  # a memcpy: no launch
        r.api(kind=KINDS.driver, cbid=9999, correlation_id=5, start=96, end=97, thread_id=140001),  # a callback id CUPTI names not
        r.api(kind=KINDS.driver, cbid=307, correlation_id=6, start=big, end=big + 5, thread_id=(1 << 32) - 1),
        r.external(external_kind=KINDS.external_kind, correlation_id=3, external_id=(1 << 64) - 2),
        r.external(external_kind=KINDS.external_kind + 1, correlation_id=3, external_id=1),  # another tool's id
        r.kernel(name=MANGLED.encode(), correlation_id=3, device_id=1, stream_id=7, start=100, end=180, graph_id=4, graph_node_id=(1 << 40) + 9,
                 context_id=2, grid_x=3, registers_per_thread=64, queued=1, submitted=2),
        r.kernel(name=b"\xc3\xa9l\xc3\xa9ment", correlation_id=6, start=big, end=big + 7),  # UTF-8 bytes: decoded as cupti-python does
        r.kernel(kind=int(K.KERNEL), name=b"serial", correlation_id=8),  # not a CONCURRENT_KERNEL record: not ours
        r.marker(flags_=MARKER_END, id=5, timestamp=99, object_kind=thread, object_id__pt__thread_id=140001),  # name and domain NULL
        r.marker(flags_=MARKER_START, id=6, timestamp=100, object_kind=thread, object_id__pt__thread_id=1, name=b"nccl:all_reduce", domain=b"NCCL"),
        r.marker(flags_=MARKER_START, id=7, timestamp=101, object_kind=thread, object_id__pt__thread_id=1, name=b"attndbg/step x", domain=b"other"),
        # a stream's marker: object_id's other union member (dcs), whose bytes are no thread id
        r.marker(flags_=1, id=8, timestamp=102, object_kind=int(cupti.ActivityObjectKind.STREAM), object_id__dcs__device_id=3,
                 object_id__dcs__context_id=11, object_id__dcs__stream_id=13, name=b"attndbg/instant"),
        r.make(cupti.ActivityMarkerData, cupti.activity_marker_data_dtype, kind=int(K.MARKER_DATA), id=5),  # a class of no layout
    ]


def test_memory_reads_equal_the_attributes() -> None:
    r = Records()
    step = _step(r)
    record_types = _record_types(cupti)
    by_memory, by_attribute = _convert(step, record_types), _convert(step, None)
    assert by_memory == by_attribute
    big = (1 << 63) + 12345
    assert by_memory.kernels == [
        Kernel(MANGLED, 3, 1, 7, 100, 180, 4, (1 << 40) + 9),
        Kernel("élément", 6, 0, 0, big, big + 7, 0, 0),
    ]
    assert by_memory.api_calls == [ApiCall(3, "cudaLaunchKernel_v7000", 90, 95, 140001), ApiCall(6, "cuLaunchKernelEx", big, big + 5, (1 << 32) - 1)]
    assert by_memory.external_ids == [ExternalId(3, (1 << 64) - 2)]
    assert by_memory.markers == [
        Marker(5, Edge.START, 80, 140001, "attndbg/run step=0 mode=DECODE bs=3", DOMAIN),
        Marker(5, Edge.END, 99, 140001, "", ""),
        Marker(8, Edge.INSTANT, 102, 0, "attndbg/instant", ""),
    ]
    readers = Converter(KINDS, callback_name=repr, record_types=record_types)._readers
    assert all(type(a) in readers for a in step[:-1])  # each of them through its layout, none by attribute


def test_each_field_read_equals_its_attribute() -> None:
    # Every value a reader unpacks, whether or not its record is kept (a union's other member too).
    r = Records()
    converter = Converter(KINDS, callback_name=repr, record_types=_record_types(cupti))
    paths = {cupti.ActivityKernel10: KERNEL_FIELDS, cupti.ActivityAPI: API_FIELDS, cupti.ActivityExternalCorrelation: EXTERNAL_FIELDS, cupti.ActivityMarker2: MARKER_FIELDS}
    for a in _step(r)[:-1]:
        assert converter._readers[type(a)](a) == attrgetter(*paths[type(a)])(a)


def test_the_record_is_the_memory_its_attributes_read() -> None:
    # The reader unpacks `_data`, the record array cupti-python's attributes read; `ptr` (the
    # public address, the reader's way for a class without `_data`) is that array's address.
    r = Records()
    for a in _step(r):
        assert a.ptr == a._data.ctypes.data and a._data.dtype.itemsize == len(ctypes.string_at(a.ptr, a._data.dtype.itemsize))


class Addressed:
    """A record class that gives only its address (`ptr`), as a cupti-python without `_data` would."""

    def __init__(self, record: Any):
        self.ptr = record.ptr


def test_a_class_without_data_is_read_at_its_address() -> None:
    r = Records()
    step = _step(r)[:-1]
    dtypes = {cupti.ActivityKernel10: cupti.activity_kernel10_dtype, cupti.ActivityAPI: cupti.activity_api_dtype,
              cupti.ActivityExternalCorrelation: cupti.activity_external_correlation_dtype, cupti.ActivityMarker2: cupti.activity_marker2_dtype}
    by_role = {cupti.ActivityKernel10: "kernel", cupti.ActivityAPI: "api", cupti.ActivityExternalCorrelation: "external_correlation", cupti.ActivityMarker2: "marker"}
    for cls, role in by_role.items():
        addressed = [Addressed(a) if type(a) is cls else a for a in step]
        record_types = RecordTypes(**{role: (Addressed, dtypes[cls])})
        assert _convert(addressed, record_types) == _convert(step, None), role


def test_an_invalid_name_fails_as_cupti_python_does() -> None:
    r = Records()
    bad = r.kernel(name=b"k\xff", correlation_id=1)
    with pytest.raises(UnicodeDecodeError):
        _ = bad.name
    with pytest.raises(UnicodeDecodeError):
        _convert([bad], _record_types(cupti))


def test_this_cupti_python_has_a_layout_for_each_kind_enabled() -> None:
    t = _record_types(cupti)
    assert (t.kernel, t.api, t.external_correlation, t.marker) == (
        (cupti.ActivityKernel10, cupti.activity_kernel10_dtype), (cupti.ActivityAPI, cupti.activity_api_dtype),
        (cupti.ActivityExternalCorrelation, cupti.activity_external_correlation_dtype), (cupti.ActivityMarker2, cupti.activity_marker2_dtype),
    )


def test_a_cupti_buffer_reads_as_its_record_objects() -> None:
    """The same records laid out as CUPTI lays them in a buffer (8-byte aligned, one after another;
    buffers.py hands on the bytes and each record's offset): convert_buffer reads each by its kind's
    layout, and gives what the objects give. The kernel record of kind KERNEL and the MARKER_DATA
    record are not a timeline's either way."""
    r = Records()
    step = _step(r)
    converter = Converter(KINDS, callback_name=lambda runtime, cbid: NAMES.get((runtime, cbid), ""), record_types=_record_types(cupti))
    assert converter.reads_buffers
    data, offsets = b"", []
    for a in step:
        offsets.append(len(data))
        record = a._data.tobytes()
        data += record + b"\0" * (-len(record) % 8)
    from_buffer = ProcessRecords(pid=1, label="t")
    converter.convert_buffer(data, offsets, from_buffer)
    assert from_buffer == _convert(step, None)
