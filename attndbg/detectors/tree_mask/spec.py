"""tree-mask on the engine's recorded `spec.custom_mask`, in its tagged layout: mask-layout,
mask-length, mask-bit-order, mask-prefix-hidden and mask-mismatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.tree_mask.base import KIND
from attndbg.detectors.tree_mask.blocks import describe_column, mismatch_cause, prefix_hidden_cause, tree_block
from attndbg.trace import tree
from attndbg.trace.mask_geometry import MaskElement, MaskGeometry, as_bool, full_prefix_sum, reverse_bits, unpack_bits, word_bits, word_dtype
from attndbg.trace.schema import MaskLayout, Trace
from attndbg.trace.visibility import visibility


def _check_spec(trace: Trace, out: list[Finding]) -> None:
    spec = trace.spec
    mask = spec.custom_mask
    if mask is None:
        return
    layout = spec.mask_layout
    field = "spec.custom_mask"
    packed = layout is MaskLayout.QLEN_ONLY_BITPACKED
    if mask.is_floating_point() or mask.is_complex() or (packed and mask.dtype is torch.bool):
        out.append(
            finding(
                KIND,
                "mask-layout",
                step=trace.source.step,
                field=field,
                evidence=f"{field} has dtype {str(mask.dtype).replace('torch.', '')}, layout {layout.value} expects "
                + ("one integer word per row" if packed else "bool (or 0/1 integers)"),
                cause="the recorded mask is not in the layout its tag names (the recorder or the engine mixed up SGLang's TreeMaskMode)",
            )
        )
        return
    if not packed and mask.dtype is not torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        out.append(
            finding(
                KIND,
                "mask-layout",
                step=trace.source.step,
                field=field,
                evidence=f"{field} holds values up to {int(mask.max())} under layout {layout.value}, which is one 0/1 element per (row, column)",
                cause="the mask was recorded bit-packed (FlashInfer's packbits, or QLEN_ONLY_BITPACKING words) but tagged as a bool layout",
            )
        )
        return
    sizes = {lay: MaskGeometry.verify(lay, draft_token_num=spec.draft_token_num, prefix_lens=trace.batch.prefix_lens).length for lay in MaskLayout}
    need = sizes[layout]
    buffer = trace.buffers.get(field)
    if buffer is not None and buffer.capacity and mask.numel() > need:
        # A buffer allocated once at a fixed size (VerifyMask): past this step's mask lies what no
        # kernel of this step reads through it (the plan's mask_indptr says what is read).
        mask = mask[:need]
    if mask.numel() != need:
        other = [lay.value for lay, size in sizes.items() if lay is not layout and size == mask.numel()]
        long = mask.numel() > need
        if other:
            cause = f"the mask has the size of layout {other[0]} but is tagged {layout.value}: the engine's TreeMaskMode and the recorded tag disagree"
        elif not long:
            cause = "the mask was built for fewer KV columns than the requests have (FlashInfer #3176: a kernel reading it runs past the buffer)"
        else:
            cause = _long_mask_cause(trace, mask, need, packed)
        rule = {MaskLayout.FULL: "Σ n·(prefix+n)", MaskLayout.QLEN_ONLY: "bs·n·n", MaskLayout.QLEN_ONLY_BITPACKED: "bs·n words"}[layout]
        out.append(
            finding(
                KIND,
                "mask-length",
                step=trace.source.step,
                # The first element that is not this step's: past the mask, or the first one missing.
                field=f"{field}[{min(need, mask.numel())}]",
                evidence=f"{field} has {mask.numel()} elements, layout {layout.value} needs {rule} = {need} ({'long' if long else 'short'} by {abs(mask.numel() - need)})"
                + (f"; {field}[{need}:] {_tail_summary(mask[need:], packed)}" if long else ""),
                cause=cause,
                expected=need,
                found=mask.numel(),
            )
        )
        return
    if packed:
        words = mask.to(torch.int64)
        if _check_bit_order(trace, words, word_bits(mask.dtype), out):
            return
        _compare_spec_packed(trace, words, word_bits(mask.dtype), out)
    else:
        _compare_spec_bool(trace, as_bool(mask), layout, out)


def _stale_elements(tail: Tensor, packed: bool) -> int:
    """Elements of a mask's tail that SGLang's own fill would not leave there: build_tree fills a
    bool mask with True (prefix columns) and bit-packed words with 0 before writing the tree."""
    return int((tail != 0).sum()) if packed else int((tail == 0).sum())


def _tail_summary(tail: Tensor, packed: bool) -> str:
    stale = _stale_elements(tail, packed)
    fill = "0" if packed else "True"
    return f"holds {stale} element(s) other than the fill value {fill}" if stale else f"is all the fill value {fill}"


def _long_mask_cause(trace: Trace, mask: Tensor, need: int, packed: bool) -> str:
    """Why an engine-sized mask is longer than the step: an earlier step's tree left in its tail, or
    a size computed from a wrong seq_lens_sum (SGLang sizes FULL masks seq_lens_sum·n + bs·n²)."""
    if _stale_elements(mask[need:], packed):
        return (
            "a stale tail: the mask buffer was sized for an earlier, larger step and reused without being re-sized or refilled, "
            "so its tail still holds that step's tree rows (a kernel or a layout check that takes the buffer's length reads them)"
        )
    extra = full_prefix_sum(mask.numel(), batch_size=trace.batch.batch_size, draft_token_num=trace.spec.draft_token_num)
    sums = {k: v for k, v in (trace.plan.scalars.items() if trace.plan is not None else ()) if k in ("seq_lens_sum", "spec_seq_lens_sum")}
    named = [f"{k} = {v}" for k, v in sums.items() if v == extra]
    return (
        f"the mask was sized for more KV columns than the requests have: from a prefix sum of {extra} instead of sum(seq_lens) = {int(trace.batch.prefix_lens.sum())}"
        + (f" (the engine's {', '.join(named)})" if named else "")
        + "; SGLang sizes a FULL mask seq_lens_sum·n + bs·n², so a stale or wrong seq_lens_sum makes it too long"
        if extra is not None and trace.spec.mask_layout is MaskLayout.FULL
        else "the mask is longer than this batch needs: built for other lengths (another step's batch size or draft_token_num)"
    )


def _word_of(trace: Trace, t: int) -> MaskElement:
    """(request, draft row, column) of word t of a bit-packed mask whose length was checked."""
    where = MaskGeometry.of_spec(trace.spec, trace.batch.prefix_lens).locate(t)
    assert where is not None, f"word {t} is past the mask, whose length was checked"
    return where


def _check_bit_order(trace: Trace, words: Tensor, stored_bits: int, out: list[Finding]) -> bool:
    n = trace.spec.draft_token_num
    expected = tree.qlen_only_bitpacked_mask(trace.spec.parents).to(torch.int64)
    if torch.equal(words, expected):
        return False
    for width in sorted({stored_bits, word_bits(word_dtype(n)), n}):
        if width < n or width > 63:
            continue
        reversed_words = reverse_bits(expected, width)
        if torch.equal(reversed_words, expected) or not torch.equal(words, reversed_words):
            continue
        t = int(torch.nonzero(words != expected)[0])
        b, r, _ = _word_of(trace, t)
        out.append(
            finding(
                KIND,
                "mask-bit-order",
                step=trace.source.step,
                request=b,
                row=int(trace.batch.qo_indptr[b]) + r,
                field=f"spec.custom_mask[{t}]",
                evidence=(
                    f"spec.custom_mask[{t}] (request {b}, draft row {r}) = {int(words[t]):#0{width + 2}b}, expected {int(expected[t]):#0{width + 2}b}: "
                    f"every one of the {words.numel()} words is the expected word with its {width} bits reversed"
                ),
                cause="the mask was packed big-endian (bit 0 = the last draft token); SGLang's QLEN_ONLY_BITPACKING and FlashInfer's packbits are little-endian, bit 0 = the root",
                expected=int(expected[t]),
                found=int(words[t]),
                width=width,
            )
        )
        return True
    return False


def _compare_spec_packed(trace: Trace, words: Tensor, stored_bits: int, out: list[Finding]) -> None:
    n = trace.spec.draft_token_num
    geometry = MaskGeometry.of_spec(trace.spec, trace.batch.prefix_lens)
    bits = unpack_bits(words, min(max(stored_bits, n), 63))
    extra = bits[:, n:].any(1)
    if bool(extra.any()):
        t = int(torch.nonzero(extra)[0])
        b, r, _ = _word_of(trace, t)
        k = n + int(torch.nonzero(bits[t, n:])[0])
        out.append(
            finding(
                KIND,
                "mask-mismatch",
                step=trace.source.step,
                request=b,
                row=int(trace.batch.qo_indptr[b]) + r,
                field=f"spec.custom_mask[{t}]",
                evidence=f"spec.custom_mask[{t}] (request {b}, draft row {r}) = {int(words[t]):#b} sets bit {k}, but there are only {n} draft tokens (bits 0..{n - 1})",
                cause="the words were packed for a larger tree or shifted (a stale or misaligned buffer)",
                found=int(words[t]),
            )
        )
        return
    found = torch.stack([geometry.visible(words, b) for b in range(geometry.batch_size)])
    _compare_draft_blocks(trace, found, "spec.custom_mask", lambda b, r, j: f"spec.custom_mask[{geometry.element(b, r, geometry.first_column(b) + j)}] bit {j}", out)


def _compare_spec_bool(trace: Trace, mask: Tensor, layout: MaskLayout, out: list[Finding]) -> None:
    bs = trace.batch.batch_size
    geometry = MaskGeometry.verify(layout, draft_token_num=trace.spec.draft_token_num, prefix_lens=trace.batch.prefix_lens)
    blocks = [geometry.block(mask, b) for b in range(bs)]
    if layout is MaskLayout.QLEN_ONLY:
        found = torch.stack(blocks)
        _compare_draft_blocks(trace, found, "spec.custom_mask", lambda b, r, j: f"spec.custom_mask[{geometry.element(b, r, geometry.first_column(b) + j)}]", out)
        return
    unfolded = [tree_block(trace, b) for b in range(bs)]
    if trace.model.sliding_window >= 0:
        folded = [visibility(trace, b) for b in range(bs)]
        wrong = [sum(int((f != e).sum()) for f, e in zip(blocks, ref)) for ref in (unfolded, folded)]
        expected = folded if wrong[1] < wrong[0] else unfolded
    else:
        expected = unfolded
    diffs = [(f != e) for f, e in zip(blocks, expected)]
    total = sum(int(d.sum()) for d in diffs)
    if total == 0:
        return
    first = next((b, d) for b, d in enumerate(diffs) if bool(d.any()))
    b, d = first
    r, c = (int(x) for x in torch.nonzero(d)[0])
    prefix = int(trace.batch.prefix_lens[b])
    element = geometry.element(b, r, c)
    prefix_only = all(
        not bool(dd[:, int(trace.batch.prefix_lens[bb]) :].any()) and not bool(blocks[bb][:, : int(trace.batch.prefix_lens[bb])][dd[:, : int(trace.batch.prefix_lens[bb])]].any())
        for bb, dd in enumerate(diffs)
    )
    check = "mask-prefix-hidden" if prefix_only else "mask-mismatch"
    found_value = bool(blocks[b][r, c])
    if prefix_only:
        cause = prefix_hidden_cause("the engine built the FULL mask with its prefix part False (zeros instead of torch.full(True))")
    else:
        cause = mismatch_cause(trace, b, r, c, found_value, blocks[b][:, prefix:])
    out.append(
        finding(
            KIND,
            check,
            step=trace.source.step,
            request=b,
            row=int(trace.batch.qo_indptr[b]) + r,
            column=c,
            field=f"spec.custom_mask[{element}]",
            evidence=f"spec.custom_mask[{element}] (request {b}, draft row {r}, {describe_column(trace, b, c)}) = {found_value}, expected {not found_value}; {total} wrong element(s) in all",
            cause=cause,
            expected=not found_value,
            found=found_value,
            wrong=total,
        )
    )


def _compare_draft_blocks(trace: Trace, found: Tensor, field: str, element, out: list[Finding]) -> None:
    """found [bs, n, n] draft blocks against the ancestor matrices; one finding at the first wrong bit."""
    expected = torch.stack([tree.ancestor_matrix(p) for p in trace.spec.parents])
    diff = found != expected
    total = int(diff.sum())
    if total == 0:
        return
    b, r, j = (int(x) for x in torch.nonzero(diff)[0])
    prefix = int(trace.batch.prefix_lens[b])
    value = bool(found[b, r, j])
    out.append(
        finding(
            KIND,
            "mask-mismatch",
            step=trace.source.step,
            request=b,
            row=int(trace.batch.qo_indptr[b]) + r,
            column=prefix + j,
            field=element(b, r, j).split(" bit")[0],
            evidence=f"{element(b, r, j)} (request {b}, draft row {r}, {describe_column(trace, b, prefix + j)}) = {value}, expected {not value}; {total} wrong element(s) in all",
            cause=mismatch_cause(trace, b, r, prefix + j, value, found[b]),
            expected=not value,
            found=value,
            wrong=total,
        )
    )
