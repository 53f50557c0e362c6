"""A recorded plan's offsets (`*indptr`, `cu_seqlens_*`) read by the offsets rule
(attndbg/trace/offsets.py): one dimension, a leading 0, never decreasing. A list that breaks it is
a problem (data: the invariants detector words it); one that keeps it may be read per request.
Where each list ends is judged by the invariants detector (detectors/invariants/indptr.py).
"""

from __future__ import annotations

from torch import Tensor

from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.trace.offsets import OffsetsFault, broken


def is_indptr(name: str) -> bool:
    """Whether a plan tensor of this name is a CSR offsets list (`*indptr`, `cu_seqlens_*`)."""
    return name.endswith("indptr") or "cu_seqlens" in name


def offsets_problem(name: str, values: Tensor) -> PlanProblem | None:
    """How plan.<name> breaks the offsets rule, at its first bad element; None when it keeps it."""
    bad = broken(values)
    if bad is None:
        return None
    if bad.fault is OffsetsFault.SHAPE:
        return PlanProblem(ProblemKind.OFFSETS_SHAPE, name, detail={"shape": list(values.shape)})
    if bad.fault is OffsetsFault.START:
        return PlanProblem(ProblemKind.OFFSETS_START, name, index=0, expected=0, found=int(values[0]))
    i = bad.at
    return PlanProblem(ProblemKind.OFFSETS_DECREASE, name, request=i - 1, index=i, expected=int(values[i - 1]), found=int(values[i]))
