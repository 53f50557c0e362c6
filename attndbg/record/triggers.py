"""What fires the flight recorder's ring (`attndbg record --ring K`), and the `--when` conditions.

A trigger is a fact about the engine run: an exception in the engine (a CUDA error among them),
a non-zero exit, a signal asking for the ring, a NaN or Inf in what was recorded, a speculative
verify step that accepted too little, or an attention-metadata buffer that moved under a captured
CUDA graph. Each becomes one `trigger` line in the written ring's manifest (trace/io.py
TriggerLine): kind, the step it names, a message.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.record.options import OptionError
from attndbg.trace.io import TriggerLine


# The host key under which an adapter records a per-row finiteness flag of the logits, computed on
# the device (`--when nan` reads it; a bool tensor, True where the row is finite).
LOGITS_FINITE = "logits_finite"


class TriggerKind(str, enum.Enum):
    EXCEPTION = "exception"  # an exception in the engine that is not a CUDA error
    CUDA_ERROR = "cuda-error"  # an illegal memory access, a device-side assert, ... (they surface late)
    EXIT = "exit"  # the command, or an engine process, exited non-zero or was killed
    SIGNAL = "signal"  # SIGUSR1: "write the ring now"
    NAN = "nan"  # --when nan: NaN or Inf in a recorded output or in the logits
    ACCEPT = "accept"  # --when 'accept<X': a verify step accepted less than X of its draft tokens
    POINTER = "pointer"  # an attention-metadata buffer moved since its CUDA graph was captured


@dataclass(frozen=True)
class Trigger:
    kind: TriggerKind
    step: int | None  # the step it names (None: none recorded yet)
    message: str
    code: int | None = None  # exit code or signal number

    def line(self, pid: int | None) -> TriggerLine:
        return TriggerLine(kind=self.kind.value, step=self.step, message=self.message, code=self.code, pid=pid)


# Words in the messages CUDA errors carry through torch (torch.AcceleratorError / RuntimeError:
# "CUDA error: an illegal memory access was encountered", "device-side assert triggered", ...).
CUDA_ERROR_WORDS = re.compile(r"CUDA error|cudaError|illegal memory access|device-side assert|CUBLAS_STATUS|CUDNN_STATUS|unspecified launch failure", re.I)


def is_cuda_error(error: BaseException) -> bool:
    return bool(CUDA_ERROR_WORDS.search(f"{type(error).__name__}: {error}"))


def from_exception(error: BaseException, step: int | None, where: str) -> Trigger:
    """The trigger of an exception that reached one of our hooks (`where` says which)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    kind = TriggerKind.CUDA_ERROR if is_cuda_error(error) else TriggerKind.EXCEPTION
    return Trigger(kind=kind, step=step, message=f"{type(error).__name__}: {first[:300]} ({where})")


@dataclass(frozen=True)
class When:
    """The `--when` conditions, parsed."""

    nan: bool = False  # NaN or Inf in a recorded output or in the logits
    accept_below: float | None = None  # acceptance rate of a verify step strictly below this

    @property
    def any(self) -> bool:
        return self.nan or self.accept_below is not None


_ACCEPT = re.compile(r"^accept\s*<\s*([0-9]*\.?[0-9]+)$")


def parse_when(texts: tuple[str, ...] | list[str]) -> When:
    """'nan', 'accept<0.2' (each --when once, or comma-separated) -> When; OptionError naming the
    first one not understood."""
    nan, accept = False, None
    for text in (part.strip() for raw in texts for part in raw.split(",")):
        if not text:
            continue
        if text.lower() == "nan":
            nan = True
            continue
        match = _ACCEPT.match(text.lower())
        if match is None:
            raise OptionError(f"--when: expected 'nan' or 'accept<X' (X a rate in (0, 1]), got {text!r}")
        value = float(match.group(1))
        if not 0 < value <= 1 or not math.isfinite(value):
            raise OptionError(f"--when: the acceptance rate in {text!r} must be in (0, 1]")
        accept = value
    return When(nan=nan, accept_below=accept)


def nonfinite(host: dict[str, Tensor | None], names: tuple[str, ...]) -> str | None:
    """The first recorded tensor among `names` (or, for a bool flag tensor, a False entry: a
    finiteness check made on the device) that carries NaN or Inf, described; None when all are finite.

    `names` ends in the adapter's names: "layer0.output", "logits_finite"."""
    for name in names:
        t = host.get(name)
        if t is None or t.numel() == 0:
            continue
        if t.dtype is torch.bool:  # a device-side finiteness flag per row
            bad = torch.nonzero(~t.reshape(-1)).flatten()
            if bad.numel():
                return f"{name.removesuffix('_finite')}: row {int(bad[0])} is not finite ({bad.numel()} row(s))"
            continue
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            flat = torch.nonzero(~finite.reshape(t.shape[0], -1).all(1)).flatten() if t.dim() else torch.zeros(1, dtype=torch.int64)
            return f"{name}: {int((~finite).sum())} NaN/Inf value(s), first in row {int(flat[0])}"
    return None


def acceptance(accepted: int, drafted: int) -> float | None:
    """Accepted draft tokens over drafted ones (None when nothing was drafted)."""
    return accepted / drafted if drafted > 0 else None
