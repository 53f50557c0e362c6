"""Shared by the invariants detector's modules: its finding class and two small tensor lookups."""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import FindingClass
from attndbg.trace.offsets import first_true

KIND = FindingClass.INVARIANT


def _request_of(qo_indptr: Tensor, t: int) -> int:
    return int(torch.searchsorted(qo_indptr, torch.tensor(t), right=True)) - 1


_first = first_true  # the offsets rule's own (attndbg/trace/offsets.py), under the name this detector's modules use
