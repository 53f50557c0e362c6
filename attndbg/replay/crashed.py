"""Run a step whose call crashed where it ran (`source.crash`: an imported call that never
returned) again, in an isolated worker process, and say whether it crashes here too.

The call is made as its source made it: the recorded plan through the adapter of the library that
built it, on the recorded inputs, eagerly. It runs in a fresh process of its own (`python -m
attndbg.replay.crashed STEP`: CUDA cannot be forked), so a fault that poisons the CUDA context or kills the process (an illegal memory access,
a segfault) ends that worker, never the caller: `check` and `replay` go on with the step's other
work. A library defect the adapter knows at this shape (`known_defect`, such as FlashInfer 0.7.2's
decode at head_dim 80) does not stop the run: the defect is what the step recorded, and the worker
is there to contain it; the finding names it. A feature the adapter cannot run at all, a missing
library or GPU, or a recorded plan the guard refuses is "not run here", with the reason: never
"not reproduced".
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass

from attndbg.backends import registry
from attndbg.backends.base import KernelError
from attndbg.plans.guard import real_requests_only, refusal
from attndbg.replay import activity
from attndbg.replay.data import build_inputs
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import Trace

# A crashed call's kernels may compile first (FlashInfer JIT: up to a minute each).
TIMEOUT_S = 900.0


@dataclass(frozen=True)
class CrashRerun:
    """What became of the crashed call when run again."""

    backend: str  # the adapter that made the call ("" when none could be named)
    ran: bool  # False: not run here (`error` says why)
    reproduced: bool  # it crashed again: the library raised, or the worker died or lost its CUDA context
    error: str  # the crash when reproduced; why it was not run when not ran; "" when it returned
    known_defect: str | None = None  # the adapter's own word on this configuration, when it has one

    def line(self) -> str:
        """One line for people: 'reproduced: ...', 'not reproduced: ...' or 'not run here: ...'."""
        if not self.ran:
            return f"not run here: {self.error}"
        if self.reproduced:
            return f"reproduced: {self.backend} crashed again ({self.error})"
        return f"not reproduced: the same {self.backend} call returned here"


def backend_of(trace: Trace) -> str | None:
    """The adapter that makes the step's call: the one whose plan the step recorded."""
    return trace.plan.backend if trace.plan is not None else None


def rerun_crashed(path: str, *, timeout_s: float = TIMEOUT_S) -> CrashRerun:
    """Run the crashed call of the step at `path` again in a fresh process (a plain subprocess, not
    a multiprocessing child: check's workers are daemonic and may not have those)."""
    trace = io.load(path)
    name = backend_of(trace) or ""
    try:
        done = subprocess.run([sys.executable, "-m", __name__, str(path)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return CrashRerun(name, ran=False, reproduced=False, error=f"the worker running it did not finish within {timeout_s:.0f} s")
    answer = next((line for line in reversed(done.stdout.splitlines()) if line.startswith(ANSWER)), None)
    if answer is not None:
        return CrashRerun(**json.loads(answer[len(ANSWER) :]))
    if done.returncode < 0:
        try:
            death = f"the worker was killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            death = f"the worker was killed by signal {-done.returncode}"
        return CrashRerun(name, ran=True, reproduced=True, error=death)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return CrashRerun(name, ran=True, reproduced=True, error=f"the worker exited with code {done.returncode} before answering ({last})")


# The worker's answer: one line of stdout, this prefix and CrashRerun's fields as JSON.
ANSWER = "attndbg-crash-rerun: "


def _run(path: str) -> CrashRerun:
    import torch

    trace = io.load(path)
    name = backend_of(trace)
    if name is None:
        return CrashRerun("", ran=False, reproduced=False, error="the step recorded no plan: which library call crashed is not known")
    try:
        backend = registry.create(name)
    except KeyError:
        return CrashRerun(name, ran=False, reproduced=False, error=f"no adapter is named {name[:80]!r}")
    backend.run_known_defects = True  # the worker is there to contain it: the recorded crash is the point
    why = backend.unavailable_reason() or backend.unsupported_reason(trace)
    if why:
        return CrashRerun(name, ran=False, reproduced=False, error=why)
    known = backend.known_defect(trace)
    plan = real_requests_only(trace, trace.plan, backend)
    refused = refusal(trace, plan, backend)
    if refused is not None:
        return CrashRerun(name, ran=False, reproduced=False, error=f"{refused.message} (not launched)", known_defect=known)
    try:
        inputs = build_inputs(trace, layer=min(trace.tensors) if trace.tensors else None, device=backend.device())
    except TraceError as e:
        return CrashRerun(name, ran=False, reproduced=False, error=f"{e.field}: {e.message}", known_defect=known)
    try:
        backend.run(trace, inputs, plan)
        if inputs.q.is_cuda:
            torch.cuda.synchronize()  # an asynchronous fault surfaces here
    except Exception as e:  # noqa: BLE001 - whatever the call raised is the answer
        if isinstance(e, KernelError) or activity.is_cuda_error(e):
            return CrashRerun(name, ran=True, reproduced=True, error=f"{type(e).__name__}: {activity.first_line(e)}", known_defect=known)
        return CrashRerun(name, ran=False, reproduced=False, error=f"attndbg could not make the call ({type(e).__name__}: {activity.first_line(e)})", known_defect=known)
    return CrashRerun(name, ran=True, reproduced=False, error="", known_defect=known)


if __name__ == "__main__":  # the worker: run the call once, print what happened
    print(ANSWER + json.dumps(vars(_run(sys.argv[1]))), flush=True)
