"""Kernels are placed in the range they were launched in (external correlation), checked against
the NVTX ranges CUPTI recorded; graph replays carry their cudaGraphLaunch's correlation id."""

from __future__ import annotations

from dataclasses import replace

from attndbg.timeline import ranges
from attndbg.timeline.matching import match, spans
from attndbg.timeline.records import ApiCall, Edge, ExternalId, Kernel, Marker
from tests.timeline.factory import Builder, replay_step


def test_every_kernel_is_placed_by_its_launch_though_it_ran_after_its_range() -> None:
    matched = match(replay_step())
    assert len(matched.launched) == 7 and not matched.outside() and not matched.disagreements()
    for launched in matched.launched:
        assert launched.kernel.start > launched.range.end  # GPU time alone would place none of them
    named = [ranges.names(k.range, matched.ranges) for k in matched.launched]
    assert [(n.phase, n.backend, n.variant, n.batch) for n in named] == [
        ("data", "", "", ""),
        ("run", "triton", "eager", ""),
        ("run", "triton", "eager", ""),
        ("replay", "triton", "graph bs=8 fill=1", "decoy"),
        ("replay", "triton", "graph bs=8 fill=1", "decoy"),
        ("replay", "triton", "graph bs=8 fill=1", "real"),
        ("replay", "triton", "graph bs=8 fill=1", "real"),
    ]
    assert all(n.step == "0" and n.mode == "DECODE" and n.batch_size == "3" for n in named)


def test_each_graph_replay_is_one_launch_running_the_captured_nodes() -> None:
    matched = match(replay_step())
    launches = matched.graph_launches
    assert [ranges.names(g.range, matched.ranges).batch for g in launches] == ["decoy", "real"]
    assert launches[0].nodes == launches[1].nodes == {(5, 1), (5, 2)}
    capture = next(r for r in matched.ranges.values() if r.message.startswith("attndbg/capture "))
    assert len(matched.unexecuted[capture.id]) == len(launches[0].nodes)  # launches recorded into the graph ran no kernel then


def test_a_kernel_outside_every_range_and_a_disagreeing_marker() -> None:
    b = Builder()
    outside = b.call("cudaLaunchKernel_v7000", in_range=False)
    b.kernel(outside, "stray")
    b.push("run", "step=0 backend=triton variant=eager")
    inside = b.call("cuLaunchKernelEx")
    b.kernel(inside, "k")
    b.pop()
    records = b.records
    # An NVTX range of another name around the launch, nested inside ours: nsys would draw the kernel there.
    records.markers += [
        Marker(id=9, edge=Edge.START, timestamp=inside.start - 1, thread_id=inside.thread_id, name="attndbg/other"),
        Marker(id=9, edge=Edge.END, timestamp=inside.end + 1, thread_id=inside.thread_id),
    ]
    matched = match(records)
    assert [k.kernel.name for k in matched.outside()] == ["stray"]
    assert [k.kernel.name for k in matched.disagreements()] == ["k"]
    assert matched.launched[0].agrees  # outside both: no disagreement


def test_runtime_call_preferred_over_the_driver_call_it_makes() -> None:
    b = Builder()
    b.push("run", "step=0")
    call = b.call("cudaLaunchKernel_v7000")
    b.records.api_calls.append(ApiCall(correlation_id=call.correlation_id, name="cuLaunchKernel", start=call.start, end=call.end, thread_id=call.thread_id))
    b.kernel(call, "k")
    b.pop()
    assert match(b.records).launched[0].launch.name == "cudaLaunchKernel_v7000"


def test_spans_pair_start_and_end_by_id_and_drop_unpaired() -> None:
    markers = [
        Marker(id=1, edge=Edge.START, timestamp=10, thread_id=1, name="attndbg/a"),
        Marker(id=2, edge=Edge.START, timestamp=11, thread_id=1, name="attndbg/b"),
        Marker(id=2, edge=Edge.END, timestamp=12, thread_id=1),
        Marker(id=3, edge=Edge.END, timestamp=13, thread_id=1),
    ]
    assert [(s.name, s.start, s.end) for s in spans(markers)] == [("attndbg/b", 11, 12)]


def test_a_missing_launch_record_still_places_the_kernel_by_its_external_id() -> None:
    records = replay_step()
    records.api_calls = [c for c in records.api_calls if c.name != "cuLaunchKernelEx"]
    matched = match(records)
    run = [k for k in matched.launched if k.kernel.name.startswith("_fwd") and k.kernel.graph_id == 0]
    assert run and all(k.launch is None and k.range is not None for k in run)


def test_names_read_the_message_words() -> None:
    assert ranges.parse("attndbg/run step=0 mode=DECODE bs=3 backend=triton variant=recorded plan") == (
        "run", {"step": "0", "mode": "DECODE", "bs": "3", "backend": "triton", "variant": "recorded plan"})
    assert ranges.parse("attndbg/detector/split-merge step=4") == ("detector/split-merge", {"step": "4", "detector": "split-merge"})
    assert ranges.parse("attndbg/backend/fa3") == ("backend/fa3", {"backend": "fa3"})


def test_a_kernel_record_keeps_graph_fields() -> None:
    k = Kernel(name="k", correlation_id=1, device=0, stream=7, start=10, end=4, graph_id=3, graph_node_id=9)
    assert k.duration == 0 and k._replace(end=20).duration == 10  # a named tuple (records.py)
    assert ExternalId(1, 2).external_id == 2


def test_nvtx_ranges_without_names_are_told_by_time() -> None:
    """CUPTI may not resolve a registered string: an unnamed NVTX range is the attndbg range it sits in."""
    records = replay_step()
    records.markers = [replace(m, name="") for m in records.markers]
    assert not match(records).disagreements()
    # The same markers, each moved to enclose the next range's launches instead: every placement disagrees.
    b = Builder()
    b.push("run", "step=0 backend=a variant=eager")
    first = b.call("cuLaunchKernelEx")
    b.kernel(first, "k1")
    b.pop()
    b.push("run", "step=0 backend=b variant=eager")
    b.kernel(b.call("cuLaunchKernelEx"), "k2")
    b.pop()
    records = b.records
    records.markers = [replace(m, name="") for m in records.markers]
    start, end = records.markers[0], records.markers[1]
    records.markers[0:2] = [replace(start, timestamp=first.end + 1), replace(end, timestamp=records.ranges[0].end + 10)]
    assert [k.kernel.name for k in match(records).disagreements()] == ["k1"]


def test_a_range_is_named_once_for_summary_and_trace() -> None:
    matched = match(replay_step())
    for r in matched.records.ranges:
        assert matched.names(r) == ranges.names(r, matched.ranges) and matched.names(r) is matched.names(r)
