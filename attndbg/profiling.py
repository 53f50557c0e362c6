"""NVTX ranges so `nsys profile attndbg ...` shows attndbg's phases: `attndbg/<phase>`.

nvtx is a dependency; its ranges cost next to nothing when no profiler is attached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import nvtx

from attndbg.trace.schema import Trace

DOMAIN = "attndbg"


def step_label(trace: Trace) -> str:
    return f"step={trace.source.step} mode={trace.batch.forward_mode.value} bs={trace.batch.batch_size}"


@contextlib.contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    message = f"attndbg/{name}" + (f" {detail}" if detail else "")
    with nvtx.annotate(message=message, domain=DOMAIN):
        yield
