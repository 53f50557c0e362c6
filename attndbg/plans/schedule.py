"""A recorded plan's own work-item schedule (`plan.plan_info`), read with the per-request facts it is
judged against: what the kernel library's scheduler decided for this plan, and the batch the plan's
kernels read beside it.

The schedule is the library's (FlashInfer: backends/flashinfer_plan_info.py, the only one that keeps
one today); the batch it must match is the plan's own: its requests (graph-padded ones included:
the wrapper was planned for them), each request's KV tokens and pages (its kv_indptr /
kv_last_page_len, as the plan reading reads them) and its query rows (qo_indptr; one a request for
decode). A vector that places an array outside the stored workspace is bad input (TraceError: one
line, exit 2), never a finding: no scheduler writes it, and reading it would read past the file's data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends.base import Backend
from attndbg.backends.flashinfer_plan_info import PlanInfoError, Schedule, tiles_needed
from attndbg.backends.plan_view import RequestKV
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import Trace

SOURCE = "recorded: the library's plan-info vector and the host int workspace its offsets index (plan.plan_info)"


@dataclass(frozen=True)
class PlanSchedule:
    """The schedule and the plan-side batch it is for (the plan's requests, in plan order)."""

    schedule: Schedule
    source: str
    requests: int  # the wrapper's batch size: the plan's kv_indptr entries - 1
    kv_lens: Tensor  # [requests] int64: tokens each request's KV list holds
    kv_pages: Tensor  # [requests] int64: pages each request's KV list holds
    qo_lens: Tensor  # [requests] int64: query rows of each request
    page_size: int
    group: int  # query heads per KV head: a prefill tile packs rows x group
    window_left: int  # the window the plan was made with (-1: none); the prefill scheduler shortens a request's KV by it

    def tiles_needed(self) -> tuple[Tensor, Tensor]:
        """(qo tiles, KV tiles) per request the schedule's settings need for this batch (the
        library's rules: backends/flashinfer_plan_info.tiles_needed); needs kv_chunk_size > 0 under
        split-KV and cta_tile_q > 0 for a prefill schedule."""
        return tiles_needed(self.schedule, kv_pages=self.kv_pages, qo_lens=self.qo_lens, page_size=self.page_size, group=self.group, window_left=self.window_left)


def read_schedule(trace: Trace, adapter: Backend | None, kv: RequestKV | None, page_size: int, window_left: int) -> PlanSchedule | None:
    """The schedule of `trace.plan` with its batch; None when the plan keeps none, its adapter reads
    none, or its KV cannot be read per request. Raises TraceError for a vector outside its workspace."""
    plan = trace.plan
    if plan is None or plan.plan_info is None or adapter is None or kv is None:
        return None
    try:
        schedule = adapter.plan_schedule(plan, kv.requests)
    except PlanInfoError as e:
        raise TraceError(f"plan.plan_info.{e.field}", e.message) from None
    if schedule is None:
        return None
    qo = plan.tensors.get("qo_indptr")
    if qo is not None and qo.dim() == 1 and qo.numel() == kv.requests + 1 and not qo.is_floating_point():
        qo_lens = qo.to(torch.int64).diff().clamp(min=0)
    else:
        qo_lens = torch.ones(kv.requests, dtype=torch.int64)  # decode: one query row a request
    model = trace.model
    return PlanSchedule(
        schedule=schedule,
        source=SOURCE,
        requests=kv.requests,
        kv_lens=kv.lengths.to(torch.int64),
        kv_pages=kv.indptr.diff().to(torch.int64),
        qo_lens=qo_lens,
        page_size=page_size,
        group=max(model.num_qo_heads // max(model.num_kv_heads, 1), 1),
        window_left=window_left,
    )
