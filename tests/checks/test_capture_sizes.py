"""invariants against the sizes the engine captured its CUDA graphs with (`Trace.capture`): a
step that fits exactly is clean; one element past any captured size is one finding
naming the check, the field and its first bad element, with the numbers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.detectors.invariants.detect import check_trace
from attndbg.trace import io
from attndbg.trace.mask_geometry import mask_length
from attndbg.trace.schema import CaptureSizes, MaskLayout, Plan, Trace
from tests.factories import make_trace

# 3 decodes (KV 5, 9, 12; page 1) in a graph captured at bs 4; the Triton plan's kv_indptr is
# [0, 5, 14, 26] and its num_kv_splits [3, 5, 6]: the step needs exactly these.
EXACT = CaptureSizes(max_bs=4, max_num_tokens=4, max_kv_splits=6, kv_indices_capacity=26, block_table_width=12, workspace_bytes=1 << 20)
# 3 verify requests of 8 tokens (prefixes 20, 75, 130; FULL mask) captured at bs 4: mask_indptr [0, 224, 888, 1992].
VERIFY_EXACT = CaptureSizes(max_bs=4, max_num_tokens=32, mask_capacity=1992, kv_indices_capacity=225)


def decode(capture: CaptureSizes | None = EXACT, *, graph: bool = True) -> Trace:
    spec = ["decode-gqa", "kv_lens=5,9,12"] + (["capture_bs=4"] if graph else [])
    trace = make_trace(*spec, plan=True)
    assert trace.plan.tensors["kv_indptr"].tolist() == [0, 5, 14, 26] and trace.plan.tensors["num_kv_splits"].tolist() == [3, 5, 6]
    return replace(trace, capture=capture)


def verify(capture: CaptureSizes | None = VERIFY_EXACT) -> Trace:
    trace = make_trace("verify", "capture_bs=4", plan=True)
    assert trace.plan.tensors["mask_indptr"].tolist() == [0, 224, 888, 1992] and trace.spec.mask_layout is MaskLayout.FULL
    return replace(trace, capture=capture)


def capture_findings(trace: Trace) -> list:
    return [f for f in check_trace(trace) if f.check.startswith("capture-") or f.check in ("num-kv-splits", "indptr-end")]


def test_steps_at_exactly_the_captured_sizes_are_clean(tmp_path: Path) -> None:
    for trace in (decode(), verify()):
        loaded = io.load(io.save(trace, tmp_path / "t.pt"))
        assert loaded.capture == trace.capture
        assert check_trace(loaded) == []


@pytest.mark.parametrize(
    ("sizes", "check", "field", "row", "evidence"),
    [
        (dict(max_bs=3), "capture-batch-size", "graph.padded_seq_lens[3]", 3, "capture_bs = 4 requests, but the static buffers hold capture.max_bs = 3"),
        (dict(max_num_tokens=3), "capture-num-tokens", "graph.padded_out_cache_loc[3]", None, "runs 4 tokens (graph.padded_out_cache_loc), but the largest captured graph holds capture.max_num_tokens = 3"),
        (dict(max_kv_splits=5), "num-kv-splits", "plan.num_kv_splits[2]", 2, "plan.num_kv_splits[2] = 6, expected a value in [1, 5] (capture.max_kv_splits = 5)"),
        (dict(kv_indices_capacity=25), "capture-kv-indices", "plan.kv_indptr[3]", 2, "plan.kv_indptr[3] = 26 (request 2's end) is past the kv_indices buffer captured with capture.kv_indices_capacity = 25"),
        (dict(kv_indices_capacity=13), "capture-kv-indices", "plan.kv_indptr[2]", 1, "plan.kv_indptr[2] = 14 (request 1's end)"),
        (dict(block_table_width=11), "capture-block-table", "batch.kv_lens[2]", 2, "request 2 reads 12 KV columns = 12 blocks of 1, but the block table was allocated 11 blocks wide"),
    ],
)
def test_one_past_a_captured_size_is_one_finding(sizes: dict, check: str, field: str, row: int | None, evidence: str) -> None:
    [found] = capture_findings(decode(replace(EXACT, **sizes)))
    assert (found.check, found.location.field, found.location.request) == (check, field, row)
    assert evidence in found.evidence, found.evidence
    assert "capture" in found.cause or "captured" in found.cause or "startup" in found.cause


@pytest.mark.parametrize(("capacity", "field", "row"), [(1991, "plan.mask_indptr[3]", 2), (887, "plan.mask_indptr[2]", 1)])
def test_a_verify_mask_past_the_captured_mask_buffer(capacity: int, field: str, row: int) -> None:
    [found] = capture_findings(verify(replace(VERIFY_EXACT, mask_capacity=capacity)))
    assert (found.check, found.location.field, found.location.request) == ("capture-mask", field, row)
    assert f"capture.mask_capacity = {capacity} elements; the step reads 1992" in found.evidence
    assert (found.data["expected"], found.data["found"]) == (capacity, 1992)


def test_without_mask_offsets_the_layout_over_the_replayed_rows_is_the_need() -> None:
    trace = verify()
    tensors = {k: v for k, v in trace.plan.tensors.items() if k not in ("mask_indptr", "custom_mask")}
    trace = replace(trace, plan=Plan(trace.plan.backend, tensors, trace.plan.scalars))
    # 4 replayed rows (the padded one has the fill seq_len 1): FULL needs 8 * (20+75+130+1) + 4 * 8 * 8.
    need = mask_length(MaskLayout.FULL, batch_size=4, draft_token_num=8, prefix_sum=226)
    assert need == 2064
    assert capture_findings(replace(trace, capture=replace(VERIFY_EXACT, mask_capacity=need))) == []
    [found] = capture_findings(replace(trace, capture=replace(VERIFY_EXACT, mask_capacity=need - 1)))
    assert (found.check, found.location.field) == ("capture-mask", f"spec.custom_mask[{need - 1}]")
    assert "layout full over the 4 replayed rows needs 2064 elements" in found.evidence


def test_a_kv_indices_buffer_recorded_cut_at_its_capacity_is_named_by_its_capacity() -> None:
    trace = decode(replace(EXACT, kv_indices_capacity=25))
    tensors = dict(trace.plan.tensors, kv_indices=trace.plan.tensors["kv_indices"][:25])  # the recorder's cut
    cut = replace(trace, plan=Plan(trace.plan.backend, tensors, trace.plan.scalars))
    # Without the captured size only the generic end mismatch is known; with it, its reason.
    assert [f.check for f in capture_findings(replace(cut, capture=None))] == ["indptr-end"]
    assert [f.check for f in capture_findings(cut)] == ["capture-kv-indices"]


def test_eager_steps_are_not_held_to_graph_sizes() -> None:
    # Only a graph replays with the captured buffers: an eager step of the same batch is clean
    # against every graph size, but a block table (persistent, eager too) still binds it.
    small = CaptureSizes(max_bs=1, max_num_tokens=1, max_kv_splits=1, kv_indices_capacity=1, mask_capacity=1)
    assert capture_findings(decode(small, graph=False)) == []
    [found] = capture_findings(decode(replace(small, block_table_width=11), graph=False))
    assert found.check == "capture-block-table"


def test_check_reports_it_from_the_file(tmp_path: Path) -> None:
    path = io.save(decode(replace(EXACT, max_bs=2)), tmp_path / "t.pt")
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--json", "-"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output[result.output.index("{") :])
    [found] = [f for step in report["steps"] for f in step["findings"]]
    assert (found["check"], found["location"]["field"]) == ("capture-batch-size", "graph.padded_seq_lens[2]")


def test_an_end_past_the_buffer_counts_even_when_the_offsets_come_back_down() -> None:
    # kv_indptr [0, 30, 14, 26]: request 0 reads indices 0..29 of a 26-element buffer, though the
    # last entry fits; indptr-decreases names the decrease, capture-kv-indices the overrun.
    trace = decode()
    tensors = dict(trace.plan.tensors, kv_indptr=trace.plan.tensors["kv_indptr"].clone())
    tensors["kv_indptr"][1] = 30
    found = {f.check: f for f in check_trace(replace(trace, plan=Plan(trace.plan.backend, tensors, trace.plan.scalars)))}
    assert "indptr-decreases" in found
    overrun = found["capture-kv-indices"]
    assert (overrun.location.field, overrun.location.request, overrun.data["found"]) == ("plan.kv_indptr[1]", 0, 30)
