"""Shared vocabulary of the split-merge detector: which path of a step merges partial states
(merge_path), and the location helpers. The LSE bases are attndbg.numerics', the split rule the
kernel's (backends/triton_kernels/split_rule.py).
"""

from __future__ import annotations

import torch

from attndbg.backends import engine_names
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import FindingClass, Location
from attndbg.trace.schema import ForwardMode, Trace

KIND = FindingClass.SPLIT_MERGE


def merge_path(trace: Trace) -> str | None:
    """The merge of partial states in the path the recording backend runs for this step, if any:
    split-KV decode, else what the adapter reproducing that backend declares (Backend.merge_path)."""
    backend = trace.source.backend
    if engine_names.merges_nothing(backend):
        return None  # one softmax over the whole row: nothing is merged
    if trace.batch.forward_mode is ForwardMode.DECODE:
        return "split-KV decode (partial states of KV splits merged by their LSEs)"
    adapter = engine_names.adapter_for(backend)
    return adapter.merge_path(trace) if adapter is not None else None


def _location(ctx: CheckContext, worst=None, **extra) -> Location:
    if worst is not None:
        extra = {"request": worst.request, "row": worst.row, "head": worst.head, **extra}
    return Location(step=ctx.step, layer=ctx.options.layer, **extra)


def _request_of(trace: Trace, row: int) -> int:
    return int(torch.searchsorted(trace.batch.qo_indptr, torch.tensor(row), right=True)) - 1
