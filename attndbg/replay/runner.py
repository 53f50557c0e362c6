"""Eager replay: data, plans, kernels, and the comparison of every backend with the reference."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from attndbg.backends import reference
from attndbg.backends.base import AttentionResult, Backend, KernelError
from attndbg.backends.triton import TritonOptions
from attndbg.backends import registry
from attndbg.compare.tolerance import Comparison, compare
from attndbg.profiling import phase, step_label
from attndbg.replay.data import build_inputs, to_device
from attndbg.trace.schema import DTYPES, Plan, Trace


class RunStatus(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # this trace uses a feature the backend lacks
    UNAVAILABLE = "unavailable"  # the backend cannot run on this machine
    ERROR = "error"  # the kernel raised


@dataclass(frozen=True)
class BackendRun:
    name: str
    status: RunStatus
    description: str
    reason: str | None = None
    comparison: Comparison | None = None
    result: AttentionResult | None = None  # CPU copies
    plan: Plan | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class ReplayResult:
    trace: Trace
    trace_path: str
    reference: AttentionResult
    runs: list[BackendRun]

    @property
    def failed(self) -> bool:
        return any(r.status in (RunStatus.FAILED, RunStatus.ERROR) for r in self.runs)


@dataclass(frozen=True)
class ReplayOptions:
    layer: int | None = None  # recorded layer whose tensors to use
    triton: TritonOptions = TritonOptions()


def replay(trace: Trace, trace_path: str, backend_names: list[str], options: ReplayOptions = ReplayOptions()) -> ReplayResult:
    label = step_label(trace)
    with phase("data", label):
        inputs = build_inputs(trace, layer=options.layer)
    with phase("reference", label):
        ref = reference.attention(trace, inputs, torch.float64)
        lowp = reference.attention(trace, inputs, DTYPES[trace.model.q_dtype])
    runs = []
    for name in backend_names:
        backend = registry.create(name, triton_options=options.triton)
        with phase(f"backend/{name}", label):
            runs.append(_run_one(backend, trace, inputs, ref, lowp))
    return ReplayResult(trace=trace, trace_path=trace_path, reference=ref, runs=runs)


def _run_one(backend: Backend, trace: Trace, cpu_inputs, ref: AttentionResult, lowp: AttentionResult) -> BackendRun:
    reason = backend.unavailable_reason()
    if reason:
        return BackendRun(backend.name, RunStatus.UNAVAILABLE, "", reason=reason)
    description = backend.describe()
    reason = backend.unsupported_reason(trace)
    if reason:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, reason=reason)
    label = step_label(trace)
    with phase("plan", label):
        plan = backend.derive_plan(trace)
    inputs = to_device(cpu_inputs, backend.device())
    start = time.perf_counter()
    try:
        with phase("run", f"{label} backend={backend.name}"):
            result = backend.run(trace, inputs, plan)
            if inputs.q.is_cuda:
                torch.cuda.synchronize()
    except KernelError as e:
        return BackendRun(backend.name, RunStatus.ERROR, description, reason=str(e), plan=plan)
    seconds = time.perf_counter() - start
    cpu_result = AttentionResult(output=result.output.cpu(), lse=result.lse.cpu())
    with phase("compare", label):
        comparison = compare(
            output=cpu_result.output,
            lse=cpu_result.lse,
            reference_output=ref.output,
            reference_lse=ref.lse,
            lowp_output=lowp.output,
            lowp_lse=lowp.lse,
            dtype=DTYPES[trace.model.q_dtype],
            qo_indptr=trace.batch.qo_indptr,
        )
    status = RunStatus.PASSED if comparison.passed else RunStatus.FAILED
    return BackendRun(backend.name, status, description, comparison=comparison, result=cpu_result, plan=plan, seconds=seconds)
