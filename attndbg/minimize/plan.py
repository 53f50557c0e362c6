"""Carry a recorded plan, mistakes included, onto a smaller step.

The recorded plan is evidence: a minimised step must keep whatever was wrong in it. A plan cannot
simply be derived again for the smaller batch (that would be the correct plan: the mistake would
be gone), nor sliced blindly (its offsets index the whole batch). So each plan tensor is cut into
per-request pieces, and each piece is compared with the same piece of the plan a correct engine
derives for the step (`Backend.derive_plan`, the adapter's own translation):

    a piece equal to the derived one   is derived again for the smaller step (its offsets, split
                                       counts and lengths follow the smaller batch)
    a piece that differs               is the mistake: it is kept as recorded

How a tensor divides into pieces is the plan reading's (`PlanReading.pieces`, attndbg/plans/pieces.py:
what the plan's backend declares, never a guess from the tensor's name), with k entries per
request (k = 1 but for a two-call verify's expand_ tables, one per draft token); rows = the
batch's requests, or the capture size on a graph step:
    OFFSETS   [rows*k+1] offsets       the start, then k lengths per request (rebuilt by cumsum, so a
                                       negative length stays a decrease)
    ROWS      [rows*k] or [rows*k, w]  k entries or table rows per request
    SEGMENTS  flat data cut by OFFSETS the request's segment
A tensor the reading gives no pieces, or whose shape does not fit them, is kept whole. A scalar
equal to the derived one is derived again; an integer that differs keeps its difference
(seq_lens_sum, which no adapter derives, is judged against the batch's own sum, padded rows
included on a graph step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.backends.base import Padding
from attndbg.plans.pieces import Cut, Piece
from attndbg.plans.reading import read
from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import Plan, Trace

MASK = "custom_mask"  # a bool mask, by the name every plan declaration gives it (backends/plan_declaration.py)


def derived_plans(trace: Trace, backend_name: str) -> dict[int, Plan]:
    """The plans a correct engine backend derives for `trace`, by the rows they cover: the batch,
    and on a graph step the capture size too (padded as the graph section says)."""
    try:
        adapter = registry.create(backend_name)
    except KeyError:
        return {}
    out: dict[int, Plan] = {}
    paddings: list[Padding | None] = [None]
    graph = trace.graph
    if graph is not None and graph.capture_bs > trace.batch.batch_size:
        paddings.append(Padding(capture_bs=graph.capture_bs, fill_value=max(graph.fill_value, 0)))
    for padding in paddings:
        try:
            plan = adapter.derive_plan(trace, padding)
        except Exception:  # noqa: BLE001 - an adapter that cannot plan this step: its pieces all stay as recorded
            continue
        out[padding.capture_bs if padding else trace.batch.batch_size] = plan
    return out


def _fits(piece: Piece, tensor: Tensor, plan: Plan, rows: int) -> bool:
    """Whether `tensor` of `plan` has the shape of `piece` over `rows` requests."""
    entries = rows * piece.per_request
    if piece.cut is Cut.SEGMENTS:
        offsets = plan.tensors.get(piece.offsets or "")
        return tensor.dim() == 1 and offsets is not None and offsets.numel() == entries + 1
    if piece.cut is Cut.OFFSETS:
        return tensor.dim() == 1 and tensor.numel() == entries + 1
    return 1 <= tensor.dim() <= 2 and tensor.shape[0] == entries


def _pieces(piece: Piece, tensor: Tensor, plan: Plan) -> list[Tensor]:
    """The tensor cut per request (k entries each); an OFFSETS tensor's start comes first."""
    k = piece.per_request
    if piece.cut is Cut.SEGMENTS:
        # Recorded offsets may be the mistake (decreasing, past the end): clamp, never index outside.
        cuts = plan.tensors[piece.offsets].to(torch.int64).clamp(0, tensor.numel()).tolist()[::k]
        return [tensor[lo : max(lo, hi)] for lo, hi in zip(cuts[:-1], cuts[1:])]
    if piece.cut is Cut.OFFSETS:
        return [tensor[:1], *(tensor[1:] - tensor[:-1]).split(k)]
    return list(tensor.split(k))


def _assemble(piece: Piece, pieces: list[Tensor], like: Tensor) -> Tensor:
    if piece.cut is Cut.SEGMENTS:
        return torch.cat([p.reshape(-1).to(like.dtype) for p in pieces]) if pieces else like[:0]
    if piece.cut is Cut.OFFSETS:
        start = pieces[0].reshape(1).to(torch.int64)
        lengths = torch.cat([p.reshape(-1).to(torch.int64) for p in pieces[1:]]) if len(pieces) > 1 else start[:0]
        return torch.cat([start, start + torch.cumsum(lengths, 0)]).to(like.dtype)
    if like.dim() == 2:
        width = max([p.shape[1] for p in pieces], default=like.shape[1])
        table = torch.zeros(sum(p.shape[0] for p in pieces), width, dtype=like.dtype)
        row = 0
        for p in pieces:
            table[row : row + p.shape[0], : p.shape[1]] = p.to(like.dtype)
            row += p.shape[0]
        return table
    return torch.cat([p.reshape(-1).to(like.dtype) for p in pieces]) if pieces else like[:0]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.to(torch.float64), b.to(torch.float64))


def _pieces_like(piece: Piece, name: str, plan: Plan | None, rows: int) -> list[Tensor] | None:
    """The same tensor of a derived plan, cut the same way (None: it has no such tensor)."""
    if plan is None or name not in plan.tensors or not _fits(piece, plan.tensors[name], plan, rows):
        return None
    return _pieces(piece, plan.tensors[name], plan)


def carry_plan(current: Trace, smaller: Trace, rows: Sequence[int]) -> Plan:
    """`current`'s recorded plan for `smaller`, whose plan row i is `current`'s row `rows[i]` (real
    rows first, then padded ones)."""
    recorded = current.plan
    assert recorded is not None
    pieces = read(current).pieces
    was, now = derived_plans(current, recorded.backend), derived_plans(smaller, recorded.backend)
    bs = current.batch.batch_size
    sizes = [bs] + ([current.graph.capture_bs] if current.graph is not None and current.graph.capture_bs > bs else [])
    tensors: dict[str, Tensor] = {}
    for name, tensor in recorded.tensors.items():
        piece = pieces.get(name)
        plan_rows = next((n for n in sizes if piece is not None and _fits(piece, tensor, recorded, n)), None)
        if piece is None or plan_rows is None:
            tensors[name] = tensor  # no per-request structure declared for it: kept whole
            continue
        chosen = [r for r in rows if r < plan_rows]
        mine = _pieces(piece, tensor, recorded)
        derived = _pieces_like(piece, name, was.get(plan_rows), plan_rows)
        fresh = _pieces_like(piece, name, now.get(len(chosen)), len(chosen))
        head = 1 if piece.cut is Cut.OFFSETS else 0  # an offsets tensor's first piece is its start
        out = [mine[0] if derived is None or fresh is None or not _same(mine[0], derived[0]) else fresh[0]] if head else []
        for i, r in enumerate(chosen):
            own = mine[r + head]
            clean = derived is not None and fresh is not None and _same(own, derived[r + head])
            out.append(fresh[i + head] if clean else own)
        tensors[name] = _assemble(piece, out, tensor)
    scalars = {name: _scalar(name, value, was, now, current, smaller) for name, value in recorded.scalars.items()}
    return Plan(backend=recorded.backend, tensors=tensors, scalars=scalars)


def _batch_seq_lens_sum(trace: Trace) -> int:
    """What SGLang passes as seq_lens_sum: the batch's, plus fill per padded row on a graph step."""
    total = int(trace.batch.seq_lens_raw.sum())
    graph = trace.graph
    if graph is not None and graph.is_graph_replay:
        total += max(0, graph.capture_bs - trace.batch.batch_size) * graph.fill_value
    return total


# Scalars no adapter derives, judged against the batch itself.
BATCH_SCALARS: dict[str, Callable[[Trace], int]] = {"seq_lens_sum": _batch_seq_lens_sum}


def _scalar(name: str, value, was: dict[int, Plan], now: dict[int, Plan], current: Trace, smaller: Trace):
    before = next((p.scalars[name] for p in was.values() if name in p.scalars), None)
    after = next((p.scalars[name] for p in now.values() if name in p.scalars), None)
    if before is None and name in BATCH_SCALARS:
        before, after = BATCH_SCALARS[name](current), BATCH_SCALARS[name](smaller)
    if before is None or after is None:
        return value
    if value == before:
        return after
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(before, int) and isinstance(after, int):
        return after + (value - before)  # the mistake's size is kept
    return value


def pad_plan(trace: Trace, padded: Plan, *, capture_bs: int) -> Plan:
    """`trace`'s recorded plan (of a graph step's real requests, mistakes included) grown to
    `capture_bs` requests: each per-request tensor that covers the real requests only gets the
    padded requests' pieces of `padded` (the adapter's plan for the padded batch) appended; a
    tensor that already covers capture_bs rows (the engine's padded buffer, as it was) or has no
    per-request structure is kept as recorded, and so are the scalars."""
    recorded, bs = trace.plan, trace.batch.batch_size
    assert recorded is not None
    pieces = read(trace).pieces
    tensors: dict[str, Tensor] = {}
    for name, tensor in recorded.tensors.items():
        piece = pieces.get(name)
        fits = piece is not None and _fits(piece, tensor, recorded, bs)
        tail = _pieces_like(piece, name, padded, capture_bs) if fits else None
        # Already capture_bs rows of the same cut (a [bs+1] indptr reads as capture_bs rows when
        # capture_bs = bs + 1: only the same cut at both sizes means it is padded already).
        if not fits or tail is None or _fits(piece, tensor, recorded, capture_bs):
            tensors[name] = tensor
            continue
        head = 1 if piece.cut is Cut.OFFSETS else 0
        tensors[name] = _assemble(piece, [*_pieces(piece, tensor, recorded), *tail[bs + head :]], tensor)
    return Plan(backend=recorded.backend, tensors=tensors, scalars=dict(recorded.scalars))


def cut_mask_blocks(current: Trace, plan: Plan | None, cut: Callable[[int, Tensor], Tensor]) -> Plan | None:
    """`plan` (carried onto a smaller verify step) with `current`'s recorded FULL bool tree mask
    (custom_mask at the offsets its backend declares for it: SGLang's Triton plan, FlashInfer's
    derived one) cut block by block, `cut(b, [n, width] block)`: carry_plan keeps a wrong block as
    recorded, at the old width, so a reduction that drops rows or columns drops them from it too.
    None: the recorded blocks do not have the tree's shape (they cannot be cut); `plan` as it is
    without such a mask."""
    recorded = current.plan
    piece = read(current).pieces.get(MASK) if recorded is not None else None
    offsets = piece.offsets if piece is not None and piece.cut is Cut.SEGMENTS else None
    if plan is None or recorded is None or MASK not in recorded.tensors or offsets not in recorded.tensors or current.spec is None:
        return plan
    n = current.spec.draft_token_num
    mask = recorded.tensors[MASK]
    geometry = MaskGeometry.from_indptr(recorded.tensors[offsets], rows=n, prefix_lens=current.batch.prefix_lens)
    blocks = []
    for b in range(current.batch.batch_size):
        start, end = geometry.span(b)
        if end > mask.numel() or int(geometry.columns[b]) < n or end - start != n * int(geometry.columns[b]):
            return None
        blocks.append(cut(b, geometry.block(mask, b)).flatten())
    flat = torch.cat(blocks).to(mask.dtype) if blocks else mask[:0]
    ends = plan.tensors.get(offsets)
    if ends is None or int(ends[current.batch.batch_size]) != flat.numel():
        return None
    return Plan(backend=plan.backend, tensors={**plan.tensors, MASK: flat}, scalars=dict(plan.scalars))
