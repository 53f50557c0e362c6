"""invariants/plan-info-*: FlashInfer's own schedule (plan.plan_info) judged against the plan's batch.

Correct schedules are made by tests/plans/flashinfer_scheduler.py from the scheduler's rules (the
library does not run on the CPU); each must stay clean, server shapes and graph-padded plans
included. A schedule left from an earlier batch, and each field broken alone, is a defect naming the
field and its first bad element."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attndbg.backends.base import Padding
from attndbg.backends.flashinfer_plan_info import FIELDS, ScheduleKind
from attndbg.detector_api.findings import Severity
from attndbg.trace.schema import PlanInfo
from tests.checks.test_invariants import build, findings, one, says, with_plan
from tests.plans.flashinfer_scheduler import scheduled

SCHEDULES = {
    "decode": dict(),
    "decode-graph": dict(graph=True),
    "tensor-core-decode": dict(tensor_cores=True),
    "tensor-core-decode-graph": dict(tensor_cores=True, graph=True),
    "decode-no-split": dict(max_grid_size=8),
}


def planned(*spec: str, padding: Padding | None = None):
    trace = with_plan(build(*spec), "flashinfer", padding)
    assert trace is not None
    return trace


def schedule_findings(trace):
    return [(f.check, f.evidence) for f in findings(trace) if f.check.startswith("plan-info")]


@pytest.mark.parametrize("options", SCHEDULES.values(), ids=SCHEDULES)
@pytest.mark.parametrize("spec", ["decode-paged", "decode-gqa", "window-decode", "softcap"])
def test_a_correct_decode_schedule_is_clean(spec, options) -> None:
    assert schedule_findings(scheduled(planned(spec), **options)) == []


@pytest.mark.parametrize("options", [dict(), dict(graph=True), dict(num_sm=4), dict(cta_tile_q=64), dict(cta_tile_q=128, graph=True)])
@pytest.mark.parametrize(
    "spec",
    # the last: a window shorter than the listed rows, so the prefill scheduler's window rule
    # (a request's KV counted up to window_left + cta_tile_q) changes the tile counts
    ["extend-prefix", "extend-cached", "mixed", "verify", "window", "selective", ("extend-prefix", "page_size=16"), ("window", "prefix_lens=3000,2000", "extend_lens=300,40", "window=1000")],
)
def test_a_correct_prefill_schedule_is_clean(spec, options) -> None:
    spec = (spec,) if isinstance(spec, str) else spec
    assert schedule_findings(scheduled(planned(*spec), **options)) == []


SERVER_DECODE = ("mode=decode", "heads=32:8", "page_size=16", "kv_lens=" + ",".join(str(900 + 97 * i) for i in range(50)), "capture_bs=64", "fill_value=1")


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_a_graph_padded_server_decode_is_clean_with_split_kv_on(tensor_cores) -> None:
    """Batch 64 captured (50 real requests of 900 to 5,700 tokens, 14 padded with seq_len 1), split-KV on."""
    trace = scheduled(planned(*SERVER_DECODE, padding=Padding(capture_bs=64, fill_value=1)), graph=True, tensor_cores=tensor_cores, max_grid_size=1056)
    s = trace.plan.plan_info.vector.tolist()
    assert s[-1] == 1 and s[0] > 64  # split-KV, padded past the requests
    assert schedule_findings(trace) == []


def test_a_server_verify_step_is_clean_under_a_graph() -> None:
    spec = ("mode=verify", "heads=32:8", "prefix_lens=" + ",".join(str(1200 + 131 * i) for i in range(48)), "topk=4", "steps=3", "draft_tokens=8", "capture_bs=64", "fill_value=1")
    trace = scheduled(planned(*spec, padding=Padding(capture_bs=64, fill_value=1)), graph=True, cta_tile_q=64)
    assert schedule_findings(trace) == []


# -- a plan left from an earlier batch ---------------------------------------------------------------


def test_a_decode_schedule_left_from_an_earlier_batch_is_a_defect() -> None:
    """The engine refilled kv_indptr for this step's longer requests but the schedule is the last
    plan()'s: request 3 grew from 260 to 2,600 tokens and keeps its 3 tiles of 128."""
    now = planned("decode-paged", "kv_lens=5,16,33,2600")
    earlier = planned("decode-paged")
    found = one(scheduled(now, for_plan=earlier.plan, max_grid_size=10000), "plan-info-kv-tiles")
    assert found.severity is Severity.DEFECT and found.location.request == 3
    assert found.location.field == "plan.plan_info.kv_tile_indices"
    says(found, "2600", "21 tiles", "128-token")
    # the twin: planned for this batch
    assert schedule_findings(scheduled(now, max_grid_size=10000)) == []


def test_a_schedule_for_a_larger_earlier_batch_reads_a_request_past_the_plan() -> None:
    now = planned("decode-paged", "kv_lens=5,16,33")
    earlier = planned("decode-paged")  # four requests
    found = one(scheduled(now, for_plan=earlier.plan), "plan-info-request-index")
    assert found.location.field == "plan.plan_info.request_indices[3]"
    says(found, "= 3", "3 requests")
    assert "earlier batch" in found.cause and "#4002" not in found.cause


def test_a_prefill_schedule_left_from_an_earlier_batch_names_its_offsets() -> None:
    now = planned("extend-prefix", "extend_lens=37,9,64")
    earlier = planned("extend-prefix")  # request 1 had 5 new tokens
    checks = {c for c, _ in schedule_findings(scheduled(now, for_plan=earlier.plan, graph=True, cta_tile_q=16))}
    assert {"plan-info-o-indptr", "plan-info-merge-indptr", "plan-info-total-rows"} <= checks
    assert schedule_findings(scheduled(now, graph=True, cta_tile_q=16)) == []


def test_a_prefill_schedule_short_of_a_requests_qo_tiles_is_a_defect() -> None:
    now = planned("extend-prefix", "extend_lens=37,5,64")
    earlier = planned("extend-prefix", "extend_lens=37,5,10")
    found = one(scheduled(now, for_plan=earlier.plan, cta_tile_q=64, graph=True), "plan-info-qo-tiles")
    assert found.location.request == 2
    says(found, "64 query rows")


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_an_eager_prefill_schedule_is_read_but_not_judged(tensor_cores) -> None:
    """On the H100, correct eager prefill-kind schedules of FlashInfer 0.7.2.post1 (paged prefill,
    tensor-core decode) read as missing their query tiles: until our reading matches that layout,
    such a schedule is shown, not judged, even when it is stale. Graph-planned ones are judged."""
    from attndbg.plans.reading import read

    if tensor_cores:
        now, earlier = planned("decode-paged", "kv_lens=5,16,33,2600"), planned("decode-paged")
        options = dict(tensor_cores=True, max_grid_size=10000)
    else:
        now, earlier = planned("extend-prefix", "extend_lens=37,5,64"), planned("extend-prefix", "extend_lens=37,5,10")
        options = dict(cta_tile_q=64)
    stale = scheduled(now, for_plan=earlier.plan, **options)
    assert read(stale).schedule.schedule.kind is ScheduleKind.PREFILL and not read(stale).schedule.schedule.graph
    assert schedule_findings(stale) == []
    assert schedule_findings(scheduled(now, for_plan=earlier.plan, graph=True, **options)) != []


# -- a CUDA-graph plan without split-KV (SGLang's deterministic inference: FlashInfer #4002) -----------


def no_split_graph(trace, *, graph_mask: bool, **options):
    """`trace` scheduled as tensor-core decode under a graph with split-KV off: one work item a
    request, the grid padded to the split-KV bound (66 here: 132 SMs x 2 over 4 KV heads), the pinned
    workspace past the items an earlier 16-request plan's. graph_mask: flashinfer#5176's layout (a
    block_valid_mask without split-KV); without it FlashInfer 0.7.2.post1's (no mask)."""
    kept = dict(tensor_cores=True, graph=True, disable_split_kv=True, graph_mask=graph_mask)
    earlier = scheduled(planned("decode-paged", "kv_lens=" + ",".join(["100"] * 16)), **kept)
    return scheduled(trace, previous=bytes(earlier.plan.plan_info.workspace.numpy()), **kept, **options)


def test_a_graph_plan_without_split_kv_is_judged_with_its_mask() -> None:
    """flashinfer#5176: the mask switches the padded blocks off, so the earlier plan's entries past
    the work items are never read: clean, as the kernel runs it."""
    trace = no_split_graph(planned("decode-paged"), graph_mask=True)
    s = read_schedule(trace)
    items = len(s.arrays["request_indices"]) - int((~s.arrays["block_valid_mask"]).sum())
    assert not s.split_kv and s.graph and s.padded_batch_size > items == 4
    assert s.arrays["request_indices"][items : items + 2].tolist() == [4, 5]  # the earlier plan's, past the batch
    assert schedule_findings(trace) == []


def test_the_same_plan_without_a_mask_runs_the_padded_blocks_over_entries_plan_never_wrote() -> None:
    """FlashInfer 0.7.2.post1: no mask, every padded block runs; the first reads request 4 of a
    4-request plan, and the cause names the padded grid, not a plan left from an earlier batch."""
    trace = no_split_graph(planned("decode-paged"), graph_mask=False)
    assert "block_valid_mask" not in read_schedule(trace).arrays
    found = one(trace, "plan-info-request-index")
    assert found.severity is Severity.DEFECT and found.location.field == "plan.plan_info.request_indices[4]"
    assert "pads the grid" in found.cause and "block_valid_mask" in found.cause and "#4002" in found.cause


def test_a_bad_entry_before_the_work_items_of_an_unmasked_graph_plan_is_named_stale() -> None:
    """The same layout planned for an earlier batch (request 0 then had 16 query tiles of 16 packed
    rows, now 3): the bad entry is among the 21 items the batch needs, not padding, so the cause is
    the stale plan."""
    now = planned("extend-prefix", "extend_lens=10,5,64")
    earlier = planned("extend-prefix", "extend_lens=64,5,10")
    found = one(no_split_graph(now, graph_mask=False, for_plan=earlier.plan, cta_tile_q=16), "plan-info-qo-tiles")
    assert found.location.field == "plan.plan_info.qo_tile_indices[3]"
    assert "earlier batch" in found.cause and "#4002" not in found.cause


@pytest.mark.parametrize(("index", "value", "expected"), [(2, 0, True), (4, 1, False)])
def test_a_wrong_mask_of_a_graph_plan_without_split_kv_is_a_defect(index, value, expected) -> None:
    trace = no_split_graph(planned("decode-paged"), graph_mask=True)
    found = one(_edit(trace, ScheduleKind.PREFILL, byte=("block_valid_mask_offset", index, value)), "plan-info-valid-mask")
    assert found.location.field == f"plan.plan_info.block_valid_mask[{index}]"
    assert found.data["expected"] is expected and found.severity is Severity.DEFECT


def read_schedule(trace):
    from attndbg.plans.reading import read

    return read(trace).schedule.schedule


# -- each field broken alone ---------------------------------------------------------------------------


def _edit(trace, kind: ScheduleKind, *, vector: dict[str, int] | None = None, byte: tuple[str, int, int] | None = None):
    info = trace.plan.plan_info
    values, workspace = info.vector.clone(), info.workspace.clone()
    names = FIELDS[kind]
    for name, value in (vector or {}).items():
        values[names.index(name)] = value
    if byte is not None:
        offset_field, index, value = byte
        workspace[int(values[names.index(offset_field)]) + index] = value
    return dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, plan_info=PlanInfo(vector=values, workspace=workspace)))


def test_a_padded_batch_size_short_of_the_work_items_is_a_defect() -> None:
    trace = _edit(scheduled(planned("decode-paged")), ScheduleKind.DECODE, vector={"padded_batch_size": 4})
    found = one(trace, "plan-info-padded-batch-size")
    says(found, "padded_batch_size = 4", "6 work items")


@pytest.mark.parametrize(("index", "value", "expected"), [(3, 0, True), (0, 1, False)])
def test_block_valid_mask_must_be_false_exactly_on_the_padding(index, value, expected) -> None:
    trace = scheduled(planned(*SERVER_DECODE, padding=Padding(capture_bs=64, fill_value=1)), graph=True, max_grid_size=1056)
    items = int(read_mask(trace).sum())
    index = index if expected else items + index
    edited = _edit(trace, ScheduleKind.DECODE, byte=("block_valid_mask_offset", index, value))
    found = one(edited, "plan-info-valid-mask")
    assert found.location.field == f"plan.plan_info.block_valid_mask[{index}]"
    assert found.data["expected"] is expected and found.severity is Severity.DEFECT
    # the padding item made valid holds what the pinned buffer held before: no request of the batch
    assert expected or one(edited, "plan-info-request-index").location.field == f"plan.plan_info.request_indices[{index}]"


def test_a_valid_padding_item_that_repeats_a_listed_tile_is_a_hazard() -> None:
    """The block recomputes request 0's tile 0: the output stays right, the finding says when not."""
    trace = scheduled(planned(*SERVER_DECODE, padding=Padding(capture_bs=64, fill_value=1)), graph=True, max_grid_size=1056)
    items = int(read_mask(trace).sum())
    trace = _edit(trace, ScheduleKind.DECODE, byte=("block_valid_mask_offset", items, 1))
    for offset_field in ("request_indices_offset", "kv_tile_indices_offset"):
        for b in range(4):
            trace = _edit(trace, ScheduleKind.DECODE, byte=(offset_field, 4 * items + b, 0))
    found = {f.check: f for f in findings(trace) if f.check.startswith("plan-info")}
    assert set(found) == {"plan-info-valid-mask", "plan-info-repeated-item"}
    assert all(f.severity is Severity.HAZARD for f in found.values())
    assert found["plan-info-repeated-item"].location.field == f"plan.plan_info.kv_tile_indices[{items}]"


def read_mask(trace):
    from attndbg.plans.reading import read

    return read(trace).schedule.schedule.arrays["block_valid_mask"]


def test_a_zero_chunk_size_under_split_kv_is_a_defect() -> None:
    trace = scheduled(planned("decode-paged"))
    for i in range(4):
        trace = _edit(trace, ScheduleKind.DECODE, byte=("kv_chunk_size_ptr_offset", i, 0))
    assert one(trace, "plan-info-chunk-size").location.field == "plan.plan_info.kv_chunk_size[0]"


def test_a_decode_o_indptr_of_another_split_is_a_defect() -> None:
    trace = _edit(scheduled(planned("decode-paged")), ScheduleKind.DECODE, byte=("o_indptr_offset", 4 * 4, 5))
    found = one(trace, "plan-info-o-indptr")
    assert found.location.field == "plan.plan_info.o_indptr[4]"
    says(found, "= 5", "expected 6")


def test_graph_rows_the_merge_reads_must_be_the_plans() -> None:
    trace = scheduled(planned("extend-prefix"), graph=True)
    rows = int(trace.plan.tensors["qo_indptr"][-1])
    found = one(_edit(trace, ScheduleKind.PREFILL, byte=("total_num_rows_offset", 0, (rows + 3) % 256)), "plan-info-total-rows")
    assert found.location.field == "plan.plan_info.total_num_rows_host[0]"
    assert torch.tensor(found.data["expected"]) == rows


def test_a_hostile_qo_indptr_is_judged_without_enumerating_its_claim() -> None:
    """qo_indptr claiming 2^40 rows for request 1: the schedule's work items are walked, never the
    tiles such a claim would need (that would not end), and the mismatch is named."""
    trace = scheduled(planned("extend-prefix"), graph=True)
    qo = trace.plan.tensors["qo_indptr"].to(torch.int64).clone()
    qo[2:] += 1 << 40
    trace = dataclasses.replace(trace, plan=dataclasses.replace(trace.plan, tensors={**trace.plan.tensors, "qo_indptr": qo}))
    checks = {c for c, _ in schedule_findings(trace)}
    assert {"plan-info-qo-tiles", "plan-info-total-rows"} <= checks
