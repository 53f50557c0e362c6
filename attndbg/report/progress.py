"""What runs now, on stderr and only on a terminal: a spinner for one step, a bar over a folder's steps.

Both name the step and the phase running in it, read from the phases open in this process
(`profiling.current()`: the detector, the backend, its variant: "tree-mask › triton › eager"), and
the time spent. The bar's rate and ETA come from completed steps only (the time per completed step
since the start), never from a burst of steps finishing together. What is printed meanwhile (a
step's table) appears above: the display steps aside, the table is printed, the display comes back.
Piped or redirected, nothing of it is written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, Task
from rich.table import Column
from rich.text import Text

from attndbg import profiling
from attndbg.trace.errors import printable

# Phase names (profiling.phase) as the spinner says them.
_WORDS = {"plan": "plan", "data": "step data", "reference": "float64 reference", "compare": "compare"}


def describe_phases(phases: Sequence[str]) -> str:
    """'attndbg/detector/split-merge step=0 ...', 'attndbg/backend/triton ...', 'attndbg/run ...
    variant=eager' -> 'split-merge › triton › eager'."""
    words: list[str] = []
    for message in phases:
        name, _, detail = message.removeprefix("attndbg/").partition(" ")
        fields = dict(part.split("=", 1) for part in detail.split() if "=" in part)
        kind, _, what = name.partition("/")
        if kind == "step":
            continue  # the file's range around all of its work: the line names the step already
        if kind in ("detector", "backend"):
            word = what
        elif kind == "run":
            word = fields.get("variant", "run")
        elif kind == "capture+replay":
            kind = fields.get("variant", "graph")  # "padded": the graph's sequence run eagerly, nothing captured
            word = f"{kind} bs={fields['capture_bs']}" if "capture_bs" in fields else kind
        else:
            word = _WORDS.get(kind, kind)
        if word and (not words or words[-1] != word):
            words.append(word)
    return " › ".join(words)


class _NowColumn(ProgressColumn):
    """`<verb> <step>: <phases open now>`, re-read at every refresh. It takes the width the other
    columns leave and is cut with '…' where the terminal is narrow: the times stay on the line."""

    def __init__(self, verb: str):
        super().__init__(table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1, min_width=8))
        self.verb = verb

    def render(self, task: Task) -> Text:
        text = Text(f"{self.verb} {task.description}")
        # In this process its open phases; a step checked in a worker, what the worker said it runs.
        now = describe_phases(profiling.current()) or task.fields.get("now", "")
        if now:
            text.append(f": {now}", style="cyan")
        return text


def _clock(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class _ElapsedColumn(ProgressColumn):
    """'elapsed 0:01:23': the time since the display started, labelled (a bare clock beside the
    ETA reads as either)."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        return Text(f"elapsed {_clock(task.finished_time if task.finished else task.elapsed or 0.0)}", style="dim")


def eta_seconds(*, total: int, done: int, began: float, last: float, now: float) -> float:
    """What is left of a folder's check, from completed steps only (never from a burst of steps
    finishing together): the time per completed step times the steps left, less what the step in
    progress has run. A step that runs past that share would take the estimate to 0 with work
    left: its overrun so far is then taken as what it still needs (the longer it has run over, the
    longer it is expected to run on). At least 1 s while any step is left."""
    left = total - done
    if left <= 0:
        return 0.0
    per_step = (last - began) / done
    running = now - last
    on_schedule = per_step * left - running
    overrun = per_step * (left - 1) + (running - per_step)
    return max(1.0, on_schedule, overrun)


class _RateColumn(ProgressColumn):
    """Time per completed step and the ETA from it: '4.1 s/step · ETA 0:00:12'."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        done, began, last = task.fields.get("done", 0), task.fields.get("began"), task.fields.get("last")
        if not done or began is None or last is None or task.total is None:
            return Text("ETA --", style="dim")
        per_step = (last - began) / done
        rate = f"{1 / per_step:.1f} steps/s" if 0 < per_step < 1 else f"{per_step:.1f} s/step"
        left = eta_seconds(total=int(task.total), done=done, began=began, last=last, now=time.monotonic())
        return Text(f"{rate} · ETA {_clock(left)}", style="dim")


class _Display:
    """A rich Progress on stderr, disabled unless stderr is a terminal."""

    def __init__(self, columns: list[ProgressColumn], total: int, console: Console | None, first: str = ""):
        console = console or Console(stderr=True)
        # expand: the step and phase column takes what the others leave (and is cut, not wrapped)
        self._progress = Progress(*columns, console=console, transient=True, expand=True, disable=not console.is_terminal or console.quiet)
        self._task = self._progress.add_task(printable(first), total=total, done=0, began=None, last=None)

    def __enter__(self) -> _Display:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def show(self, what: str) -> None:
        """What runs now, e.g. '3/12 rec/step_000003.pt: triton, reference'."""
        self._progress.update(self._task, description=printable(what), refresh=True)

    def print(self, console: Console, renderable: Any) -> None:
        """Print a finished step's output on `console` (stdout, or stderr under `--json -`)."""
        if self._progress.disable:
            console.print(renderable)
            return
        self._progress.stop()
        console.print(renderable)
        self._progress.start()


class StepProgress(_Display):
    """`replay`: a spinner with the step, the phase and the time elapsed, advanced step by step."""

    def __init__(self, total: int, verb: str, *, console: Console | None = None):
        super().__init__([SpinnerColumn(), _NowColumn(verb), _ElapsedColumn()], total, console)

    def print(self, console: Console, renderable: Any) -> None:
        self._progress.advance(self._task)
        super().print(console, renderable)


# The narrowest terminal that shows a folder's bar: below, the count, the step, the rate with the
# ETA and the elapsed time fill an 80-column line.
BAR_FROM = 100


class CheckProgress(_Display):
    """`check`: one step, a spinner naming it and the phase; a folder, a bar over its steps naming
    the step awaited (reports come in recording order) with the rate and ETA of completed steps."""

    def __init__(self, paths: Sequence[str | Path], *, console: Console | None = None):
        self._paths = [str(p) for p in paths]
        console = console or Console(stderr=True)
        if len(self._paths) == 1:
            columns: list[ProgressColumn] = [SpinnerColumn(), _NowColumn("checking"), _ElapsedColumn()]
        else:
            # Under BAR_FROM columns the bar goes (the count says as much) and the step keeps room.
            bar: list[ProgressColumn] = [BarColumn(bar_width=20)] if console.width >= BAR_FROM else []
            columns = [SpinnerColumn(), *bar, MofNCompleteColumn(), _NowColumn("checking"), _RateColumn(), _ElapsedColumn()]
        super().__init__(columns, len(self._paths), console, first=self._name(0))
        self._done = 0

    def __enter__(self) -> CheckProgress:
        self._progress.update(self._task, began=time.monotonic())
        super().__enter__()
        return self

    def done(self, report: Any) -> None:
        """A step's report came back (the `progress` callback of `check_steps`)."""
        self._done += 1
        self._progress.update(self._task, completed=self._done, done=self._done, last=time.monotonic(), now="")
        if self._done < len(self._paths):
            self.show(self._name(self._done))

    def now(self, index: int, phase: str) -> None:
        """What a worker runs for step `index` (the `now` callback of `check_steps`): shown while it
        is the step awaited."""
        if index == self._done:
            self._progress.update(self._task, now=printable(phase))

    def _name(self, index: int) -> str:
        """The step awaited: the file itself, or a folder's step by its file name."""
        if index >= len(self._paths):
            return ""
        return self._paths[index] if len(self._paths) == 1 else Path(self._paths[index]).name
