"""The per-request KV of a recorded plan, read leniently by the layout its backend declares
(`Backend.plan_layout`, backends/plan_declaration.py): the slot or page ids each request's kernel
reads and the tokens they hold (`RequestKV`, the one per-request KV type), and the columns of the
request's KV row they cover (`request_coverage`).

Lenient: a plan the guard would refuse is still read where its structure allows (the detectors say
what is wrong with it); where it does not (a page table shorter than a length, a last page length
outside the page), the reading stops with the problem, as data.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.plan_layout import KvEnd, KvIds, PlanLayout
from attndbg.backends.plan_view import RequestKV
from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.trace.schema import ForwardMode, Trace


def kv_ends(trace: Trace, layout: PlanLayout) -> tuple[KvEnd, ...]:
    """Where each request's listed columns may end, in the order they are tried: decode and
    selective steps read whole rows whatever the backend; extend and verify steps by the layout."""
    batch = trace.batch
    if batch.forward_mode is ForwardMode.DECODE or batch.selective:
        return (KvEnd.KV,)
    return layout.ends


def read_kv(layout: PlanLayout, page_size: int, tensors: dict[str, Tensor], well_formed: set[str]) -> tuple[RequestKV | None, list[PlanProblem]]:
    """The plan's per-request KV (every request it covers, padded ones included) from its typed
    `tensors`, reading CSR offsets only from the `well_formed` ones; None when the layout's fields
    are absent, or malformed as the problems say."""
    if layout.kv is KvIds.TABLE:
        return _read_table(layout, page_size, tensors)
    if layout.count not in well_formed or layout.ids not in tensors:
        return None, []
    indptr, indices = tensors[layout.count], tensors[layout.ids]
    if int(indptr[-1]) > indices.numel():
        return None, []  # the ids would run off the buffer (the invariants detector's indptr-end)
    last = tensors.get(layout.length) if layout.kv is KvIds.PAGES_LAST_PAGE_LEN and layout.length else None
    given = tensors.get(layout.length) if layout.kv is KvIds.PAGES_LENGTHS and layout.length else None
    lengths = []
    for b in range(indptr.numel() - 1):
        count = int(indptr[b + 1]) - int(indptr[b])
        if layout.kv is KvIds.SLOTS:
            length = count
        elif given is not None and b < given.numel():
            length = int(given[b])
        elif last is not None and b < last.numel():
            page_len = int(last[b])
            if count and not 1 <= page_len <= page_size:
                problem = PlanProblem(ProblemKind.LAST_PAGE_LEN, layout.length or "", request=b, index=b, found=page_len, detail={"page_size": page_size})
                return None, [problem]
            length = (count - 1) * page_size + page_len if count else 0
        else:
            length = count * page_size  # the plan gives only ids: read as whole pages
        lengths.append(length)
    return RequestKV(page_size, indptr, indices, torch.tensor(lengths, dtype=torch.int64), layout.ids), []


def _read_table(layout: PlanLayout, page_size: int, tensors: dict[str, Tensor]) -> tuple[RequestKV | None, list[PlanProblem]]:
    table_name, lens_name = layout.ids, layout.count
    if table_name not in tensors or lens_name not in tensors or tensors[table_name].dim() != 2:
        return None, []
    table, lens = tensors[table_name], tensors[lens_name]
    if table.shape[0] != lens.numel():
        return None, [PlanProblem(ProblemKind.TABLE_ROWS, table_name, detail={"lengths": lens_name, "rows": table.shape[0], "requests": lens.numel()})]
    pages = []
    for b in range(lens.numel()):
        need = max(-(-int(lens[b]) // page_size), 0)
        if need > table.shape[1]:
            problem = PlanProblem(ProblemKind.TABLE_SHORT, lens_name, request=b, index=b, found=int(lens[b]), detail={"table": table_name, "pages": need, "columns": table.shape[1]})
            return None, [problem]
        pages.append(need)
    counts = torch.tensor(pages, dtype=torch.int64)
    ids = torch.cat([table[b, :n] for b, n in enumerate(pages)]) if pages else table.new_zeros(0)
    lengths = torch.tensor([int(v) for v in lens], dtype=torch.int64)
    return RequestKV(page_size, torch.nn.functional.pad(counts.cumsum(0), (1, 0)), ids, lengths, table_name, table=True), []


def request_coverage(trace: Trace, kv: RequestKV, ends: tuple[KvEnd, ...], b: int) -> tuple[int, int] | None:
    """(start, end) of request b's columns that the plan covers, or None when its length fits no rule.

    The covered columns end at the prefix or at the whole row (by the layout and mode); with a
    sliding window they may start later, page-aligned, but no later than the first column a query
    of the request can see."""
    batch = trace.batch
    by_end = {KvEnd.PREFIX: int(batch.prefix_lens[b]), KvEnd.KV: int(batch.kv_lens[b])}
    length = int(kv.lengths[b])
    for kind in ends:
        start = by_end[kind] - length
        if 0 <= start <= needed_start(trace, b) and start % kv.page_size == 0:
            return start, by_end[kind]
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
