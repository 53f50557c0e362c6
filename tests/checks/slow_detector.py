"""A test detector that spends ATTNDBG_TEST_SLOW_S seconds inside a launch it announces (as
triton, "slow sweep"): long enough for a progress display to see what a worker runs. Registered
through ATTNDBG_DETECTORS (`slow=tests.checks.slow_detector:DETECTOR`), so check's workers load it."""

from __future__ import annotations

import os
import time

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector
from attndbg.replay import activity


def detect(ctx) -> list:
    with activity.launching("triton", "slow sweep"):
        time.sleep(float(os.environ.get("ATTNDBG_TEST_SLOW_S", "2")))
    return []


DETECTOR = Detector(kind=FindingClass("slow"), summary="a test: sleeps inside an announced launch", detect=detect, opt_in=True)
