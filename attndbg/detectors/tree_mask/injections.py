"""Mistakes in speculative tree masks that the tree-mask detector finds.

A wrong tree mask lives in what the engine recorded: `spec.custom_mask` (in its layout) and the
plan's `custom_mask` / `mask_indptr` (FULL layout) or, for a two-call verify, the expand tables its
backend's layout names (backends/plan_layout.py). Where the engine builds one mask and hands it to the
backend, a mistake in building it reaches both, so both are changed. Placement (request, row,
column) comes from a generator seeded with the trace's seed, or by keyword for tests. A mistake
that does not apply raises ValueError saying what the trace needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from attndbg.backends.plan_layout import ExpandTables
from attndbg.plans.reading import read
from attndbg.trace import tree
from attndbg.trace.mask_geometry import MaskGeometry, reverse_bits, word_bits
from attndbg.trace.schema import ForwardMode, MaskLayout, Plan, Spec, Trace


def _rng(trace: Trace, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(trace.seed * 1000003 + salt)


def _pick(options: list, g: torch.Generator):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _need_verify(trace: Trace, kind: str) -> Spec:
    if not trace.is_tree_verify:
        raise ValueError(f"{kind} is a tree-mask mistake: it needs a TARGET_VERIFY trace with a draft tree (synth verify)")
    return trace.spec


def _with(trace: Trace, *, spec_mask: Tensor | None = None, tensors: dict[str, Tensor] | None = None) -> Trace:
    if spec_mask is not None:
        trace = replace(trace, spec=replace(trace.spec, custom_mask=spec_mask))
    if tensors:
        plan = trace.plan
        trace = replace(trace, plan=Plan(backend=plan.backend, tensors={**plan.tensors, **tensors}, scalars=dict(plan.scalars)))
    return trace


def _plan_geometry(trace: Trace) -> MaskGeometry | None:
    """Where each real request's [n, width] block lies in the plan's FULL custom_mask, by its mask_indptr."""
    plan = trace.plan
    if plan is None or "custom_mask" not in plan.tensors or "mask_indptr" not in plan.tensors:
        return None
    return MaskGeometry.from_indptr(plan.tensors["mask_indptr"], rows=trace.spec.draft_token_num, prefix_lens=trace.batch.prefix_lens)


def _spec_geometry(trace: Trace) -> MaskGeometry:
    return MaskGeometry.of_spec(trace.spec, trace.batch.prefix_lens)


def _set_spec_bit(trace: Trace, mask: Tensor, b: int, row: int, draft: int, value: bool) -> Tensor:
    geometry = _spec_geometry(trace)
    column = int(trace.batch.prefix_lens[b]) + draft
    at = geometry.element(b, row, column)
    mask = mask.clone()
    if trace.spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED:
        bit = column - geometry.first_column(b)
        word = int(mask[at])
        mask[at] = word | (1 << bit) if value else word & ~(1 << bit)
    else:
        mask[at] = value
    return mask


def sibling_visible(trace: Trace, *, request: int | None = None, row: int | None = None, column: int | None = None) -> Trace:
    """One draft token sees its sibling: a next-sibling link followed as a parent link while building the tree mask.

    `row` and `column` are draft-token indices of request `request` with the same parent.
    """
    spec = _need_verify(trace, "sibling-visible")
    pairs = [
        (b, i, j)
        for b in range(trace.batch.batch_size)
        for i in range(1, spec.draft_token_num)
        for j in range(1, spec.draft_token_num)
        if i != j and int(spec.parents[b, i]) == int(spec.parents[b, j])
    ]
    if request is None or row is None or column is None:
        if not pairs:
            raise ValueError("sibling-visible: the draft trees are chains (topk=1), no token has a sibling")
        request, row, column = _pick(pairs, _rng(trace, 11))
    if (request, row, column) not in pairs:
        raise ValueError(f"sibling-visible: draft tokens {row} and {column} of request {request} are not siblings")
    spec_mask = _set_spec_bit(trace, spec.custom_mask, request, row, column, True) if spec.custom_mask is not None else None
    tensors = {}
    geometry = _plan_geometry(trace)
    if geometry is not None:
        mask = trace.plan.tensors["custom_mask"].clone()
        mask[geometry.element(request, row, int(trace.batch.prefix_lens[request]) + column)] = True
        tensors["custom_mask"] = mask
    elif (expand := _expand_tables(trace)) is not None:
        tensors.update(_expand_add(trace, expand, request, row, column))
    if spec_mask is None and not tensors:
        raise ValueError("sibling-visible: the trace records no tree mask (neither spec.custom_mask nor a plan mask)")
    return _with(trace, spec_mask=spec_mask, tensors=tensors)


def _expand_tables(trace: Trace) -> ExpandTables | None:
    """The plan's two-call verify tables, where its backend's layout has them and the plan holds them."""
    plan = trace.plan
    layout = read(trace).layout
    expand = layout.expand if layout is not None else None
    return expand if expand is not None and expand.table in plan.tensors else None


def _expand_add(trace: Trace, expand: ExpandTables, b: int, row: int, column: int) -> dict[str, Tensor]:
    """Two-call verify: list draft token `column`'s slot among row's visible slots."""
    plan = trace.plan
    n = trace.spec.draft_token_num
    r = b * n + row
    table = plan.tensors[expand.table].clone()
    lens = plan.tensors[expand.lengths].clone()
    prefix = int(trace.batch.prefix_lens[b])
    slot = int(trace.batch.request_slots(b)[prefix + column])
    k = int(lens[r])
    at = int(torch.nonzero(table[r] == slot)[0])
    table[r, k], table[r, at] = table[r, at].clone(), table[r, k].clone()
    lens[r] = k + 1
    cu = torch.nn.functional.pad(torch.cumsum(lens.to(torch.int64), 0), (1, 0)).to(plan.tensors[expand.cu_seqlens_k].dtype)
    return {expand.table: table, expand.lengths: lens, expand.cu_seqlens_k: cu}


def bit_order(trace: Trace) -> Trace:
    """Bit-packed tree mask packed big-endian (bit 0 = last draft token) where SGLang and FlashInfer pack little-endian."""
    spec = _need_verify(trace, "bit-order")
    if spec.mask_layout is not MaskLayout.QLEN_ONLY_BITPACKED or spec.custom_mask is None:
        raise ValueError("bit-order needs a bit-packed mask: synth verify mask_layout=qlen_only_bitpacked")
    words = spec.custom_mask
    reversed_words = reverse_bits(words, word_bits(words.dtype))
    if torch.equal(reversed_words, words.to(torch.int64)):
        raise ValueError("bit-order: every word is a bit palindrome, reversing changes nothing")
    return _with(trace, spec_mask=reversed_words.to(words.dtype))


def short_buffer(trace: Trace, *, request: int | None = None, columns: int | None = None) -> Trace:
    """Tree mask built for fewer KV columns than the request has, flattened without a shape check (FlashInfer #3176).

    Request `request`'s FULL block is built [n, prefix + n - columns] (its first `columns` prefix
    columns dropped); a QLEN_ONLY block loses its last column, a bit-packed mask its last word.
    The plan's mask is cut the same way and its mask_indptr left as it was.
    """
    spec = _need_verify(trace, "short-buffer")
    prefix = trace.batch.prefix_lens
    g = _rng(trace, 12)
    if request is None:
        candidates = [b for b in range(trace.batch.batch_size) if int(prefix[b]) > 0]
        request = _pick(candidates or list(range(trace.batch.batch_size)), g)
    p = int(prefix[request])
    if columns is None:
        columns = int(torch.randint(1, p + 1, (1,), generator=g)) if p > 0 else 1
    n = spec.draft_token_num
    spec_mask = None
    if spec.custom_mask is not None:
        mask = spec.custom_mask
        if spec.mask_layout is MaskLayout.FULL and not 1 <= columns <= p:
            raise ValueError(f"short-buffer: request {request} has {p} prefix columns, cannot drop {columns}")
        geometry = _spec_geometry(trace)
        block = geometry.block(mask, request)
        if spec.mask_layout is MaskLayout.FULL:
            spec_mask = geometry.with_block(mask, request, block[:, columns:])
        elif spec.mask_layout is MaskLayout.QLEN_ONLY:
            spec_mask = geometry.with_block(mask, request, block[:, :-1])
        else:
            spec_mask = geometry.with_block(mask, request, block[:-1])  # one word per row: the last row's goes
    tensors = {}
    geometry = _plan_geometry(trace)
    if geometry is not None:
        width = int(geometry.columns[request])
        drop = min(columns, width - n) if width > n else 1
        mask = trace.plan.tensors["custom_mask"]
        tensors["custom_mask"] = geometry.with_block(mask, request, geometry.block(mask, request)[:, drop:])
    if spec_mask is None and not tensors:
        raise ValueError("short-buffer: the trace records no tree mask to cut")
    return _with(trace, spec_mask=spec_mask, tensors=tensors)


def missing_prefix(trace: Trace) -> Trace:
    """FULL tree mask whose prefix columns are False (zeros where SGLang writes torch.full(True)), so drafts see no context."""
    spec = _need_verify(trace, "missing-prefix")
    if spec.mask_layout is not MaskLayout.FULL or spec.custom_mask is None:
        raise ValueError("missing-prefix needs a FULL-layout mask: synth verify mask_layout=full")
    prefix = trace.batch.prefix_lens
    if not bool((prefix > 0).any()):
        raise ValueError("missing-prefix: no request has a prefix")
    geometry = _spec_geometry(trace)
    mask = spec.custom_mask.clone()
    for b in range(trace.batch.batch_size):
        geometry.block(mask, b)[:, : geometry.prefix_columns(b)] = False
    tensors = {}
    plan_geometry = _plan_geometry(trace)
    if plan_geometry is not None:
        plan_mask = trace.plan.tensors["custom_mask"].clone()
        for b in range(plan_geometry.batch_size):
            plan_geometry.block(plan_mask, b)[:, : plan_geometry.prefix_columns(b)] = False
        tensors["custom_mask"] = plan_mask
    return _with(trace, spec_mask=mask, tensors=tensors)


def window_ignored(trace: Trace) -> Trace:
    """Plan tree mask built without the sliding window while the kernel's window is off, so drafts see keys older than the window."""
    _need_verify(trace, "window-ignored")
    window = trace.model.sliding_window
    geometry = _plan_geometry(trace)
    if window < 0 or geometry is None:
        raise ValueError("window-ignored needs a verify trace with a sliding window and a plan mask (e.g. a flashinfer plan of synth verify window=40)")
    kernel_window = trace.plan.scalars.get("window_left", trace.plan.scalars.get("sliding_window", window))
    if int(kernel_window) >= 0:
        raise ValueError("window-ignored: this plan's kernel applies the window itself (window_left >= 0)")
    mask = trace.plan.tensors["custom_mask"].clone()
    for b in range(geometry.batch_size):
        geometry.block(mask, b)[:, : geometry.prefix_columns(b)] = True
    if torch.equal(mask, trace.plan.tensors["custom_mask"]):
        raise ValueError("window-ignored: every prefix column is inside the window already")
    return _with(trace, tensors={"custom_mask": mask})


def qlen_indptr(trace: Trace) -> Trace:
    """mask_indptr computed with QLEN_ONLY sizes (n·n per request) for a FULL-layout mask."""
    _need_verify(trace, "qlen-indptr")
    plan = trace.plan
    if plan is None or "mask_indptr" not in plan.tensors:
        raise ValueError("qlen-indptr needs a verify plan with a mask_indptr (triton or flashinfer)")
    indptr = plan.tensors["mask_indptr"]
    # Every entry, padded requests' too: the engine computes them all with the same wrong sizes.
    qlen = MaskGeometry.verify(MaskLayout.QLEN_ONLY, draft_token_num=trace.spec.draft_token_num, prefix_lens=torch.zeros(indptr.numel() - 1, dtype=torch.int64))
    wrong = qlen.indptr
    if torch.equal(wrong, indptr.to(torch.int64)):
        raise ValueError("qlen-indptr: no request has a prefix, so both layouts have the same sizes")
    return _with(trace, tensors={"mask_indptr": wrong.to(indptr.dtype)})


def stale_after_causal(trace: Trace) -> Trace:
    """Extend step whose plan keeps the custom mask of an earlier verify step (FlashInfer #1028: a wrapper re-planned causal kept its mask)."""
    batch = trace.batch
    if batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND) or batch.selective:
        raise ValueError("stale-after-causal needs a (non-selective) EXTEND or MIXED trace, the causal step after a verify")
    if trace.plan is None:
        raise ValueError("stale-after-causal lives in the recorded plan, and this trace has none")
    blocks = []
    for b in range(batch.batch_size):
        e, p = int(batch.extend_lens[b]), int(batch.prefix_lens[b])
        # The old verify step's tree: a binary tree over this request's tokens.
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, e)], dtype=torch.int64)
        block = torch.ones(e, p + e, dtype=torch.bool)
        block[:, p:] = tree.ancestor_matrix(parents) if e else block[:, p:]
        blocks.append(block.flatten())
    mask = torch.cat(blocks)
    indptr = MaskGeometry.full(rows=batch.extend_lens, prefix_lens=batch.prefix_lens).indptr
    return _with(trace, tensors={"custom_mask": mask, "mask_indptr": indptr})


INJECTIONS: dict[str, Callable[[Trace], Trace]] = {
    "tree-mask:sibling-visible": sibling_visible,
    "tree-mask:bit-order": bit_order,
    "tree-mask:short-buffer": short_buffer,
    "tree-mask:missing-prefix": missing_prefix,
    "tree-mask:window-ignored": window_ignored,
    "tree-mask:qlen-indptr": qlen_indptr,
    "tree-mask:stale-after-causal": stale_after_causal,
}
