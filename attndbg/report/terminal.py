"""Where output is read, and what that changes: a terminal has a width, lines wrap at words and
tables fold to fit; a pipe or a file has none, so each line is as long as its content, with no
padding after it (what `grep`, `less -S` and an editor read best).

The consoles are made in one place (`console`); renderables that lay themselves out by the width
they get ask `unbounded` whether that width is a pipe's. Settings of one command (--color/--no-color,
-q/--quiet) are a frozen `Terminal` the CLI passes in.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass
from typing import IO, Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel

# The width a pipe is given: no line of ours comes near it, so nothing wraps or folds, and a table
# is as wide as its content. Renderables compare against it (`unbounded`) to choose a layout for
# reading in a file rather than on a screen.
PIPED_WIDTH = 1 << 16


@dataclass(frozen=True)
class Terminal:
    """A command's --color/--no-color (None: colour on a terminal only, NO_COLOR respected) and
    -q/--quiet (only the verdict line on stdout, no progress display)."""

    color: bool | None = None
    quiet: bool = False


def unbounded(options: ConsoleOptions) -> bool:
    """Whether the output goes to a pipe or a file (no width), not a terminal."""
    return options.max_width >= PIPED_WIDTH


class _WithoutTrailingSpace(io.TextIOBase):
    """A text stream that writes each line without the spaces rich pads it with (a table title is
    padded to the table's width, a cell to its column's); what is left of a line when flushed is
    written as it is."""

    def __init__(self, stream: IO[str]):
        self._stream = stream
        self._pending = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()


def console(*, stderr: bool = False, terminal: Terminal = Terminal(), details: bool = True) -> Console:
    """The console a command prints on: stdout (stderr where stdout carries JSON). On a terminal
    (rich's test, so TTY_COMPATIBLE=1 and FORCE_COLOR count) its width; piped, $COLUMNS when set,
    else unbounded, lines without trailing spaces. `details`: what -q/--quiet silences (every
    table and note; the verdict line is printed on a console made with details=False)."""
    stream = sys.stderr if stderr else sys.stdout
    on_terminal = Console(file=stream).is_terminal
    piped = not on_terminal and not os.environ.get("COLUMNS", "").isdigit()
    color: dict[str, Any] = {}
    if terminal.color is False:
        color = {"color_system": None, "no_color": True}
    elif terminal.color is True:  # forced: ANSI colours into a pipe too (less -R reads them)
        color = {"color_system": "auto" if on_terminal else "standard", "no_color": False}
    return Console(
        file=_WithoutTrailingSpace(stream) if piped else stream,
        width=PIPED_WIDTH if piped else None,
        highlight=False,
        soft_wrap=False,
        quiet=terminal.quiet and details,
        **color,
    )


class FittedPanel(Panel):
    """A panel as wide as the terminal; in a pipe, as wide as its content (a panel drawn to the
    pipe's width would put its right edge 65,536 columns out)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        self.expand = not unbounded(options)
        yield from super().__rich_console__(console, options)


def duration(seconds: float) -> str:
    """'0.4 s', '12 s', '3 min 05 s', '1 h 02 min': how long a command took, for its verdict line."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
