"""tree-mask: speculative-verify masks against the draft tree, and verify outputs against the reference.

Ground truth is the draft tree (`spec.parents`) with the batch's lengths: draft token r of a
request sees its whole prefix, the root, itself and its ancestors; with a sliding window, only keys
whose position is within the window of its own (a draft token sits at prefix + its tree depth).

Checks on the engine's recorded `spec.custom_mask`, in its layout:

    mask-layout         dtype or values that cannot be the tagged layout (a packed mask tagged bool)
    mask-length         not Σ n·(prefix+n) (full), Σ n·n (qlen_only) or bs·n words (bit-packed)
    mask-bit-order      every bit-packed word is the expected one with its bits reversed (big-endian)
    mask-prefix-hidden  a FULL mask hides prefix columns (they are all True in SGLang's FULL layout)
    mask-mismatch       the first wrong request / row / column, what it should be, and how many

The spec's FULL mask is SGLang's spec_info mask: the tree only, prefix columns True. SGLang builds
one mask for every layer, so it cannot fold a sliding window in; a mask with the window folded in
exactly (prefix columns older than the window False) is accepted too.

Checks on the recorded plan, judged by what its kernel will see (FULL-layout bool masks of the
triton and flashinfer vocabularies, fa3's two-call expand tables, fa3's per-draft-token tables of
a sliding-window layer, or plain causal plans):

    mask-indptr         mask_indptr[b+1] - mask_indptr[b] != n·(prefix_b+n) (flashinfer: n·covered KV)
    mask-length         custom_mask shorter or longer than mask_indptr[-1], or packed bytes shorter than
                        their blocks (FlashInfer #3176): the request and first element read past
                        it; where the library lays the blocks out itself (FlashInfer's plan()), a
                        mask of another length is read where it was not written and is not
                        compared with the draft tree
    mask-prefix-hidden, mask-mismatch   as above, for the mask the kernel reads (Triton skips the
                        prefix columns: skip_prefix_custom_mask, SGLang's default)
    window-ignored      the kernel's window is off (window_left / sliding_window = -1), so the mask
                        must fold the window in, and it shows prefix columns older than the window
    window-offset       the window is applied by KV index (query i at prefix + i, not prefix + depth)
                        and hides columns inside the window; or Triton's `window_kv_offsets` do not
                        match the prefix columns the plan dropped
    window-cascade      a sliding-window layer ran fa3's two-call cascade with its window: the prefix
                        call aligns every draft row's window to the prefix's last keys, not to the
                        draft token's position (sglang#9658: these layers need swa_spec_metadata)
    plan-mask-missing   the plan runs verify causally by index, and the tree is not a chain

A correct engine with a sliding window either folds the window into the plan's mask by position
and turns the kernel's window off (what attndbg's FlashInfer plan does), or passes only the
window's KV plus `window_kv_offsets` (SGLang's Triton SWA path) where the draft tree is a chain.

    stale-mask          a non-verify step that needs no mask (not selective, cross or masked) whose plan still carries a custom_mask
                        (FlashInfer #1028); across a recording, a verify step whose mask equals the
                        previous verify step's although the trees differ
    verify-output       rows of a verify step that fail against the reference with plans derived
                        from the tree (the kernel mis-applies a correct mask)
    recorded-verify-output  rows that fail with the recorded plan, with the mask columns that
                        differ from the true mask at those rows (a plan whose mask_indptr is wrong
                        or whose mask is shorter than it is not launched: the kernel would read
                        past the buffer)

Locations: `row` is the step's query row (token index), `column` the column of the request's KV
row (prefix columns first, draft token j at prefix + j), whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.tree_mask.base import KIND
from attndbg.detectors.tree_mask.outputs import _output_findings
from attndbg.detectors.tree_mask.spec import _check_spec
from attndbg.detectors.tree_mask.recorded import recorded_plan_findings
from attndbg.plans.reading import PlanReading, read
from attndbg.trace.schema import Trace


def detect(ctx: CheckContext) -> list[Finding]:
    findings = mask_findings(ctx.trace, ctx.plan())
    if ctx.trace.is_tree_verify:
        findings += _output_findings(ctx, run_recorded=not _reads_past_mask(findings))
    return findings


def _reads_past_mask(findings: list[Finding]) -> bool:
    """A recorded plan whose mask offsets point past its buffer is not launched: the kernel would
    read outside the allocation (FlashInfer #3176 read past it silently; it may also fault)."""
    for f in findings:
        if not (f.location.field or "").startswith("plan."):
            continue
        if f.check == "mask-indptr" or (f.check == "mask-length" and f.data.get("found", 0) < f.data.get("expected", 0)):
            return True
    return False


def mask_findings(trace: Trace, reading: PlanReading | None = None) -> list[Finding]:
    """Every mask check of one step that needs no kernel (pure); `reading`: the step's plan
    reading (default: read here)."""
    out: list[Finding] = []
    if not trace.is_tree_verify:
        _check_stale_plan(trace, out)
        return out
    _check_spec(trace, out)
    reading = reading if reading is not None else read(trace)
    if trace.plan is not None and _flat_vectors(reading):
        out += recorded_plan_findings(reading)  # (a plan field of the wrong rank is the invariants detector's plan-shape)
    return out


# Verify-step fields every mask-carrying layout reads flat, beside the layout's own index vectors.
_MASK_VECTORS = ("custom_mask", "mask_indptr", "qo_indptr")


def _flat_vectors(reading: PlanReading) -> bool:
    layout = reading.layout
    names = _MASK_VECTORS + (layout.vectors() if layout is not None and layout.csr else ())
    return all(t.dim() == 1 for name, t in reading.plan.tensors.items() if name in names)


@dataclass(frozen=True)
class VerifyDigest:
    """What stale-mask keeps of a verify step: its tree and both masks (small, picklable)."""

    tp_rank: int
    step: int
    path: str
    parents: Tensor
    prefix_lens: Tensor
    masks: dict[str, Tensor]  # "spec.custom_mask" / "plan.custom_mask" -> the mask as recorded


def recording_digest(ctx: CheckContext) -> VerifyDigest | None:
    trace = ctx.trace
    if not trace.is_tree_verify:
        return None
    masks = {"spec.custom_mask": trace.spec.custom_mask}
    plan_mask = _plan_mask(trace)
    if plan_mask is not None:
        masks["plan.custom_mask"] = plan_mask
    return VerifyDigest(trace.source.tp_rank, ctx.step, ctx.path, trace.spec.parents, trace.batch.prefix_lens, masks)


class RecordingState:
    """stale-mask over a recording, one step at a time: only the previous verify step per TP rank is kept."""

    def __init__(self) -> None:
        self.previous: dict[int, VerifyDigest] = {}

    def observe(self, now: VerifyDigest | None) -> list[Finding]:
        if now is None:
            return []
        prev = self.previous.get(now.tp_rank)
        self.previous[now.tp_rank] = now
        if prev is None or _same_tree(now, prev):
            return []
        out = []
        for field, mask in now.masks.items():
            before = prev.masks.get(field)
            if before is None or mask.numel() == 0 or mask.dtype != before.dtype or mask.shape != before.shape:
                continue
            if not torch.equal(mask, before):
                continue
            out.append(
                finding(
                    KIND,
                    "stale-mask",
                    step=now.step,
                    field=field,
                    evidence=f"{field} of step {now.step} equals step {prev.step}'s ({mask.numel()} elements), but the draft trees (or prefix lengths) of the two steps differ",
                    cause="the engine reused the previous verify step's mask buffer without rebuilding it for this step's tree",
                    trace=now.path,
                    previous_step=prev.step,
                )
            )
        return out


def detect_recording(contexts: list[CheckContext]) -> list[Finding]:
    """stale-mask: a verify step's mask identical to the previous verify step's while the trees differ."""
    state = RecordingState()
    ordered = sorted(contexts, key=lambda c: (c.trace.source.tp_rank, c.step))
    return [f for ctx in ordered for f in state.observe(recording_digest(ctx))]


def _same_tree(a: VerifyDigest, b: VerifyDigest) -> bool:
    return a.parents.shape == b.parents.shape and torch.equal(a.parents, b.parents) and torch.equal(a.prefix_lens, b.prefix_lens)


def _plan_mask(trace: Trace) -> Tensor | None:
    return trace.plan.tensors.get("custom_mask") if trace.plan is not None else None


# -- stale masks on non-verify steps ---------------------------------------------------------------------------


def _check_stale_plan(trace: Trace, out: list[Finding]) -> None:
    plan = trace.plan
    batch = trace.batch
    if plan is None or batch.selective or batch.cross or batch.custom_mask is not None:
        return  # selective recompute, cross-attention and a step with its own mask legitimately run a custom mask
    mask = plan.tensors.get("custom_mask")
    if mask is None or mask.numel() == 0:
        return
    extra = " and mask_indptr" if "mask_indptr" in plan.tensors else ""
    out.append(
        finding(
            KIND,
            "stale-mask",
            step=trace.source.step,
            field="plan.custom_mask",
            evidence=f"this {trace.batch.forward_mode.value} step has no draft tree, but its {plan.backend} plan carries a custom_mask of {mask.numel()} elements{extra}",
            cause="a wrapper planned with a custom mask for a verify step kept it when re-planned for causal attention (FlashInfer #1028): the kernel applies the old tree mask",
            elements=mask.numel(),
        )
    )
