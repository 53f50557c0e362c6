"""A test detector whose failure changes kind with the batch size, registered through
ATTNDBG_DETECTORS (`kind-test=tests.minimize.kind_detector:DETECTOR`) so minimize's workers load it.

With 3 requests or more it reports a finding (`kind-test/seen`); with fewer it "makes an illegal
memory access" inside an announced Triton launch, as a kernel given a smaller batch might, and
poisons its process's (simulated) CUDA context. A minimiser that counts any failure as the same
one (TensorRT-LLM's) would shrink a 4-request step to 1 request; attndbg's must stop at 3."""

from __future__ import annotations

import torch

from attndbg.detector_api.findings import FindingClass, finding
from attndbg.detectors.base import Detector
from attndbg.replay import activity

KIND = FindingClass("kind-test")
ILLEGAL = "CUDA error: an illegal memory access was encountered"
CRASH_BELOW = 3


def _poisoned() -> str | None:
    return ILLEGAL


def detect(ctx) -> list:
    bs = ctx.trace.batch.batch_size
    if bs >= CRASH_BELOW:
        return [finding(KIND, "seen", step=ctx.step, evidence=f"{bs} requests", cause="a test finding")]
    if "triton" in ctx.options.exclude:
        return []  # checked again without the backend that crashed
    activity.probe = _poisoned  # this process's context is gone from now on
    with activity.launching("triton", "kind-test launch"):
        raise torch.AcceleratorError(ILLEGAL)


DETECTOR = Detector(kind=KIND, summary="a test: a finding with 3+ requests, a crash with fewer", detect=detect, opt_in=True)
