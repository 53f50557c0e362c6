"""A test detector whose own kernel really poisons its process's CUDA context on one step: a Triton
kernel that loads 1 TiB past a tensor (an illegal memory access), or a torch index out of bounds on
the GPU (a device-side assert). Registered through ATTNDBG_DETECTORS
(`gpu-fault=tests.gpu.fault_detector:DETECTOR`), so check's worker processes load it too.

Every step it allocates on the GPU and synchronises, so a step taken by a process whose context is
poisoned fails in it. On the step numbered ATTNDBG_TEST_FAULT_STEP it faults the way
ATTNDBG_TEST_FAULT says: `launch` inside a launch it announces (as triton, the runner's way),
`kernel` in its own code, not announced and not synchronised (the fault surfaces later, as in
split-merge's own launch on the H100), `assert` a device-side assert, not announced,
`raise` inside a launch it announces, a kernel that faults and then a host-side error (as
FlashInfer 0.7.2's tensor-core decode at head_dim 80 faults, then its merge raises "Unsupported
head_dim"), `merge` in split-merge's stage-2 probe, launched through the runner's `merge` (our stage 2 swapped,
in this process only, for a kernel that reads far past its tensors)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector
from attndbg.replay import activity

KIND = FindingClass("gpu-fault")
# Far past any allocation: 1 TiB past the tensor (as tests/gpu/out_of_bounds_backend.py reads).
FAR = 1 << 40
WHAT = "read 1 TiB past a tensor"


@triton.jit
def _read_far(src, dst, offset):
    tl.store(dst, tl.load(src + offset))


def detect(ctx) -> list:
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()  # a poisoned context fails here, on every step after the fault
    how = os.environ.get("ATTNDBG_TEST_FAULT", "launch")
    if str(ctx.step) != os.environ.get("ATTNDBG_TEST_FAULT_STEP"):
        return []
    if how == "launch":
        if "triton" not in ctx.backends():
            return []  # left out after its crash: the detector launches only the step's backends
        with activity.launching("triton", WHAT):
            _read_far[(1,)](x, x, FAR)
    elif how == "raise":
        if "triton" not in ctx.backends():
            return []  # left out after its crash, as above
        with activity.launching("triton", WHAT):
            _read_far[(1,)](x, x, FAR)  # asynchronous: still pending when the error below is raised
            raise RuntimeError("Unsupported head_dim: 80")
    elif how == "merge":
        if "triton" not in ctx.backends():
            return []  # left out after its crash, as above
        from attndbg.backends.triton_kernels import decode
        from attndbg.detectors.split_merge import stage2

        def faulting_stage2(*, o, **kwargs) -> None:
            _read_far[(1,)](o, o, FAR)  # asynchronous: surfaces when the runner's launch synchronises

        decode.decode_stage2 = faulting_stage2  # the worker ends on the fault: nothing to restore
        stage2.stage2_probe.__wrapped__(64)  # the probe itself, not its per-process cache
    elif how == "kernel":
        _read_far[(1,)](x, x, FAR)  # asynchronous: nothing raises here
    else:
        x[torch.tensor([1 << 20], device="cuda")]  # index out of bounds: a device-side assert, asynchronous
    return []


DETECTOR = Detector(kind=KIND, summary="a test: a real illegal memory access on one step", detect=detect, opt_in=True)
