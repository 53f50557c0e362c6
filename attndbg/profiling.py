"""NVTX ranges so `nsys profile attndbg ...` shows attndbg's phases: `attndbg/<phase>`.

nvtx is a dependency; its ranges cost next to nothing when no profiler is attached. The phases
open now are also kept (`current()`), so a spinner can say what runs: the detector, the backend,
its variant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import nvtx

if TYPE_CHECKING:  # a type only: --help and synth --list must not import torch (tests/cli/test_startup.py)
    from attndbg.trace.schema import Trace

DOMAIN = "attndbg"

_open: list[str] = []  # the messages of the phases open in this process, outermost first


def step_label(trace: Trace) -> str:
    return f"step={trace.source.step} mode={trace.batch.forward_mode.value} bs={trace.batch.batch_size}"


@contextlib.contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    message = f"attndbg/{name}" + (f" {detail}" if detail else "")
    _open.append(message)
    try:
        with nvtx.annotate(message=message, domain=DOMAIN):
            yield
    finally:
        _open.pop()


def current() -> tuple[str, ...]:
    """The phases open now, outermost first ('attndbg/detector/split-merge step=0 ...', ...); read
    from another thread (a spinner's refresh) it is a consistent copy."""
    return tuple(_open)
