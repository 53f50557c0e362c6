"""Shared by the invariants detector's modules: its finding class, two small tensor lookups, the
draft extend's query rule its checks cite."""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import FindingClass
from attndbg.trace.offsets import first_true

KIND = FindingClass.INVARIANT

# What a draft extend's queries are, by SGLang's mode (engines.md A2; record/sglang/batch.py): a
# draft extend's seq_lens and query offsets that count other queries follow the other mode's rule.
DRAFT_EXTEND_QUERIES = (
    "a draft extend runs its own mode's queries per request: the classic DRAFT_EXTEND its accepted tokens, "
    "DRAFT_EXTEND_V2 its whole verify window (num_tokens_per_req = speculative_num_draft_tokens, whatever it accepted)"
)


def _request_of(qo_indptr: Tensor, t: int) -> int:
    return int(torch.searchsorted(qo_indptr, torch.tensor(t), right=True)) - 1


_first = first_true  # the offsets rule's own (attndbg/trace/offsets.py), under the name this detector's modules use
