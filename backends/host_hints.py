"""Host-side hints a kernel reads beside its plan's tensors: a `max_seq_len`, `max_seqlen_q`,
`max_query_len` or `max_extend_len` integer the engine computes on the host and passes at launch,
which sizes the kernel's grid or its walk over a block table. Every tensor may be right and the
hint still wrong (issue "host-side hints": vLLM #43991, SGLang #9416).

An adapter declares, per engine backend name it answers to (`Backend.host_hints`), which hints
reach which of its kernels and what each one sizes; the invariants detector judges the recorded
value against the batch (attndbg/detectors/invariants/host_hints.py). What a hint means is said
here once, as data:

- `Sizes.ROWS`: the kernel launches work for `hint` rows (query tokens of the longest request, or
  KV columns): a hint below the batch's longest leaves rows or keys unread (a defect). Above, the
  extra work finds nothing to do: engines round hints up (a graph captured at its largest shape).
- `Sizes.TABLE_WALK`: as ROWS, and the kernel reads ceil(hint / page_size) entries of each
  block-table row: past the table's width it reads outside the tensor it was given (a defect).
  Within the width, a hint above the batch's longest is the engines' own practice (SGLang's
  trtllm_mha passes max_context_len; vLLM captures its graphs with max_model_len).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Measures(enum.Enum):
    """What batch length a hint stands for."""

    QUERY_LEN = "the longest query length"  # query tokens of one request (extend length)
    KV_LEN = "the longest KV length"  # KV columns one request reads (prefix + extend)


class Sizes(enum.Enum):
    """What the kernel sizes by the hint."""

    ROWS = "the rows it launches work for"
    TABLE_WALK = "its walk over the block table"


class Rows(enum.Enum):
    """Which requests the kernel that reads the hint runs (vLLM's builders put decodes first)."""

    ALL = "all"
    DECODES = "decodes"  # the first num_decodes (the builder's count)
    PREFILLS = "prefills"  # the rest


@dataclass(frozen=True)
class HostHint:
    """One hint one kernel reads."""

    scalar: str  # plan.scalars: the value the kernel is launched with
    measures: Measures
    sizes: Sizes
    kernel: str  # the kernel and where it reads the hint (its source), for a finding's cause
    rows: Rows = Rows.ALL
    # plan.tensors: the [rows, width] block table the kernel walks (TABLE_WALK only).
    table: str = ""
    # plan.scalars / plan.tensors that must be present for this kernel to be the one that ran (the
    # engine's metadata holds the part of the kernel that reads the hint); () when it always runs.
    present: tuple[str, ...] = ()
    # The adapter's own plan carries the hint under this name, so `attndbg replay --plan both` runs
    # the kernel with it as recorded and as the batch implies (the derived plan), and diffs them.
    replayed: bool = False
