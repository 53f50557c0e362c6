"""Mistakes of a verify step's mask: the tree mask ignored (causal by token index), read transposed,
read in the other bit order, or ignored past the key tile where the draft tokens start; the
recorded plan's own (wrong) mask applied; and a sliding window applied by KV index instead of by
the draft tokens' tree depth.

Ground truth (trace/visibility.py): draft token r of a request sees its prefix, the root, itself
and its ancestors; a window measures distances by rope position, prefix + depth. Both mistakes
index draft token r as column prefix + r.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, plan_kv, plan_slots, spans, with_rows
from attndbg.trace import tree
from attndbg.trace.mask_geometry import word_bits, word_dtype
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
        output = states.under("chain", replace(trace, spec=replace(trace.spec, parents=tree.chain_parents(n, trace.batch.batch_size))))
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


def _tree_rows(trace: Trace, b: int) -> Tensor:
    """[n, prefix + n] bool: the mask request b's verify kernel should apply (prefix columns visible,
    then the ancestor matrix), before the window."""
    prefix, n = int(trace.batch.prefix_lens[b]), trace.spec.draft_token_num
    full = torch.ones(n, prefix + n, dtype=torch.bool)
    full[:, prefix:] = tree.ancestor_matrix(trace.spec.parents[b])
    return full


class _WrongTreeMask(MistakeModel):
    """A verify step whose kernel applied a wrong version of the right mask: each request's [n,
    prefix + n] mask a `variants` rule makes of the true one, the window still by rope position.
    Only requests whose wrong mask hides or shows a key the truth does not are candidates."""

    def applies(self, trace: Trace) -> bool:
        return trace.is_tree_verify

    def variants(self, trace: Trace, b: int) -> Iterator[tuple[Tensor, str, str, dict]]:
        """(wrong [n, prefix + n] mask, summary, detail, params) per parameter choice of the mistake."""
        raise NotImplementedError

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        wrong: dict[str, dict[int, Tensor]] = {}  # summary -> request -> mask
        words: dict[tuple[str, int], tuple[str, dict]] = {}
        for b in requests:
            truth = visibility(trace, b)
            for mask, summary, detail, params in self.variants(trace, b):
                if torch.equal(visibility(trace, b, tree_mask=mask), truth):
                    continue
                wrong.setdefault(summary, {})[b] = mask
                words[(summary, b)] = (detail, params)
        for summary, masks in wrong.items():
            def seen(b: int, rows: slice, masks: dict[int, Tensor] = masks) -> Tensor:
                return visibility(trace, b, rows, tree_mask=masks.get(b, _tree_rows(trace, b)))

            output = states.under((self.name, summary), trace, visible=seen)
            for b in masks:
                detail, params = words[(summary, b)]
                yield Candidate(request=b, output=output[states.rows(b)].double(), summary=summary, detail=detail, params=params)


class MaskTransposed(_WrongTreeMask):
    """The tree mask read transposed (row and column swapped: a [q, k] mask read as [k, q]), so a
    draft token sees its descendants instead of its ancestors."""

    name = "mask-transposed"
    cause = (
        "The verify kernel read the tree mask transposed (query and key index swapped, a row-major mask read as "
        "column-major), so each draft token saw its descendants' keys instead of its ancestors'."
    )

    def variants(self, trace: Trace, b: int) -> Iterator[tuple[Tensor, str, str, dict]]:
        prefix = int(trace.batch.prefix_lens[b])
        full = _tree_rows(trace, b)
        full[:, prefix:] = full[:, prefix:].T.clone()
        yield full, "verify attention with the tree mask read transposed (each draft token saw its descendants)", f"request {b}, {trace.spec.draft_token_num} draft tokens", {}


class MaskBitOrder(_WrongTreeMask):
    """A bit-packed tree mask read in the other bit order: one word per draft row (SGLang's
    QLEN_ONLY_BITPACKED, 8/16/32-bit words by n) read big-endian, so draft token r sees column
    word_bits - 1 - c for c; or the request's whole row-major [n, prefix + n] mask packed into bytes
    (FlashInfer's packbits, little-endian) read with each byte's bits reversed."""

    name = "mask-bit-order"
    cause = (
        "The verify kernel read the bit-packed tree mask in the other bit order (big-endian where SGLang and "
        "FlashInfer pack little-endian: bit j is column j), so draft tokens saw the keys of mirrored columns."
    )

    def variants(self, trace: Trace, b: int) -> Iterator[tuple[Tensor, str, str, dict]]:
        prefix, n = int(trace.batch.prefix_lens[b]), trace.spec.draft_token_num
        truth = _tree_rows(trace, b)
        width = word_bits(word_dtype(n))
        mirrored = width - 1 - torch.arange(n)
        draft = torch.zeros(n, n, dtype=torch.bool)
        inside = mirrored < n
        draft[:, inside] = truth[:, prefix:][:, mirrored[inside]]
        words = truth.clone()
        words[:, prefix:] = draft
        yield words, "verify attention with each draft row's bit-packed mask word read big-endian", f"request {b}, {n} draft tokens in {width}-bit words", {"packing": "word", "word_bits": width}
        flat = truth.flatten()
        pad = (-flat.numel()) % 8
        padded = torch.cat([flat, torch.zeros(pad, dtype=torch.bool)]).view(-1, 8).flip(1).flatten()
        yield padded[: flat.numel()].view_as(truth), "verify attention with the request's byte-packed mask read with each byte's bits reversed", f"request {b}, [{n}, {prefix + n}] mask in bytes", {"packing": "byte"}


# Key tiles of the kernels whose custom mask stops at the diagonal tile (BLOCK_N of Triton and
# FlashAttention-style extend kernels).
CAUSAL_TILES = (16, 32, 64, 128)


class MaskIgnoredPastCausalTile(_WrongTreeMask):
    """The custom mask applied only in the key tile that holds the first draft column, and ignored
    (causal by token index) in the tiles after it: a kernel that masks the tile on the causal
    diagonal and treats later tiles as plain causal. Tiles of T columns from column 0 of the row."""

    name = "mask-ignored-past-causal-tile"
    cause = (
        "The verify kernel applied the custom tree mask only in the key tile where the draft tokens start and ran "
        "later key tiles causally by token index, so draft tokens past that tile saw their siblings' keys."
    )

    def variants(self, trace: Trace, b: int) -> Iterator[tuple[Tensor, str, str, dict]]:
        prefix, n = int(trace.batch.prefix_lens[b]), trace.spec.draft_token_num
        truth = _tree_rows(trace, b)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        by_columns: dict[int, list[int]] = {}  # first causal column -> tiles giving it
        for tile in CAUSAL_TILES:
            first = (prefix // tile + 1) * tile  # the first column of the tile after the draft tokens' first
            if first < prefix + n:
                by_columns.setdefault(first, []).append(tile)
        for first, tiles in by_columns.items():
            wrong = truth.clone()
            wrong[:, first:] = causal[:, first - prefix :]
            yield wrong, "verify attention with the custom mask ignored past the key tile where the draft tokens start (causal by index there)", f"request {b}, columns {first}-{prefix + n - 1} causal (key tiles of {spans(tiles) if len(tiles) > 1 else tiles[0]})", {"first_causal_column": first, "tiles": tiles}


class RecordedPlanMask(MistakeModel):
    """A verify step whose kernel applied the mask its recorded plan holds (read by the plan's
    backend layout: a stale tail, a wrong mask_indptr, a plan from an earlier tree, a missing mask),
    where that mask differs from the tree's. The tree-mask detector says how the plan's mask is
    wrong; this says the engine's output came from it."""

    name = "recorded-plan-mask"
    cause = (
        "The verify kernel applied the mask of its recorded plan, which differs from the draft tree's (a stale "
        "tail of the mask buffer, a wrong mask_indptr, or a mask left from another step as in FlashInfer #1028; "
        "tree-mask names which)."
    )

    def applies(self, trace: Trace) -> bool:
        return trace.is_tree_verify and trace.plan is not None

    def shown_by_metadata(self, trace: Trace) -> bool:
        return self.applies(trace)  # candidates come only from a recorded plan that differs from the batch

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        view = states.plan.visibility
        if view is None:
            return
        batch = trace.batch
        wrong: dict[int, Tensor] = {}
        differ: dict[int, int] = {}  # request -> mask entries its recorded block gets wrong
        for b in requests:
            block = view.blocks.get(b)
            if block is None or tuple(block.shape) != (trace.spec.draft_token_num, int(batch.kv_lens[b])):
                continue
            entries = int((block != visibility(trace, b)).sum())
            if entries:
                wrong[b], differ[b] = block, entries
        if not wrong:
            return

        def seen(b: int, rows: slice) -> Tensor:
            return wrong[b][rows] if b in wrong else visibility(trace, b, rows)

        output = states.under("recorded-plan-mask", trace, visible=seen)
        for b in wrong:
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary=f"verify attention with the recorded plan's {view.kind} mask, which differs from the draft tree's",
                detail=f"request {b}, {differ[b]} mask entries differ",
                params={"plan_mask": view.kind, "entries_differ": differ[b]},
            )


class MaskRowStride(_WrongTreeMask):
    """A tree mask laid out with one row stride and read with another. SGLang lays the verify mask
    out FULL: each request's [n, prefix + n] block row-major (stride prefix + n), the blocks back to
    back (build_tree). Kernels that read it with another stride:

    draft stride   a kernel that takes the prefix as visible and reads only the draft columns, as
                   from a QLEN_ONLY [n, n] mask: draft row r column j from element r * n + j of the
                   request's block;
    listed stride  a kernel over the KV its plan lists (L columns: a sliding-window layer's kept
                   prefix columns and the drafts) that reads [n, L] blocks: listed column j of row
                   r from element r * L + j, either of the request's own block (a kernel handed the
                   engine's block offsets) or of the blocks laid back to back at the offsets the
                   kernel computes itself, cumsum(n * L) (FlashInfer's plan(); SGLang #39287).

    A reading past the mask (the kernel reading other memory) is not reproducible, not tried."""

    name = "mask-row-stride"
    cause = (
        "The verify kernel read the tree mask with another row stride than it was laid out with (a FULL "
        "[n, prefix + n] mask read as [n, n] draft rows, or as [n, L] rows over the L columns the plan lists, as "
        "in SGLang #39287's sliding-window verify), so each draft row read part of another row's mask."
    )

    def variants(self, trace: Trace, b: int) -> Iterator[tuple[Tensor, str, str, dict]]:
        prefix, n = int(trace.batch.prefix_lens[b]), trace.spec.draft_token_num
        if prefix == 0:
            return  # no prefix columns: both layouts are [n, n]
        laid = _tree_rows(trace, b).flatten()
        read = torch.ones(n, prefix + n, dtype=torch.bool)
        read[:, prefix:] = laid[: n * n].view(n, n)
        yield read, "verify attention with the FULL tree mask (row stride prefix + n) read as [n, n] draft rows", f"request {b}, stride {n} for {prefix + n}", {"laid_stride": prefix + n, "read_stride": n, "columns": "drafts"}

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        yield from super().candidates(states, requests)
        listed = _listed_rows(states)
        if listed is None:
            return
        trace = states.trace
        batch, n = trace.batch, trace.spec.draft_token_num
        laid = [_tree_rows(trace, b).flatten() for b in range(batch.batch_size)]
        back_to_back, own_starts = torch.cat(laid), torch.tensor([0, *[x.numel() for x in laid]]).cumsum(0)
        lengths = torch.tensor([r.numel() for r in listed])
        kernel_starts = torch.cat([torch.zeros(1, dtype=torch.int64), (n * lengths).cumsum(0)])
        for offsets, starts in (("the engine's", own_starts), ("its own cumsum(n x listed)", kernel_starts)):
            masks = {}
            for b in requests:
                prefix, length, start = int(batch.prefix_lens[b]), int(lengths[b]), int(starts[b])
                if length == prefix + n or start + n * length > back_to_back.numel():
                    continue  # the request's own stride, or a reading past the mask
                masks[b] = back_to_back[start : start + n * length].view(n, length)
            yield from self._listed(states, listed, masks, offsets)

    def _listed(self, states: PartialStates, listed: list[Tensor], masks: dict[int, Tensor], offsets: str) -> Iterator[Candidate]:
        """The kernel over each request's listed KV, request b reading `masks[b]` [n, L]."""
        if not masks:
            return
        trace = states.trace
        wrong = with_rows(trace, listed, [r.numel() for r in listed])

        def seen(b: int, part: slice) -> Tensor:
            return masks[b][part] if b in masks else visibility(wrong, b, part)

        output = states.under(("mask-row-stride-listed", offsets), wrong, visible=seen)
        n = trace.spec.draft_token_num
        for b, mask in masks.items():
            prefix, length = int(trace.batch.prefix_lens[b]), mask.shape[1]
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary=f"verify attention over the KV its plan lists with the FULL tree mask (row stride prefix + n) read as [n, listed] blocks at {offsets} offsets",
                detail=f"request {b}, stride {length} for {prefix + n} ({length - n} of {prefix} prefix columns listed)",
                params={"laid_stride": prefix + n, "read_stride": length, "columns": "listed", "offsets": "engine" if offsets.startswith("the engine") else "kernel"},
            )


def _listed_rows(states: PartialStates) -> list[Tensor] | None:
    """Every request's KV slots as its recorded plan lists them, when the plan lists the drafts
    after some of the prefix (a list that ends with the request's draft slots, shorter than its
    row); requests listing their whole row keep it. None when no request lists fewer columns, or
    the plan cannot be read safely."""
    trace = states.trace
    kv = plan_kv(states.plan)
    if kv is None:
        return None
    batch, n = trace.batch, trace.spec.draft_token_num
    rows, shorter = [], False
    for b in range(batch.batch_size):
        own = batch.request_slots(b)
        ids, length = kv.of(b)
        listed = plan_slots(ids, length, kv.page_size)
        if listed.numel() != length or length < n or not torch.equal(listed[-n:], own[-n:]):
            return None  # not a list of kept prefix columns and the drafts
        shorter |= length < own.numel()
        rows.append(listed)
    return rows if shorter else None
