"""What is structurally wrong with a recorded plan, as the plan reading found it: data, not findings.

A problem says what the reading could not take as its kernel would (an offsets list that
decreases, a page table shorter than a length, a mask buffer shorter than its offsets) and where,
with the numbers found. It claims nothing about the engine: the detector that owns the check words
it as a finding (attndbg/detectors/invariants/structure.py for the KV structure,
attndbg/detectors/tree_mask/recorded.py for a verify step's mask), and decides whether it counts.

Each kind's `detail` keys are listed with it; `field` is the plan tensor at fault (without "plan.").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ProblemKind(enum.Enum):
    # -- any plan's tensors (plans/reading.py) --
    INDEX_DTYPE = "an index tensor holds floats, complex numbers or bools"  # detail: dtype
    INDEX_RANK = "an index tensor has the wrong number of dimensions"  # detail: shape, dims
    # -- offsets (plans/offsets.py): `index` is the first bad element --
    OFFSETS_SHAPE = "an offsets list that is empty or not one-dimensional"  # detail: shape
    OFFSETS_START = "an offsets list that does not start at 0"  # found: its first entry
    OFFSETS_DECREASE = "an offsets list that decreases"  # found: values[index], expected: values[index - 1]
    # -- the per-request KV (plans/kv.py) --
    TABLE_ROWS = "a page table and its lengths of different batch sizes"  # detail: lengths (tensor), rows, requests
    TABLE_SHORT = "a length that needs more pages than its table row holds"  # found: the length; detail: lengths, pages, columns
    LAST_PAGE_LEN = "a last page length outside [1, page_size]"  # found; detail: page_size
    # -- a verify step's mask (plans/visibility.py) --
    MASK_OFFSETS_MISSING = "a mask without the offsets that place its blocks"  # detail: present (the tensor the plan holds)
    MASK_BLOCK_SIZE = "mask offsets that give a request a block of another size"  # found, expected; detail: n, prefix, width
    PACKED_BLOCK_BYTES = "packed mask offsets that give a request another number of bytes"  # found, expected; detail: rows, columns, bits
    MASK_LENGTH = "a mask buffer of another length than its offsets reach"  # found: buffer length, expected: offsets' end; detail: stale
    WINDOW_OFFSET = "window offsets that do not name the first column the window list holds"  # found, expected; detail: present, listed
    EXPAND_MISSING = "a two-call verify without its draft-block call's tables"  # detail: lengths
    EXPAND_ROWS = "a two-call verify's tables without one row per draft token"  # detail: lengths, rows, entries, expected


@dataclass(frozen=True)
class PlanProblem:
    kind: ProblemKind
    field: str  # the plan tensor (or "scalars.<name>") at fault, e.g. "kv_indptr"
    request: int | None = None
    index: int | None = None  # the element of `field` the problem is first seen at
    expected: int | None = None
    found: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
