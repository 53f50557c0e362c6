"""NVTX ranges so `nsys profile attndbg ...` shows attndbg's phases: `attndbg/<phase>`.

nvtx is a dependency; its ranges cost next to nothing when no profiler is attached. The phases
open now are also kept (`current()`), so a spinner can say what runs: the detector, the backend,
its variant. An observer (`observe`: `--timeline`'s CUPTI collector) is told of each phase as it
opens and closes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import nvtx

if TYPE_CHECKING:  # a type only: --help and synth --list must not import torch (tests/cli/test_startup.py)
    from attndbg.trace.schema import Trace

DOMAIN = "attndbg"
PREFIX = "attndbg/"  # every range's message starts with it
# Set by `--timeline` for the worker processes a check spawns: a directory where each worker writes
# its own CUPTI records (CUPTI is per process), which the parent merges.
TIMELINE_VARIABLE = "ATTNDBG_TIMELINE_DIR"
# What those processes are called in the timeline ("attndbg check worker", "engine process"), set with it.
TIMELINE_LABEL_VARIABLE = "ATTNDBG_TIMELINE_LABEL"


class Observer(Protocol):
    def push(self, message: str) -> None: ...
    def pop(self) -> None: ...


_open: list[str] = []  # the messages of the phases open in this process, outermost first
_observer: Observer | None = None
_environment_read = False


def observe(observer: Observer | None) -> None:
    """Tell `observer` of every phase from now on (None: no one)."""
    global _observer
    _observer = observer


def _observe_from_environment() -> None:
    """In a check worker or an engine's process under `record` (a process the CLI never ran in),
    start the timeline's collection when the parent asked for one. Here, because CUPTI must be
    set up before the process's first NVTX call, and the first phase makes it; imported by name,
    so this module imports nothing of the timeline (nor cupti) unless asked."""
    global _environment_read
    _environment_read = True
    directory = os.environ.get(TIMELINE_VARIABLE)
    if directory:
        importlib.import_module("attndbg.timeline.worker").attach(directory, label=os.environ.get(TIMELINE_LABEL_VARIABLE) or None)


def step_label(trace: Trace) -> str:
    return f"step={trace.source.step} mode={trace.batch.forward_mode.value} bs={trace.batch.batch_size}"


def step_range(path: str | os.PathLike[str], trace: Trace) -> contextlib.AbstractContextManager[None]:
    """The range around all of one step file's work in replay and check: `attndbg/step
    trace=decode_gqa.pt step=0 mode=DECODE bs=3`. Every range inside inherits the file's name (a
    timeline reads it from the enclosing ranges), which a replay of a folder needs: step numbers
    repeat from file to file (most shipped traces are step 0)."""
    return phase("step", f"trace={os.path.basename(os.fspath(path))} {step_label(trace)}")


def _current_observer() -> Observer | None:
    """The observer now, the environment's read first (once) in a process the CLI never ran in."""
    if _observer is None and not _environment_read:
        _observe_from_environment()
    return _observer


# Set by an NVTX tool (Nsight Systems, Nsight Compute) in the processes it profiles: the library it
# injects into NVTX, which is what records a range's message.
NVTX_TOOL_VARIABLE = "NVTX_INJECTION64_PATH"


def labels_read() -> bool:
    """Whether a range's words are read by anyone now: `--timeline`'s observer, or an NVTX tool.
    A hot path (the recorder's per-step range) words its label in full only then."""
    return _current_observer() is not None or _nvtx_tool()


@functools.cache
def _nvtx_tool() -> bool:
    """The variable as first read: NVTX reads it once too, at its first call."""
    return bool(os.environ.get(NVTX_TOOL_VARIABLE))


@contextlib.contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    message = f"{PREFIX}{name}" + (f" {detail}" if detail else "")
    observer = _current_observer()
    _open.append(message)
    if observer is not None:
        observer.push(message)
    try:
        with nvtx.annotate(message=message, domain=DOMAIN):
            yield
    finally:
        if observer is not None:
            observer.pop()
        _open.pop()


def current() -> tuple[str, ...]:
    """The phases open now, outermost first ('attndbg/detector/split-merge step=0 ...', ...); read
    from another thread (a spinner's refresh) it is a consistent copy."""
    return tuple(_open)
