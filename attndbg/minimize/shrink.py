"""The reductions `attndbg minimize` tries: each takes a step and returns a smaller one, the same
step in every other respect, or raises `NotApplicable` saying why it cannot apply.

    keep_requests   some of the batch's requests (trace/subbatch.py), with their graph rows
    keep_padding    fewer of a CUDA-graph step's padded rows (capture_bs shrinks with them)
    fewer_heads     fewer KV heads, and query heads with them (the GQA group kept, or 1)
    drop_columns    a request's first cached KV columns (whole pages): its row starts later (not
                    when the step keeps the engine's output, which those columns shaped)
    smaller_pages   KV pages of a divisor of the page size (toward 1)
(tokens.py: fewer draft tokens of a verify step's trees, fewer new tokens of an extend.)

The batch, the draft tree, the graph section and the recorded layer tensors change here (the
engine's recorded output and LSE with every removed request, head, row or draft token); the
recorded plan goes along through `plan.carry_plan`, given which row of the step each row of the
smaller step is (`Reduced.rows`). The KV pool (`kv_cache_size`, the recorded KV rows) is never
shrunk: slot ids keep their meaning, so a plan's ids (right or wrong) still name the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg.minimize.plan import carry_plan, cut_mask_blocks, derived_plans
from attndbg.plans.reading import read
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import AttentionKind, Graph, LayerTensors, MaskLayout, Trace, indptr
from attndbg.trace.subbatch import sub_batch


class NotApplicable(ValueError):
    """This reduction does not apply to this step (the reason says why)."""


@dataclass(frozen=True)
class Reduced:
    trace: Trace
    removed: str  # what was removed, for people: "requests 0, 2 (of 4)"
    rows: tuple[int, ...]  # per plan row of the smaller step (real, then padded): the step's row it is


def padded_count(trace: Trace) -> int:
    graph = trace.graph
    return max(0, graph.capture_bs - trace.batch.batch_size) if graph is not None else 0


def _with_plan(current: Trace, smaller: Trace, rows: tuple[int, ...], removed: str) -> Reduced:
    plan = carry_plan(current, smaller, rows) if current.plan is not None else None
    return Reduced(replace(smaller, plan=plan), removed, rows)


def _graph_rows(trace: Trace, keep: list[int], token_rows: Tensor, padded: int) -> Graph | None:
    """The graph section for real requests `keep` (their query tokens `token_rows`) and the first
    `padded` padded rows, as the runner had filled them."""
    graph = trace.graph
    if graph is None:
        return None
    bs, tokens = trace.batch.batch_size, trace.batch.num_tokens
    pad = padded_count(trace)
    per_row = (graph.padded_out_cache_loc.numel() - tokens) // pad if pad else 0
    rows = torch.tensor(keep + list(range(bs, bs + padded)), dtype=torch.int64)
    tail = torch.arange(tokens, tokens + padded * per_row)
    token_index = torch.cat([token_rows, tail])

    def per_token(t: Tensor) -> Tensor:
        return t[token_index[token_index < t.numel()]]

    qo = graph.padded_qo_indptr
    if qo is not None:
        lengths = qo.diff()[rows[rows < qo.numel() - 1]]
        qo = qo[:1] + indptr(lengths)
    return replace(
        graph,
        capture_bs=len(keep) + padded,
        padded_seq_lens=graph.padded_seq_lens[rows[rows < graph.padded_seq_lens.numel()]],
        padded_req_pool_indices=None if graph.padded_req_pool_indices is None else graph.padded_req_pool_indices[rows[rows < graph.padded_req_pool_indices.numel()]],
        padded_out_cache_loc=per_token(graph.padded_out_cache_loc),
        padded_positions=per_token(graph.padded_positions),
        padded_qo_indptr=qo,
        padded_block_table=None if graph.padded_block_table is None else graph.padded_block_table[rows[rows < graph.padded_block_table.shape[0]]],
    )


def keep_requests(trace: Trace, keep: list[int]) -> Reduced:
    """Requests `keep` of the step (in batch order), with every padded row."""
    bs = trace.batch.batch_size
    if len(keep) >= bs:
        raise NotApplicable("keeps every request")
    part = sub_batch(trace, keep)
    pad = padded_count(trace)
    smaller = replace(part.trace, graph=_graph_rows(trace, list(keep), part.rows, pad))
    dropped = [b for b in range(bs) if b not in keep]
    rows = (*keep, *range(bs, bs + pad))
    return _with_plan(trace, smaller, rows, f"requests {', '.join(map(str, dropped))} (of {bs})")


def keep_padding(trace: Trace, padded: int) -> Reduced:
    """The first `padded` of the step's padded rows."""
    pad = padded_count(trace)
    if not 0 < padded < pad:
        raise NotApplicable(f"the step has {pad} padded rows")
    bs = trace.batch.batch_size
    all_rows = torch.arange(trace.batch.num_tokens)
    smaller = replace(trace, graph=_graph_rows(trace, list(range(bs)), all_rows, padded), buffers={})
    rows = (*range(bs), *range(bs, bs + padded))
    return _with_plan(trace, smaller, rows, f"{pad - padded} of {pad} padded rows")


def fewer_heads(trace: Trace, num_qo_heads: int, num_kv_heads: int) -> Reduced:
    """The first `num_kv_heads` KV heads and the first `num_qo_heads` query heads (query head h
    reads KV head h // group, so the first heads of both stay paired)."""
    model = trace.model
    if (num_qo_heads, num_kv_heads) == (model.num_qo_heads, model.num_kv_heads):
        raise NotApplicable("the same heads")
    if num_qo_heads % num_kv_heads or num_qo_heads > model.num_qo_heads or num_kv_heads > model.num_kv_heads:
        raise NotApplicable(f"{num_qo_heads}:{num_kv_heads} is not fewer heads than {model.num_qo_heads}:{model.num_kv_heads}")
    if num_qo_heads // num_kv_heads > model.gqa_group:
        raise NotApplicable("a query head would read a KV head it did not read")
    if model.attention is AttentionKind.MLA and num_kv_heads != 1:
        raise NotApplicable("MLA has one latent KV head")

    def layer(t: LayerTensors) -> LayerTensors:
        return replace(
            t,
            q=t.q[:, :num_qo_heads],
            k_new=t.k_new[:, :num_kv_heads],
            v_new=t.v_new[:, :num_kv_heads],
            k_rows=t.k_rows[:, :num_kv_heads],
            v_rows=t.v_rows[:, :num_kv_heads],
            output=None if t.output is None else t.output[:, :num_qo_heads],
            lse=None if t.lse is None else t.lse[:, :num_qo_heads],
        )

    smaller = replace(
        trace,
        # The first query heads are kept, and with them their sink logits.
        model=replace(model, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, sinks=None if model.sinks is None else model.sinks[:num_qo_heads].clone()),
        tensors={k: layer(t) for k, t in trace.tensors.items()},
    )
    rows = tuple(range(trace.batch.batch_size + padded_count(trace)))
    return _with_plan(trace, smaller, rows, f"heads {model.num_qo_heads}:{model.num_kv_heads} -> {num_qo_heads}:{num_kv_heads}")


def drop_columns(trace: Trace, request: int, count: int) -> Reduced:
    """Request `request`'s first `count` cached KV columns: its row starts `count` columns later,
    its positions and lengths are `count` smaller, as if its prompt had been shorter."""
    batch, model = trace.batch, trace.model
    prefix = int(batch.prefix_lens[request])
    if batch.selective:
        raise NotApplicable("a selective step's query columns are a subset of the row")
    if batch.cross or batch.custom_mask is not None:
        raise NotApplicable("a cross-attention row or a custom mask's columns are not cut here")
    if not 0 < count <= prefix or count % model.page_size:
        raise NotApplicable(f"request {request} has {prefix} cached columns (page size {model.page_size})")
    if trace.graph is not None and trace.graph.padded_block_table is not None:
        raise NotApplicable("the graph's block table lists the row's pages")
    if any(t.output is not None or t.lse is not None for t in trace.tensors.values()):
        # Every query of the request attends to these columns: the engine's recorded output cannot
        # follow them, and a step judged against an output of other keys fails for another reason.
        raise NotApplicable("the step's recorded engine output covers these columns: it cannot be cut with them")
    lo, hi = int(batch.slot_indptr[request]), int(batch.slot_indptr[request + 1])
    keep = torch.ones(batch.slot_ids.numel(), dtype=torch.bool)
    keep[lo : lo + count] = False
    lengths = torch.zeros(batch.batch_size, dtype=torch.int64)
    lengths[request] = count
    qo = batch.qo_indptr
    shift = torch.zeros(batch.num_tokens, dtype=torch.int64)
    shift[int(qo[request]) : int(qo[request + 1])] = count
    smaller_batch = replace(
        batch,
        prefix_lens=batch.prefix_lens - lengths,
        kv_lens=batch.kv_lens - lengths,
        slot_ids=batch.slot_ids[keep],
        slot_indptr=indptr(batch.kv_lens - lengths),
        query_cols=batch.query_cols - shift,
        positions=batch.positions - shift,
        seq_lens_raw=batch.seq_lens_raw - lengths,
    )
    spec = trace.spec
    if spec is not None and spec.custom_mask is not None and spec.mask_layout is MaskLayout.FULL:
        geometry = MaskGeometry.of_spec(spec, batch.prefix_lens)
        if spec.custom_mask.numel() != geometry.length:
            raise NotApplicable("the recorded tree mask does not have its layout's length: its blocks cannot be cut")
        start, end = geometry.span(request)
        block = spec.custom_mask[start:end].reshape(int(geometry.rows[request]), -1)[:, count:]
        spec = replace(spec, custom_mask=torch.cat([spec.custom_mask[:start], block.flatten(), spec.custom_mask[end:]]))
    graph = trace.graph
    if graph is not None:
        seq_lens = graph.padded_seq_lens.clone()
        seq_lens[request] -= count
        positions = graph.padded_positions.clone()
        positions[: batch.num_tokens] -= shift[: positions.numel()]
        graph = replace(graph, padded_seq_lens=seq_lens, padded_positions=positions)
    smaller = replace(trace, batch=smaller_batch, spec=spec, graph=graph, buffers={})
    rows = tuple(range(batch.batch_size + padded_count(trace)))
    reduced = _with_plan(trace, smaller, rows, f"request {request}: {count} of {prefix} cached columns")
    plan = cut_mask_blocks(trace, reduced.trace.plan, lambda b, block: block[:, count:] if b == request else block)
    if plan is None:
        raise NotApplicable("the recorded plan's mask blocks do not have the tree's shape: their columns cannot be cut")
    return replace(reduced, trace=replace(reduced.trace, plan=plan))


def smaller_pages(trace: Trace, page_size: int) -> Reduced:
    """The same step with KV pages of `page_size` (a divisor of the step's: every page splits into
    whole smaller ones, so each slot keeps its column's page offset). A recorded plan that names
    pages goes along only when it is the adapter's own (derived again at the new size): a
    mistake in page ids of the old size has no meaning at the new one."""
    model = trace.model
    if not 1 <= page_size < model.page_size or model.page_size % page_size:
        raise NotApplicable(f"page size {page_size} does not divide the step's {model.page_size} into smaller pages")
    if trace.graph is not None and trace.graph.padded_block_table is not None:
        raise NotApplicable("the graph's block table lists pages of the step's size")
    smaller = replace(trace, model=replace(model, page_size=page_size), buffers={})
    rows = tuple(range(trace.batch.batch_size + padded_count(trace)))
    reduced = _with_plan(trace, smaller, rows, f"page size {model.page_size} -> {page_size}")
    if trace.plan is not None and not _plan_in_slots(trace) and not _is_derived(reduced.trace):
        raise NotApplicable("the recorded plan names pages and differs from the adapter's: its page ids cannot be carried to another size")
    return reduced


def _plan_in_slots(trace: Trace) -> bool:
    """The recorded plan lists KV slots (SGLang's Triton backend), whatever the page size."""
    try:
        layout = read(trace).layout
    except ValueError:
        return False
    return layout is not None and layout.page_size == 1


def _is_derived(trace: Trace) -> bool:
    plan = trace.plan
    derived = derived_plans(trace, plan.backend).get(trace.batch.batch_size)
    return derived is not None and derived.tensors.keys() == plan.tensors.keys() and all(
        torch.equal(plan.tensors[k].to(torch.float64), derived.tensors[k].to(torch.float64)) for k in plan.tensors
    )
