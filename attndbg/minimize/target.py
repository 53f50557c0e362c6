"""What `attndbg minimize` keeps while it shrinks a step: one failure, of one kind.

A failure is one of three kinds, and a smaller step reproduces the target only with a failure of
the same kind (TensorRT-LLM's minimiser, tests/unittest/_torch/attention/minimize.py, counts any
exception as "still failing" in one process, so after one illegal memory access every later
candidate fails and it shrinks to the smallest case whatever the bug):

    CRASH     the backend crashed (a `backend-crash` finding): the same backend, the same error
              (an illegal memory access stays one; a segfault or a device-side assert is another)
    FINDING   a detector's finding of the same class and check
    MISMATCH  the backend's replay failed the float64 reference (`--finding replay`)

and, when the step's standalone script (`attndbg repro`) reproduces, its symptom too (SYMPTOM: a
crash, NaN or Inf, rows over tolerance): a label kept by a smaller step whose script no longer
reproduces is not the failure the user came with

and, for FINDING and MISMATCH, without a crash the original step did not have (a candidate that
crashes shows another failure, whatever else it reports).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from attndbg.detector_api.findings import Finding, FindingClass, Severity

# Not a detector: the minimiser's own check that the backend's replay passes the reference.
REPLAY = FindingClass("replay")
# Not a detector either: the step's repro script reproduces, with the symptom its check names
# ("crash", "nan-inf", "mismatch"). Never a target of its own: kept beside the target when the
# original step's script reproduces, so a smaller step keeps the symptom, not only the label.
REPRO = FindingClass("repro")


class FailureKind(enum.Enum):
    CRASH = "crash"
    FINDING = "finding"
    MISMATCH = "mismatch"
    SYMPTOM = "symptom"  # the repro script reproduces (`REPRO`), with the symptom its check names


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    finding_class: str
    check: str
    detail: str = ""  # CRASH: "<backend>: <error>", the error with its numbers and addresses left out
    defect: bool = True

    def __str__(self) -> str:
        name = f"{self.finding_class}/{self.check}"
        return f"{name} ({self.kind.value}: {self.detail})" if self.detail else f"{name} ({self.kind.value})"


def _error_kind(text: str) -> str:
    """The error without what changes between runs of the same fault (addresses, numbers)."""
    first = (text.strip().splitlines() or [""])[0]
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", first).strip()


def failure_of(f: Finding) -> Failure:
    if f.kind is FindingClass.BACKEND_CRASH:
        error = f.data.get("error") or f.data.get("death") or ""
        return Failure(FailureKind.CRASH, f.kind.value, f.check, f"{f.data.get('backend') or 'a kernel'}: {_error_kind(str(error))}")
    if f.kind is REPLAY:
        return Failure(FailureKind.MISMATCH, f.kind.value, f.check)
    if f.kind is REPRO:
        return Failure(FailureKind.SYMPTOM, f.kind.value, f.check)
    if f.kind is FindingClass.BACKEND_CRASH and f.data.get("reproduced") is False:
        # A recorded crash that did not come back here is a hazard about the step, no crash of it.
        return Failure(FailureKind.FINDING, f.kind.value, f.check, defect=False)
    return Failure(FailureKind.FINDING, f.kind.value, f.check, defect=f.severity is Severity.DEFECT)


def parse_wanted(spec: str | None) -> tuple[str | None, str | None]:
    """--finding CLASS[/check] -> (class, check); (None, None) for the step's first failure."""
    if not spec:
        return None, None
    cls, _, check = spec.partition("/")
    return cls.strip(), (check.strip() or None)


def choose(failures: Sequence[Failure], wanted: tuple[str | None, str | None]) -> Failure | None:
    """The failure to keep: the one `wanted` names (its first), else the step's first crash, then
    its first defect, then its first hazard, then a replay mismatch."""
    cls, check = wanted
    if cls is not None:
        return next((f for f in failures if f.finding_class == cls and (check is None or f.check == check)), None)
    order = (
        lambda f: f.kind is FailureKind.CRASH,
        lambda f: f.kind is FailureKind.FINDING and f.defect,
        lambda f: f.kind is FailureKind.FINDING,
        lambda f: f.kind is FailureKind.MISMATCH,
    )
    return next((f for test in order for f in failures if test(f)), None)


def reproduces(target: Failure, failures: Sequence[Failure], original: Sequence[Failure], symptom: str | None = None) -> bool:
    """Does a candidate with `failures` show `target` (found on the step with `original`), of its
    kind, and, when `symptom` is given, does its repro script reproduce with that symptom?"""
    if symptom is not None and not any(f.kind is FailureKind.SYMPTOM and f.check == symptom for f in failures):
        return False
    if target.kind is FailureKind.CRASH:
        return any(f.kind is FailureKind.CRASH and f.detail == target.detail for f in failures)
    crashes_before = {f.detail for f in original if f.kind is FailureKind.CRASH}
    if any(f.kind is FailureKind.CRASH and f.detail not in crashes_before for f in failures):
        return False  # it crashed where the step did not: another failure, whatever else it shows
    return any(f.kind is target.kind and f.finding_class == target.finding_class and f.check == target.check for f in failures)
