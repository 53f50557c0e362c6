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
triton and flashinfer vocabularies, fa3's two-call expand tables, or plain causal plans):

    mask-indptr         mask_indptr[b+1] - mask_indptr[b] != n·(prefix_b+n) (flashinfer: n·covered KV)
    mask-length         custom_mask shorter or longer than mask_indptr[-1] (FlashInfer #3176)
    mask-prefix-hidden, mask-mismatch   as above, for the mask the kernel reads (Triton skips the
                        prefix columns: skip_prefix_custom_mask, SGLang's default)
    window-ignored      the kernel's window is off (window_left / sliding_window = -1), so the mask
                        must fold the window in, and it shows prefix columns older than the window
    window-offset       the window is applied by KV index (query i at prefix + i, not prefix + depth)
                        and hides columns inside the window; or Triton's `window_kv_offsets` do not
                        match the prefix columns the plan dropped
    plan-mask-missing   the plan runs verify causally by index, and the tree is not a chain

A correct engine with a sliding window either folds the window into the plan's mask by position
and turns the kernel's window off (what attndbg's FlashInfer plan does), or passes only the
window's KV plus `window_kv_offsets` (SGLang's Triton SWA path) where the draft tree is a chain.

    stale-mask          a non-verify, non-selective step whose plan still carries a custom_mask
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

from attndbg.trace.visibility import visibility
from attndbg.checks.context import CheckContext
from attndbg.checks.findings import Finding, FindingClass, Location
from attndbg.checks.invariants import kv_coverage
from attndbg.replay.runner import BackendRun, PlanSource, ReplayOptions, RunStatus
from attndbg.trace import tree
from attndbg.trace.schema import MaskLayout, Trace

# Shown per failing row in the output findings.
MAX_ROWS_SHOWN = 4
MAX_COLUMNS_SHOWN = 8


def detect(ctx: CheckContext) -> list[Finding]:
    findings = mask_findings(ctx.trace)
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


def mask_findings(trace: Trace) -> list[Finding]:
    """Every mask check of one step that needs no kernel (pure)."""
    out: list[Finding] = []
    if not trace.is_tree_verify:
        _check_stale_plan(trace, out)
        return out
    _check_spec(trace, out)
    if trace.plan is not None:
        plan_view(trace, out)
    return out


def detect_recording(contexts: list[CheckContext]) -> list[Finding]:
    """stale-mask: a verify step's mask identical to the previous verify step's while the trees differ."""
    out: list[Finding] = []
    previous: dict[int, CheckContext] = {}
    for ctx in sorted(contexts, key=lambda c: (c.trace.source.tp_rank, c.step)):
        trace = ctx.trace
        if not trace.is_tree_verify:
            continue
        prev = previous.get(trace.source.tp_rank)
        previous[trace.source.tp_rank] = ctx
        if prev is None or _same_tree(trace, prev.trace):
            continue
        for field, now, before in (
            ("spec.custom_mask", trace.spec.custom_mask, prev.trace.spec.custom_mask),
            ("plan.custom_mask", _plan_mask(trace), _plan_mask(prev.trace)),
        ):
            if now is None or before is None or now.numel() == 0 or now.dtype != before.dtype or now.shape != before.shape:
                continue
            if not torch.equal(now, before):
                continue
            out.append(
                _finding(
                    trace,
                    "stale-mask",
                    field=field,
                    evidence=f"{field} of step {ctx.step} equals step {prev.step}'s ({now.numel()} elements), but the draft trees (or prefix lengths) of the two steps differ",
                    cause="the engine reused the previous verify step's mask buffer without rebuilding it for this step's tree",
                    trace_path=ctx.path,
                    previous_step=prev.step,
                )
            )
    return out


# -- helpers --------------------------------------------------------------------------------------------


def _finding(trace: Trace, check: str, *, evidence: str, cause: str, request=None, row=None, column=None, head=None, field=None, trace_path: str = "", **data) -> Finding:
    location = Location(step=trace.source.step, request=request, row=row, column=column, head=head, field=field)
    return Finding(FindingClass.TREE_MASK, check, location, evidence, cause, trace=trace_path, data=data)


def _same_tree(a: Trace, b: Trace) -> bool:
    return (
        a.spec.parents.shape == b.spec.parents.shape
        and torch.equal(a.spec.parents, b.spec.parents)
        and torch.equal(a.batch.prefix_lens, b.batch.prefix_lens)
    )


def _plan_mask(trace: Trace) -> Tensor | None:
    return trace.plan.tensors.get("custom_mask") if trace.plan is not None else None


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype is torch.bool else mask != 0


def _tree_block(trace: Trace, b: int) -> Tensor:
    """[n, prefix + n] the FULL block without a window: prefix True, draft part = ancestors."""
    prefix = int(trace.batch.prefix_lens[b])
    n = trace.spec.draft_token_num
    block = torch.ones(n, prefix + n, dtype=torch.bool)
    block[:, prefix:] = tree.ancestor_matrix(trace.spec.parents[b])
    return block


def _describe_column(trace: Trace, b: int, column: int) -> str:
    prefix = int(trace.batch.prefix_lens[b])
    return f"KV column {column}" + (f" = draft token {column - prefix}" if column >= prefix else " (prefix)")


def _mismatch_cause(trace: Trace, b: int, row: int, column: int, found: bool, found_draft: Tensor | None) -> str:
    """One sentence for a wrong (row, column) of request b's tree mask."""
    prefix = int(trace.batch.prefix_lens[b])
    parents = trace.spec.parents[b]
    anc = tree.ancestor_matrix(parents)
    if found_draft is not None and not torch.equal(found_draft, anc):
        if torch.equal(found_draft, anc.T):
            return "the mask is transposed: rows and columns swapped (a key's descendants instead of a query's ancestors)"
        causal = torch.tril(torch.ones_like(anc))
        if torch.equal(found_draft, causal):
            return "the mask is causal by token index, not the draft tree: every draft token sees all earlier drafts"
        for c in range(trace.batch.batch_size):
            if c != b and torch.equal(found_draft, tree.ancestor_matrix(trace.spec.parents[c])) and not torch.equal(anc, found_draft):
                return f"request {b}'s block holds request {c}'s tree: the per-request blocks are written at the wrong offsets or in the wrong order"
    if column < prefix:
        if found:
            return "a prefix column older than the sliding window is visible: the mask ignores the window"
        return "a prefix column is hidden: the FULL layout's prefix part must be all True"
    j = column - prefix
    if found:
        if j > 0 and int(parents[j]) == int(parents[row]) and j != row:
            return f"draft token {row} sees its sibling {j}: the mask marks a sibling as an ancestor (e.g. a next-sibling link followed as a parent link)"
        return f"draft token {row} sees draft token {j}, which is not its ancestor: the mask was built from the wrong parent list"
    if j == row:
        return f"draft token {row} cannot see itself: the mask's diagonal is missing"
    return f"draft token {row} cannot see its ancestor {j}: its ancestor chain is cut (a wrong parent index)"


# -- the recorded spec mask --------------------------------------------------------------------------------


def _layout_sizes(trace: Trace) -> dict[MaskLayout, int]:
    n = trace.spec.draft_token_num
    prefix = trace.batch.prefix_lens
    bs = trace.batch.batch_size
    return {
        MaskLayout.FULL: int((n * (prefix + n)).sum()),
        MaskLayout.QLEN_ONLY: bs * n * n,
        MaskLayout.QLEN_ONLY_BITPACKED: bs * n,
    }


def _word_bits(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size() * 8


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
            _finding(
                trace,
                "mask-layout",
                field=field,
                evidence=f"{field} has dtype {str(mask.dtype).replace('torch.', '')}, layout {layout.value} expects "
                + ("one integer word per row" if packed else "bool (or 0/1 integers)"),
                cause="the recorded mask is not in the layout its tag names (the recorder or the engine mixed up SGLang's TreeMaskMode)",
            )
        )
        return
    if not packed and mask.dtype is not torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        out.append(
            _finding(
                trace,
                "mask-layout",
                field=field,
                evidence=f"{field} holds values up to {int(mask.max())} under layout {layout.value}, which is one 0/1 element per (row, column)",
                cause="the mask was recorded bit-packed (FlashInfer's packbits, or QLEN_ONLY_BITPACKING words) but tagged as a bool layout",
            )
        )
        return
    sizes = _layout_sizes(trace)
    if mask.numel() != sizes[layout]:
        other = [lay.value for lay, size in sizes.items() if lay is not layout and size == mask.numel()]
        if other:
            cause = f"the mask has the size of layout {other[0]} but is tagged {layout.value}: the engine's TreeMaskMode and the recorded tag disagree"
        elif mask.numel() < sizes[layout]:
            cause = "the mask was built for fewer KV columns than the requests have (FlashInfer #3176: a kernel reading it runs past the buffer)"
        else:
            cause = "the mask is longer than this batch needs: built for other lengths, or a graph buffer recorded untrimmed"
        rule = {MaskLayout.FULL: "Σ n·(prefix+n)", MaskLayout.QLEN_ONLY: "bs·n·n", MaskLayout.QLEN_ONLY_BITPACKED: "bs·n words"}[layout]
        out.append(
            _finding(
                trace,
                "mask-length",
                field=field,
                evidence=f"{field} has {mask.numel()} elements, layout {layout.value} needs {rule} = {sizes[layout]} ({'short' if mask.numel() < sizes[layout] else 'long'} by {abs(mask.numel() - sizes[layout])})",
                cause=cause,
                expected=sizes[layout],
                found=mask.numel(),
            )
        )
        return
    if packed:
        words = mask.to(torch.int64)
        if _check_bit_order(trace, words, _word_bits(mask.dtype), out):
            return
        _compare_spec_packed(trace, words, _word_bits(mask.dtype), out)
    else:
        _compare_spec_bool(trace, _as_bool(mask), layout, out)


def _expected_words(trace: Trace) -> Tensor:
    return tree.qlen_only_bitpacked_mask(trace.spec.parents).to(torch.int64)


def _reverse(words: Tensor, width: int) -> Tensor:
    bits = (words[:, None] >> torch.arange(width)) & 1
    return (bits.flip(1) << torch.arange(width)).sum(1)


def _check_bit_order(trace: Trace, words: Tensor, stored_bits: int, out: list[Finding]) -> bool:
    n = trace.spec.draft_token_num
    expected = _expected_words(trace)
    if torch.equal(words, expected):
        return False
    for width in sorted({stored_bits, _word_bits(tree.bitpacked_word_dtype(n)), n}):
        if width < n or width > 63:
            continue
        reversed_words = _reverse(expected, width)
        if torch.equal(reversed_words, expected) or not torch.equal(words, reversed_words):
            continue
        t = int(torch.nonzero(words != expected)[0])
        b, r = divmod(t, n)
        out.append(
            _finding(
                trace,
                "mask-bit-order",
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
    width = max(stored_bits, n)
    bits = ((words[:, None] >> torch.arange(min(width, 63))) & 1).to(torch.bool)
    extra = bits[:, n:].any(1)
    if bool(extra.any()):
        t = int(torch.nonzero(extra)[0])
        b, r = divmod(t, n)
        k = n + int(torch.nonzero(bits[t, n:])[0])
        out.append(
            _finding(
                trace,
                "mask-mismatch",
                request=b,
                row=int(trace.batch.qo_indptr[b]) + r,
                field=f"spec.custom_mask[{t}]",
                evidence=f"spec.custom_mask[{t}] (request {b}, draft row {r}) = {int(words[t]):#b} sets bit {k}, but there are only {n} draft tokens (bits 0..{n - 1})",
                cause="the words were packed for a larger tree or shifted (a stale or misaligned buffer)",
                found=int(words[t]),
            )
        )
        return
    found = bits[:, :n].reshape(trace.batch.batch_size, n, n)
    _compare_draft_blocks(trace, found, "spec.custom_mask", lambda b, r, j: f"spec.custom_mask[{b * n + r}] bit {j}", out)


def _compare_spec_bool(trace: Trace, mask: Tensor, layout: MaskLayout, out: list[Finding]) -> None:
    n = trace.spec.draft_token_num
    bs = trace.batch.batch_size
    if layout is MaskLayout.QLEN_ONLY:
        found = mask.reshape(bs, n, n)
        _compare_draft_blocks(trace, found, "spec.custom_mask", lambda b, r, j: f"spec.custom_mask[{(b * n + r) * n + j}]", out)
        return
    offsets = tree.full_mask_indptr(n, trace.batch.prefix_lens)
    blocks = [mask[int(offsets[b]) : int(offsets[b + 1])].reshape(n, -1) for b in range(bs)]
    unfolded = [_tree_block(trace, b) for b in range(bs)]
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
    element = int(offsets[b]) + r * (prefix + n) + c
    prefix_only = all(
        not bool(dd[:, int(trace.batch.prefix_lens[bb]) :].any()) and not bool(blocks[bb][:, : int(trace.batch.prefix_lens[bb])][dd[:, : int(trace.batch.prefix_lens[bb])]].any())
        for bb, dd in enumerate(diffs)
    )
    check = "mask-prefix-hidden" if prefix_only else "mask-mismatch"
    found_value = bool(blocks[b][r, c])
    if prefix_only:
        cause = "the engine built the FULL mask with its prefix part False (zeros instead of torch.full(True)); every draft token must see the whole prefix"
    else:
        cause = _mismatch_cause(trace, b, r, c, found_value, blocks[b][:, prefix:])
    out.append(
        _finding(
            trace,
            check,
            request=b,
            row=int(trace.batch.qo_indptr[b]) + r,
            column=c,
            field=f"spec.custom_mask[{element}]",
            evidence=f"spec.custom_mask[{element}] (request {b}, draft row {r}, {_describe_column(trace, b, c)}) = {found_value}, expected {not found_value}; {total} wrong element(s) in all",
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
        _finding(
            trace,
            "mask-mismatch",
            request=b,
            row=int(trace.batch.qo_indptr[b]) + r,
            column=prefix + j,
            field=element(b, r, j).split(" bit")[0],
            evidence=f"{element(b, r, j)} (request {b}, draft row {r}, {_describe_column(trace, b, prefix + j)}) = {value}, expected {not value}; {total} wrong element(s) in all",
            cause=_mismatch_cause(trace, b, r, prefix + j, value, found[b]),
            expected=not value,
            found=value,
            wrong=total,
        )
    )


# -- the recorded plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanVisibility:
    """What the recorded plan's kernel will let each draft row see, per real request."""

    kind: str  # "mask" | "causal" | "expand"
    blocks: dict[int, Tensor]  # request -> [n, prefix + n] bool (requests the plan leaves unclear are absent)


def _vocabulary(trace: Trace) -> str | None:
    plan = trace.plan
    impl = plan.scalars.get("impl")
    if plan.backend == "triton" or (plan.backend == "mla" and impl == "triton"):
        return "triton"
    if plan.backend in ("flashinfer", "fa3", "mla"):
        return plan.backend
    return None


def _kernel_window(trace: Trace, name: str) -> int:
    value = trace.plan.scalars.get(name, trace.model.sliding_window)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else trace.model.sliding_window


def _index_window(prefix: int, n: int, width: int, window: int) -> Tensor:
    """[n, width] what a kernel window by KV index allows: query i at column prefix + i."""
    if window < 0:
        return torch.ones(n, width, dtype=torch.bool)
    return (prefix + torch.arange(n))[:, None] - torch.arange(width)[None, :] <= window


def plan_view(trace: Trace, out: list[Finding] | None = None) -> PlanVisibility | None:
    """The recorded plan's effective visibility; structural findings go to `out` and, with them,
    visibility comparisons against the truth. None when the plan's vocabulary is unknown or its KV
    structure is malformed (invariants reports that)."""
    out = out if out is not None else []
    vocabulary = _vocabulary(trace)
    coverage = kv_coverage(trace)
    if vocabulary is None or coverage is None:
        return None
    plan = trace.plan
    if vocabulary in ("triton", "flashinfer") and "custom_mask" in plan.tensors:
        view = _mask_view(trace, vocabulary, coverage, out)
    elif vocabulary == "fa3" and plan.scalars.get("verify_path") == "two-call":
        view = _expand_view(trace, coverage, out)
    else:
        window = _kernel_window(trace, "window_left" if vocabulary != "triton" else "sliding_window")
        view = _causal_view(trace, coverage, window)
    if view is not None:
        _compare_plan(trace, view, out)
    return view


def _causal_view(trace: Trace, coverage, window: int) -> PlanVisibility:
    n = trace.spec.draft_token_num
    blocks = {}
    for b, span in enumerate(coverage):
        if span is None:
            continue
        prefix = int(trace.batch.prefix_lens[b])
        cols = torch.arange(prefix + n)
        seen = (cols[None, :] <= (prefix + torch.arange(n))[:, None]) & (cols >= span[0])[None, :]
        blocks[b] = seen & _index_window(prefix, n, prefix + n, window)
    return PlanVisibility("causal", blocks)


def _mask_view(trace: Trace, vocabulary: str, coverage, out: list[Finding]) -> PlanVisibility | None:
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    mask = plan.tensors["custom_mask"]
    indptr = plan.tensors.get("mask_indptr")
    if indptr is None:
        out.append(_finding(trace, "mask-indptr", field="plan.mask_indptr", evidence="the plan carries custom_mask but no mask_indptr", cause="the kernel cannot find each request's block: mask_indptr was not passed with the mask"))
        return None
    indptr = indptr.to(torch.int64)
    if indptr.numel() < batch.batch_size + 1 or int(indptr[0]) != 0 or bool((indptr.diff() < 0).any()):
        return None  # invariants names the bad element
    widths = []
    for b in range(batch.batch_size):
        prefix = int(batch.prefix_lens[b])
        if vocabulary == "flashinfer" and coverage[b] is not None:
            widths.append(coverage[b][1] - coverage[b][0])  # FlashInfer's block spans the KV it is given
        else:
            widths.append(prefix + n)
    sizes = indptr.diff()[: batch.batch_size]
    expected_sizes = torch.tensor([n * w for w in widths], dtype=torch.int64)
    b = int(torch.nonzero(sizes != expected_sizes)[0]) if bool((sizes != expected_sizes).any()) else -1
    if b >= 0:
        found = int(sizes[b])
        prefix = int(batch.prefix_lens[b])
        if found == n * n:
            cause = "mask_indptr counts only the n x n draft block (QLEN_ONLY sizes) while the mask is in the FULL layout"
        elif found == n * prefix:
            cause = "mask_indptr leaves out the draft columns: it was computed from seq_lens without draft_token_num"
        elif found == n * (prefix + 2 * n):
            cause = "mask_indptr counts the draft tokens twice (seq_lens that already included them, plus n)"
        else:
            cause = "mask_indptr is not cumsum(n * (prefix + n)): computed from another batch's lengths"
        out.append(
            _finding(
                trace,
                "mask-indptr",
                request=b,
                field=f"plan.mask_indptr[{b + 1}]",
                evidence=f"plan.mask_indptr gives request {b} a block of {found} elements (mask_indptr[{b + 1}] - mask_indptr[{b}]), expected "
                + (f"n·(prefix+n) = {n}·({prefix}+{n})" if widths[b] == prefix + n else f"n·(KV the plan covers) = {n}·{widths[b]}")
                + f" = {int(expected_sizes[b])}",
                cause=cause,
                expected=int(expected_sizes[b]),
                found=found,
            )
        )
        return None
    end = int(indptr[-1])
    if mask.numel() != end:
        short = mask.numel() < end
        out.append(
            _finding(
                trace,
                "mask-length",
                field="plan.custom_mask",
                evidence=f"plan.custom_mask has {mask.numel()} elements but mask_indptr[-1] = {end} ({'short' if short else 'long'} by {abs(end - mask.numel())})",
                cause=(
                    "the mask was built for fewer KV columns than the plan's requests have; the kernel reads past the buffer (FlashInfer #3176)"
                    if short
                    else "the mask buffer is longer than its offsets: built for other lengths, or recorded untrimmed"
                ),
                expected=end,
                found=mask.numel(),
            )
        )
        if short:
            return None
    bits = _as_bool(mask)
    window = _kernel_window(trace, "sliding_window" if vocabulary == "triton" else "window_left")
    offsets = plan.tensors.get("window_kv_offsets")
    skip_prefix = vocabulary == "triton" and bool(plan.scalars.get("skip_prefix_custom_mask", True))
    blocks = {}
    for b in range(batch.batch_size):
        if coverage[b] is None:
            continue
        prefix = int(batch.prefix_lens[b])
        start, _ = coverage[b]
        block = bits[int(indptr[b]) : int(indptr[b + 1])].reshape(n, widths[b])
        if vocabulary == "triton":
            offset = int(offsets[b]) if offsets is not None and b < offsets.numel() else 0
            if offset != start:
                out.append(_offset_finding(trace, b, offset, start, offsets is not None))
                continue
            seen = block.clone()
            if skip_prefix:
                seen[:, :prefix] = True
        else:
            seen = torch.zeros(n, prefix + n, dtype=torch.bool)
            seen[:, start:] = block
        seen[:, :start] = False
        blocks[b] = seen & _index_window(prefix, n, prefix + n, window)
    return PlanVisibility("mask", blocks)


def _offset_finding(trace: Trace, b: int, offset: int, start: int, present: bool) -> Finding:
    return _finding(
        trace,
        "window-offset",
        request=b,
        field=f"plan.window_kv_offsets[{b}]" if present else "plan.window_kv_offsets",
        evidence=(
            f"plan.kv_indices hold request {b}'s prefix from column {start} (the sliding window's), but "
            + (f"plan.window_kv_offsets[{b}] = {offset}" if present else "the plan has no window_kv_offsets")
            + f": the kernel reads the mask {abs(start - offset)} column(s) off"
        ),
        cause="the mask is indexed as if the plan held the whole prefix: the sliding window's KV offset (SGLang's window_kv_offsets) is missing or wrong",
        expected=start,
        found=offset,
    )


def _expand_view(trace: Trace, coverage, out: list[Finding]) -> PlanVisibility | None:
    """fa3 two-call: call 1 covers the prefix, call 2 row b*n+i covers the draft slots it lists."""
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    table, lens = plan.tensors.get("expand_page_table"), plan.tensors.get("expand_cache_seqlens")
    if table is None or lens is None or table.dim() != 2:
        out.append(_finding(trace, "plan-mask-missing", field="plan.expand_page_table", evidence="a two-call verify plan without expand_page_table / expand_cache_seqlens", cause="the second (draft-block) call of the two-call verify was not planned"))
        return None
    if table.shape[0] < batch.batch_size * n or lens.numel() < batch.batch_size * n:
        out.append(
            _finding(
                trace,
                "mask-length",
                field="plan.expand_page_table",
                evidence=f"plan.expand_page_table has {table.shape[0]} rows and expand_cache_seqlens {lens.numel()}, expected one per draft token = {batch.batch_size * n}",
                cause="the draft-block call was planned for another batch or draft_token_num",
            )
        )
        return None
    blocks = {}
    for b in range(batch.batch_size):
        if coverage[b] is None:
            continue
        prefix = int(batch.prefix_lens[b])
        draft_slots = batch.request_slots(b)[prefix:]
        seen = torch.zeros(n, prefix + n, dtype=torch.bool)
        seen[:, coverage[b][0] : prefix] = True
        for i in range(n):
            r = b * n + i
            listed = table[r, : max(min(int(lens[r]), table.shape[1]), 0)].to(torch.int64)
            seen[i, prefix:] = torch.isin(draft_slots, listed)
        blocks[b] = seen
    return PlanVisibility("expand", blocks)


def _compare_plan(trace: Trace, view: PlanVisibility, out: list[Finding]) -> None:
    """One finding per check id at its first (request, row, column), against the true visibility."""
    batch = trace.batch
    plan = trace.plan
    first: dict[str, tuple] = {}
    counts: dict[str, int] = {}
    for b, seen in sorted(view.blocks.items()):
        truth = visibility(trace, b)
        prefix = int(batch.prefix_lens[b])
        unwindowed = _tree_block(trace, b)
        # Columns before the plan's KV start are outside every row's window (kv_coverage's rule),
        # so a difference is always in what the plan's kernel will do with what it reads.
        for r, c in torch.nonzero(seen != truth).tolist():
            found = bool(seen[r, c])
            check = _classify(trace, view, b, r, c, found, bool(unwindowed[r, c]))
            counts[check] = counts.get(check, 0) + 1
            first.setdefault(check, (b, r, c, found))
    for check, (b, r, c, found) in first.items():
        prefix = int(batch.prefix_lens[b])
        row = int(batch.qo_indptr[b]) + r
        field = _plan_field(trace, view, b, r, c)
        if check == "window-offset":
            field = "plan.scalars." + ("sliding_window" if _vocabulary(trace) == "triton" else "window_left")
        if check == "window-ignored":
            cause = "the kernel's window is off (window_left = -1), so the mask must fold the sliding window in by position, and it was built without it"
        elif check == "window-offset":
            cause = "the kernel applies the sliding window by KV index (query i at column prefix + i), but draft token i sits at prefix + its depth: fold the window into the mask by position and turn the kernel's window off"
        elif check == "plan-mask-missing":
            cause = "the plan runs the verify step as causal attention by token index with no tree mask, but the draft tree is not a chain"
        elif check == "mask-prefix-hidden":
            cause = "the plan's FULL mask hides prefix columns that the kernel reads; every draft token must see the whole prefix"
        else:
            found_draft = view.blocks[b][:, prefix:] if view.kind != "causal" else None
            cause = _mismatch_cause(trace, b, r, c, found, found_draft)
        out.append(
            _finding(
                trace,
                check,
                request=b,
                row=row,
                column=c,
                field=field,
                evidence=(
                    f"with the recorded {plan.backend} plan, draft row {r} of request {b} (step row {row}) {'sees' if found else 'cannot see'} "
                    f"{_describe_column(trace, b, c)}; it should {'not ' if found else ''}see it ({field}); {counts[check]} such (row, column) pair(s)"
                ),
                cause=cause,
                expected=not found,
                found=found,
                pairs=counts[check],
            )
        )


def _classify(trace: Trace, view: PlanVisibility, b: int, r: int, c: int, found: bool, tree_allows: bool) -> str:
    prefix = int(trace.batch.prefix_lens[b])
    window = trace.model.sliding_window
    if found and c < prefix and tree_allows and window >= 0:
        return "window-ignored"
    if not found and view.kind != "expand" and window >= 0:
        kernel_window = _kernel_window(trace, "sliding_window" if _vocabulary(trace) == "triton" else "window_left")
        if not bool(_index_window(prefix, trace.spec.draft_token_num, prefix + trace.spec.draft_token_num, kernel_window)[r, c]):
            return "window-offset"
    if view.kind == "causal":
        return "plan-mask-missing"
    if view.kind == "mask" and not found and c < prefix:
        return "mask-prefix-hidden"
    return "mask-mismatch"


def _plan_field(trace: Trace, view: PlanVisibility, b: int, r: int, c: int) -> str:
    plan = trace.plan
    n = trace.spec.draft_token_num
    if view.kind == "mask":
        indptr = plan.tensors["mask_indptr"].to(torch.int64)
        width = int(indptr[b + 1] - indptr[b]) // n
        shift = int(trace.batch.prefix_lens[b]) + n - width  # flashinfer blocks start at the covered KV
        return f"plan.custom_mask[{int(indptr[b]) + r * width + c - shift}]"
    if view.kind == "expand":
        return f"plan.expand_page_table[{b * n + r}]"
    return "plan.scalars.causal" if "causal" in plan.scalars else "plan.custom_mask"


# -- stale masks on non-verify steps ---------------------------------------------------------------------------


def _check_stale_plan(trace: Trace, out: list[Finding]) -> None:
    plan = trace.plan
    if plan is None or trace.batch.selective:
        return  # selective recompute legitimately runs a custom mask
    mask = plan.tensors.get("custom_mask")
    if mask is None or mask.numel() == 0:
        return
    extra = " and mask_indptr" if "mask_indptr" in plan.tensors else ""
    out.append(
        _finding(
            trace,
            "stale-mask",
            field="plan.custom_mask",
            evidence=f"this {trace.batch.forward_mode.value} step has no draft tree, but its {plan.backend} plan carries a custom_mask of {mask.numel()} elements{extra}",
            cause="a wrapper planned with a custom mask for a verify step kept it when re-planned for causal attention (FlashInfer #1028): the kernel applies the old tree mask",
            elements=mask.numel(),
        )
    )


# -- outputs -------------------------------------------------------------------------------------------------


def _output_findings(ctx: CheckContext, *, run_recorded: bool) -> list[Finding]:
    trace = ctx.trace
    out: list[Finding] = []
    backends = ctx.backends()
    if not backends:
        return out
    for run in ctx.replay().runs:
        if run.variant == "eager":
            _report_run(trace, run, None, "verify-output", out)
    plan = trace.plan
    if run_recorded and plan is not None and plan.backend in backends:
        view = plan_view(trace)
        recorded = ctx.replay(ReplayOptions(layer=ctx.options.layer, plan=PlanSource.RECORDED))
        for run in recorded.runs:
            if run.variant == "recorded plan":
                _report_run(trace, run, view, "recorded-verify-output", out)
    return out


def _report_run(trace: Trace, run: BackendRun, view: PlanVisibility | None, check: str, out: list[Finding]) -> None:
    recorded = check == "recorded-verify-output"
    if run.status is RunStatus.ERROR:
        if recorded and run.reason and run.reason.endswith("(not launched)"):
            return  # an out-of-cache plan: invariants explains it
        out.append(
            _finding(
                trace,
                check,
                evidence=f"{run.name} ({run.variant}) raised on this verify step: {run.reason}",
                cause="the kernel rejected the verify plan" + (" the engine recorded" if recorded else " derived from the draft tree"),
                backend=run.name,
                variant=run.variant,
            )
        )
        return
    if run.status is not RunStatus.FAILED or run.comparison is None:
        return
    ratio = torch.maximum(run.comparison.row_errors, run.comparison.lse_errors)  # [T, Hq]
    failing = torch.nonzero((ratio > 1).any(-1)).flatten().tolist()
    if not failing:
        return
    batch = trace.batch
    qo = batch.qo_indptr
    parts, columns_of_first = [], []
    for t in failing[:MAX_ROWS_SHOWN]:
        b = int(torch.searchsorted(qo, torch.tensor(t), right=True)) - 1
        r = t - int(qo[b])
        text = f"row {t} (request {b}, draft token {r}, {float(ratio[t].max()):.3g}x tolerance)"
        if recorded:
            wrong = _wrong_columns(trace, view, b, r)
            if t == failing[0]:
                columns_of_first = wrong
            if wrong is None:
                text += ": the plan's mask for this row could not be read"
            elif wrong:
                shown = ", ".join(f"{c} ({'should be visible' if e else 'should be hidden'})" for c, e in wrong[:MAX_COLUMNS_SHOWN])
                text += f": its recorded mask differs from the true mask at columns {shown}" + (" ..." if len(wrong) > MAX_COLUMNS_SHOWN else "")
            else:
                text += ": its recorded mask row matches the true mask"
        parts.append(text)
    t0 = failing[0]
    b0 = int(torch.searchsorted(qo, torch.tensor(t0), right=True)) - 1
    head = int(torch.argmax(ratio[t0]))
    if not recorded:
        cause = "the kernel applies a correct tree mask wrongly: the plan was derived from the draft tree, so the kernel (or its mask packing) is at fault"
    elif columns_of_first:
        cause = "the recorded plan's tree mask shows or hides the listed columns at the failing rows, so those rows attend to the wrong keys"
    else:
        cause = "the failing rows' masks are right: the recorded plan's indices, offsets or lengths make them wrong (see the invariants findings)"
    out.append(
        _finding(
            trace,
            check,
            request=b0,
            row=t0,
            column=columns_of_first[0][0] if columns_of_first else None,
            head=head,
            evidence=f"{run.name} ({run.variant}): {len(failing)} of {batch.num_tokens} rows fail against the reference; " + "; ".join(parts),
            cause=cause,
            backend=run.name,
            variant=run.variant,
            failing_rows=failing[:32],
            columns=[c for c, _ in columns_of_first] if columns_of_first else [],
        )
    )


def _wrong_columns(trace: Trace, view: PlanVisibility | None, b: int, r: int) -> list[tuple[int, bool]] | None:
    """Columns where the plan's visibility at (request b, draft row r) differs from the truth: (column, should see)."""
    if view is None or b not in view.blocks:
        return None
    truth = visibility(trace, b)[r]
    seen = view.blocks[b][r]
    return [(int(c), bool(truth[c])) for c in torch.nonzero(seen != truth).flatten()]
