"""A test adapter registered through ATTNDBG_BACKENDS whose verify plans carry the tree mask
transposed, as a mask builder that writes mask[k, q] for mask[q, k] would: it launches our real
Triton extend kernel (the triton adapter's `run`) with that plan. tree-mask's verify-output must
name the mechanism from the kernel's output alone (attndbg/diagnose's mask-transposed)."""

from __future__ import annotations

import torch

from attndbg.backends.base import Padding
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import Plan, Trace


class TransposedMaskBackend(TritonBackend):
    name = "transposed_mask"
    engine_names = {}  # no engine ran it: it answers to no recorded backend name

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        plan = super().derive_plan(trace, padding)
        if not trace.is_tree_verify or "custom_mask" not in plan.tensors:
            return plan
        mask, indptr = plan.tensors["custom_mask"].clone(), plan.tensors["mask_indptr"].to(torch.int64)
        n = trace.spec.draft_token_num
        for b in range(trace.batch.batch_size):
            prefix = int(trace.batch.prefix_lens[b])
            block = mask[int(indptr[b]) : int(indptr[b + 1])].view(n, prefix + n)
            block[:, prefix:] = block[:, prefix:].T.clone()
        return Plan(plan.backend, {**plan.tensors, "custom_mask": mask}, plan.scalars)
