"""Shared by the invariants detector's modules: its finding class and two small tensor lookups."""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import FindingClass

KIND = FindingClass.INVARIANT


def _request_of(qo_indptr: Tensor, t: int) -> int:
    return int(torch.searchsorted(qo_indptr, torch.tensor(t), right=True)) - 1


def _first(mask: Tensor) -> int:
    return int(torch.nonzero(mask.flatten())[0]) if bool(mask.any()) else -1
