"""A sub-batch of a step (attndbg/trace/subbatch.py) is the chosen requests as the engine would have
batched them alone: a valid trace of their own, reading the same KV slots, with their rows, draft
trees and tree-mask blocks; run on the step's data (StepData.sub_batch) its float64 reference is
the step's reference of those rows, computed anew from the sub-batch alone."""

from __future__ import annotations

import pytest
import torch

from attndbg.backends import reference
from attndbg.replay.step_data import StepData
from attndbg.trace import io
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import to_dict
from attndbg.trace.subbatch import sub_batch
from attndbg.trace.validate import from_dict
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=16")
STEPS = {
    "mixed": ("mixed", *SMALL, "prefix_lens=9,0,30,4", "extend_lens=6,5,1,1"),
    "verify-full": ("verify", *SMALL, "prefix_lens=7,12,3", "mask_layout=full"),
    "verify-bitpacked": ("verify", *SMALL, "prefix_lens=7,12,3", "mask_layout=qlen_only_bitpacked"),
    "selective": ("selective", *SMALL, "kv_lens=20,31", "select=3"),
    "graph-decode": ("decode-paged", *SMALL, "kv_lens=5,16,33", "capture_bs=4"),
}


def valid(trace):
    """The trace as validation sees it, after a round trip through the storage form."""
    return from_dict(to_dict(trace))


@pytest.mark.parametrize("name", list(STEPS))
def test_a_sub_batch_keeps_its_requests_and_is_a_valid_step(name: str) -> None:
    trace = make_trace(*STEPS[name], plan=True)
    batch = trace.batch
    chosen = (2, 0) if batch.batch_size > 2 else (1,)
    part = sub_batch(trace, chosen)
    sub = valid(part.trace).batch
    qo = batch.qo_indptr
    assert part.requests == chosen
    assert part.rows.tolist() == [t for b in chosen for t in range(int(qo[b]), int(qo[b + 1]))]
    for k, b in enumerate(chosen):
        assert torch.equal(sub.request_slots(k), batch.request_slots(b))  # the same KV slots
        for field in ("prefix_lens", "extend_lens", "kv_lens", "seq_lens_raw"):
            assert int(getattr(sub, field)[k]) == int(getattr(batch, field)[b]), field
    for field in ("query_cols", "out_cache_loc", "positions"):
        assert torch.equal(getattr(sub, field), getattr(batch, field)[part.rows]), field
    assert (sub.kv_cache_size, sub.forward_mode, sub.selective) == (batch.kv_cache_size, batch.forward_mode, batch.selective)
    # The whole batch's plan and graph padding are not the sub-batch's: a backend derives its own.
    assert part.trace.plan is None and part.trace.graph is None and part.trace.buffers == {}


@pytest.mark.parametrize("name", ["verify-full", "verify-bitpacked"])
def test_a_sub_batch_carries_its_requests_trees_and_mask_blocks(name: str) -> None:
    trace = make_trace(*STEPS[name])
    part = sub_batch(trace, (2, 1))
    spec = valid(part.trace).spec
    assert torch.equal(spec.parents, trace.spec.parents[[2, 1]])
    whole = MaskGeometry.of_spec(trace.spec, trace.batch.prefix_lens)
    mine = MaskGeometry.of_spec(spec, part.trace.batch.prefix_lens)
    assert spec.custom_mask.numel() == mine.length
    for k, b in enumerate((2, 1)):
        assert torch.equal(mine.visible(spec.custom_mask, k), whole.visible(trace.spec.custom_mask, b))


def test_a_mask_that_does_not_fit_the_whole_batch_is_left_out() -> None:
    """A recorded mask of the wrong length is evidence for tree-mask; no block of it is one request's."""
    from dataclasses import replace

    trace = make_trace(*STEPS["verify-full"])
    short = replace(trace, spec=replace(trace.spec, custom_mask=trace.spec.custom_mask[:-3]))
    assert sub_batch(short, (0,)).trace.spec.custom_mask is None


def test_recorded_layer_tensors_keep_the_sub_batchs_rows() -> None:
    trace = io.load("traces/transformers_step.pt")
    part = sub_batch(trace, (2,))
    whole, mine = trace.tensors[0], valid(part.trace).tensors[0]
    for field in ("q", "k_new", "v_new", "output", "lse"):
        if getattr(whole, field) is None:  # not recorded (this engine gives no LSE)
            assert getattr(mine, field) is None, field
        else:
            assert torch.equal(getattr(mine, field), getattr(whole, field)[part.rows]), field
    assert whole.output is not None
    assert torch.equal(mine.kv_slots, whole.kv_slots) and torch.equal(mine.k_rows, whole.k_rows)  # the pool's contents


@pytest.mark.parametrize("name", ["mixed", "verify-bitpacked", "selective"])
def test_the_sub_batchs_reference_is_the_steps_reference_of_its_rows(name: str) -> None:
    """StepData.sub_batch hands a sub-batch the step's reference rows: they must be what the float64
    reference computes from the sub-batch alone, on the same inputs (same keys at the same slots)."""
    trace = make_trace(*STEPS[name])
    data = StepData(trace, device="cpu")
    bs = trace.batch.batch_size
    part = sub_batch(trace, (3, 0, 2) if bs == 4 else (bs - 1, 0))
    mine = data.sub_batch(part)
    alone = reference.attention(part.trace, mine.inputs, torch.float64)
    assert torch.equal(mine.inputs.q, data.inputs.q[part.rows]) and mine.inputs.k_cache is data.inputs.k_cache
    assert torch.allclose(alone.output, mine.reference.output, rtol=0, atol=1e-12)
    assert torch.allclose(alone.lse, mine.reference.lse, rtol=0, atol=1e-12)
    assert torch.equal(mine.output_tolerance(), data.output_tolerance()[part.rows])


@pytest.mark.parametrize("requests", [(), (0, 0), (3,), (-1,)])
def test_a_sub_batch_is_distinct_requests_of_the_batch(requests: tuple[int, ...]) -> None:
    trace = make_trace(*STEPS["verify-full"])
    with pytest.raises(ValueError, match="distinct requests of the batch of 3"):
        sub_batch(trace, requests)
