"""A test backend whose kernel reads far outside its tensors: Triton's decode, preceded by a real
out-of-bounds load (an illegal memory access on a GPU). For the crash-isolation test only;
registered through ATTNDBG_BACKENDS, so check's worker processes can create it too."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import Plan, Trace

# Far past any allocation: 1 TiB past the query tensor.
FAR = 1 << 40


@triton.jit
def _read_far(src, dst, offset):
    tl.store(dst, tl.load(src + offset))


class OutOfBoundsBackend(TritonBackend):
    name = "oob-triton"

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        sink = torch.empty(1, dtype=inputs.q.dtype, device=inputs.q.device)
        _read_far[(1,)](inputs.q, sink, FAR)
        torch.cuda.synchronize()  # the fault surfaces here, inside the launch the runner names
        return super().run(trace, inputs, plan)


class SubBatchOutOfBoundsBackend(TritonBackend):
    """Triton, except on a batch of one request of the step numbered ATTNDBG_TEST_FAULT_STEP (what
    batch-invariance replays a request alone as), where it first reads far out of bounds."""

    name = "oob-alone"

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        if trace.batch.batch_size == 1 and str(trace.source.step) == os.environ.get("ATTNDBG_TEST_FAULT_STEP"):
            sink = torch.empty(1, dtype=inputs.q.dtype, device=inputs.q.device)
            _read_far[(1,)](inputs.q, sink, FAR)
            torch.cuda.synchronize()  # inside the sub-batch's launch, which the runner announces
        return super().run(trace, inputs, plan)
