"""What a step's repro script shows where it runs: the symptom `attndbg minimize` keeps.

A step's script (script.py, written as `attndbg repro` writes it by default: the recorded plan
when the step holds one of the backend's, a CUDA-graph replay for a step recorded as one) is run
in a process of its own, as a user would run it, and read back by its exit code and its last line
("symptom: crash | nan-inf | mismatch | none"). `probe_with_symptom` is minimize's probe of a
candidate (checks/workers.py's check function) with the candidate's own script run too: its
symptom becomes a `repro` finding the search requires beside the target, so a smaller step is kept
only while its script still reproduces the way the original's did.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from attndbg.backends.base import KernelError
from attndbg.checks.step import StepResult
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass, finding
from attndbg.minimize.probe import probe_one
from attndbg.minimize.target import REPRO
from attndbg.repro.script import build, write
from attndbg.trace import io
from attndbg.trace.errors import TraceError

# A script compiles its kernels on first use (FlashInfer JIT: up to a minute each) and, for a step
# recorded as crashed, runs them in a child process.
TIMEOUT_S = 900
EXIT_REPRODUCED, EXIT_NOT_REPRODUCED, EXIT_CANNOT_RUN = 1, 0, 2
SYMPTOMS = ("crash", "nan-inf", "mismatch")


@dataclass(frozen=True)
class ScriptOutcome:
    """How the step's script ended."""

    symptom: str | None  # "crash", "nan-inf" or "mismatch" when it reproduces; None when not
    ran: bool  # False: no script, or it could not run here (`said` says why)
    said: str  # its verdict line ("reproduced: ...", "not reproduced: ...", "could not run here: ...") or why none was written

    def describe(self) -> str:
        if self.symptom is not None:
            return f"{self.symptom} ({self.said})"
        return self.said


def script_outcome(path: str | Path, backend: str, *, timeout_s: float = TIMEOUT_S) -> ScriptOutcome:
    """Write the step's default script for `backend` beside a scratch copy and run it."""
    try:
        trace = io.load(path)
        repro = build(trace, backend, source_name=str(path))
    except (TraceError, ValueError, NotImplementedError, KernelError) as e:
        return ScriptOutcome(None, ran=False, said=f"no script: {e}")
    with tempfile.TemporaryDirectory(prefix="attndbg-symptom-") as scratch:
        script = write(repro, Path(scratch) / "repro.py")[0]
        try:
            done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=scratch, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return ScriptOutcome(None, ran=False, said=f"the script did not finish within {timeout_s:.0f} s")
    lines = done.stdout.strip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith(("reproduced:", "not reproduced:", "could not run here:"))), "")
    last = lines[-1] if lines else ""
    if done.returncode == EXIT_REPRODUCED and last.startswith("symptom: ") and last.removeprefix("symptom: ") in SYMPTOMS:
        return ScriptOutcome(last.removeprefix("symptom: "), ran=True, said=verdict)
    if done.returncode == EXIT_NOT_REPRODUCED:
        return ScriptOutcome(None, ran=True, said=verdict or "not reproduced")
    if done.returncode == EXIT_CANNOT_RUN:
        return ScriptOutcome(None, ran=False, said=verdict or "could not run here")
    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return ScriptOutcome(None, ran=False, said=f"the script ended with exit code {done.returncode} ({error[:200]})")


def probe_with_symptom(path: str, only: list[FindingClass], options: CheckOptions) -> StepResult:
    """minimize's probe of one candidate (probe_one), and its repro script: a `repro` finding named
    by the symptom when the script reproduces."""
    result = probe_one(path, only, options)
    if result.report.error and result.report.bad_input:
        return result
    if not options.backends:
        return result
    # Even where a crash has left the backend out of the check (options.exclude): the script runs
    # in a process of its own, and its crash is the symptom.
    backend = options.backends[0]
    outcome = script_outcome(path, backend)
    if outcome.symptom is None:
        return result
    found = finding(
        REPRO,
        outcome.symptom,
        step=result.report.step,
        evidence=f"the step's {backend} repro script: {outcome.said}",
        cause="the standalone script reproduces the failure with the library alone",
        backend=backend,
    )
    return replace(result, report=replace(result.report, findings=[*result.report.findings, found]))
