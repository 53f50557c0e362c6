"""diff_traces: change one thing on purpose, the diff names exactly that field and element."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from rich.console import Console

from attndbg.compare.trace_diff import FieldStatus, TraceDiff, diff_traces
from attndbg.report.diff import render_trace_diff, trace_diff_to_json
from attndbg.trace import io, tree
from attndbg.trace.schema import EngineBuffer, Graph, LayerTensors, LseBase, MaskLayout, Plan, Trace
from attndbg.trace.synth import build, parse_spec


def _with_plan(trace: Trace) -> Trace:
    """A FlashInfer-like page-size-1 plan, as a correct engine would record it."""
    b = trace.batch
    plan = Plan(
        backend="flashinfer",
        tensors={
            "kv_indptr": b.slot_indptr.to(torch.int32),
            "kv_indices": b.slot_ids.to(torch.int32),
            "kv_last_page_len": torch.ones(b.batch_size, dtype=torch.int32),
            "qo_indptr": b.qo_indptr.to(torch.int32),
        },
        scalars={"causal": True, "page_size": 1},
    )
    return dataclasses.replace(trace, plan=plan)


def _with_graph(trace: Trace, capture_bs: int = 8, fill: int = 1) -> Trace:
    b = trace.batch
    pad = capture_bs - b.batch_size
    graph = Graph(
        is_graph_replay=True,
        capture_bs=capture_bs,
        fill_value=fill,
        padded_seq_lens=torch.cat([b.seq_lens_raw, torch.full((pad,), fill, dtype=torch.int64)]),
        padded_req_pool_indices=torch.arange(capture_bs),
        padded_out_cache_loc=torch.cat([b.out_cache_loc, torch.zeros(pad, dtype=torch.int64)]),
        padded_positions=torch.cat([b.positions, torch.zeros(pad, dtype=torch.int64)]),
    )
    return dataclasses.replace(trace, graph=graph)


def _layer(trace: Trace, fill: float = 0.0) -> LayerTensors:
    m, t = trace.model, trace.batch.num_tokens
    return LayerTensors(
        q=torch.full((t, m.num_qo_heads, m.head_dim), fill),
        k_new=torch.zeros(t, m.num_kv_heads, m.head_dim),
        v_new=torch.zeros(t, m.num_kv_heads, m.v_head_dim),
        kv_slots=torch.arange(3),
        k_rows=torch.zeros(3, m.num_kv_heads, m.head_dim),
        v_rows=torch.zeros(3, m.num_kv_heads, m.v_head_dim),
        output=None,
        lse=None,
        lse_base=LseBase.E,
    )


def _decode() -> Trace:
    return _with_graph(_with_plan(build(parse_spec(["decode-mha", "kv_lens=3,64,129"]))), capture_bs=4)


def _only(d: TraceDiff):
    assert len(d.differences) == 1, [f.field for f in d.differences]
    return d.differences[0]


def test_identical_traces_have_no_differences() -> None:
    a = _decode()
    a = dataclasses.replace(a, tensors={0: _layer(a)})
    b = _decode()  # built again from the same spec: equal values, different tensor objects
    b = dataclasses.replace(b, tensors={0: _layer(b)})
    d = diff_traces(a, b)
    assert d.identical and not d.differs and not d.differences
    sections = {f.field.split(".", 1)[0] for f in d.fields}
    assert sections == {"source", "model", "seed", "batch", "graph", "plan", "tensors"}
    assert all(f.status is FieldStatus.EQUAL for f in d.fields)
    assert trace_diff_to_json(d)["identical"] is True


def test_one_slot_id_changed_is_named_with_its_request_and_column() -> None:
    a = _decode()
    # Request 2, column 40: a prefix column, so the batch stays self-consistent.
    k = int(a.batch.slot_indptr[2]) + 40
    slots = a.batch.slot_ids.clone()
    slots[k] = a.batch.kv_cache_size - 1 if int(slots[k]) != a.batch.kv_cache_size - 1 else 1
    b = dataclasses.replace(a, batch=dataclasses.replace(a.batch, slot_ids=slots))
    f = _only(diff_traces(a, b))
    assert f.field == "batch.slot_ids" and f.status is FieldStatus.ELEMENTS
    assert f.index == (k,) and f.count == 1 and f.numel == a.batch.slot_ids.numel()
    assert (f.a, f.b) == (int(a.batch.slot_ids[k]), int(slots[k]))
    assert f.where == "request 2, column 40"


def test_one_plan_index_changed() -> None:
    a = _decode()
    indices = a.plan.tensors["kv_indices"].clone()
    k = int(a.plan.tensors["kv_indptr"][1]) + 5  # segment 1, entry 5
    indices[k] += 1
    b = dataclasses.replace(a, plan=dataclasses.replace(a.plan, tensors={**a.plan.tensors, "kv_indices": indices}))
    f = _only(diff_traces(a, b))
    assert f.field == "plan.tensors.kv_indices"
    assert (f.index, f.count, f.a, f.b) == ((k,), 1, int(a.plan.tensors["kv_indices"][k]), int(indices[k]))
    assert f.where == "kv_indptr segment 1, entry 5"


def _verify(layout: MaskLayout) -> Trace:
    return build(parse_spec(["verify", f"mask_layout={layout.value}"]))


def test_one_bit_flipped_in_a_full_mask() -> None:
    a = _verify(MaskLayout.FULL)
    n, prefix = a.spec.draft_token_num, a.batch.prefix_lens.tolist()
    request, row, draft_col = 1, 5, 2
    # FULL layout: request b's [n, prefix_b + n] block starts after sum over earlier requests of n * (prefix + n).
    k = sum(n * (p + n) for p in prefix[:request]) + row * (prefix[request] + n) + prefix[request] + draft_col
    mask = a.spec.custom_mask.clone()
    mask[k] = ~mask[k]
    b = dataclasses.replace(a, spec=dataclasses.replace(a.spec, custom_mask=mask))
    f = _only(diff_traces(a, b))
    assert f.field == "spec.custom_mask" and f.index == (k,) and f.count == 1
    assert (f.a, f.b) == (bool(a.spec.custom_mask[k]), not bool(a.spec.custom_mask[k]))
    assert f.where == f"request 1, row 5, col {prefix[1] + 2} (draft col 2)"


def test_one_bit_flipped_in_a_qlen_only_mask() -> None:
    a = _verify(MaskLayout.QLEN_ONLY)
    n = a.spec.draft_token_num
    k = 2 * n * n + 7 * n + 3  # request 2, row 7, draft col 3
    mask = a.spec.custom_mask.clone()
    mask[k] = ~mask[k]
    f = _only(diff_traces(a, dataclasses.replace(a, spec=dataclasses.replace(a.spec, custom_mask=mask))))
    assert f.field == "spec.custom_mask" and f.index == (k,)
    assert f.where == "request 2, row 7, draft col 3"


def test_one_bit_flipped_in_a_bitpacked_mask() -> None:
    a = _verify(MaskLayout.QLEN_ONLY_BITPACKED)
    n = a.spec.draft_token_num
    k = 1 * n + 4  # request 1, row 4
    mask = a.spec.custom_mask.clone()
    mask[k] ^= 1 << 6
    f = _only(diff_traces(a, dataclasses.replace(a, spec=dataclasses.replace(a.spec, custom_mask=mask))))
    assert f.field == "spec.custom_mask" and f.index == (k,)
    assert (f.a ^ f.b) == 1 << 6
    assert f.where.startswith("request 1, row 4")
    table = _render(render_trace_diff(diff_traces(a, dataclasses.replace(a, spec=dataclasses.replace(a.spec, custom_mask=mask)))))
    assert "bits [6] differ" in table


def test_parents_and_layout_differences() -> None:
    a = _verify(MaskLayout.FULL)
    parents = a.spec.parents.clone()
    parents[0, 7] = 0
    b_spec = dataclasses.replace(
        a.spec, parents=parents, mask_layout=MaskLayout.QLEN_ONLY, custom_mask=tree.qlen_only_mask(parents)
    )
    d = diff_traces(a, dataclasses.replace(a, spec=b_spec))
    by_field = {f.field: f for f in d.differences}
    assert set(by_field) == {"spec.parents", "spec.custom_mask", "spec.mask_layout"}
    assert by_field["spec.parents"].index == (0, 7) and by_field["spec.parents"].b == 0
    assert (by_field["spec.mask_layout"].a, by_field["spec.mask_layout"].b) == ("full", "qlen_only")
    assert by_field["spec.custom_mask"].status is FieldStatus.SHAPE


def test_scalar_and_enum_fields() -> None:
    a = _decode()
    b = dataclasses.replace(a, model=dataclasses.replace(a.model, num_kv_heads=4, sm_scale=0.5))
    d = diff_traces(a, b)
    assert {(f.field, f.a, f.b) for f in d.differences} == {
        ("model.num_kv_heads", 8, 4),
        ("model.sm_scale", a.model.sm_scale, 0.5),
    }
    assert {f.field for f in d.section("model") if f.equal} >= {"model.num_qo_heads", "model.head_dim"}


def test_lengths_that_differ_name_the_first_difference_in_the_common_prefix() -> None:
    a = _decode()
    longer = torch.cat([a.batch.positions, torch.tensor([999])])
    f = _only(diff_traces(a, dataclasses.replace(a, batch=dataclasses.replace(a.batch, positions=longer))))
    assert f.status is FieldStatus.SHAPE and f.a_meta == "int64 [3]" and f.b_meta == "int64 [4]"
    assert f.index == (3,) and f.a is None and f.count == 0  # the common prefix is equal


def test_dtype_only_difference_says_values_are_equal() -> None:
    a = _decode()
    tensors = {**a.plan.tensors, "kv_indptr": a.plan.tensors["kv_indptr"].to(torch.int64)}
    f = _only(diff_traces(a, dataclasses.replace(a, plan=dataclasses.replace(a.plan, tensors=tensors))))
    assert f.field == "plan.tensors.kv_indptr" and f.status is FieldStatus.DTYPE and f.count == 0
    assert (f.a_meta, f.b_meta) == ("int32 [4]", "int64 [4]")


def test_plan_tensors_and_sections_on_one_side_only() -> None:
    a = _decode()
    tensors = {k: v for k, v in a.plan.tensors.items() if k != "kv_last_page_len"}
    tensors["page_table"] = torch.zeros(3, 4, dtype=torch.int32)
    b = dataclasses.replace(a, plan=dataclasses.replace(a.plan, tensors=tensors), graph=None)
    d = diff_traces(a, b)
    assert {(f.field, f.status) for f in d.differences} == {
        ("plan.tensors.kv_last_page_len", FieldStatus.ONLY_A),
        ("plan.tensors.page_table", FieldStatus.ONLY_B),
        ("graph", FieldStatus.ONLY_A),
    }


def test_graph_fill_value_change() -> None:
    a = _decode()
    b = _with_graph(_with_plan(build(parse_spec(["decode-mha", "kv_lens=3,64,129"]))), capture_bs=4, fill=0)
    d = diff_traces(a, b)
    by_field = {f.field: f for f in d.differences}
    assert set(by_field) == {"graph.fill_value", "graph.padded_seq_lens"}
    assert by_field["graph.padded_seq_lens"].index == (3,)  # the one padded row
    assert (by_field["graph.padded_seq_lens"].a, by_field["graph.padded_seq_lens"].b) == (1, 0)


def test_layer_tensors_nan_equals_nan_and_missing_layers() -> None:
    a = _decode()
    la, lb = _layer(a, float("nan")), _layer(a, float("nan"))
    lb.q[2, 1, 3] = 0.25
    d = diff_traces(dataclasses.replace(a, tensors={0: la}), dataclasses.replace(a, tensors={0: lb, 5: _layer(a)}))
    by_field = {f.field: f for f in d.differences}
    assert set(by_field) == {"tensors.0.q", "tensors.5"}
    q = by_field["tensors.0.q"]
    assert q.index == (2, 1, 3) and q.count == 1 and q.b == 0.25 and q.a != q.a  # a is NaN
    assert by_field["tensors.5"].status is FieldStatus.ONLY_B


def _render(renderable) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()


def test_render_and_json_name_the_field_and_both_values() -> None:
    a = _decode()
    slots = a.batch.slot_ids.clone()
    slots[10] = 2
    b = dataclasses.replace(a, batch=dataclasses.replace(a.batch, slot_ids=slots))
    d = diff_traces(a, b)
    text = _render(render_trace_diff(d, labels=("old.pt", "new.pt")))
    assert "batch.slot_ids" in text and "old.pt" in text and "request 1, column 7" in text
    assert f"{int(a.batch.slot_ids[10])} vs 2" in text
    data = json.loads(json.dumps(trace_diff_to_json(d), allow_nan=False))
    assert data["identical"] is False and d.differs
    assert data["differences"] == [
        {
            "field": "batch.slot_ids",
            "status": "elements",
            "a": int(a.batch.slot_ids[10]),
            "b": 2,
            "a_meta": "int64 [196]",
            "b_meta": "int64 [196]",
            "index": [10],
            "count": 1,
            "numel": 196,
            "where": "request 1, column 7",
        }
    ]
    assert "model.num_qo_heads" in data["equal"]
    assert "identical" in _render(render_trace_diff(diff_traces(a, a)))


@pytest.mark.parametrize("preset", ["mla-decode", "decode-paged", "selective", "mixed"])
def test_presets_diff_clean_against_themselves(preset: str) -> None:
    assert diff_traces(build(parse_spec([preset])), build(parse_spec([preset]))).identical


# -- engine buffers (Trace.buffers) -------------------------------------------------------------------

TAIL = 4  # kv_indices entries past kv_indptr[-1]: the engine sized the buffer from a larger seq_lens_sum


def _with_buffer(trace: Trace, *, tail: list[int], capacity: bool = False, length: int | None = None) -> Trace:
    """The decode plan's kv_indices as the engine's buffer: the step's entries, then `tail` entries no
    kernel of the step reads (garbage torch.empty left, or an earlier step's ids)."""
    indices = trace.plan.tensors["kv_indices"]
    read = indices.numel()
    recorded = torch.cat([indices, torch.tensor(tail, dtype=indices.dtype)])
    plan = dataclasses.replace(trace.plan, tensors={**trace.plan.tensors, "kv_indices": recorded})
    buffer = EngineBuffer(length=length if length is not None else recorded.numel(), read=read, capacity=capacity)
    return dataclasses.replace(trace, plan=plan, buffers={"plan.kv_indices": buffer})


def test_identical_buffers_are_a_section_of_equal_fields() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    d = diff_traces(a, _with_buffer(_decode(), tail=[7] * TAIL))
    assert d.identical
    assert [f.field for f in d.section("buffers")] == [f"buffers.plan.kv_indices.{name}" for name in ("length", "read", "capacity", "contents")]


def test_a_stale_tail_is_named_past_what_the_kernel_reads() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    b = _with_buffer(_decode(), tail=[7, 9, 7, 7])
    read = a.buffers["plan.kv_indices"].read
    by_field = {f.field: f for f in diff_traces(a, b).differences}
    assert set(by_field) == {"plan.tensors.kv_indices", "buffers.plan.kv_indices.contents"}
    f = by_field["buffers.plan.kv_indices.contents"]
    assert (f.status, f.index, f.a, f.b, f.count) == (FieldStatus.ELEMENTS, (read + 1,), 7, 9, 1)
    assert f.where == f"past what the kernel reads (read {read})"


def test_a_difference_the_kernel_reads_is_named_by_its_segment() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    indices = a.plan.tensors["kv_indices"].clone()
    k = int(a.plan.tensors["kv_indptr"][1]) + 5
    indices[k] += 1
    b = dataclasses.replace(a, plan=dataclasses.replace(a.plan, tensors={**a.plan.tensors, "kv_indices": indices}))
    f = next(f for f in diff_traces(a, b).differences if f.field == "buffers.plan.kv_indices.contents")
    assert f.index == (k,) and f.where == f"kv_indptr segment 1, entry 5; read by the kernel (read {a.buffers['plan.kv_indices'].read})"


def test_length_read_and_capacity_differences() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    b = _with_buffer(_decode(), tail=[7] * TAIL, capacity=True, length=4096)  # a graph buffer, cut after the tail
    by_field = {f.field: f for f in diff_traces(a, b).differences}
    assert set(by_field) == {"buffers.plan.kv_indices.length", "buffers.plan.kv_indices.capacity"}
    assert (by_field["buffers.plan.kv_indices.length"].a, by_field["buffers.plan.kv_indices.length"].b) == (a.buffers["plan.kv_indices"].length, 4096)
    assert (by_field["buffers.plan.kv_indices.capacity"].a, by_field["buffers.plan.kv_indices.capacity"].b) == (False, True)
    shorter = _with_buffer(_decode(), tail=[7])
    f = next(f for f in diff_traces(a, shorter).differences if f.field == "buffers.plan.kv_indices.contents")
    assert f.status is FieldStatus.SHAPE and f.a is None and f.numel == shorter.plan.tensors["kv_indices"].numel()


def test_a_buffer_on_one_side_only() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    b = dataclasses.replace(a, buffers={})  # recorded before buffers were kept
    f = next(f for f in diff_traces(a, b).differences if f.field.startswith("buffers."))
    assert (f.field, f.status) == ("buffers.plan.kv_indices", FieldStatus.ONLY_A)
    assert not [f for f in diff_traces(a, b).fields if f.field.endswith(".contents")]


def test_render_and_json_of_a_buffer_difference() -> None:
    a = _with_buffer(_decode(), tail=[7] * TAIL)
    d = diff_traces(a, _with_buffer(_decode(), tail=[7, 9, 7, 7]))
    text = _render(render_trace_diff(d))
    read = a.buffers["plan.kv_indices"].read
    assert "buffers.plan.kv_indices.contents" in text and f"past what the kernel reads (read {read})" in text
    assert "buffers: 1 of 4 differ" in text
    data = json.loads(json.dumps(trace_diff_to_json(d), allow_nan=False))
    [entry] = [e for e in data["differences"] if e["field"] == "buffers.plan.kv_indices.contents"]
    assert (entry["index"], entry["a"], entry["b"]) == ([read + 1], 7, 9)


def test_recordings_whose_steps_differ_only_in_a_buffer_tail(tmp_path) -> None:
    from attndbg.compare.recording_diff import diff_recordings
    from attndbg.report.diff import recording_diff_to_json, render_recording_diff

    for name, tail in (("a", [7] * TAIL), ("b", [7, 7, 9, 7])):
        (tmp_path / name).mkdir()
        io.save(_decode(), tmp_path / name / "step_000000.pt")
        io.save(_with_buffer(_decode(), tail=tail), tmp_path / name / "step_000001.pt")
    d = diff_recordings(tmp_path / "a", tmp_path / "b")
    assert d.first_difference.index == 1
    assert [f.field for f in d.first_difference.diff.differences] == ["plan.tensors.kv_indices", "buffers.plan.kv_indices.contents"]
    text = _render(render_recording_diff(d))
    assert "1 of 2 steps differ; first at #1" in text and "plan.tensors.kv_indices" in text
    data = recording_diff_to_json(d)
    assert data["first_difference"] == 1 and data["steps"][1]["diff"]["differences"][1]["where"].startswith("past what the kernel reads")
