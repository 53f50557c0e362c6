"""Check one step: load it, run the detectors on one `CheckContext`, and report (`StepReport`),
with what the recording detectors keep of it (`StepResult`). The same in this process
(run.py's `check_in_process`) and in a worker (workers.py).

A step that cannot be read or replayed here is a report with its error, never an exception; a
detector that fails on a step is named in the report and the others still run.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attndbg.backends import engine_names
from attndbg.checks.crashes import Recheck, crash_finding, recorded_crash_finding, with_crashes
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import Finding, FindingClass
from attndbg.detectors import registry
from attndbg.detectors.base import Detector
from attndbg.profiling import phase, step_range
from attndbg.replay import activity, memory_share
from attndbg.replay.crashed import rerun_crashed
from attndbg.trace import io
from attndbg.trace.schema import Trace
from attndbg.trace.validate import TraceError


@dataclass(frozen=True)
class StepReport:
    path: str
    step: int  # -1: the recording as a whole, or a step whose file could not be read
    mode: str
    findings: list[Finding]
    error: str | None = None  # the step was not checked: why (unreadable file, a worker that died)
    seconds: float = 0.0
    backends: tuple[str, ...] = ()  # kernel backends the detectors ran on this step
    bad_input: bool = False  # the error is the step's (unreadable, cannot fit here), not a detector's or a worker's
    # The plan detectors ran but could not read the recorded plan: "<plan.backend>: <why>" (the verdict names it).
    plan_unread: str | None = None
    # The step's call crashed where it ran (source.crash) and could not be run again here: why.
    crash_unrun: str | None = None
    # A CUDA-graph step padded for an engine backend no adapter answers to and no table gives
    # padding rules for (backends/engine_names.py): its name, which the verdict says; its padded
    # rows were judged by no kernel's rules, never by another backend's.
    unknown_engine_backend: str | None = None
    # "<engine backend>: why" when no kernel of the step's engine backend runs here (its adapter
    # reads the plan only: Backend.kernels_elsewhere), which the verdict says.
    engine_kernels_elsewhere: str | None = None

    @property
    def checked(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class StepResult:
    """What checking one step sends back: its report and the recording detectors' digests."""

    report: StepReport
    digests: dict[FindingClass, Any] = field(default_factory=dict)
    # Not checked: over this worker's share of the GPU but within the workers' whole part of it
    # (memory_share.OverShare), or out of GPU memory in a worker. The worker pool checks it again, alone.
    over_share: bool = False


def detectors_of(only: list[FindingClass]) -> dict[FindingClass, Detector]:
    return {kind: registry.load(kind) for kind in only}


def check_one(path: str | Path, only: list[FindingClass], options: CheckOptions) -> StepResult:
    """Load and check one step; an unreadable step is a report with its error, never an exception.

    A CUDA error that poisons the context, wherever it surfaces in the step (activity.py), ends a
    worker process here, before it can take another step. In one process the step gets the crash
    finding instead, the detectors after it are not run, and `activity.lost()` tells the caller."""
    start = time.perf_counter()
    detectors = detectors_of(only)
    try:
        trace = io.load(path)
    except TraceError as e:
        return StepResult(StepReport(str(path), -1, "unreadable", [], error=f"{e.field}: {e.message}", bad_input=True))
    ctx = CheckContext(trace=trace, path=str(path), options=options)

    def not_checked(error: str, *, bad_input: bool = False) -> StepReport:
        return StepReport(str(path), trace.source.step, trace.batch.forward_mode.value, [], error=error, bad_input=bad_input)

    findings: list[Finding] = []
    failures: list[str] = []
    crash_unrun = None
    if trace.source.crash is not None:
        rerun = rerun_crashed(str(path))
        if rerun.ran:
            findings.append(recorded_crash_finding(str(path), trace.source.step, trace.source.crash, rerun))
        else:
            crash_unrun = rerun.error
    activity.begin_step()
    crash: activity.Launch | None = None
    with step_range(path, trace):
        for kind, detector in detectors.items():
            try:
                with activity.detector(kind.value):
                    findings.extend(detector.run(ctx))
                    with _context_probe(kind):
                        activity.check_context()  # a fault some code swallowed, or raised outside any launch
            except TraceError as e:  # valid, but cannot be replayed here (e.g. its KV pool does not fit)
                return StepResult(not_checked(f"{e.field}: {e.message}", bad_input=True), over_share=isinstance(e, memory_share.OverShare))
            except Exception as e:  # noqa: BLE001 - a detector that cannot read this step must not end the check
                try:
                    with _context_probe(kind):
                        activity.check_error(e, kind.value)  # a poisoned CUDA context: a worker ends here
                except activity.CudaContextLost as lost:
                    crash = lost.crash
                    break
                if memory_share.shared() and memory_share.out_of_memory(e):  # checked again, alone: not a verdict
                    return StepResult(not_checked(f"the {kind.value} detector ran out of GPU memory in a worker"), over_share=True)
                first = (str(e).strip().splitlines() or [""])[0][:200]
                failures.append(f"the {kind.value} detector failed on this step ({type(e).__name__}: {first})")
    if crash is not None:
        return StepResult(_crashed_in_process(ctx, findings, failures, crash, [k.value for k in detectors], start))
    digests = {kind: detector.digest(ctx) for kind, detector in detectors.items()}
    report = StepReport(
        str(path),
        trace.source.step,
        trace.batch.forward_mode.value,
        [_located(_with_trace(f, str(path)), trace) for f in findings],
        error="; ".join(failures) or None,
        seconds=time.perf_counter() - start,
        backends=ctx.backends_consulted(),
        plan_unread=_plan_unread(ctx, detectors),
        crash_unrun=crash_unrun,
        unknown_engine_backend=_unknown_engine_backend(trace),
        engine_kernels_elsewhere=engine_names.kernels_elsewhere(trace),
    )
    return StepResult(report, {k: d for k, d in digests.items() if d is not None})


def _unknown_engine_backend(trace: Trace) -> str | None:
    """The engine backend of a graph step with padded rows, when nothing here knows its padding rules."""
    graph = trace.graph
    if graph is None or not graph.is_graph_replay or graph.capture_bs <= trace.batch.batch_size:
        return None
    return engine_names.unknown_name(trace)


def _context_probe(kind: FindingClass) -> AbstractContextManager[None]:
    """The range of the CUDA-context probe after a detector (activity.probe: one tiny kernel, its
    tensor made once): attndbg's own launches, named, so a timeline places them too."""
    return phase("context-probe", f"detector={kind.value}")


def _crashed_in_process(ctx: CheckContext, findings: list[Finding], failures: list[str], crash: activity.Launch, names: list[str], start: float) -> StepReport:
    """The step on which this process lost its CUDA context: the findings made before the crash,
    after the crash finding, which names the detectors that did not run. Not an error: the crash is
    the step's verdict (a defect), and the terminal shows it as a finding."""
    trace = ctx.trace
    after = names[names.index(crash.detector) + 1 :] if crash.detector in names else []
    death = "lost this process's CUDA context"
    if after:
        death += f" (not run on this step after the crash: {', '.join(after)})"
    if failures:
        death += f" (before it: {'; '.join(failures)})"
    report = StepReport(
        str(ctx.path),
        trace.source.step,
        trace.batch.forward_mode.value,
        [_located(_with_trace(f, str(ctx.path)), trace) for f in findings],
        seconds=time.perf_counter() - start,
        backends=ctx.backends_consulted(),
    )
    return with_crashes(report, [crash_finding(str(ctx.path), crash, death, Recheck.IN_PROCESS, backend_options=ctx.options.backend_options)])


def step_of(path: str | Path) -> tuple[int, str]:
    """The step number and mode of a step not checked (-1 and "unchecked" when unreadable)."""
    try:
        trace = io.load(path)
    except TraceError:
        return -1, "unchecked"
    return trace.source.step, trace.batch.forward_mode.value


def _plan_unread(ctx: CheckContext, detectors: dict[FindingClass, Detector]) -> str | None:
    """A plan detector ran and read less than the recorded plan: what the verdict says about it."""
    why = ctx.plan().unread if any(detector.reads_plan for detector in detectors.values()) else None
    return None if why is None else f"{ctx.trace.plan.backend[:80]}: {why}"


def _located(finding: Finding, trace: Trace) -> Finding:
    """Add the row within its request to a finding that names a request and a step row."""
    loc = finding.location
    if loc.request is None or loc.row is None or loc.request_row is not None or not 0 <= loc.request < trace.batch.batch_size:
        return finding
    return replace(finding, location=replace(loc, request_row=loc.row - int(trace.batch.qo_indptr[loc.request])))


def _with_trace(finding: Finding, path: str) -> Finding:
    return finding if finding.trace else replace(finding, trace=path)
