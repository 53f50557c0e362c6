"""What a detector reports: a class, a location, the evidence in numbers, and the likely cause."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FindingClass(enum.Enum):
    INVARIANT = "invariants"
    FILL_VALUE = "fill-value"
    TREE_MASK = "tree-mask"
    SPLIT_MERGE = "split-merge"
    # Not a detector: the check engine's own report of a kernel library that crashed on a step
    # (its worker died, or poisoned its CUDA context); the step is checked again without it.
    BACKEND_CRASH = "backend-crash"


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

    def to_json(self) -> dict[str, Any]:
        loc = {k: v for k, v in self.location.__dict__.items() if v is not None}
        return {
            "class": self.kind.value,
            "check": self.check,
            "trace": self.trace,
            "location": loc,
            "evidence": self.evidence,
            "cause": self.cause,
            "data": self.data,
        }
