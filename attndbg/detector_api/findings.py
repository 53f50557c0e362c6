"""What a detector reports: a class, a location, the evidence in numbers, and the likely cause."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar


class FindingClass:
    """The class of a finding: the kind of the detector that reports it ("tree-mask"), or the check
    engine's own "backend-crash".

    An open set, unlike an enum: a third-party detector brings its own kind (`FindingClass("toy")`).
    One object per value, so classes compare with `is` like enum members, also after pickling
    through a check worker; `.value` is the string the reports and `--json` print.
    """

    __slots__ = ("value",)
    value: str
    _interned: ClassVar[dict[str, FindingClass]] = {}
    # A kind is a word of the command line (`--only`, `--inject KIND:MISTAKE`) and of JSON.
    _SPELLING: ClassVar[re.Pattern[str]] = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")

    INVARIANT: ClassVar[FindingClass]
    FILL_VALUE: ClassVar[FindingClass]
    TREE_MASK: ClassVar[FindingClass]
    SPLIT_MERGE: ClassVar[FindingClass]
    BATCH_INVARIANCE: ClassVar[FindingClass]
    EXPOSURE: ClassVar[FindingClass]
    KERNELS: ClassVar[FindingClass]
    BACKEND_CRASH: ClassVar[FindingClass]

    def __new__(cls, value: str) -> FindingClass:
        existing = cls._interned.get(value)
        if existing is not None:
            return existing
        if not isinstance(value, str) or not cls._SPELLING.fullmatch(value):
            raise ValueError(f"a finding class is lower-case words joined by hyphens, such as 'tree-mask'; got {value!r}")
        made = super().__new__(cls)
        object.__setattr__(made, "value", value)
        return cls._interned.setdefault(value, made)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FindingClass is immutable")

    def __reduce__(self) -> tuple[type[FindingClass], tuple[str]]:
        return FindingClass, (self.value,)  # unpickled to the one object of its value

    def __repr__(self) -> str:
        return f"FindingClass({self.value!r})"

    def __str__(self) -> str:
        return self.value


FindingClass.INVARIANT = FindingClass("invariants")
FindingClass.FILL_VALUE = FindingClass("fill-value")
FindingClass.TREE_MASK = FindingClass("tree-mask")
FindingClass.SPLIT_MERGE = FindingClass("split-merge")
FindingClass.BATCH_INVARIANCE = FindingClass("batch-invariance")
FindingClass.EXPOSURE = FindingClass("exposure")
FindingClass.KERNELS = FindingClass("kernels")
# Not a detector: the check engine's own report of a kernel library that crashed on a step
# (its worker died, or poisoned its CUDA context); the step is checked again without it.
FindingClass.BACKEND_CRASH = FindingClass("backend-crash")


class Severity(enum.Enum):
    """What a finding claims about the step (DESIGN.md "Findings").

    DEFECT: this step's output is wrong, or a kernel given this plan would read out of bounds; it
    fails the check (exit 1). HAZARD: this step is correct, and wrong under a condition the finding
    states (a later op that mixes padded rows into real ones, a stale value that stops being valid, a
    mistake the engine could make); it is reported and counted, and fails only `check --strict`.
    The detector that makes a finding decides: it is the one that knows whether the output is right.
    """

    DEFECT = "defect"
    HAZARD = "hazard"


@dataclass(frozen=True)
class Location:
    """Where a finding is; unset parts do not apply. `row` is the query token's index in the step;
    `request_row` its index within its request (set by the check engine from the batch)."""

    step: int
    layer: int | None = None
    request: int | None = None
    row: int | None = None
    column: int | None = None  # key column of the request's KV row, or mask column
    head: int | None = None
    field: str | None = None  # trace field with the first bad element, e.g. "plan.kv_indptr[3]"
    request_row: int | None = None  # the row within its request

    def __str__(self) -> str:
        parts = [f"step {self.step}"]
        for name in ("layer", "request", "row", "column", "head"):
            value = getattr(self, name)
            if value is None:
                continue
            if name == "row" and self.request_row is not None and self.request is not None:
                parts.append(f"row {self.request_row} (step row {value})")
            else:
                parts.append(f"{name} {value}")
        if self.field:
            parts.append(self.field)
        return " / ".join(parts)


@dataclass(frozen=True)
class Finding:
    kind: FindingClass
    check: str  # short stable id of the specific check, e.g. "indptr-decreases"
    location: Location
    evidence: str  # the numbers: "kv_indptr[3] = 17 < kv_indptr[2] = 20"
    cause: str  # one sentence naming the likely cause
    trace: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # machine-readable evidence for --json
    severity: Severity = Severity.DEFECT  # a hazard only where the detector knows this step's output is right

    def to_json(self) -> dict[str, Any]:
        loc = {k: v for k, v in self.location.__dict__.items() if v is not None}
        return {
            "class": self.kind.value,
            "check": self.check,
            "severity": self.severity.value,
            "trace": self.trace,
            "location": loc,
            "evidence": self.evidence,
            "cause": self.cause,
            "data": self.data,
        }


# Keywords of `finding()` that say where; every other keyword is data.
_PLACE = ("layer", "request", "row", "column", "head", "field")


def finding(
    kind: FindingClass, check: str, *, step: int, evidence: str, cause: str, trace: str = "", severity: Severity = Severity.DEFECT, **details: Any
) -> Finding:
    """The finding every detector builds: `kind` (the detector's), `check` (its stable id), at `step`.

    Keywords named like a Location field (layer, request, row, column, head, field) place it in
    the step; the others, in the order given, are its machine-readable data for `--json`.
    `severity`: HAZARD only where this step's output is right and the cause states when it is not.
    """
    where = {name: details.pop(name) for name in _PLACE if name in details}
    return Finding(kind, check, Location(step=step, **where), evidence, cause, trace=trace, data=details, severity=severity)
