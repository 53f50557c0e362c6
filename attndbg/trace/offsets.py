"""The offsets rule, once: a CSR offsets list (an "indptr": `*indptr`, `cu_seqlens_*`, a batch's
`slot_indptr`, vLLM's `query_start_loc`) is a non-empty 1-D tensor that starts at 0 and never
decreases. Each reader words a break its own way: loading a trace refuses it (validate.py), the
replay guard does not launch a plan that holds one (attndbg/plans/guard.py), and the invariants
detector reports a recorded plan's as a finding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class OffsetsFault(enum.Enum):
    SHAPE = "not a non-empty one-dimensional tensor"
    START = "does not start at 0"
    DECREASES = "decreases"


@dataclass(frozen=True)
class BrokenOffsets:
    """Where an offsets list first breaks the rule."""

    fault: OffsetsFault
    at: int  # the first bad element: 0 for START (and SHAPE), i with values[i] < values[i - 1] for DECREASES


def first_true(mask: Tensor) -> int:
    """The flat index of the first True in `mask`, -1 when there is none."""
    return int(torch.nonzero(mask.flatten())[0]) if bool(mask.any()) else -1


def first_decrease(values: Tensor) -> int:
    """The first index i with values[i] < values[i - 1] (an offsets list that decreases there), -1
    when there is none."""
    i = first_true(values[1:] < values[:-1])
    return i + 1 if i >= 0 else -1


def broken(values: Tensor) -> BrokenOffsets | None:
    """How `values` breaks the offsets rule, first; None when it keeps it."""
    if values.dim() != 1 or values.numel() == 0:
        return BrokenOffsets(OffsetsFault.SHAPE, 0)
    if int(values[0]) != 0:
        return BrokenOffsets(OffsetsFault.START, 0)
    i = first_decrease(values)
    return BrokenOffsets(OffsetsFault.DECREASES, i) if i > 0 else None
