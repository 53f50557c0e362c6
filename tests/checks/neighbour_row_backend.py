"""A test adapter registered through ATTNDBG_BACKENDS with a batch-dependent plan bug: it launches
our real Triton decode kernels (through the triton adapter's `run`), but its plan builder gives the
last request of a batch of two or more the KV row of the request before it, as a plan builder
indexing req_to_token with req_pool_indices[b - 1] for the last row would. Alone, a request's plan
is right; in a batch, the last request reads its neighbour's keys (the first kv_len of them: tests
order the batch so that the neighbour's row is the longer). Only batch-invariance can see it from
outputs: every plan it builds is well formed, and the whole batch alone only fails the reference.
"""

from __future__ import annotations

import torch

from attndbg.backends.base import Padding
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import ForwardMode, Plan, Trace


class NeighbourRowBackend(TritonBackend):
    name = "neighbour_row"
    engine_names = {}  # no engine ran it: it answers to no recorded backend name

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        plan = super().derive_plan(trace, padding)
        bs = trace.batch.batch_size
        if trace.batch.forward_mode is not ForwardMode.DECODE or bs < 2:
            return plan
        indptr, indices = plan.tensors["kv_indptr"].to(torch.int64), plan.tensors["kv_indices"].clone()
        last, neighbour = int(indptr[bs - 1]), int(indptr[bs - 2])
        n = int(indptr[bs]) - last
        if int(indptr[bs - 1]) - neighbour < n:
            raise ValueError("neighbour_row: the test orders the batch so that the neighbour's row is at least as long")
        indices[last : last + n] = indices[neighbour : neighbour + n]
        return Plan(plan.backend, {**plan.tensors, "kv_indices": indices}, plan.scalars)
