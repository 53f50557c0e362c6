"""What every command shares: exit codes, the bad-input error and its one line on stderr (exit 2),
the console, JSON output. Only click and rich are imported here.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

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


def make_console(*, stderr: bool = False) -> Console:
    """The terminal's width; piped, $COLUMNS when set, else 160. `stderr` when stdout carries JSON."""
    stream = sys.stderr if stderr else sys.stdout
    piped_default = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160
    return Console(highlight=False, soft_wrap=False, width=piped_default, stderr=stderr)


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
