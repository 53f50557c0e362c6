"""A check function for the worker-shutdown test: importing it (as every worker does, by name)
makes the worker's exit take SLOW_EXIT_S, as a real worker's teardown of its interpreter, CUDA
context and kernel modules takes about a second."""

from __future__ import annotations

import atexit
import time

from attndbg.checks.step import check_one

SLOW_EXIT_S = 3.0  # long against an interpreter's own teardown under load (about 1 s), so that "at once" (< 3x) and "in turn" (>= 4x) stay apart

atexit.register(time.sleep, SLOW_EXIT_S)


def check_then_exit_slowly(path, only, options):
    return check_one(path, only, options)
