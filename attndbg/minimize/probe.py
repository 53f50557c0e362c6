"""What a minimiser's worker runs on each candidate: `check_one` (the detectors asked for) and,
when the target is a replay mismatch, the backend's replay against the float64 reference.

It is the `check` function of checks/workers.py, so each candidate runs behind the same crash
boundary as `attndbg check`: a kernel that crashes or poisons the CUDA context ends the worker,
and the candidate gets a `backend-crash` finding, never a half-run verdict.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from attndbg.checks.step import StepResult, check_one
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass, finding
from attndbg.minimize.target import REPLAY
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus, replay
from attndbg.trace import io


def probe_one(path: str, only: list[FindingClass], options: CheckOptions) -> StepResult:
    """Check one candidate with the detectors of `only`; REPLAY among them: also replay it."""
    detectors = [kind for kind in only if kind is not REPLAY]
    result = check_one(path, detectors, options)
    if REPLAY not in only or result.report.error and result.report.bad_input:
        return result
    trace = io.load(path)
    backends = [b for b in options.backends or () if b not in options.exclude]
    plan = PlanSource.BOTH if trace.plan is not None and trace.plan.backend in backends else PlanSource.DERIVED
    replayed = replay(trace, str(Path(path)), backends, ReplayOptions(plan=plan, backend_options=options.backend_options, max_memory=options.max_memory))
    found = [
        finding(
            REPLAY,
            run.status.value,  # "failed": beyond tolerance; "error": the kernel raised, or a plan was refused
            step=trace.source.step,
            evidence=f"{run.name} ({run.variant.label}): {run.reason or '; '.join(run.problems) or 'outside the tolerance of the float64 reference'}",
            cause="the backend's replay of this step fails the float64 reference",
            backend=run.name,
            variant=run.variant.label,
        )
        for run in replayed.runs
        if run.status in (RunStatus.FAILED, RunStatus.ERROR)
    ]
    return replace(result, report=replace(result.report, findings=[*result.report.findings, *found]))
