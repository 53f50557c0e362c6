"""The plan guard: before a *recorded* plan reaches a kernel, would it read outside the KV cache,
the step's rows, or one of its own tensors?

A wrong engine plan is what users bring us to find, but handing a kernel indices past an
allocation turns a finding into an illegal memory access that kills the process (and on a GPU the
CUDA context), or a read of arbitrary device memory. The guard knows no backend: each backend's
plan view (attndbg/backends/plan_view.py, derived from its plan declaration) lists what its kernels
read and the bound of each; the guard checks them in order and names the first bad element. A plan
it cannot view is refused too: never launched unchecked. A plan it cannot read (a field its
declaration names missing or unreadable, `PlanUnreadable`) is refused as *not read*: incomplete, which says nothing about memory, so no
detector reports it as a finding and the check's verdict names it. The invariants and tree-mask
detectors explain what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.backends.base import Backend, PartialStates
from attndbg.backends.plan_view import USUAL_OFFSETS, Bound, Entries, Equals, Extents, Offsets, PlanUnreadable, PlanView, PlanViewError, RequestRows
from attndbg.trace import offsets
from attndbg.trace.offsets import OffsetsFault, first_true
from attndbg.trace.schema import Plan, Trace

_INDPTRS = USUAL_OFFSETS


def _request_count(plan: Plan) -> int | None:
    counts = [int(plan.tensors[name].numel()) - 1 for name in _INDPTRS if name in plan.tensors and plan.tensors[name].numel()]
    return max(counts) if counts else None


def real_requests_only(trace: Trace, plan: Plan, backend: Backend | None = None) -> Plan:
    """The real requests' part of a plan recorded at a CUDA-graph replay.

    Such a plan covers the graph's capture_bs requests, padding included (SGLang builds it that
    way). Replayed eagerly on the step's real batch, its padded requests would read query rows that
    do not exist: keep the first batch_size requests of every per-request tensor, and of each flat
    tensor the part those requests index. Which tensors are per request, and with how many rows
    each, is the backend plan view's `layout` (fa3's two-call expand_ tables have one row per draft
    token); without one, the usual indptr names and every tensor with a row per request. Any other
    plan is returned as it is (the guard then judges it whole).
    """
    graph, bs = trace.graph, trace.batch.batch_size
    if graph is None or not graph.is_graph_replay or bs >= graph.capture_bs:
        return plan
    view = _view(trace, plan, backend)
    layout = view.layout if view is not None else None
    n = view.requests if layout is not None else _request_count(plan)
    if n != graph.capture_bs:
        return plan
    tensors = dict(plan.tensors)
    for group in layout if layout is not None else _usual_layout(plan, n):
        keep, whole = bs * group.per_request, n * group.per_request
        for name in group.rows:
            values = plan.tensors.get(name)
            if values is not None and values.dim() >= 1 and values.shape[0] == whole:
                tensors[name] = values[:keep]
        for name, target in group.offsets:
            values = plan.tensors.get(name)
            if values is None or values.dim() != 1 or values.numel() != whole + 1:
                continue
            tensors[name] = values[: keep + 1]
            if target is not None and target in plan.tensors:
                tensors[target] = plan.tensors[target][: max(0, int(values[keep]))]
    return Plan(backend=plan.backend, tensors=tensors, scalars=dict(plan.scalars))


def _view(trace: Trace, plan: Plan, backend: Backend | None) -> PlanView | None:
    """The plan's view, or None where there is none (`refusal` then says why)."""
    try:
        backend = backend or registry.create(plan.backend)
        return backend.plan_view(trace, plan)
    except (KeyError, PlanViewError):
        return None


def _usual_layout(plan: Plan, n: int) -> tuple[RequestRows, ...]:
    """Without a backend's layout: the usual indptrs, and every other tensor with one row per request
    (split counts, page tables, ...) but the flat tensors those indptrs index."""
    flat = {target for target in _INDPTRS.values() if target}
    rows = tuple(name for name, values in plan.tensors.items() if name not in _INDPTRS and name not in flat and values.dim() >= 1 and values.shape[0] == n)
    return (RequestRows(1, rows, tuple(_INDPTRS.items())),)


@dataclass(frozen=True)
class Refusal:
    """Why a plan is not launched: the message, and the plan field it names first (None: no field)."""

    message: str
    field: str | None  # a plan tensor's name or "scalars.<name>"
    # The plan could not be read (a field missing or unreadable): incomplete, not unsafe. False: a
    # bound is violated (or no view exists), so a kernel given it could read out of bounds.
    unread: bool = False


def out_of_bounds(trace: Trace, plan: Plan, backend: Backend | None = None) -> str | None:
    """None when `plan` is safe to launch on this step: it covers no more requests than the step
    has and every bound of its backend's plan view holds. Else why not, naming the tensor and its
    first bad element. `backend`: the one that would run it (default: the one `plan.backend` names)."""
    found = refusal(trace, plan, backend)
    return None if found is None else found.message


def refusal(trace: Trace, plan: Plan, backend: Backend | None = None) -> Refusal | None:
    """`out_of_bounds` with the field it names, for detectors that report refusals as findings."""
    return guarded_view(trace, plan, backend)[1]


def guarded_view(
    trace: Trace, plan: Plan, backend: Backend | None = None, *, viewed: tuple[PlanView | None, PlanViewError | None] | None = None
) -> tuple[PlanView | None, Refusal | None]:
    """The plan's view as its kernels read it, when the guard lets it be launched (no refusal);
    else (None, why not). `viewed`: `backend.plan_view(trace, plan)`'s answer (the view, or the
    error it raised) where the caller has it already."""
    if backend is None:
        try:
            backend = registry.create(plan.backend)
        except KeyError:
            return None, Refusal(f"recorded plan cannot be guarded: no backend is named {plan.backend[:80]!r}", None)
    if viewed is None:
        try:
            viewed = backend.plan_view(trace, plan), None
        except PlanViewError as e:
            viewed = None, e
    view, error = viewed
    if isinstance(error, PlanUnreadable):
        return None, Refusal(f"recorded plan not read: {error}", error.field or None, unread=True)
    if error is not None:
        return None, Refusal(f"recorded plan cannot be guarded: {error}", error.field or None)
    if view is None:
        return None, Refusal(f"recorded plan cannot be guarded: the {backend.name} backend declares no plan view", None)
    bs = trace.batch.batch_size
    if view.requests > bs:
        padded = trace.graph is not None and trace.graph.is_graph_replay and view.requests == trace.graph.capture_bs
        message = f"recorded plan covers {view.requests} requests, the step has {bs}" + (" (it is padded to the graph's capture size)" if padded else "")
        return None, Refusal(message, None)
    for bound in view.bounds:
        problem = violation(bound)
        if problem:
            return None, Refusal(f"recorded plan {problem}", _field_of(bound))
    return view, None


def merge_refusal(states: PartialStates) -> str | None:
    """None when a merge kernel given `states` reads only inside them: one LSE per state and, where
    the split rule tells the empty states, one KV length and one split count per row, each count in
    [1, parts] (the kernel merges a row's first num_splits states). Else why not."""
    output, lse = states.output, states.lse
    if output.dim() != 4 or tuple(lse.shape) != tuple(output.shape[:3]):
        return f"lse {tuple(lse.shape)} does not hold one LSE per state of output {tuple(output.shape)} ([rows, heads, parts, dv])"
    if states.rows is not None:
        mask = states.rows
        if mask.dtype != torch.bool or tuple(mask.shape) != (output.shape[0],) or output.shape[2] != 2 or states.kv_lens is not None:
            return f"rows {mask.dtype} {tuple(mask.shape)}: a row mask is one bool per row of two states ({tuple(output.shape)}), without a split rule"
    if states.kv_lens is None and states.num_splits is None:
        return None
    if states.kv_lens is None or states.num_splits is None:
        return "kv_lens and num_splits: the split rule needs both"
    rows, _, parts, _ = output.shape
    kv_lens, splits = states.kv_lens.to(torch.int64), states.num_splits.to(torch.int64)
    bounds: list[Bound] = [
        Equals("kv_lens.numel()", kv_lens.numel(), rows, "one KV length per row"),
        Equals("num_splits.numel()", splits.numel(), rows, "one split count per row"),
        Entries("kv_lens", kv_lens, None, 0, INT64_MAX, "KV lengths"),
        Entries("num_splits", splits, None, 1, parts + 1, f"split counts the states hold ({parts} per row)"),
    ]
    return next((problem for problem in map(violation, bounds) if problem), None)


def _field_of(bound: Bound) -> str:
    """The plan tensor a bound judges ('kv_last_page_len' of 'kv_last_page_len.numel()',
    'cu_seqlens_q' of 'cu_seqlens_q[-1]'), or 'scalars.<name>'."""
    if isinstance(bound, Extents):
        return bound.field or bound.target
    return bound.field if bound.field.startswith("scalars.") else bound.field.split(".")[0].split("[")[0]


def violation(bound: Bound) -> str | None:
    """The first element of `bound` that breaks it, as '<tensor>[<index>] = <value> ...', or None."""
    if isinstance(bound, Equals):
        return None if bound.found == bound.expected else f"{bound.field} = {bound.found}, expected {bound.expected} ({bound.why})"
    if isinstance(bound, Offsets):
        return _offsets_violation(bound)
    if isinstance(bound, Entries):
        return _entries_violation(bound)
    return _extents_violation(bound)


def _offsets_violation(bound: Offsets) -> str | None:
    values, name = bound.values, bound.field
    if values.numel() == 0:
        return None  # no request: `requests_of` refuses the plan where one is needed
    bad = offsets.broken(values)
    if bad is not None and bad.fault is OffsetsFault.START:
        return f"{name}[0] = {int(values[0])}: offsets must start at 0"
    if bad is not None:
        i = bad.at
        return f"{name}[{i}] = {int(values[i])} < {name}[{i - 1}] = {int(values[i - 1])}: offsets must not decrease"
    i = first_true(values > bound.limit)
    if i >= 0:
        return f"{name}[{i}] = {int(values[i])} {bound.past}"
    return None


# A bound from a hostile scalar (max_kv_splits = 2**63 - 1, plus one) must not overflow int64.
INT64_MAX = 2**63 - 1


def _entries_violation(bound: Entries) -> str | None:
    values = bound.values
    high = bound.high if isinstance(bound.high, Tensor) else torch.full_like(values, min(bound.high, INT64_MAX))
    bad = (values < bound.low) | (values >= high)
    if bound.used is not None:
        bad &= bound.used
    if not bool(bad.any()):
        return None
    at = tuple(int(i) for i in torch.nonzero(bad)[0])
    where = ", ".join(map(str, at))
    return f"{bound.field}[{where}] = {int(values[at])} is outside [{bound.low}, {int(high[at])}): {bound.meaning}"


def _extents_violation(bound: Extents) -> str | None:
    n = min(bound.starts.numel(), bound.sizes.numel())
    ends = bound.starts[:n] + bound.sizes[:n]
    b = first_true((ends > bound.limit) | (bound.starts[:n] < 0))
    if b < 0:
        return None
    start, size = int(bound.starts[b]), int(bound.sizes[b])
    where = f"{bound.field}[{b}] = {start}" if bound.field else f"request {b}'s block starts at {start}"
    return f"{where}: request {b}'s {bound.block} of {size} elements ends at {start + size}, past {bound.target}'s length {bound.limit}"
