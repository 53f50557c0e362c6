"""Factory helpers shared by tests: traces from synth specs, stored dicts, files on disk."""

from __future__ import annotations

from pathlib import Path

import torch

from attndbg.replay.plans import with_engine_plan
from attndbg.trace import io, synth
from attndbg.trace.schema import Trace, to_dict


def make_trace(*spec: str, plan: bool = False) -> Trace:
    trace = synth.build(synth.parse_spec(list(spec)))
    return with_engine_plan(trace) if plan else trace


def stored(*spec: str) -> dict:
    return to_dict(make_trace(*spec))


def write_raw(path: Path, data: object) -> Path:
    torch.save(data, path)
    return path


def write_trace(path: Path, *spec: str, plan: bool = True) -> Path:
    return io.save(make_trace(*spec, plan=plan), path)
