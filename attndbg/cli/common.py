"""What every command shares: exit codes, the bad-input error and its one line on stderr (exit 2),
the console, JSON output. Only click and rich (and report/terminal.py, rich only) are imported here.
"""

from __future__ import annotations

import contextvars
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.text import Text

from attndbg.report.terminal import Terminal
from attndbg.report.terminal import console as terminal_console
from attndbg.trace.errors import TraceError
from attndbg.trace.synth_spec import SpecError


F = TypeVar("F", bound=Callable[..., Any])
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
# Nothing failed, but something asked for did not run (a named backend unavailable, a step not checked).
EXIT_NOT_RUN = 3
# record: the command exited 0 but no step was recorded because a hook failed (named on stderr).
EXIT_NOT_RECORDED = 4


class BadInput(Exception):
    """Any user-input problem that is not a TraceError (unknown backend, bad option combination)."""


class NotRunHere(Exception):
    """What was asked for cannot run on this machine (it needs a CUDA GPU, an optional package): the
    input is fine, nothing ran. One line on stderr, exit 3, as for a named backend that cannot run."""


# The --color/--no-color and -q/--quiet of the command running (options.terminal sets them).
TERMINAL: contextvars.ContextVar[Terminal] = contextvars.ContextVar("attndbg_terminal", default=Terminal())


def make_console(*, stderr: bool = False, details: bool = True) -> Console:
    """The command's console (report/terminal.py): the terminal's width; piped, $COLUMNS when set,
    else lines as long as their content. `stderr` when stdout carries JSON; `details` False for the
    verdict line, the one thing -q/--quiet prints."""
    return terminal_console(stderr=stderr, terminal=TERMINAL.get(), details=details)


def print_verdict(console: Console, line: str | Text) -> None:
    """A command's verdict line: on a terminal wrapped at word boundaries (never cut mid-word by
    the terminal); piped, one line whatever its length (logs grep it). Never read as markup."""
    console.print(line if isinstance(line, Text) else Text(line), soft_wrap=not console.is_terminal)


def handles_bad_input(func: F) -> F:
    """Turn bad input into one line on stderr and exit code 2, and what cannot run on this machine
    into one line and exit code 3; never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (TraceError, SpecError, BadInput) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except NotRunHere as e:
            click.echo(f"not run: {e}", err=True)
            sys.exit(EXIT_NOT_RUN)

    return wrapper  # type: ignore[return-value]


def write_json(path: str, data: Any) -> None:
    """Write `data` to `path`, or to stdout when `path` is "-"."""
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        click.echo(text, nl=False)
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise BadInput(f"--json {path}: cannot write ({e.strerror or e})") from None


def check_outputs(**paths: str | None) -> None:
    """Refuse an output file whose folder does not exist before a long run, not after it."""
    for option, path in paths.items():
        if path and path != "-" and not Path(path).absolute().parent.is_dir():
            raise BadInput(f"--{option.replace('_', '-')} {path}: the folder {Path(path).parent} does not exist")
