"""Which kernel launch this process is in, and whether its CUDA context still works: the evidence a
crash boundary needs (issues 15 and 21).

Every kernel a check launches is announced, `with launching(backend, what):` (the runner's runs,
and each detector's own sweeps, probes and merges), and `check_one` names the detector it runs
(`detector(kind)`). A check worker process registers a sink (memory its parent reads after the
worker is gone) that always holds `backend<TAB>what<TAB>error<TAB>detector` for the launch in
progress. When the process dies inside a kernel (a segfault, an abort) the parent reads the last
record and reports "flashinfer crashed on this step (eager): killed by SIGSEGV", then checks the
step again without that backend.

A CUDA error that poisons the context (an illegal memory access, a device-side assert, ...: the
sticky errors of `STICKY`) does not kill the process, but every later CUDA call in it fails, so every
later step would fail for a reason that is not its own. After any CUDA error (`is_cuda_error`: by
type, or a message naming CUDA or a sticky error) the context is probed: one that cannot synchronise
and run one tiny kernel is poisoned. Wherever the fault surfaces in a step it is caught: inside an
announced launch (which synchronises before it ends, so an asynchronous fault surfaces inside the
launch it belongs to), in a detector's own code, or by the probe after each detector
(`check_context`), which also finds a fault some code swallowed. Then `lose(crash)`: in a worker the
crash is written to the sink and the process ends at once (exit `POISONED_EXIT`), before it can take
another step; the parent reports a `backend-crash` finding and a fresh worker takes its place. In
one process (no sink: `--in-process`, or `--jobs 1` on a machine without CUDA) the context cannot be
recovered: `lose` records the crash (`lost()`) and raises `CudaContextLost`, the step gets the crash
finding, and the check reports every later step as not checked, for that one reason, unrun.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

# The exit code of a worker that ended itself on a poisoned CUDA context.
POISONED_EXIT = 86

# CUDA's sticky errors, as cudaGetErrorString words them (whatever wraps them: torch's
# AcceleratorError "CUDA error: ...", Triton's "Triton Error [CUDA]: ...", FlashInfer's "... failed
# with error ..."). After one of them every CUDA call of the process fails (CUDA runtime API,
# cudaError: "the process must be terminated and relaunched"). Matched whole, so that our own
# words about a crash (a plan guard's "an illegal memory access ...") never read as one.
STICKY = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "misaligned address",  # cudaErrorMisalignedAddress
    "device-side assert triggered",  # cudaErrorAssert
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "invalid program counter",  # cudaErrorInvalidPc
    "hardware stack error",  # cudaErrorHardwareStackError
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
)

# A CUDA error that says the process is out of device memory is the step's size, not a crash.
_NOT_A_CRASH = ("out of memory",)


@dataclass(frozen=True)
class Launch:
    """What was running when a process crashed; "" where not known."""

    backend: str = ""  # the kernel library announced: "flashinfer"
    what: str = ""  # what of it: a run's variant ("eager", "graph bs=8 fill=1") or a detector's own launch
    error: str = ""  # the CUDA error's first line, when the context was poisoned (not a signal)
    detector: str = ""  # the detector that was running: "split-merge"

    def text(self) -> str:
        fields = (self.backend, self.what, self.error, self.detector)
        return "\t".join(f.replace("\t", " ") for f in fields).rstrip("\t")

    def phase(self) -> str:
        """'split-merge › flashinfer › extend_path=cascade': what a progress display says runs."""
        return " › ".join(part for part in (self.detector, self.backend, self.what) if part)

    def where(self) -> str:
        """'flashinfer (extend_path=cascade) in the split-merge detector', as far as it is known."""
        parts = []
        if self.backend:
            parts.append(f"{self.backend} ({self.what})" if self.what else self.backend)
        elif self.what:
            parts.append(self.what)
        if self.detector:
            parts.append(f"in the {self.detector} detector")
        return " ".join(parts) or "outside any announced launch"


class CudaContextLost(RuntimeError):
    """Raised, in one process, once a CUDA error has poisoned its context: nothing on the GPU runs
    again in this process. Not a KernelError: the runner does not report it as one backend's error."""

    def __init__(self, crash: Launch):
        super().__init__(f"CUDA context unusable after {crash.where()}: {crash.error}")
        self.crash = crash


_sink: Callable[[str], None] | None = None
_detector = ""
_launch: Launch | None = None  # the launch in progress (launches nest: a detector's around the runner's)
_suspect: Launch | None = None  # the last launch of this step that raised a CUDA error
_lost: Launch | None = None  # in one process: the crash that left the context unusable


def set_sink(sink: Callable[[str], None] | None) -> None:
    global _sink
    _sink = sink


def recording() -> bool:
    return _sink is not None


def _note() -> None:
    if _sink is not None:
        _sink((_launch or Launch(detector=_detector)).text())


@contextlib.contextmanager
def detector(name: str) -> Iterator[None]:
    """Name the detector running, so a crash outside an announced launch still says where it was."""
    global _detector
    _detector = name
    _note()
    try:
        yield
    finally:
        _detector = ""
        _note()


@contextlib.contextmanager
def launching(backend: str, what: str) -> Iterator[None]:
    """Name the launch while it runs; on an error that poisons CUDA, `lose` (a worker ends)."""
    global _launch, _suspect
    outer = _launch
    _launch = Launch(backend, what, detector=_detector)
    _note()
    try:
        yield
        _synchronize()  # an asynchronous fault surfaces here, inside the launch it belongs to
    except CudaContextLost:
        raise  # an inner launch already handled it
    except Exception as e:
        # A host-side error (a library refusing a head dim after its first kernel was queued) can
        # leave that kernel's asynchronous fault pending: it is surfaced here, inside the launch
        # it belongs to, not blamed on whatever synchronises next (FlashInfer 0.7.2's tensor-core
        # decode at head_dim 80 faults, then its merge raises "Unsupported head_dim").
        error = e if is_cuda_error(e) else _pending_fault() or e
        if is_cuda_error(error):
            crash = replace(_launch, error=first_line(error))
            if poisoned(error):
                lose(crash, error)
            _suspect = crash
        raise
    finally:
        # Out of the launch, however it ended (an error the runner reports is not a crash): a worker
        # that dies later must not be blamed on this backend.
        _launch = outer
        _note()


def begin_step() -> None:
    global _suspect
    _suspect = None


def check_context() -> None:
    """After a detector: when the CUDA context no longer works (a fault some code swallowed, or one
    raised outside any launch), `lose` it, blamed on the last launch of the step that raised a CUDA
    error, else on the detector."""
    error = probe()
    if error is not None:
        lose(replace(_suspect, error=_suspect.error or error) if _suspect else Launch(error=error, detector=_detector))


def check_error(error: BaseException, detector: str) -> None:
    """A detector raised `error`: when it poisoned the CUDA context, `lose` it (it raises)."""
    if isinstance(error, CudaContextLost):
        raise error
    if is_cuda_error(error) and poisoned(error):
        lose(Launch(error=first_line(error), detector=detector), error)


def lose(crash: Launch, cause: BaseException | None = None) -> None:
    """The CUDA context is unusable: a worker writes `crash` to its sink and ends at once, before it
    can take another step; one process records it and raises CudaContextLost."""
    global _lost
    if _sink is not None:
        _sink(crash.text())
        sys.stderr.flush()
        os._exit(POISONED_EXIT)
    _lost = crash
    raise CudaContextLost(crash) from cause


def lost() -> Launch | None:
    """In one process: the crash after which its CUDA context is unusable, if one happened."""
    return _lost


def start_check() -> None:
    """Before an in-process check: forget an earlier crash once the context works again (no CUDA
    context was ever poisoned: a test's simulated crash). A really poisoned one stays lost."""
    global _lost
    if _lost is not None and probe() is None:
        _lost = None


def parse(text: str) -> Launch | None:
    """What the sink last held; None when nothing was running."""
    if not text:
        return None
    parts = (text.split("\t") + ["", "", "", ""])[:4]
    return Launch(*parts)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def is_cuda_error(error: BaseException) -> bool:
    """A CUDA error, by type (torch's AcceleratorError) or message (libraries wrap them in their own
    exceptions: Triton's "Triton Error [CUDA]: ...", our KernelError "AcceleratorError: CUDA error: ...",
    FlashInfer's "... failed with error an illegal memory access was encountered"): one after which
    the context is probed."""
    text = f"{type(error).__name__}: {error}".lower()
    if any(s in text for s in _NOT_A_CRASH):
        return False
    if any(s in text for s in STICKY):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, (getattr(torch, "AcceleratorError", ()), torch.cuda.CudaError)):
        return True
    return "cuda error" in text or "[cuda]" in text or "cudaerror" in text or "acceleratorerror" in text


def poisoned(error: BaseException) -> bool:
    """Whether the CUDA context is unusable after the CUDA error `error`, tested, not guessed from
    the message: after a sticky error every CUDA call fails, so the probe fails too, and a message
    that only reads like one (a test's simulated fault, a library quoting an earlier error) on a
    context that still works is the error of its launch, reported as such by the runner."""
    return is_cuda_error(error) and probe() is not None


_probe_tensor = None  # the probe's one element, allocated once: a probe never allocates again


def probe() -> str | None:
    """The error of a synchronise and one tiny kernel when this process's CUDA context no longer
    works (a sticky error is returned by every later CUDA call); None when it works or CUDA was
    never started here (a probe never starts CUDA). Out of memory for its one element is not a
    dead context: a worker at its memory share must not read as crashed."""
    global _probe_tensor
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
        if _probe_tensor is None:
            _probe_tensor = torch.zeros(1, device="cuda")
        _probe_tensor.add_(1)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return None
    except Exception as e:  # noqa: BLE001 - any other failure here means the context is gone
        return first_line(e)
    return None


def _pending_fault() -> BaseException | None:
    """The CUDA error a synchronise raises now (a fault queued before a host-side error), if any."""
    try:
        _synchronize()
    except Exception as e:  # noqa: BLE001 - only a CUDA error is returned; anything else is not a fault
        return e if is_cuda_error(e) else None
    return None


def _synchronize() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()
