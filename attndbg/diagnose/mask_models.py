"""Mistakes of a verify step's mask: the tree mask ignored (causal by token index), and a sliding
window applied by KV index instead of by the draft tokens' tree depth.

Ground truth (trace/visibility.py): draft token r of a request sees its prefix, the root, itself
and its ancestors; a window measures distances by rope position, prefix + depth. Both mistakes
index draft token r as column prefix + r.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates
from attndbg.trace import tree
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility


def _chain(trace: Trace, b: int) -> bool:
    """Whether request b's draft tree is a chain (then every index-based rule equals the tree's)."""
    depths = tree.depths(trace.spec.parents[b])
    return bool(torch.equal(depths, torch.arange(depths.numel())))


class MaskIgnored(MistakeModel):
    """A verify step whose kernel ran causally by token index: the custom tree mask ignored (a plan
    without it, or a kernel that drops it), so draft token r sees drafts 0..r, siblings included."""

    name = "mask-ignored"
    cause = (
        "The verify kernel ignored the custom tree mask and attended causally by token index, so draft tokens saw "
        "their siblings' and cousins' keys (a plan built without custom_mask, or a kernel path that drops it)."
    )

    def applies(self, trace: Trace) -> bool:
        return trace.is_tree_verify

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        branched = [b for b in requests if not _chain(trace, b)]
        if not branched:
            return
        n = trace.spec.draft_token_num
        # A chain tree's visibility is causal by index, and its depths put draft r at prefix + r.
        chain = torch.arange(-1, n - 1).expand(trace.batch.batch_size, n).clone()
        output = states.under("chain", replace(trace, spec=replace(trace.spec, parents=chain)))
        for b in branched:
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary="verify attention run causally by token index, the custom tree mask ignored",
                detail=f"request {b}, {n} draft tokens",
                params={},
            )


class WindowWithoutDraftOffset(MistakeModel):
    """A verify step with a sliding window applied by KV index: draft token r taken at column prefix
    + r instead of rope position prefix + depth(r), so it loses the oldest prefix keys its window
    still holds. The tree mask itself is kept: the keys are the true visibility cut to columns
    >= prefix + r - window, one partial state per draft index."""

    name = "window-without-draft-offset"
    cause = (
        "The sliding window was applied by KV index (draft token i at column prefix + i) instead of by position "
        "(prefix + its tree depth), so draft tokens deeper in the list than in the tree lost keys inside their window."
    )

    def applies(self, trace: Trace) -> bool:
        return trace.is_tree_verify and trace.model.sliding_window >= 0

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        batch, window, n = trace.batch, trace.model.sliding_window, trace.spec.draft_token_num
        cut = {b: [max(0, int(batch.prefix_lens[b]) + r - window) for r in range(n)] for b in requests if not _chain(trace, b)}
        # Only requests where some draft token's index window starts past its position window differ.
        cut = {b: starts for b, starts in cut.items() if _loses_keys(trace, b, starts)}
        if not cut:
            return
        got = states.of((b, start, int(batch.kv_lens[b])) for b, starts in cut.items() for start in starts)
        for b, starts in cut.items():
            kv = int(batch.kv_lens[b])
            output = torch.stack([got[(b, start, kv)][0][r] for r, start in enumerate(starts)])
            yield Candidate(
                request=b,
                output=output,
                summary="verify attention with the sliding window applied by KV index, without the draft tokens' tree-depth offset",
                detail=f"request {b}, window {window}, prefix {int(batch.prefix_lens[b])}",
                params={"window": window},
            )


def _loses_keys(trace: Trace, b: int, starts: list[int]) -> bool:
    """Whether cutting request b's draft row r to columns >= starts[r] hides a key it sees."""
    visible = visibility(trace, b)
    cols = torch.arange(visible.shape[1])
    return bool((visible & (cols[None, :] < torch.tensor(starts)[:, None])).any())
