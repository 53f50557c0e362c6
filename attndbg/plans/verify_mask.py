"""A verify step's recorded plan, judged by what its kernel will see, read by the layout its
backend declares (backends/plan_layout.py MaskReading): a mask of FULL or covered-KV blocks, a
two-call verify's expand tables or a plain causal plan, turned into a PlanVisibility and compared
with the true visibility (mask-indptr, mask-length, window-ignored, window-offset,
plan-mask-missing, mask-prefix-hidden, mask-mismatch: the tree-mask detector's findings).

Read by the tree-mask detector (detectors/tree_mask/) and by the mistake model that applies the
recorded plan's mask (diagnose/mask_models.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends.plan_layout import ExpandTables, MaskReading, PackedMask, PlanLayout, WindowList
from attndbg.detector_api.findings import Finding, FindingClass, finding
from attndbg.plans.kv import kv_coverage, plan_layout
from attndbg.plans.tree_blocks import as_bool, describe_column, mismatch_cause, tree_block
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility

KIND = FindingClass.TREE_MASK  # what the plan's kernel would get wrong: the tree-mask detector's finding


@dataclass(frozen=True)
class PlanVisibility:
    """What the recorded plan's kernel will let each draft row see, per real request."""

    kind: str  # "mask" | "causal" | "expand"
    blocks: dict[int, Tensor]  # request -> [n, prefix + n] bool (requests the plan leaves unclear are absent)


def _layout(trace: Trace) -> PlanLayout | None:
    return plan_layout(trace, trace.plan)


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
    visibility comparisons against the truth. None when the plan's backend declares no layout or
    its KV structure is malformed (invariants reports that)."""
    out = out if out is not None else []
    layout = _layout(trace)
    coverage = kv_coverage(trace)
    if layout is None or coverage is None:
        return None
    if layout.mask in (MaskReading.FULL_BLOCKS, MaskReading.COVERED_BLOCKS):
        view = _mask_view(trace, layout, coverage, out)
    elif layout.mask is MaskReading.EXPAND_CALL and layout.expand is not None:
        view = _expand_view(trace, layout.expand, coverage, out)
    else:
        view = _causal_view(trace, coverage, _kernel_window(trace, layout.window))
    if view is not None:
        _compare_plan(trace, layout, view, out)
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


def _mask_view(trace: Trace, layout: PlanLayout, coverage, out: list[Finding]) -> PlanVisibility | None:
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    widths = []
    for b in range(batch.batch_size):
        prefix = int(batch.prefix_lens[b])
        if layout.mask is MaskReading.COVERED_BLOCKS and coverage[b] is not None:
            widths.append(coverage[b][1] - coverage[b][0])  # the block spans the KV the plan lists
        else:
            widths.append(prefix + n)
    geometry = MaskGeometry.full(rows=torch.full((batch.batch_size,), n), prefix_lens=batch.prefix_lens, columns=widths)
    if "custom_mask" not in plan.tensors and layout.packed_mask is not None:
        unpacked = _unpacked(trace, layout.packed_mask, geometry, out)
        if unpacked is None:
            return None
        mask, indptr = unpacked
    else:
        mask = plan.tensors["custom_mask"]
        indptr = plan.tensors.get("mask_indptr")
        if indptr is None:
            out.append(finding(KIND, "mask-indptr", step=trace.source.step, field="plan.mask_indptr", evidence="the plan carries custom_mask but no mask_indptr", cause="the kernel cannot find each request's block: mask_indptr was not passed with the mask"))
            return None
        indptr = indptr.to(torch.int64)
        if indptr.numel() < batch.batch_size + 1 or int(indptr[0]) != 0 or bool((indptr.diff() < 0).any()):
            return None  # invariants names the bad element
    sizes = indptr.diff()[: batch.batch_size]
    expected_sizes = geometry.sizes
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
            finding(
                KIND,
                "mask-indptr",
                step=trace.source.step,
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
    buffer = trace.buffers.get("plan.custom_mask")
    if buffer is not None and buffer.capacity and mask.numel() > end:
        mask = mask[:end]  # a buffer allocated once at a fixed size: the kernel reads its first `end` elements
    if mask.numel() != end:
        short = mask.numel() < end
        tail = as_bool(mask[end:])
        stale = int((~tail).sum())  # SGLang fills a FULL mask with True before writing the tree
        out.append(
            finding(
                KIND,
                "mask-length",
                step=trace.source.step,
                field=f"plan.custom_mask[{min(end, mask.numel())}]",
                evidence=f"plan.custom_mask has {mask.numel()} elements but mask_indptr[-1] = {end} ({'short' if short else 'long'} by {abs(end - mask.numel())})"
                + ("" if short else f"; plan.custom_mask[{end}:] " + (f"holds {stale} False element(s)" if stale else "is all True")),
                cause=(
                    "the mask was built for fewer KV columns than the plan's requests have; the kernel reads past the buffer (FlashInfer #3176)"
                    if short
                    else (
                        "a stale tail: the engine sized the mask for this step but it holds an earlier, larger step's tree rows past its offsets (a reused buffer, not refilled)"
                        if stale
                        else "the mask buffer is longer than its offsets: sized from other lengths (a wrong seq_lens_sum) than the ones mask_indptr was built from"
                    )
                ),
                expected=end,
                found=mask.numel(),
            )
        )
        if short:
            return None
        mask = mask[:end]
    bits = as_bool(mask)
    window = _kernel_window(trace, layout.window)
    full = layout.mask is MaskReading.FULL_BLOCKS
    windows = layout.window_list if full else None
    offsets = plan.tensors.get(windows.offsets) if windows is not None else None
    window_starts = _window_list_starts(trace, windows) if windows is not None else None
    skip_prefix = full and layout.skip_prefix is not None and bool(plan.scalars.get(layout.skip_prefix, True))
    blocks = {}
    for b in range(batch.batch_size):
        if coverage[b] is None:
            continue
        prefix = int(batch.prefix_lens[b])
        start, _ = coverage[b]
        if window_starts is not None:
            if window_starts[b] is None:
                continue  # a malformed window list: invariants' window-kv names it
            start = window_starts[b]
        block = geometry.block(bits, b)  # the recorded offsets are the geometry's: checked above
        if full:
            offset = int(offsets[b]) if offsets is not None and b < offsets.numel() else 0
            if offset != start:
                out.append(_offset_finding(trace, layout, b, offset, start, offsets is not None))
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


def _unpacked(trace: Trace, packed: PackedMask, geometry: MaskGeometry, out: list[Finding]) -> tuple[Tensor, Tensor] | None:
    """A mask the plan holds packed (FlashInfer's plan(): each request's [n, KV listed] block
    little-endian in whole bytes at its byte offset), as bools over the geometry's offsets; None
    when a request's bytes do not hold its block (with the finding) or lie past the buffer."""
    plan, bs = trace.plan, trace.batch.batch_size
    data, offsets = plan.tensors.get(packed.tensor), plan.tensors.get(packed.indptr)
    if data is None or offsets is None:
        present = packed.tensor if data is not None else packed.indptr
        missing = packed.indptr if data is not None else packed.tensor
        out.append(finding(KIND, "mask-indptr", step=trace.source.step, field=f"plan.{missing}", evidence=f"the plan carries {present} but no {missing}", cause="the kernel cannot find each request's packed block: the mask and its byte offsets were not recorded together"))
        return None
    offsets = offsets.to(torch.int64)
    if offsets.dim() != 1 or offsets.numel() < bs + 1 or int(offsets[0]) != 0 or bool((offsets.diff() < 0).any()):
        return None  # invariants names the bad element
    bits = geometry.sizes
    want = PackedMask.byte_sizes(bits)
    found = offsets.diff()[:bs]
    if bool((found != want).any()):
        b = int(torch.nonzero(found != want)[0])
        out.append(
            finding(
                KIND,
                "mask-indptr",
                step=trace.source.step,
                request=b,
                field=f"plan.{packed.indptr}[{b + 1}]",
                evidence=f"plan.{packed.indptr} gives request {b} {int(found[b])} byte(s) of packed mask, but its block of {int(geometry.rows[b])} x {int(geometry.columns[b])} = {int(bits[b])} elements packs to {int(want[b])}",
                cause="the mask was packed for other lengths than the KV the plan lists (FlashInfer packs each q_len x kv_len block into whole bytes at these offsets)",
                expected=int(want[b]),
                found=int(found[b]),
            )
        )
        return None
    if data.numel() < int(offsets[bs]):
        return None  # the kernel would read past the bytes: the plan's view bounds it (invariants)
    return PackedMask.unpack(data, offsets, bits), geometry.indptr


def _window_list_starts(trace: Trace, windows: WindowList) -> list[int | None] | None:
    """Per real request, the first prefix column of the plan's window list (SGLang's
    `window_kv_indptr` / `window_kv_indices`), which a sliding-window layer's kernel reads instead
    of the plan's ids; None when the plan has no window list or the layer has no window (then the
    plan's ids are read)."""
    plan, batch = trace.plan, trace.batch
    indptr = plan.tensors.get(windows.indptr)
    if trace.model.sliding_window < 0 or indptr is None or windows.indices not in plan.tensors or indptr.dim() != 1:
        return None
    indptr = indptr.to(torch.int64)
    if indptr.numel() < batch.batch_size + 1:
        return [None] * batch.batch_size
    lens = indptr.diff()[: batch.batch_size]
    # Verify and extend lists hold the tail of the prefix: SGLang's window_kv_start_idx = prefix - len.
    return [int(p) - int(n) if 0 <= int(n) <= int(p) else None for p, n in zip(batch.prefix_lens, lens)]


def _offset_finding(trace: Trace, layout: PlanLayout, b: int, offset: int, start: int, present: bool) -> Finding:
    windows = layout.window_list
    assert windows is not None  # FULL_BLOCKS offsets are read only through a window list
    listed = windows.indices if windows.indptr in trace.plan.tensors and trace.model.sliding_window >= 0 else layout.ids
    return finding(
        KIND,
        "window-offset",
        step=trace.source.step,
        request=b,
        field=f"plan.{windows.offsets}[{b}]" if present else f"plan.{windows.offsets}",
        evidence=(
            f"plan.{listed} hold request {b}'s prefix from column {start} (the sliding window's), but "
            + (f"plan.{windows.offsets}[{b}] = {offset}" if present else f"the plan has no {windows.offsets}")
            + f": the kernel reads the mask {abs(start - offset)} column(s) off"
        ),
        cause="the mask is indexed as if the plan held the whole prefix: the sliding window's KV offset (SGLang's window_kv_offsets) is missing or wrong",
        expected=start,
        found=offset,
    )


def _expand_view(trace: Trace, expand: ExpandTables, coverage, out: list[Finding]) -> PlanVisibility | None:
    """Two-call verify: call 1 covers the prefix, call 2 row b*n+i covers the draft slots it lists."""
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    table, lens = plan.tensors.get(expand.table), plan.tensors.get(expand.lengths)
    if table is None or lens is None or table.dim() != 2:
        out.append(finding(KIND, "plan-mask-missing", step=trace.source.step, field=f"plan.{expand.table}", evidence=f"a two-call verify plan without {expand.table} / {expand.lengths}", cause="the second (draft-block) call of the two-call verify was not planned"))
        return None
    if table.shape[0] < batch.batch_size * n or lens.numel() < batch.batch_size * n:
        out.append(
            finding(
                KIND,
                "mask-length",
                step=trace.source.step,
                field=f"plan.{expand.table}",
                evidence=f"plan.{expand.table} has {table.shape[0]} rows and {expand.lengths} {lens.numel()}, expected one per draft token = {batch.batch_size * n}",
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


def _compare_plan(trace: Trace, layout: PlanLayout, view: PlanVisibility, out: list[Finding]) -> None:
    """One finding per check id at its first (request, row, column), against the true visibility."""
    batch = trace.batch
    plan = trace.plan
    first: dict[str, tuple] = {}
    counts: dict[str, int] = {}
    for b, seen in sorted(view.blocks.items()):
        truth = visibility(trace, b)
        prefix = int(batch.prefix_lens[b])
        unwindowed = tree_block(trace, b)
        # Columns before the plan's KV start are outside every row's window (kv_coverage's rule),
        # so a difference is always in what the plan's kernel will do with what it reads.
        for r, c in torch.nonzero(seen != truth).tolist():
            found = bool(seen[r, c])
            check = _classify(trace, layout, view, b, r, c, found, bool(unwindowed[r, c]))
            counts[check] = counts.get(check, 0) + 1
            first.setdefault(check, (b, r, c, found))
    for check, (b, r, c, found) in first.items():
        prefix = int(batch.prefix_lens[b])
        row = int(batch.qo_indptr[b]) + r
        field = _plan_field(trace, layout, view, b, r, c)
        if check == "window-offset":
            field = "plan.scalars." + layout.window
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
            cause = mismatch_cause(trace, b, r, c, found, found_draft)
        out.append(
            finding(
                KIND,
                check,
                step=trace.source.step,
                request=b,
                row=row,
                column=c,
                field=field,
                evidence=(
                    f"with the recorded {plan.backend} plan, draft row {r} of request {b} (step row {row}) {'sees' if found else 'cannot see'} "
                    f"{describe_column(trace, b, c)}; it should {'not ' if found else ''}see it ({field}); {counts[check]} such (row, column) pair(s)"
                ),
                cause=cause,
                expected=not found,
                found=found,
                pairs=counts[check],
            )
        )


def _classify(trace: Trace, layout: PlanLayout, view: PlanVisibility, b: int, r: int, c: int, found: bool, tree_allows: bool) -> str:
    prefix = int(trace.batch.prefix_lens[b])
    window = trace.model.sliding_window
    if found and c < prefix and tree_allows and window >= 0:
        return "window-ignored"
    if not found and view.kind != "expand" and window >= 0:
        kernel_window = _kernel_window(trace, layout.window)
        if not bool(_index_window(prefix, trace.spec.draft_token_num, prefix + trace.spec.draft_token_num, kernel_window)[r, c]):
            return "window-offset"
    if view.kind == "causal":
        return "plan-mask-missing"
    if view.kind == "mask" and not found and c < prefix:
        return "mask-prefix-hidden"
    return "mask-mismatch"


def _plan_field(trace: Trace, layout: PlanLayout, view: PlanVisibility, b: int, r: int, c: int) -> str:
    plan = trace.plan
    n = trace.spec.draft_token_num
    if view.kind == "mask" and "custom_mask" not in plan.tensors and layout.packed_mask is not None:
        # Packed: the byte of the request's block holding (r, c), and its bit (little-endian).
        coverage = kv_coverage(trace)
        start = coverage[b][0] if coverage is not None and coverage[b] is not None else 0
        width = trace.batch.prefix_lens[b] + n - start
        element = r * int(width) + c - start
        byte = int(plan.tensors[layout.packed_mask.indptr][b]) + element // 8
        return f"plan.{layout.packed_mask.tensor}[{byte}] bit {element % 8}"
    if view.kind == "mask":
        geometry = MaskGeometry.from_indptr(plan.tensors["mask_indptr"], rows=n, prefix_lens=trace.batch.prefix_lens)
        return f"plan.custom_mask[{geometry.element(b, r, c)}]"
    if view.kind == "expand" and layout.expand is not None:
        return f"plan.{layout.expand.table}[{b * n + r}]"
    return "plan.scalars.causal" if "causal" in plan.scalars else "plan.custom_mask"
