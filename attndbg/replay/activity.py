"""Which kernel launch this process is in: the evidence a crash boundary needs (issue 15).

A check worker process registers a sink (memory its parent reads after the worker is gone). Around
every kernel launch the runner names what runs, `backend<TAB>variant`. When the process dies inside
a kernel (a segfault, an abort) the parent reads the last name and reports "flashinfer crashed on
this step (eager): killed by SIGSEGV", then checks the step again without that backend.

A CUDA error that poisons the context (an illegal memory access, a device-side assert) does not
kill the process, but every later CUDA call in it fails, so every later step would fail for a
reason that is not its own. A worker therefore ends itself at once on such an error (exit
`POISONED_EXIT`, the error's first line in the sink), and its parent treats that like a crash.

Without a sink (one process, `--jobs 1` on a CPU) nothing is recorded and errors propagate as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

# The exit code of a worker that ended itself on a poisoned CUDA context.
POISONED_EXIT = 86

_sink: Callable[[str], None] | None = None


def set_sink(sink: Callable[[str], None] | None) -> None:
    global _sink
    _sink = sink


def recording() -> bool:
    return _sink is not None


@contextlib.contextmanager
def launching(backend: str, variant: str) -> Iterator[None]:
    """Name the launch while it runs; in a worker, end the process on an error that poisons CUDA."""
    sink = _sink
    if sink is None:
        yield
        return
    sink(f"{backend}\t{variant}")
    try:
        yield
    except Exception as e:
        if _cuda_poisoned(e):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            sink(f"{backend}\t{variant}\t{first}")
            sys.stderr.flush()
            os._exit(POISONED_EXIT)
        raise
    finally:
        # Out of the launch, however it ended (an error the runner reports is not a crash): a worker
        # that dies later must not be blamed on this backend.
        sink("")


def parse(text: str) -> tuple[str, str, str] | None:
    """(backend, variant, error) from what the sink last held; None when no launch was running."""
    if not text:
        return None
    parts = text.split("\t")
    return parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else ""


def _cuda_poisoned(error: Exception) -> bool:
    """Whether the CUDA context is unusable after `error` (sticky errors), tested, not guessed
    from the message: a context that cannot run one tiny kernel and synchronise is poisoned."""
    if "cuda" not in f"{type(error).__name__} {error}".lower():
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False
