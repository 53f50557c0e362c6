"""A crash as a finding: a kernel that killed its worker or poisoned its CUDA context (an illegal
memory access, a device-side assert) is one `backend-crash` finding on the step it ran on, naming
the backend, what of it was launched and the detector that launched it, as far as they are known
(replay/activity.py records them). Where the backend is known it is a library defect, named as the
kernels detector names one (detector_api/library_defect.py): the library and its release, the
step's shape, and the `attndbg repro` command of the crashed run."""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import TypeVar

from attndbg.backends import registry
from attndbg.backends.options import BackendOptions
from attndbg.detector_api.findings import Finding, FindingClass, Severity, finding
from attndbg.detector_api.library_defect import LibraryDefect, library_defect
from attndbg.replay.activity import Launch
from attndbg.replay.crashed import CrashRerun
from attndbg.replay.variants import EAGER, parse_variant
from attndbg.trace import io
from attndbg.trace.validate import TraceError


class Recheck(Enum):
    """What became of the step after its crash."""

    WITHOUT_BACKEND = "without-backend"  # checked again by a fresh worker without the backend
    WITHOUT_DETECTOR = "without-detector"  # checked again without the detector (no announced launch)
    NONE = "none"  # not checked again: the crash's origin is unknown, or it crashed again
    IN_PROCESS = "in-process"  # one process: its CUDA context cannot be recovered


def crash_finding(path: str, crash: Launch, death: str, recheck: Recheck, *, backend_options: BackendOptions = BackendOptions()) -> Finding:
    """`crash` on the step at `path`; `death`: how the worker ended ("killed by SIGSEGV", "left its
    CUDA context unusable") or, in one process, how the context was lost. `backend_options`: the
    check's (--backend-option), which the repro command repeats."""
    how = f"{death}: {crash.error}" if crash.error else death
    inside = f" in the {crash.detector} detector" if crash.detector else ""
    defect = _library_defect(path, crash, backend_options) if crash.backend else None
    if crash.backend:
        who = f"{crash.backend} crashed on this step ({crash.what}){inside}"
        library = f"The {crash.backend} kernels crashed on this step's inputs and plan"
        alone = f"Replay it alone (`attndbg replay {path} --backend {crash.backend}`) to reproduce; "
        if defect is not None:
            who += f" ({defect.library}; shape: {defect.shape})"
            library = f"{defect.library} crashed on this step's inputs and plan"
            alone = f"`{defect.repro}` reproduces it standalone (the library's calls alone; exit 1 or a crash when it does); "
    else:
        who = f"a CUDA kernel crashed on this step{inside or ' outside the detectors'}, outside any announced launch"
        library = f"A kernel{inside} faulted on this step (no launch was announced: the backend is not known)"
        only = f" --only {crash.detector}" if crash.detector else ""
        alone = f"Check it alone (`attndbg check {path}{only} --in-process`) to reproduce; "
    then = {
        Recheck.WITHOUT_BACKEND: f"; the step's other backends and detectors were checked again without {crash.backend} in a fresh worker.",
        Recheck.WITHOUT_DETECTOR: f"; the step's other detectors were checked again without {crash.detector} in a fresh worker.",
        Recheck.NONE: "; the step was not checked again (nothing to leave out, or it crashed again without it).",
        Recheck.IN_PROCESS: (
            "; this process's CUDA context is unusable after it, so the step's remaining detectors and every later step were "
            "not checked (check without --in-process: a fresh worker then takes every step after a crash)."
        ),
    }[recheck]
    return finding(
        FindingClass.BACKEND_CRASH,
        "backend-crashed",
        step=-1,  # the step number is known once the step is read
        evidence=f"{who}: {'the worker running it' if recheck is not Recheck.IN_PROCESS else 'the check'} {how}",
        cause=f"{library}{then} {alone}run it under compute-sanitizer to find the faulting access.",
        trace=str(path),
        backend=crash.backend,
        variant=crash.what,
        detector=crash.detector,
        death=death,
        error=crash.error,
        rechecked=recheck.value,
        **({} if defect is None else {k: v for k, v in defect.data().items() if k != "backend"}),
    )


def _library_defect(path: str, crash: Launch, options: BackendOptions) -> LibraryDefect | None:
    """The crashed run named as a library defect, when the step and the backend can be read here.
    A detector's own launch ("extend_path=cascade") is scripted as the eager run of the step."""
    try:
        trace = io.load(path)
        backend = registry.create(crash.backend, options=options)
    except (TraceError, KeyError, ImportError, AttributeError):  # unreadable here: the crash is named without it
        return None
    try:
        variant = parse_variant(crash.what.partition(", ")[0])  # "eager, request 3 alone": its variant
    except ValueError:
        variant = EAGER
    return library_defect(trace, path, backend, variant=variant, plan=None, options=options)


def recorded_crash_finding(path: str, step: int, recorded: str, rerun: CrashRerun) -> Finding:
    """The step's call crashed where it ran (`source.crash`, what its source logged) and was run
    again here, alone, in a fresh worker (`rerun`, which did run). Reproduced: a defect of the
    library's on these inputs and this plan; not reproduced: a hazard (the same call returned here:
    the crash depends on something the evidence does not hold: the device, the library build, state
    left by earlier calls)."""
    logged = recorded or "no error was logged"
    known = f" The adapter knows this configuration: {rerun.known_defect}." if rerun.known_defect else ""
    alone = f"`attndbg repro {path} --backend {rerun.backend}` writes a script that makes the same call with the library alone."
    if rerun.reproduced:
        return finding(
            FindingClass.BACKEND_CRASH,
            "recorded-crash",
            step=step,
            evidence=f"the recorded {rerun.backend} call crashed where it ran ({logged}); run again here in a fresh worker it crashed again: {rerun.error}",
            cause=f"The {rerun.backend} kernels crash on this call's inputs and plan: reproduced.{known} {alone}",
            trace=path,
            backend=rerun.backend,
            reproduced=True,
            recorded_error=recorded,
            error=rerun.error,
        )
    return finding(
        FindingClass.BACKEND_CRASH,
        "recorded-crash-not-reproduced",
        step=step,
        evidence=f"the recorded {rerun.backend} call crashed where it ran ({logged}); run again here in a fresh worker, the same call returned",
        cause=(
            "The crash needs something this run does not have: another GPU or library build, or state earlier calls left behind "
            f"(a plan buffer, the workspace).{known} Run it where it crashed: {alone}"
        ),
        trace=path,
        severity=Severity.HAZARD,
        backend=rerun.backend,
        reproduced=False,
        recorded_error=recorded,
    )


Report = TypeVar("Report")  # a StepReport (checks/step.py imports this module)


def with_crashes(report: Report, crashes: list[Finding]) -> Report:
    """`report` (a StepReport) with the crash findings first, located at its step once it is known."""
    if not crashes:
        return report
    located = [replace(f, location=replace(f.location, step=report.step)) for f in crashes]  # type: ignore[attr-defined]
    return replace(report, findings=located + list(report.findings))  # type: ignore[type-var, attr-defined]
