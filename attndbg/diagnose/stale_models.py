"""Mistakes of plan state left from an earlier batch: a kernel that applied what its plan still held
from an earlier plan instead of what this step planned.

    stale plan mask   a causal step whose kernel applied the custom mask its plan kept from an
                      earlier (verify) plan, at that plan's offsets (FlashInfer #1028)

Plans that name another batch's KV slots are recorded-plan-kv's (kv_models), a graph that never
read this step's metadata is plan-from-capture's; an output left from an earlier launch, which
depends on none of this step's inputs, is judged across steps (stale_output.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from attndbg.backends.plan_layout import PackedMask
from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates
from attndbg.trace.schema import ForwardMode, Trace


class StalePlanMask(MistakeModel):
    """A step without a tree (extend, mixed, decode) whose kernel applied the custom mask its recorded
    plan holds: a wrapper planned with a mask (a verify) and planned again without one kept it
    (FlashInfer #1028, fixed by clearing the mask buffers in plan()). The kernel reads request b's
    q_len x kv_len block from the mask's offset for b, row-major (FlashInfer's custom mask: the
    block replaces the causal mask), whatever step the mask and its offsets were written for."""

    name = "stale-plan-mask"
    cause = (
        "The kernel applied a custom mask its plan kept from an earlier plan (a wrapper planned with a verify "
        "step's tree mask and re-planned causal without one kept the mask buffers, FlashInfer #1028), so this "
        "step's queries saw the keys a stale mask allowed instead of the causal ones."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        return trace.plan is not None and not trace.is_tree_verify and not batch.selective and batch.forward_mode is not ForwardMode.IDLE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        blocks = self._blocks(states, requests)
        if not blocks:
            return

        def seen(b: int, rows: slice) -> Tensor:
            return blocks[b][rows] if b in blocks else causal(trace, b)[rows]

        output = states.under("stale-plan-mask", trace, visible=seen)
        for b, block in blocks.items():
            differ = int((block != causal(trace, b)).sum())
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary="attention with a stale custom mask its plan kept from an earlier plan, on a step without a tree",
                detail=f"request {b}, [{block.shape[0]}, {block.shape[1]}] block, {differ} entries differ from causal",
                params={"entries_differ": differ},
            )

    def _blocks(self, states: PartialStates, requests: list[int]) -> dict[int, Tensor]:
        """Request -> [q_len, kv_len] the mask the kernel applied, for the requests whose block the
        plan's mask holds and which differs from causal."""
        trace, reading = states.trace, states.plan
        mask = _kept_mask(trace, reading.layout.packed_mask if reading.layout is not None else None)
        if mask is None:
            return {}
        bits, starts = mask
        batch = trace.batch
        coverage = reading.coverage
        blocks = {}
        for b in requests:
            q, kv = int(batch.extend_lens[b]), int(batch.kv_lens[b])
            # The plan reads the request's row from column 0: all of it, or its prefix with the new
            # tokens' K/V passed apart (Triton's extend); any other span is recorded-plan-kv's case.
            own_row = coverage is not None and coverage[b] in ((0, kv), (0, int(batch.prefix_lens[b])))
            if b >= starts.numel() or not own_row or q == 0:
                continue
            start = int(starts[b])
            if start < 0 or start + q * kv > bits.numel():
                continue  # past the mask's buffer: the kernel read other memory
            block = bits[start : start + q * kv].view(q, kv)
            if not torch.equal(block, causal(trace, b)):
                blocks[b] = block
        return blocks


def causal(trace: Trace, b: int) -> Tensor:
    """[q_len, kv_len] the causal mask of request b, its queries at the end of its row."""
    batch = trace.batch
    qo = batch.qo_indptr
    cols = batch.query_cols[int(qo[b]) : int(qo[b + 1])]
    return torch.arange(int(batch.kv_lens[b]))[None, :] <= cols[:, None]


def _kept_mask(trace: Trace, packed: PackedMask | None) -> tuple[Tensor, Tensor] | None:
    """The custom mask the plan holds, as bools, and each request's first element in it: a bool
    `custom_mask` at `mask_indptr`'s element offsets, or a packed one (`packed`, FlashInfer's
    plan(): little-endian bytes) at its byte offsets; None when the plan holds none."""
    tensors = trace.plan.tensors
    if packed is not None and packed.tensor in tensors and packed.indptr in tensors:
        data = tensors[packed.tensor].to(torch.int64)
        bits = ((data[:, None] >> torch.arange(8)) & 1).flatten().to(torch.bool)
        return bits, tensors[packed.indptr].to(torch.int64) * 8
    if "custom_mask" in tensors and "mask_indptr" in tensors:
        return tensors["custom_mask"].flatten().to(torch.bool), tensors["mask_indptr"].to(torch.int64)
    return None
