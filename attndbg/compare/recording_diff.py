"""Diff two recordings (or folders of traces) step by step: the first step that differs, and in it
the first field, so two runs of one engine command can be told apart without opening each step.

Steps are paired by position (manifest order, or name order in a plain folder). A step that cannot
be loaded is reported with its error and the others are still compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from attndbg.compare.trace_diff import TraceDiff, diff_traces
from attndbg.trace import io
from attndbg.trace.errors import TraceError


@dataclass(frozen=True)
class StepDiff:
    index: int  # position in both recordings
    a_file: str | None  # None: recording a has fewer steps
    b_file: str | None
    diff: TraceDiff | None = None  # None when a side is missing or could not be loaded
    error: str = ""  # why a side could not be loaded

    @property
    def differs(self) -> bool:
        return self.diff is None or self.diff.differs


@dataclass(frozen=True)
class RecordingDiff:
    a_path: str
    b_path: str
    steps: tuple[StepDiff, ...]

    @property
    def differing(self) -> tuple[StepDiff, ...]:
        return tuple(s for s in self.steps if s.differs)

    @property
    def first_difference(self) -> StepDiff | None:
        return next(iter(self.differing), None)

    @property
    def differs(self) -> bool:
        return bool(self.differing)


def diff_recordings(a: str | os.PathLike, b: str | os.PathLike) -> RecordingDiff:
    """Every step of `a` against the step at the same position of `b`."""
    a_paths, b_paths = io.trace_paths(a), io.trace_paths(b)
    steps = []
    for index in range(max(len(a_paths), len(b_paths))):
        a_file = str(a_paths[index]) if index < len(a_paths) else None
        b_file = str(b_paths[index]) if index < len(b_paths) else None
        if a_file is None or b_file is None:
            steps.append(StepDiff(index, a_file, b_file))
            continue
        try:
            steps.append(StepDiff(index, a_file, b_file, diff=diff_traces(io.load(a_file), io.load(b_file))))
        except TraceError as e:
            steps.append(StepDiff(index, a_file, b_file, error=str(e)))
    return RecordingDiff(a_path=str(a), b_path=str(b), steps=tuple(steps))
