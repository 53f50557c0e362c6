"""A test detector that runs out of GPU memory in a worker's share, as a large step does when the
other workers' caches and CUDA contexts fill the card: on the step numbered ATTNDBG_TEST_OOM_STEP it
raises CUDA's out-of-memory error while its process keeps to a share smaller than the workers' whole
part. Registered through ATTNDBG_DETECTORS (`oom=tests.checks.oom_detector:DETECTOR`), so check's
workers load it; each run appends "step share" to ATTNDBG_TEST_OOM_LOG."""

from __future__ import annotations

import os

import torch

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector
from attndbg.replay import memory_share


def detect(ctx) -> list:
    with open(os.environ["ATTNDBG_TEST_OOM_LOG"], "a") as log:
        log.write(f"{ctx.step} {memory_share.share()}\n")
    if str(ctx.step) == os.environ.get("ATTNDBG_TEST_OOM_STEP") and memory_share.shared():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 338.00 MiB.")
    return []


DETECTOR = Detector(kind=FindingClass("oom"), summary="a test: out of GPU memory in a worker's share on one step", detect=detect, opt_in=True)
