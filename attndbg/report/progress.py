"""A spinner with the elapsed time while long steps run, on stderr and only on a terminal.

What is printed meanwhile (a step's table) appears above it: the spinner steps aside, the table is
printed, the spinner comes back. Piped or redirected, nothing of it is written.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class StepProgress:
    def __init__(self, total: int, verb: str, *, console: Console | None = None):
        console = console or Console(stderr=True)
        columns = [SpinnerColumn(), TextColumn(f"{verb} {{task.description}}"), TimeElapsedColumn()]
        self._progress = Progress(*columns, console=console, transient=True, disable=not console.is_terminal)
        self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> StepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def show(self, what: str) -> None:
        """What runs now, e.g. '3/12 rec/step_000003.pt: triton, reference'."""
        self._progress.update(self._task, description=what, refresh=True)

    def print(self, console: Console, renderable: Any) -> None:
        """Print a finished step's output on `console` (stdout, or stderr under `--json -`)."""
        self._progress.advance(self._task)
        if self._progress.disable:
            console.print(renderable)
            return
        self._progress.stop()
        console.print(renderable)
        self._progress.start()
