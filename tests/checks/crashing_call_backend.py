"""A test adapter registered through ATTNDBG_BACKENDS that stands in for a kernel library whose call
crashes, on the CPU: our Triton adapter, whose run first does what ATTNDBG_TEST_CRASH says:
`cuda` raises what a poisoned CUDA context raises (an illegal memory access), `segfault` kills its
own process as a library's segfault would, `none` runs normally (the crash does not come back).
While repro records a script's calls it runs normally (the library is not called then)."""

from __future__ import annotations

import os
import signal

from attndbg.backends import script_calls
from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import Plan, Trace

ILLEGAL = "CUDA error: an illegal memory access was encountered"


class CrashingCallBackend(TritonBackend):
    name = "crashing_call"
    engine_names = {}  # no engine ran it: it answers to no recorded backend name

    def _run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        # While repro records a script's calls no library runs: nothing to crash.
        how = "none" if script_calls.scripting() else os.environ.get("ATTNDBG_TEST_CRASH", "cuda")
        if how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if how == "cuda":
            raise RuntimeError(ILLEGAL)
        return super()._run(trace, inputs, plan)
