"""What the recorder may still do once the device faulted: host memory only.

A CUDA error (an illegal memory access, a device-side assert) is sticky: every later CUDA call of
the process returns it. Most such calls raise a Python exception we can catch, but some run in
C++ destructors, where an exception ends the process (std::terminate, SIGABRT):
- freeing a pinned host tensor that received a `non_blocking` copy: torch's caching host
  allocator records an event on each stream that used the block, and creating that event throws
  (`Exception raised from createEvent`, CUDAEvent.h, under `c10::TensorImpl::~TensorImpl`);
- so a recorder that drops a step's host copy after a fault kills the engine process, often
  before the ring is written.

Hence this latch. Once a CUDA error is seen (`latch`), the recorder
- queries, records or waits on no event, and allocates no pinned memory (no new host copies);
- reads only what already landed in host memory (host_copy.py's markers);
- never frees a pinned tensor it holds (`keep`): they stay referenced until the process ends,
  and past the interpreter's teardown too (a module's globals are cleared there, which would
  free them).

A pinned tensor dropped after the fault happened on the device but before any call reported it
is checked on the way out (host_copy.py asks its last event, which raises, not aborts).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from attndbg.record.triggers import is_cuda_error

_lock = threading.RLock()  # re-entered when a collection finalizes a host copy (its __del__ keeps) inside `keep`
_faulted = False
_reason = ""
# Tensors that must never be freed; referenced once more from C (ctypes) when the device faults,
# so that the interpreter's teardown, which clears module globals, does not free them either.
_kept: list[Any] = []
_pinned_forever = False


def latch(reason: str) -> None:
    """A CUDA error was seen: from now on, host memory only."""
    global _faulted, _reason, _pinned_forever
    with _lock:
        if not _faulted:
            _faulted, _reason = True, reason
        if not _pinned_forever:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))
            _pinned_forever = True


def faulted() -> bool:
    return _faulted


def reason() -> str:
    return _reason


def keep(tensors: list[Any]) -> None:
    """Hold `tensors` (pinned host memory a copy wrote into) until the process ends."""
    with _lock:
        _kept.extend(tensors)


def kept_count() -> int:
    return len(_kept)


def reset() -> None:
    """A new recording session starts with the device presumed healthy (tests and in-process
    engines start several in one process); tensors already kept stay kept."""
    global _faulted, _reason
    with _lock:
        _faulted, _reason = False, ""


def seen_in(error: BaseException) -> bool:
    """Latch on `error` when it is a CUDA error; returns whether it was one."""
    if is_cuda_error(error):
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        latch(f"{type(error).__name__}: {first[:200]}")
        return True
    return False
