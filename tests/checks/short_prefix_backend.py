"""A test adapter registered through ATTNDBG_BACKENDS whose extend plans read each cached prefix one
token short, as a plan builder that took the prefix length before the last cached token was
counted would (kv_indptr built from prefix_lens - 1): it launches our real Triton extend kernel
(the triton adapter's `run`) with that plan. Every plan it builds is well formed; only the outputs
show it, on extend and mixed steps (a mixed step's decode rows read their prefix the same way), and
the kernels detector must say so. Decode and verify plans are the triton adapter's own."""

from __future__ import annotations

import torch

from attndbg.backends.base import Padding
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import ForwardMode, Plan, Trace, indptr


class ShortPrefixBackend(TritonBackend):
    name = "short_prefix"
    engine_names = {}  # no engine ran it: it answers to no recorded backend name

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        plan = super().derive_plan(trace, padding)
        if trace.batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or trace.batch.selective:
            return plan
        offsets = plan.tensors["kv_indptr"].to(torch.int64)
        rows = [plan.tensors["kv_indices"][int(offsets[b]) : max(int(offsets[b]), int(offsets[b + 1]) - 1)] for b in range(len(offsets) - 1)]
        lengths = torch.tensor([r.numel() for r in rows])
        return Plan(plan.backend, {**plan.tensors, "kv_indptr": indptr(lengths).to(torch.int32), "kv_indices": torch.cat(rows)}, plan.scalars)


class ShortPrefixAsTriton(ShortPrefixBackend):
    """The same plan bug in place of the triton adapter (a test puts it in the registry under that
    name): `attndbg repro` scripts the built-in adapters by name, so the command a finding gives
    can be run and must reproduce, while the real triton adapter's script must not."""

    name = "triton"
