"""Run the detectors over a step or a recording: `attndbg check`.

The detectors are those of attndbg/detectors/registry.py, each a `Detector` (detectors/base.py):
`detect(ctx)` judges one step. Detectors that look across steps (stale masks, pointer stability)
also give a `recording_digest(ctx)` (the little they keep of a step: small and picklable) and a
`recording_state()` whose `observe(digest)` sees the digests in recording order. A recording is
checked as a stream: one step's context lives only while that step is checked, so memory does not
grow with the recording's length. With `jobs > 1` steps are checked by worker processes
(`workers.py`); reports come back in recording order either way, so the result is the same for
every number of jobs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attndbg import machine
from attndbg.checks.crashes import Recheck, crash_finding, recorded_crash_finding, with_crashes
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detector_api.findings import Finding, FindingClass
from attndbg.detectors import registry
from attndbg.detectors.base import Detector
from attndbg.plural import counted
from attndbg.profiling import phase, step_range
from attndbg.replay import activity, memory_share
from attndbg.replay.crashed import rerun_crashed
from attndbg.suggest import did_you_mean
from attndbg.trace import io
from attndbg.trace.schema import Trace
from attndbg.trace.validate import TraceError

def parse_only(spec: str | None) -> list[FindingClass]:
    """`--only`: 'fill-value,tree-mask' -> kinds (None: every detector of the registry but the
    opt-in ones, which run only when named); ValueError naming the first unknown one and the choices."""
    known = registry.names()
    if spec is None:
        return [FindingClass(name) for name in registry.default_names()]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:  # `--only ""` (an empty variable, say) is not "every detector"
        raise ValueError(f"{spec!r} names no detector; detectors: {', '.join(known)} (leave --only out for the default ones)")
    out = []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown detector {name!r}{did_you_mean(name, known)}; detectors: {', '.join(known)}")
        out.append(FindingClass(name))
    return out


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


@dataclass(frozen=True)
class StepSelection:
    """Which steps of a recording to check: `--steps A:B` (by step number) and `--sample N`."""

    start: int | None = None
    stop: int | None = None
    sample: int | None = None  # N steps spread evenly over the selection (first and last included)


def numbered_paths(target: str | Path) -> list[tuple[int, Path]]:
    """(step number, file) of every step of `target` in recording order: numbered as the manifest
    numbers them, else by file order (what --steps A:B counts)."""
    target = Path(target)
    if target.is_dir() and (target / io.MANIFEST).exists():
        return [(e.step, target / e.file) for e in io.read_manifest(target)]
    return list(enumerate(io.trace_paths(target)))


def select_paths(target: str | Path, selection: StepSelection = StepSelection()) -> list[Path]:
    """The step files of `target` in recording order, restricted to `selection`."""
    numbered = numbered_paths(target)
    paths = [
        path
        for step, path in numbered
        if (selection.start is None or step >= selection.start) and (selection.stop is None or step < selection.stop)
    ]
    n = selection.sample
    if n is not None and n < len(paths):
        # Evenly spaced and deterministic: the same command checks the same steps.
        picks = sorted({round(i * (len(paths) - 1) / max(1, n - 1)) for i in range(n)}) if n > 1 else [0]
        paths = [paths[i] for i in picks]
    return paths


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
        plan_unread=_plan_unread(trace, detectors),
        crash_unrun=crash_unrun,
    )
    return StepResult(report, {k: d for k, d in digests.items() if d is not None})


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


def check_in_process(paths: list[Path], only: list[FindingClass], options: CheckOptions) -> Iterator[StepResult]:
    """Check `paths` one after another in this process. Once a crash has poisoned its CUDA context
    (which cannot be recovered in the process), the steps after it are reported as not checked,
    each with the one reason, without being run: running them would fail each for that reason."""
    activity.start_check()
    lost_at: str | None = None if activity.lost() is None else "before this check"
    for path in paths:
        if activity.lost() is None:
            result = check_one(path, only, options)
            if activity.lost() is not None:
                lost_at = f"on step {result.report.step}"
            yield result
            continue
        crash = activity.lost()
        step, mode = step_of(path)
        reason = (
            f"not checked: this process's CUDA context was lost to a crash {lost_at} ({crash.where()}: {crash.error}); "
            "check without --in-process to have a fresh worker take each step after a crash"
        )
        yield StepResult(StepReport(str(path), step, mode, [], error=reason))


def step_of(path: str | Path) -> tuple[int, str]:
    """The step number and mode of a step not checked (-1 and "unchecked" when unreadable)."""
    try:
        trace = io.load(path)
    except TraceError:
        return -1, "unchecked"
    return trace.source.step, trace.batch.forward_mode.value


def _plan_unread(trace: Trace, detectors: dict[FindingClass, Detector]) -> str | None:
    """A plan detector ran and read less than the recorded plan: what the verdict says about it."""
    why = next((why for detector in detectors.values() if (why := detector.unread(trace)) is not None), None)
    return None if why is None else f"{trace.plan.backend[:80]}: {why}"


def check_steps(
    target: str,
    only: list[FindingClass],
    options: CheckOptions = CheckOptions(),
    progress: Callable[[StepReport], None] | None = None,
    *,
    selection: StepSelection = StepSelection(),
    jobs: int | None = 1,
    devices: tuple[int, ...] | None = None,
    isolate: bool | None = None,
    now: Callable[[int, str], None] | None = None,
    compile_first: bool | None = None,
) -> Iterator[StepReport]:
    """Check the steps of `target` (a .pt file or a recording directory) in recording order.

    `jobs` > 1 spreads steps over worker processes (on `devices`, round robin, when given); None
    picks a number from the machine and the recording (`auto_jobs`). The reports, and the findings
    of the recording detectors, are identical for every number of jobs. `isolate` runs even one
    job in a worker process, a crash boundary for the kernel libraries (workers.py); None: on a
    GPU machine, where an illegal memory access would poison this process's CUDA context. Without
    it, such a crash is its step's finding and the steps after it are not checked (check_in_process).
    `now(index, phase)`: in workers, what the step awaited runs ('split-merge › triton › eager'),
    read from its worker every NOW_EVERY_S (in one process a display reads profiling.current()).
    `compile_first`: with workers on a GPU, compile the kernels the recording's shapes need before
    the first step, all at once (precompile.py); None: where FlashInfer's cache lacks enough of them
    for that to pay (precompile.worth_compiling).
    """
    paths = select_paths(target, selection)
    states = {kind: state for kind, detector in detectors_of(only).items() if (state := detector.new_state()) is not None}
    if jobs is None:
        jobs = auto_jobs(len(paths), devices)
        if jobs > 1:
            sys.stderr.write(f"attndbg: checking {counted(len(paths), 'step')} in {counted(jobs, 'worker process', 'worker processes')} (--jobs auto; --jobs 1 for one)\n")
    if isolate is None:
        isolate = machine.cuda_available()
    if jobs > 1 or isolate:
        from attndbg.checks.precompile import before_checking
        from attndbg.checks.workers import check_in_workers

        shapes = first_of_each_shape(paths) if jobs > 1 or (compile_first is None and machine.cuda_available()) else []
        before_checking(paths, only, options, asked=compile_first, shapes=shapes)
        first = shapes if jobs > 1 else []
        if len(first) > 1:
            sys.stderr.write(f"attndbg: checking one step of each of {len(first)} kernel shapes first, in parallel (kernels compile on first use)\n")
        results: Iterator[StepResult] = check_in_workers(paths, only, options, jobs=jobs, devices=devices, first=first, now=now)
    else:
        results = check_in_process(paths, only, options)
    across: list[Finding] = []
    for result in results:
        for kind, digest in result.digests.items():
            across += states[kind].observe(digest) if kind in states else []
        if progress:
            progress(result.report)
        yield result.report
    if across:
        yield StepReport(str(target), -1, "recording", across)


# Steps looked at to find the kernel shapes of a recording (loading them costs milliseconds each).
SHAPE_SAMPLE = 32
# --jobs auto. Each worker loads every kernel module itself (seconds, more with FlashInfer), so a
# worker is worth it only with enough steps to spread: one per this many steps. At most this many
# workers per GPU: on an H100, 8 workers checked 1,000 decode steps in 50 s against 77 ms a step
# in one process (docs/benchmarks.md, "Checking 1,000 decode steps"); beyond that they wait on one another.
STEPS_PER_WORKER = 50
WORKERS_PER_GPU = 8


def auto_jobs(steps: int, devices: tuple[int, ...] | None) -> int:
    """Worker processes for `steps` steps: two host cores each (a worker's Python and the kernel
    launches it waits on), at most WORKERS_PER_GPU per GPU, one per STEPS_PER_WORKER steps."""
    cores = max(1, machine.host_cores() // 2)
    per_device = WORKERS_PER_GPU * max(1, len(devices or ()))
    return max(1, min(cores, per_device, steps // STEPS_PER_WORKER))


def first_of_each_shape(paths: list[Path]) -> list[int]:
    """Indices of one step per kernel shape, from a sample spread over the recording."""
    from attndbg.checks.precompile import kernel_shape

    picks = sorted({round(i * (len(paths) - 1) / max(1, SHAPE_SAMPLE - 1)) for i in range(min(SHAPE_SAMPLE, len(paths)))})
    first: dict[tuple, int] = {}
    for i in picks:
        try:
            first.setdefault(kernel_shape(io.load(paths[i])), i)
        except TraceError:
            continue  # reported when its turn comes
    return sorted(first.values())


def _located(finding: Finding, trace: Trace) -> Finding:
    """Add the row within its request to a finding that names a request and a step row."""
    loc = finding.location
    if loc.request is None or loc.row is None or loc.request_row is not None or not 0 <= loc.request < trace.batch.batch_size:
        return finding
    return replace(finding, location=replace(loc, request_row=loc.row - int(trace.batch.qo_indptr[loc.request])))


def _with_trace(finding: Finding, path: str) -> Finding:
    return finding if finding.trace else replace(finding, trace=path)
