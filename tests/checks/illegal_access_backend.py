"""A test adapter registered through ATTNDBG_BACKENDS whose kernel "makes an illegal memory access"
on one step (the step numbered ATTNDBG_TEST_FAULT_STEP), simulated on the CPU: our Triton adapter,
whose kernel call raises what Triton raises after such a fault (the adapter wraps it in a
KernelError, as it wraps every library error). From then on every run of it in that process raises
the same, as every CUDA call does in a poisoned context, and the probe of the context fails."""

from __future__ import annotations

import os

from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.backends.triton import TritonBackend
from attndbg.replay import activity
from attndbg.trace.schema import Plan, Trace

ILLEGAL = "Triton Error [CUDA]: an illegal memory access was encountered"

_poisoned = False  # this process's simulated CUDA context


def _probe() -> str | None:
    return ILLEGAL if _poisoned else None


class IllegalAccessBackend(TritonBackend):
    name = "illegal_access"
    engine_names = {}  # no engine ran it: it answers to no recorded backend name
    alone_only = False  # fault on the step's every run (True: only on a batch of one request)

    def _run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        global _poisoned
        faulting = str(trace.source.step) == os.environ.get("ATTNDBG_TEST_FAULT_STEP") and (not self.alone_only or trace.batch.batch_size == 1)
        if _poisoned or faulting:
            _poisoned = True
            activity.probe = _probe  # the context of this process is gone from now on
            raise RuntimeError(ILLEGAL)
        return super()._run(trace, inputs, plan)


class IllegalAloneBackend(IllegalAccessBackend):
    """Faults only on a request of the step run alone, as batch-invariance replays each one."""

    name = "illegal_alone"
    alone_only = True


def reset() -> None:
    """For in-process tests: this process's simulated context works again."""
    global _poisoned
    _poisoned = False
