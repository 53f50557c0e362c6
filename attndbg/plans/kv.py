"""The per-request KV view of a recorded plan: the slot or page ids each request's kernel reads,
read by the layout of its backend's plan declaration (`Backend.plan_layout`, derived in
backends/plan_declaration.py), and the
columns of the request's KV row they cover (`kv_coverage`, used by invariants and tree-mask).
A plan whose KV structure is broken is reported as the invariants detector's finding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.backends.plan_layout import KvEnd, KvIds, PlanLayout
from attndbg.backends.plan_view import PlanUnreadable, PlanViewError
from attndbg.detector_api.findings import Finding, finding
from attndbg.plans.offsets import KIND, indptr_shape, is_indptr
from attndbg.trace.schema import ForwardMode, Plan, Trace


@dataclass
class _Segment:
    units: Tensor  # [u] int64: recorded slot or page ids the kernel reads for this request
    length: int | None  # tokens the plan says the kernel reads; None when the plan gives only units
    field: str  # the tensor holding them, e.g. "plan.kv_indices"
    offset: int  # flat index of units[0] in it
    row: int | None = None  # page-table row (then units are row[:u])

    def name(self, j: int) -> str:
        return f"{self.field}[{self.row}, {j}]" if self.row is not None else f"{self.field}[{self.offset + j}]"


@dataclass
class KvView:
    layout: PlanLayout
    page_size: int  # 1 for slot ids
    segments: list[_Segment]
    ends: tuple[KvEnd, ...]  # where each request's covered columns end
    count_field: str
    length_field: str

    @property
    def requests(self) -> int:
        return len(self.segments)


def plan_layout(trace: Trace, plan: Plan) -> PlanLayout | None:
    """The layout the plan's backend declares; None when no adapter has its name or it declares none."""
    adapter = registry.adapter_of(plan)
    return adapter.plan_layout(trace, plan) if adapter is not None else None


def unread_reason(trace: Trace) -> str | None:
    """Why the plan detectors cannot read this step's recorded plan as its kernel would (no adapter
    has the plan's backend name, the adapter declares no plan view or no layout for it, or the plan
    lacks a field its layout declares or holds one that cannot be read: "plan has no scalar
    window_left"); None when they can, or the step recorded no plan. A plan view that refuses the
    plan for a violated bound is not this: the refusal is a finding (invariants' plan-unsafe)."""
    plan = trace.plan
    if plan is None:
        return None
    adapter = registry.adapter_of(plan)
    if adapter is None:
        return "no adapter here"
    try:
        view = adapter.plan_view(trace, plan)
    except PlanUnreadable as e:
        return str(e)  # incomplete, not unsafe: never launched, named on the verdict line
    except PlanViewError:
        view = True  # it has a view, and this plan breaks it: invariants says how
    if view is None:
        return f"the {adapter.name} adapter declares no plan view"
    if adapter.plan_layout(trace, plan) is None:
        return f"the {adapter.name} adapter declares no plan layout for it"
    return None


def _ends(trace: Trace, layout: PlanLayout) -> tuple[KvEnd, ...]:
    batch = trace.batch
    if batch.forward_mode is ForwardMode.DECODE or batch.selective:
        return (KvEnd.KV,)
    return layout.ends


def _unreadable(trace: Trace, plan: Plan) -> bool:
    """The plan lacks a field its backend's view declares, or holds one that view cannot read."""
    adapter = registry.adapter_of(plan)
    if adapter is None:
        return False
    try:
        adapter.plan_view(trace, plan)
    except PlanUnreadable:
        return True
    except PlanViewError:
        return False  # readable, and a bound it breaks is plan-unsafe's
    return False


def kv_view(trace: Trace, plan: Plan, t: dict[str, Tensor], sane: set[str], out: list[Finding]) -> KvView | None:
    layout = plan_layout(trace, plan)
    # An incomplete plan is not read per request: how its layout reads it may hang on the missing
    # field (fa3's verify_path picks one call or two), so what it would say is a guess. The verdict
    # names it (unread_reason); checks of the tensors it holds still run.
    if layout is None or _unreadable(trace, plan):
        return None
    ends = _ends(trace, layout)
    ps = layout.page_size_of(plan, trace.model.page_size)
    if layout.kv is KvIds.TABLE:
        table_name, lens_name = layout.ids, layout.count
        if table_name not in t or lens_name not in t or t[table_name].dim() != 2:
            return None
        table, lens = t[table_name], t[lens_name]
        if table.shape[0] != lens.numel():
            out.append(
                finding(KIND, "plan-batch-size", step=trace.source.step, field=f"plan.{table_name}", evidence=f"plan.{table_name} has {table.shape[0]} rows, {lens_name} has {lens.numel()} requests", cause="the page table and the lengths were built for different batches")
            )
            return None
        segments = []
        for b in range(lens.numel()):
            pages = max(-(-int(lens[b]) // ps), 0)
            if pages > table.shape[1]:
                out.append(
                    finding(
                        KIND,
                        "kv-length",
                        step=trace.source.step,
                        request=b,
                        field=f"plan.{lens_name}[{b}]",
                        evidence=f"plan.{lens_name}[{b}] = {int(lens[b])} needs {pages} pages, plan.{table_name} has {table.shape[1]} columns",
                        cause=f"{lens_name} is longer than the page table row built for this request (lengths and table from different steps)",
                    )
                )
                return None
            segments.append(_Segment(table[b, :pages], int(lens[b]), f"plan.{table_name}", 0, row=b))
        return KvView(layout, ps, segments, ends, lens_name, layout.length_field)
    if layout.count not in sane or layout.ids not in t:
        return None
    indptr, indices = t[layout.count], t[layout.ids]
    if int(indptr[-1]) > indices.numel():
        return None  # indptr-end already says it; segments would run off the buffer
    last = t.get(layout.length) if layout.kv is KvIds.PAGES_LAST_PAGE_LEN and layout.length else None
    lengths = t.get(layout.length) if layout.kv is KvIds.PAGES_LENGTHS and layout.length else None
    segments = []
    for b in range(indptr.numel() - 1):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        count = hi - lo
        if layout.kv is KvIds.SLOTS:
            length = count
        elif lengths is not None and b < lengths.numel():
            length = int(lengths[b])
        elif last is not None and b < last.numel():
            page_len = int(last[b])
            if count and not 1 <= page_len <= ps:
                out.append(
                    finding(
                        KIND,
                        "kv-last-page-len",
                        step=trace.source.step,
                        request=b,
                        field=f"plan.{layout.length}[{b}]",
                        evidence=f"plan.{layout.length}[{b}] = {page_len}, expected a value in [1, {ps}] (page_size {ps})",
                        cause=f"{layout.length} was computed as seq_len % page_size without mapping 0 to a full page, or from a stale length",
                        found=page_len,
                    )
                )
                return None
            length = (count - 1) * ps + page_len if count else 0
        else:
            length = None
        segments.append(_Segment(indices[lo:hi], length, f"plan.{layout.ids}", lo))
    return KvView(layout, ps, segments, ends, layout.count, layout.length_field)


def kv_coverage(trace: Trace) -> list[tuple[int, int] | None] | None:
    """Per real request, the columns [start, end) of its KV row that the recorded plan reads, by
    this module's rules; None per request whose plan length fits no rule, and None overall when
    the plan is absent, of a backend that declares no layout, or malformed (the checks above say how)."""
    plan = trace.plan
    if plan is None:
        return None
    scratch: list[Finding] = []
    tensors = {name: v.to(torch.int64) for name, v in plan.tensors.items() if not (v.is_floating_point() or v.is_complex())}
    sane = {name for name in tensors if not is_indptr(name) or indptr_shape(trace, name, tensors[name], scratch)}
    view = kv_view(trace, plan, tensors, sane, scratch)
    if view is None or view.requests < trace.batch.batch_size:
        return None
    return [request_coverage(trace, view, b) for b in range(trace.batch.batch_size)]


def request_coverage(trace: Trace, view: KvView, b: int) -> tuple[int, int] | None:
    """(start, end) of request b's columns that the plan covers, or None when its length fits no rule.

    The covered columns end at the prefix or at the whole row (by the layout and mode); with a
    sliding window they may start later, page-aligned, but no later than the first column a query
    of the request can see."""
    batch = trace.batch
    seg = view.segments[b]
    ends = {KvEnd.PREFIX: int(batch.prefix_lens[b]), KvEnd.KV: int(batch.kv_lens[b])}
    length = seg.length if seg.length is not None else seg.units.numel() * view.page_size
    for kind in view.ends:
        start = ends[kind] - length
        if 0 <= start <= needed_start(trace, b) and start % view.page_size == 0:
            return start, ends[kind]
    return None


def needed_start(trace: Trace, b: int) -> int:
    """The first column of request b's row that any of its queries may see."""
    batch, window = trace.batch, trace.model.sliding_window
    if window < 0:
        return 0
    if trace.is_tree_verify:
        first_query = int(batch.prefix_lens[b])  # the root, at depth 0
    elif int(batch.extend_lens[b]) > 0:
        first_query = int(batch.query_cols[int(batch.qo_indptr[b])])
    else:
        first_query = int(batch.kv_lens[b])
    return max(first_query - window, 0)
