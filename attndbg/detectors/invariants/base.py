"""Shared helpers of the invariants detector: its Finding constructor and two small tensor lookups."""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.checks.findings import Finding, FindingClass, Location
from attndbg.trace.schema import Trace


def _finding(trace: Trace, check: str, *, evidence: str, cause: str, request=None, row=None, column=None, field=None, trace_path: str = "", **data) -> Finding:
    location = Location(step=trace.source.step, request=request, row=row, column=column, field=field)
    return Finding(FindingClass.INVARIANT, check, location, evidence, cause, trace=trace_path, data=data)


def _request_of(qo_indptr: Tensor, t: int) -> int:
    return int(torch.searchsorted(qo_indptr, torch.tensor(t), right=True)) - 1


def _first(mask: Tensor) -> int:
    return int(torch.nonzero(mask.flatten())[0]) if bool(mask.any()) else -1
