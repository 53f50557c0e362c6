"""CUPTI's records into ours. The records are plain objects carrying the attributes cupti-python's
record classes have (ActivityKernel10, ActivityAPI, ActivityExternalCorrelation, ActivityMarker2),
and the enum values are stand-in numbers: the conversion reads both as given."""

from __future__ import annotations

import enum
import json
from types import SimpleNamespace as Record

from attndbg.timeline.convert import MARKER_END, MARKER_START, Converter, Kinds
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
