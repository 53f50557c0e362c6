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
from collections.abc import Callable, Iterator
from pathlib import Path

from attndbg import machine
from attndbg.checks.selection import StepSelection, select_paths
from attndbg.checks.step import StepReport, StepResult, check_one, detectors_of, step_of
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import Finding, FindingClass
from attndbg.plural import counted
from attndbg.replay import activity
from attndbg.trace import io
from attndbg.trace.validate import TraceError


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
