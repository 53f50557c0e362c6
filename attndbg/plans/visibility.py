"""What a verify step's recorded plan lets each draft row see, read by the layout its backend
declares (backends/plan_layout.py MaskReading): a mask of FULL or covered-KV blocks (as bools, or
packed as FlashInfer's plan() keeps it), a two-call verify's expand tables, a sliding-window call's
per-draft-token tables, or a plain causal plan. Where the kernel applies its own window to a call in
FA3's layout, it is applied as FlashAttention does: by listed key index, a call's q_len rows aligned
to its last keys (bottom-right).
The result is a `PlanVisibility` per real request, or the structural problems that stop the reading
(data; the tree-mask detector words them and compares the visibility with the draft tree's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends.plan_layout import ExpandTables, MaskReading, PackedMask, PlanLayout, WindowList
from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.trace.mask_geometry import MaskGeometry, as_bool
from attndbg.trace.offsets import broken
from attndbg.trace.schema import Trace

Coverage = list[tuple[int, int] | None]  # per real request, the KV columns [start, end) the plan lists


@dataclass(frozen=True)
class PlanVisibility:
    """What the recorded plan's kernel will let each draft row see, per real request."""

    kind: str  # "mask" | "causal" | "expand" | "window"
    blocks: dict[int, Tensor]  # request -> [n, prefix + n] bool (requests the plan leaves unclear are absent)


@dataclass(frozen=True)
class MaskSettings:
    """The scalars the kernel applies the mask with (plans/scalars.py reads them)."""

    window: int  # the kernel's own window by KV index (-1: none)
    skip_prefix: bool  # FULL blocks: the kernel ignores the prefix columns (they count as visible)
    window_right: int = -1  # a non-causal call's right window by KV index (-1: none)


def index_window(prefix: int, n: int, width: int, window: int) -> Tensor:
    """[n, width] what a kernel window by KV index allows: query i at column prefix + i."""
    if window < 0:
        return torch.ones(n, width, dtype=torch.bool)
    return (prefix + torch.arange(n))[:, None] - torch.arange(width)[None, :] <= window


def read_visibility(trace: Trace, layout: PlanLayout, coverage: Coverage, settings: MaskSettings) -> tuple[PlanVisibility | None, list[PlanProblem]]:
    """The recorded plan's effective visibility, with the problems met reading it (in the order
    met; some stop the reading: None)."""
    problems: list[PlanProblem] = []
    if layout.mask in (MaskReading.FULL_BLOCKS, MaskReading.COVERED_BLOCKS):
        view = _mask_view(trace, layout, coverage, settings, problems)
    elif layout.mask is MaskReading.EXPAND_CALL and layout.expand is not None:
        view = _per_draft_view(trace, layout.expand, coverage, settings, problems, prefix_call=True)
    elif layout.mask is MaskReading.WINDOW_CALL and layout.expand is not None:
        view = _per_draft_view(trace, layout.expand, coverage, settings, problems, prefix_call=False)
    else:
        view = _causal_view(trace, coverage, settings.window)
    return view, problems


def _causal_view(trace: Trace, coverage: Coverage, window: int) -> PlanVisibility:
    n = trace.spec.draft_token_num
    blocks = {}
    for b, span in enumerate(coverage):
        if span is None:
            continue
        prefix = int(trace.batch.prefix_lens[b])
        cols = torch.arange(prefix + n)
        seen = (cols[None, :] <= (prefix + torch.arange(n))[:, None]) & (cols >= span[0])[None, :]
        blocks[b] = seen & index_window(prefix, n, prefix + n, window)
    return PlanVisibility("causal", blocks)


def mask_widths(trace: Trace, layout: PlanLayout, coverage: Coverage) -> list[int]:
    """Per real request, the columns of its mask block: the KV the plan lists (COVERED_BLOCKS), else
    its whole row (prefix + n)."""
    n = trace.spec.draft_token_num
    widths = []
    for b in range(trace.batch.batch_size):
        if layout.mask is MaskReading.COVERED_BLOCKS and coverage[b] is not None:
            widths.append(coverage[b][1] - coverage[b][0])
        else:
            widths.append(int(trace.batch.prefix_lens[b]) + n)
    return widths


def _mask_view(trace: Trace, layout: PlanLayout, coverage: Coverage, settings: MaskSettings, problems: list[PlanProblem]) -> PlanVisibility | None:
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    widths = mask_widths(trace, layout, coverage)
    geometry = MaskGeometry.full(rows=torch.full((batch.batch_size,), n), prefix_lens=batch.prefix_lens, columns=widths)
    if "custom_mask" not in plan.tensors and layout.packed_mask is not None:
        unpacked = _unpacked(trace, layout.packed_mask, geometry, problems)
        if unpacked is None:
            return None
        mask, indptr = unpacked
    else:
        mask = plan.tensors["custom_mask"]
        indptr = plan.tensors.get("mask_indptr")
        if indptr is None:
            problems.append(PlanProblem(ProblemKind.MASK_OFFSETS_MISSING, "mask_indptr", detail={"present": "custom_mask"}))
            return None
        indptr = indptr.to(torch.int64)
        if indptr.numel() < batch.batch_size + 1 or broken(indptr) is not None:
            return None  # invariants names the bad element
    sizes = indptr.diff()[: batch.batch_size]
    expected_sizes = geometry.sizes
    if bool((sizes != expected_sizes).any()):
        b = int(torch.nonzero(sizes != expected_sizes)[0])
        detail = {"n": n, "prefix": int(batch.prefix_lens[b]), "width": widths[b]}
        problems.append(PlanProblem(ProblemKind.MASK_BLOCK_SIZE, "mask_indptr", request=b, index=b + 1, expected=int(expected_sizes[b]), found=int(sizes[b]), detail=detail))
        return None
    end = int(indptr[-1])
    buffer = trace.buffers.get("plan.custom_mask")
    if buffer is not None and buffer.capacity and mask.numel() > end:
        mask = mask[:end]  # a buffer allocated once at a fixed size: the kernel reads its first `end` elements
    if mask.numel() != end:
        short = mask.numel() < end
        stale = int((~as_bool(mask[end:])).sum())  # SGLang fills a FULL mask with True before writing the tree
        detail = {"stale": stale, "computed": layout.mask_offsets_computed, **_past_end(indptr, geometry, mask.numel())}
        problems.append(PlanProblem(ProblemKind.MASK_LENGTH, "custom_mask", request=detail.get("request"), index=min(end, mask.numel()), expected=end, found=mask.numel(), detail=detail))
        if short or layout.mask_offsets_computed:
            return None  # read past its end, or its blocks read where they were not laid out
        mask = mask[:end]
    return _blocks(trace, layout, coverage, settings, geometry, as_bool(mask), problems)


def _blocks(trace: Trace, layout: PlanLayout, coverage: Coverage, settings: MaskSettings, geometry: MaskGeometry, bits: Tensor, problems: list[PlanProblem]) -> PlanVisibility:
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    full = layout.mask is MaskReading.FULL_BLOCKS
    windows = layout.window_list if full else None
    offsets = plan.tensors.get(windows.offsets) if windows is not None else None
    window_starts = _window_list_starts(trace, windows) if windows is not None else None
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
                problems.append(_window_offset(trace, layout, b, offset, start, offsets is not None))
                continue
            seen = block.clone()
            if settings.skip_prefix:
                seen[:, :prefix] = True
        else:
            seen = torch.zeros(n, prefix + n, dtype=torch.bool)
            seen[:, start:] = block
        seen[:, :start] = False
        blocks[b] = seen & index_window(prefix, n, prefix + n, settings.window)
    return PlanVisibility("mask", blocks)


def _unpacked(trace: Trace, packed: PackedMask, geometry: MaskGeometry, problems: list[PlanProblem]) -> tuple[Tensor, Tensor] | None:
    """A mask the plan holds packed (FlashInfer's plan(): each request's [n, KV listed] block
    little-endian in whole bytes at its byte offset), as bools over the geometry's offsets; None
    when a request's bytes do not hold its block (with the problem) or lie past the buffer."""
    plan, bs = trace.plan, trace.batch.batch_size
    data, offsets = plan.tensors.get(packed.tensor), plan.tensors.get(packed.indptr)
    if data is None or offsets is None:
        present = packed.tensor if data is not None else packed.indptr
        missing = packed.indptr if data is not None else packed.tensor
        problems.append(PlanProblem(ProblemKind.MASK_OFFSETS_MISSING, missing, detail={"present": present}))
        return None
    offsets = offsets.to(torch.int64)
    if offsets.numel() < bs + 1 or broken(offsets) is not None:
        return None  # invariants names the bad element
    bits = geometry.sizes
    want = PackedMask.byte_sizes(bits)
    found = offsets.diff()[:bs]
    if bool((found != want).any()):
        b = int(torch.nonzero(found != want)[0])
        detail = {"rows": int(geometry.rows[b]), "columns": int(geometry.columns[b]), "bits": int(bits[b])}
        problems.append(PlanProblem(ProblemKind.PACKED_BLOCK_BYTES, packed.indptr, request=b, index=b + 1, expected=int(want[b]), found=int(found[b]), detail=detail))
        return None
    if data.numel() < int(offsets[bs]):
        # The kernel reads the blocks' bytes past the buffer (FlashInfer #3176: plan() packed a mask
        # built for other lengths unchecked).
        detail = {"stale": 0, "computed": True, "packed": True, **_past_end(offsets, geometry, data.numel(), packed=True)}
        problems.append(PlanProblem(ProblemKind.MASK_LENGTH, packed.tensor, request=detail["request"], index=data.numel(), expected=int(offsets[bs]), found=data.numel(), detail=detail))
        return None
    return PackedMask.unpack(data, offsets, bits), geometry.indptr


def _past_end(offsets: Tensor, geometry: MaskGeometry, length: int, packed: bool = False) -> dict[str, int]:
    """Where a kernel reading the blocks at `offsets` first reads past a mask of `length` elements
    (bytes when `packed`): the request, its block's [start, stop) and shape, and the block's first
    element read past the end (its row and column); empty when no block reaches past it."""
    ends = offsets[1 : geometry.sizes.numel() + 1]
    past = torch.nonzero(ends > length).flatten()
    if not past.numel():
        return {}
    b = int(past[0])
    start = int(offsets[b])
    element = max(length - start, 0) * (8 if packed else 1)  # the first element of the block not in the mask
    columns = int(geometry.columns[b])
    return {"request": b, "start": start, "stop": int(offsets[b + 1]), "rows": int(geometry.rows[b]), "columns": columns, "element": element, "row": element // columns, "column": element % columns}


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


def _window_offset(trace: Trace, layout: PlanLayout, b: int, offset: int, start: int, present: bool) -> PlanProblem:
    windows = layout.window_list
    assert windows is not None  # FULL_BLOCKS offsets are read only through a window list
    listed = windows.indices if windows.indptr in trace.plan.tensors and trace.model.sliding_window >= 0 else layout.ids
    return PlanProblem(ProblemKind.WINDOW_OFFSET, windows.offsets, request=b, index=b if present else None, expected=start, found=offset, detail={"present": present, "listed": listed})


def call_window(q_len: int, keys: int, left: int, right: int) -> Tensor:
    """[q_len, keys] what FlashAttention's window (left, right) lets a call's rows see, by listed
    key index: row i is aligned to key keys - q_len + i (bottom-right); -1 leaves a side open."""
    aligned = (keys - q_len + torch.arange(q_len))[:, None]
    key = torch.arange(keys)[None, :]
    allowed = torch.ones(q_len, keys, dtype=torch.bool)
    if left >= 0:
        allowed &= key >= aligned - left
    if right >= 0:
        allowed &= key <= aligned + right
    return allowed


def _per_draft_tables(trace: Trace, expand: ExpandTables, problems: list[PlanProblem]) -> tuple[Tensor, Tensor] | None:
    """The (table, lengths) of a call with a row per draft token; None (with the problem) when
    absent or short of the step's draft tokens."""
    plan, batch = trace.plan, trace.batch
    n = trace.spec.draft_token_num
    table, lens = plan.tensors.get(expand.table), plan.tensors.get(expand.lengths)
    if table is None or lens is None or table.dim() != 2:
        problems.append(PlanProblem(ProblemKind.EXPAND_MISSING, expand.table, detail={"lengths": expand.lengths}))
        return None
    if table.shape[0] < batch.batch_size * n or lens.numel() < batch.batch_size * n:
        detail = {"lengths": expand.lengths, "rows": table.shape[0], "entries": lens.numel()}
        problems.append(PlanProblem(ProblemKind.EXPAND_ROWS, expand.table, expected=batch.batch_size * n, found=table.shape[0], detail=detail))
        return None
    return table, lens


def _listed(table: Tensor, lens: Tensor, r: int, window: int) -> Tensor:
    """Row r's listed slots that its one causal query sees under the window (its last keys)."""
    listed = table[r, : max(min(int(lens[r]), table.shape[1]), 0)].to(torch.int64)
    return listed[call_window(1, listed.numel(), window, 0)[0]]


def _per_draft_view(trace: Trace, tables: ExpandTables, coverage: Coverage, settings: MaskSettings, problems: list[PlanProblem], *, prefix_call: bool) -> PlanVisibility | None:
    """A call with a row per draft token: row b*n+i is draft token i's own causal query over the
    slots it lists, of which the kernel's window keeps the last window + 1.

    `prefix_call`: a two-call verify (EXPAND_CALL): the rows list the draft slots only, and call 1
    covers the prefix, non-causal, under the window as FlashAttention applies it to that call (the
    n draft rows aligned to the prefix's last n keys, whatever their depths). Else a sliding-window
    layer's only call (WINDOW_CALL, FA3's swa_spec_metadata): the rows list the prefix too."""
    batch = trace.batch
    n = trace.spec.draft_token_num
    read = _per_draft_tables(trace, tables, problems)
    if read is None:
        return None
    table, lens = read
    blocks = {}
    for b in range(batch.batch_size):
        if coverage[b] is None:
            continue
        prefix, start = int(batch.prefix_lens[b]), coverage[b][0]
        slots = batch.request_slots(b)[: prefix + n].to(torch.int64)
        seen = torch.stack([torch.isin(slots, _listed(table, lens, b * n + i, settings.window)) for i in range(n)])
        if prefix_call:
            seen[:, :prefix] = False
            seen[:, start:prefix] = call_window(n, prefix - start, settings.window, settings.window_right)
        blocks[b] = seen
    return PlanVisibility("expand" if prefix_call else "window", blocks)
