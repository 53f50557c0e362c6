"""A test detector that poisons its process's (simulated) CUDA context on one step, as a detector's
own kernel launch does with an illegal memory access on a GPU: registered through ATTNDBG_DETECTORS
(`cuda-fault=tests.checks.cuda_fault_detector:DETECTOR`), so check's worker processes load it too.

On the step numbered ATTNDBG_TEST_FAULT_STEP it raises CUDA's illegal-memory-access error, the way
ATTNDBG_TEST_FAULT says: inside a launch it announces (`launch`: as triton, "cuda-fault sweep"), in its
own code outside any launch (`detector`), or swallowed by its own code (`swallowed`: only the probe
of the context finds it). From then on the process's context is poisoned as a real one is: the probe
of the context fails, and this detector fails on every later step with the same error, so a step
that a poisoned worker took would come back "not checked"."""

from __future__ import annotations

import os

import torch

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector
from attndbg.replay import activity

KIND = FindingClass("cuda-fault")
# As torch words it (torch.AcceleratorError, cudaErrorIllegalAddress).
ILLEGAL = "CUDA error: an illegal memory access was encountered"

_poisoned = False  # this process's simulated CUDA context


def _probe() -> str | None:
    return ILLEGAL if _poisoned else None


def detect(ctx) -> list:
    global _poisoned
    if _poisoned:
        raise torch.AcceleratorError(ILLEGAL)  # as every CUDA call after a real fault
    how = os.environ.get("ATTNDBG_TEST_FAULT", "launch")
    if str(ctx.step) != os.environ.get("ATTNDBG_TEST_FAULT_STEP"):
        return []
    if how == "launch" and "triton" in ctx.options.exclude:
        return []  # as a real detector launches only the backends the step runs (ctx.backends())
    _poisoned = True
    activity.probe = _probe  # the context of this process is gone from now on
    if how == "launch":
        with activity.launching("triton", "cuda-fault sweep"):
            raise torch.AcceleratorError(ILLEGAL)
    if how == "detector":
        raise torch.AcceleratorError(ILLEGAL)
    try:
        raise torch.AcceleratorError(ILLEGAL)
    except RuntimeError:
        return []  # swallowed: the step looks clean, the context is not


def reset() -> None:
    """For in-process tests: this process's simulated context works again."""
    global _poisoned
    _poisoned = False


DETECTOR = Detector(kind=KIND, summary="a test: poisons the CUDA context on one step", detect=detect, opt_in=True)
# The same fault under a second kind: a fault that follows the step from one detector to the next.
SECOND = Detector(kind=FindingClass("cuda-fault-again"), summary="a test: the same fault, a second detector", detect=detect, opt_in=True)
