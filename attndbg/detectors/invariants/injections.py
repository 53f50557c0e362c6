"""Mistakes in the engine's bookkeeping and recorded plan that the invariants detector finds.

Each function takes a trace (with a recorded plan where the mistake lives in the plan) and returns
a copy carrying one realistic mistake; the batch ground truth is never touched. Where the mistake
lands (request, column) is chosen from a generator seeded with the trace's seed, or given by
keyword for tests. A mistake that does not apply to the trace raises ValueError saying why.
Plan tensors are found through the layout their backend declares (backends/plan_layout.py), so
no backend is named here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg.plans.reading import read
from attndbg.trace import tree
from attndbg.trace.schema import ForwardMode, Plan, Trace


def _rng(trace: Trace, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(trace.seed * 1000003 + salt)


def _pick(options: list, g: torch.Generator):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _need_plan(trace: Trace, what: str) -> Plan:
    if trace.plan is None:
        raise ValueError(f"{what} lives in the recorded plan, and this trace has none (synth one with a plan)")
    return trace.plan


def _with_tensors(trace: Trace, **tensors: Tensor) -> Trace:
    plan = trace.plan
    return replace(trace, plan=Plan(backend=plan.backend, tensors={**plan.tensors, **tensors}, scalars=dict(plan.scalars)))


@dataclass(frozen=True)
class _KvLists:
    """Where a plan lists each real request's KV ids, by its layout."""

    name: str  # the tensor of ids
    page_size: int  # tokens per id
    counts: list[int]  # ids per real request
    spans: list[tuple[int, int]] | None  # a CSR list: [lo, hi) per request of `name`; None: table rows


def _kv_lists(trace: Trace, plan: Plan, *, default_page_size: int) -> _KvLists:
    """The plan's KV ids per request, as its backend's layout lists them (`default_page_size`
    where the plan has no page_size scalar and the layout fixes none)."""
    layout = read(replace(trace, plan=plan)).layout
    if layout is None:
        raise ValueError(f"the {plan.backend} plan's backend declares no plan layout: where its KV ids are is unknown")
    ps = layout.page_size_of(plan, default_page_size)
    bs = trace.batch.batch_size
    if layout.csr:
        if layout.count not in plan.tensors or layout.ids not in plan.tensors:
            raise ValueError(f"the {plan.backend} plan has no {layout.count} / {layout.ids}")
        indptr = plan.tensors[layout.count].to(torch.int64).tolist()
        spans = [(indptr[b], indptr[b + 1]) for b in range(len(indptr) - 1)]
        return _KvLists(layout.ids, ps, [hi - lo for lo, hi in spans[:bs]], spans)
    if layout.ids not in plan.tensors or layout.length is None or layout.length not in plan.tensors:
        raise ValueError(f"the {plan.backend} plan has no {layout.ids} / {layout.length}")
    return _KvLists(layout.ids, ps, [-(-int(n) // ps) for n in plan.tensors[layout.length][:bs]], None)


def decreasing_indptr(trace: Trace, *, request: int | None = None) -> Trace:
    """kv_indptr partly overwritten by another batch's offsets (a metadata buffer shared between wrappers), so it decreases.

    kv_indptr[request] and kv_indptr[request + 1] (cu_seqlens_k on an FA3 plan) are swapped, so
    kv_indptr[request + 1] < kv_indptr[request]: request `request` gets a negative length.
    """
    plan = _need_plan(trace, "decreasing-indptr")
    name = next((n for n in ("kv_indptr", "cu_seqlens_k") if n in plan.tensors), None)
    if name is None:
        raise ValueError(f"the {plan.backend} plan has neither kv_indptr nor cu_seqlens_k")
    indptr = plan.tensors[name].clone()
    candidates = [b for b in range(1, trace.batch.batch_size) if int(indptr[b]) < int(indptr[b + 1])]
    if request is None:
        if not candidates:
            raise ValueError(f"decreasing-indptr needs a request after the first with KV in {name} (batch of {trace.batch.batch_size})")
        request = _pick(candidates, _rng(trace, 1))
    if request not in candidates:
        raise ValueError(f"request {request}: needs 1 <= request < batch size and {name}[{request}] < {name}[{request + 1}]")
    low, high = int(indptr[request]), int(indptr[request + 1])
    indptr[request], indptr[request + 1] = high, low
    return _with_tensors(trace, **{name: indptr})


def wrong_req_row(trace: Trace, *, request: int | None = None, source: int | None = None) -> Trace:
    """kv_indices of one request built from another request's req_to_token row (a wrong req_pool_indices entry).

    The request keeps its number of entries; they become the first entries of the other
    request's req_to_token row (as page ids on a paged plan), and past that row's used length
    the zeros of an unused req_to_token tail.
    """
    plan = _need_plan(trace, "wrong-req-row")
    batch = trace.batch
    bs = batch.batch_size
    if bs < 2:
        raise ValueError("wrong-req-row needs at least two requests")
    kv = _kv_lists(trace, plan, default_page_size=trace.model.page_size)
    name, ps, counts, spans = kv.name, kv.page_size, kv.counts, kv.spans
    if spans is not None:
        current = [plan.tensors[name][lo:hi].to(torch.int64) for lo, hi in spans[:bs]]
    else:
        current = [plan.tensors[name][b, : counts[b]].to(torch.int64) for b in range(bs)]

    def row_of(c: int, count: int) -> Tensor:
        units = batch.request_slots(c)[::ps] // ps
        out = torch.zeros(count, dtype=torch.int64)
        k = min(count, units.numel())
        out[:k] = units[:k]
        return out

    pairs = [(b, c) for b in range(bs) for c in range(bs) if b != c and counts[b] > 0 and not torch.equal(row_of(c, counts[b]), current[b])]
    if request is None or source is None:
        if not pairs:
            raise ValueError("wrong-req-row: no two requests whose rows differ over the first one's length")
        preferred = [(b, c) for b, c in pairs if int(batch.kv_lens[c]) >= counts[b] * ps] or pairs
        request, source = _pick(preferred, _rng(trace, 2))
    if (request, source) not in pairs:
        raise ValueError(f"wrong-req-row: request {source}'s row does not differ from request {request}'s indices")
    wrong = row_of(source, counts[request])
    tensor = plan.tensors[name].clone()
    if spans is not None:
        lo, hi = spans[request]
        tensor[lo:hi] = wrong.to(tensor.dtype)
    else:
        tensor[request, : counts[request]] = wrong.to(tensor.dtype)
    return _with_tensors(trace, **{name: tensor})


def index_outside_cache(trace: Trace, *, request: int | None = None, column: int | None = None) -> Trace:
    """A garbage KV index from a req_to_token pool allocated with torch.empty (SGLang #1782), past the end of the cache.

    `column` counts entries of the request's indices (pages on a paged plan).
    """
    plan = _need_plan(trace, "index-outside-cache")
    bs = trace.batch.batch_size
    kv = _kv_lists(trace, plan, default_page_size=trace.model.page_size)
    name, ps, counts, spans = kv.name, kv.page_size, kv.counts, kv.spans
    limit = trace.batch.kv_cache_size // ps
    g = _rng(trace, 3)
    if request is None:
        candidates = [b for b in range(bs) if counts[b] > 0]
        if not candidates:
            raise ValueError("index-outside-cache: no request reads any KV")
        request = _pick(candidates, g)
    if column is None:
        column = int(torch.randint(counts[request], (1,), generator=g))
    if not 0 <= column < counts[request]:
        raise ValueError(f"request {request} has {counts[request]} indices, column {column} is not one")
    garbage = limit + 1 + int(torch.randint(1 << 20, (1,), generator=g))
    tensor = plan.tensors[name].clone()
    if spans is not None:
        tensor[spans[request][0] + column] = garbage
    else:
        tensor[request, column] = garbage
    return _with_tensors(trace, **{name: tensor})


def stale_positions(trace: Trace, *, request: int | None = None) -> Trace:
    """positions of one request left from the previous step (not advanced by this step's seq_lens update).

    Every position of the request is one less than it should be.
    """
    batch = trace.batch
    qo = batch.qo_indptr
    candidates = [b for b in range(batch.batch_size) if int(batch.extend_lens[b]) > 0 and int(batch.positions[int(qo[b])]) > 0]
    if request is None:
        if not candidates:
            raise ValueError("stale-positions needs a request whose first position is > 0")
        request = _pick(candidates, _rng(trace, 4))
    if request not in candidates:
        raise ValueError(f"request {request} has no position that can be one step stale")
    positions = batch.positions.clone()
    positions[int(qo[request]) : int(qo[request + 1])] -= 1
    return replace(trace, batch=replace(batch, positions=positions))


def verify_positions_by_index(trace: Trace) -> Trace:
    """draft-token positions computed as prefix + token index instead of prefix + tree depth (EAGLE verify)."""
    if not trace.is_tree_verify:
        raise ValueError("verify-positions needs a TARGET_VERIFY trace (synth verify)")
    batch = trace.batch
    depth = torch.cat([tree.depths(p) for p in trace.spec.parents])
    index = torch.cat([torch.arange(int(n)) for n in batch.extend_lens])
    if torch.equal(depth, index):
        raise ValueError("verify-positions: the draft tree is a chain, where depth and index agree")
    positions = torch.repeat_interleave(batch.prefix_lens, batch.extend_lens) + index
    return replace(trace, batch=replace(batch, positions=positions))


def seq_lens_sum_before_increment(trace: Trace) -> Trace:
    """seq_lens_sum taken on the host before the decode step's seq_lens += 1 (one short per request)."""
    plan = _need_plan(trace, "seq-lens-sum")
    if trace.batch.forward_mode is not ForwardMode.DECODE:
        raise ValueError("seq-lens-sum imitates the decode increment: it needs a DECODE trace")
    total = int(trace.batch.seq_lens_raw.sum()) - trace.batch.batch_size
    return replace(trace, plan=Plan(backend=plan.backend, tensors=dict(plan.tensors), scalars={**plan.scalars, "seq_lens_sum": total}))


INJECTIONS: dict[str, Callable[[Trace], Trace]] = {
    "invariants:decreasing-indptr": decreasing_indptr,
    "invariants:wrong-req-row": wrong_req_row,
    "invariants:index-outside-cache": index_outside_cache,
    "invariants:stale-positions": stale_positions,
    "invariants:verify-positions": verify_positions_by_index,
    "invariants:seq-lens-sum": seq_lens_sum_before_increment,
}
