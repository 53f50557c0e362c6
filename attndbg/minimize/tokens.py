"""Reductions that keep some of each request's query tokens: `attndbg minimize`'s draft tree and
extend lengths (shrink.py has the others, and the `Reduced` they all return).

    fewer_drafts    a verify step's draft trees cut to their first `draft_token_num` tokens, or
                    pruned to `topk` children per node first (each token's parent comes before
                    it, so a tree's first n tokens are a tree: kept tokens keep their ancestors)
    shorter_extend  the first `keep` new tokens of one request of an extend step (a shorter chunk)

A kept token keeps its slot, position and recorded rows; the KV row is the prefix, then the kept
tokens' columns; a recorded tree mask (the spec's, in its layout, and a plan's FULL bool blocks)
keeps the kept rows and columns, so a wrong bit stays wrong where its row and column stay. The
rest of the recorded plan goes along through `plan.carry_plan`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from attndbg.minimize.plan import carry_plan, cut_mask_blocks
from attndbg.minimize.shrink import NotApplicable, Reduced, padded_count
from attndbg.trace.mask_geometry import MaskGeometry, pack_bits, unpack_bits, word_dtype
from attndbg.trace.schema import MaskLayout, Trace, indptr
from attndbg.trace.subbatch import layer_rows


def _tree_tokens(parents: Tensor, draft_token_num: int, topk: int | None) -> list[int]:
    """The tokens of one tree kept: those whose every ancestor is among the first `topk` children
    of its parent (all, when None), then the first `draft_token_num` of them."""
    rank = torch.zeros(parents.numel(), dtype=torch.int64)
    children: dict[int, int] = {}
    kept = []
    for i, parent in enumerate(parents.tolist()):
        rank[i] = children.get(parent, 0)
        children[parent] = int(rank[i]) + 1
        if i == 0 or ((topk is None or int(rank[i]) < topk) and parent in kept):
            kept.append(i)
    return kept[:draft_token_num]


def _relabel(parents: Tensor, kept: list[int]) -> Tensor:
    new = {old: j for j, old in enumerate(kept)}
    return torch.tensor([-1 if j == 0 else new[int(parents[old])] for j, old in enumerate(kept)], dtype=torch.int64)


def fewer_drafts(trace: Trace, draft_token_num: int, topk: int | None = None) -> Reduced:
    """Each request's draft tree cut to `draft_token_num` tokens (after pruning to `topk` children per node)."""
    spec = trace.spec
    if spec is None or not trace.is_tree_verify:
        raise NotApplicable("not a tree-verify step")
    n = spec.draft_token_num
    if topk is not None and topk >= spec.topk:
        raise NotApplicable(f"topk {topk} is not below the step's {spec.topk}")
    kept = [_tree_tokens(spec.parents[b], draft_token_num, topk) for b in range(trace.batch.batch_size)]
    count = min(len(k) for k in kept) if kept else 0
    kept = [k[:count] for k in kept]
    if count < 1 or kept == [list(range(n))] * len(kept):
        raise NotApplicable(f"{draft_token_num} draft tokens, topk {topk}: removes no token of {n}")
    parents = torch.stack([_relabel(spec.parents[b], k) for b, k in enumerate(kept)]) if kept else spec.parents[:, :count]
    new_spec = replace(spec, draft_token_num=count, topk=spec.topk if topk is None else topk, parents=parents, custom_mask=_spec_mask(trace, kept))
    smaller = _keep_tokens(trace, kept, tokens_per_padded_row=count)
    smaller = replace(smaller, spec=new_spec)
    what = f"draft tokens {n} -> {count}" + (f", topk {spec.topk} -> {topk}" if topk is not None else "")
    reduced = _with_plan(trace, smaller, what)
    plan = cut_mask_blocks(trace, reduced.trace.plan, lambda b, block: _block_of(block, int(trace.batch.prefix_lens[b]), n, kept[b]))
    if plan is None:
        raise NotApplicable("the recorded plan's mask blocks do not have the tree's shape: they cannot be cut")
    return replace(reduced, trace=replace(reduced.trace, plan=plan))


def shorter_extend(trace: Trace, request: int, keep: int) -> Reduced:
    """Request `request`'s first `keep` new tokens of an extend step (its chunk `keep` tokens long)."""
    batch = trace.batch
    if trace.spec is not None or batch.selective:
        raise NotApplicable("a verify or selective step's query tokens are not a chunk of the row's tail")
    if batch.cross or batch.custom_mask is not None:
        raise NotApplicable("a cross-attention step's or a custom mask's query rows are not cut here")
    extend = int(batch.extend_lens[request])
    if not 1 <= keep < extend:
        raise NotApplicable(f"request {request} has {extend} new tokens")
    kept = [list(range(int(e))) for e in batch.extend_lens.tolist()]
    kept[request] = kept[request][:keep]
    smaller = _keep_tokens(trace, kept, tokens_per_padded_row=None)
    return _with_plan(trace, smaller, f"request {request}: {extend - keep} of {extend} new tokens")


def _with_plan(current: Trace, smaller: Trace, removed: str) -> Reduced:
    rows = tuple(range(current.batch.batch_size + padded_count(current)))
    plan = carry_plan(current, smaller, rows) if current.plan is not None else None
    return Reduced(replace(smaller, plan=plan), removed, rows)


def _keep_tokens(trace: Trace, kept: list[list[int]], *, tokens_per_padded_row: int | None) -> Trace:
    """The step with request b's query tokens `kept[b]` (indices within its new tokens, ascending)."""
    batch = trace.batch
    qo = batch.qo_indptr
    rows, slots = [], []
    for b, keep in enumerate(kept):
        prefix = int(batch.prefix_lens[b])
        row = batch.request_slots(b)
        within = torch.tensor(keep, dtype=torch.int64)
        rows.append(int(qo[b]) + within)
        slots.append(torch.cat([row[:prefix], row[prefix + within]]))
    token_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    extend = torch.tensor([len(k) for k in kept], dtype=torch.int64)
    removed = batch.extend_lens - extend
    columns = torch.cat([int(batch.prefix_lens[b]) + torch.arange(len(k)) for b, k in enumerate(kept)]) if kept else token_rows
    smaller = replace(
        batch,
        extend_lens=extend,
        kv_lens=batch.prefix_lens + extend,
        slot_indptr=indptr(batch.prefix_lens + extend),
        slot_ids=torch.cat(slots),
        query_cols=columns,
        out_cache_loc=batch.out_cache_loc[token_rows],
        positions=batch.positions[token_rows],
        # A verify step's seq_lens leave the draft tokens out (SGLang); others count every column.
        seq_lens_raw=batch.seq_lens_raw if trace.is_tree_verify else batch.seq_lens_raw - removed,
    )
    return replace(
        trace,
        batch=smaller,
        graph=_graph(trace, token_rows, tokens_per_padded_row),
        tensors={layer: layer_rows(t, token_rows) for layer, t in trace.tensors.items()},
        buffers={},
    )


def _graph(trace: Trace, token_rows: Tensor, tokens_per_padded_row: int | None):
    graph = trace.graph
    if graph is None:
        return None
    pad, tokens = padded_count(trace), trace.batch.num_tokens
    per_row = (graph.padded_out_cache_loc.numel() - tokens) // pad if pad else 0
    keep = per_row if tokens_per_padded_row is None else min(per_row, tokens_per_padded_row)
    tail = [tokens + r * per_row + j for r in range(pad) for j in range(keep)]
    index = torch.cat([token_rows, torch.tensor(tail, dtype=torch.int64)])

    def per_token(t: Tensor) -> Tensor:
        return t[index[index < t.numel()]]

    qo = graph.padded_qo_indptr
    if qo is not None:
        lengths = torch.tensor([len(r) for r in _split(token_rows, trace)] + [keep] * pad, dtype=torch.int64)
        qo = qo[:1] + indptr(lengths).to(qo.dtype)
    return replace(graph, padded_out_cache_loc=per_token(graph.padded_out_cache_loc), padded_positions=per_token(graph.padded_positions), padded_qo_indptr=qo)


def _split(token_rows: Tensor, trace: Trace) -> list[Tensor]:
    qo = trace.batch.qo_indptr
    return [token_rows[(token_rows >= int(qo[b])) & (token_rows < int(qo[b + 1]))] for b in range(trace.batch.batch_size)]


def _block_of(block: Tensor, prefix: int, n: int, keep: list[int]) -> Tensor:
    """A [n, prefix + n] (FULL) or [n, n] bool block cut to the kept rows and draft columns."""
    index = torch.tensor(keep, dtype=torch.int64)
    columns = torch.cat([torch.arange(block.shape[1] - n), block.shape[1] - n + index])
    return block[index][:, columns]


def _spec_mask(trace: Trace, kept: list[list[int]]) -> Tensor | None:
    """The recorded tree mask, each request's block cut to its kept rows and columns, in its layout."""
    spec = trace.spec
    mask = spec.custom_mask
    if mask is None:
        return None
    geometry = MaskGeometry.of_spec(spec, trace.batch.prefix_lens)
    if mask.numel() != geometry.length:
        raise NotApplicable("the recorded tree mask does not have its layout's length: its blocks cannot be cut")
    n, blocks = spec.draft_token_num, []
    for b, keep in enumerate(kept):
        visible = geometry.visible(mask, b)
        cut = _block_of(visible, int(trace.batch.prefix_lens[b]), n, keep)
        if spec.mask_layout is MaskLayout.QLEN_ONLY_BITPACKED:
            # Bits above the row's columns (garbage a kernel must ignore) are not kept.
            blocks.append(pack_bits(cut).to(word_dtype(len(keep))))
        else:
            blocks.append(cut.flatten().to(mask.dtype))
    return torch.cat(blocks) if blocks else mask[:0]
