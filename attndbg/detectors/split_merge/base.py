"""Shared vocabulary of the split-merge detector: its finding class and the location helpers. Which
path of a step merges partial states is backends/engine_names.py's `merge_path` (the split mistake
models ask it too); the LSE bases are attndbg.numerics', the split rule the kernel's
(backends/triton_kernels/split_rule.py).
"""

from __future__ import annotations

import torch

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import FindingClass, Location
from attndbg.trace.schema import Trace

KIND = FindingClass.SPLIT_MERGE


def _location(ctx: CheckContext, worst=None, **extra) -> Location:
    if worst is not None:
        extra = {"request": worst.request, "row": worst.row, "head": worst.head, **extra}
    return Location(step=ctx.step, layer=ctx.options.layer, **extra)


def _request_of(trace: Trace, row: int) -> int:
    return int(torch.searchsorted(trace.batch.qo_indptr, torch.tensor(row), right=True)) - 1
