"""The `attndbg` click group: --version, click's usage errors as one line (exit 2), and the
environment checked before any command runs.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from attndbg.cli.common import EXIT_BAD_INPUT, EXIT_OK


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """--version: one line naming the versions a bug report needs first, without importing torch."""
    if not value or ctx.resilient_parsing:
        return
    from attndbg.environment import version_line

    click.echo(version_line())
    ctx.exit()


class _Group(click.Group):
    """click's usage errors (unknown option, bad value) as one line on stderr and exit 2, like
    every other bad input, instead of click's usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # bare `attndbg`: the help
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)  # as a shell reports SIGINT
        sys.exit(code if isinstance(code, int) else EXIT_OK)  # --help/--version return 0


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version, help="attndbg, Python, torch with its CUDA, triton and flashinfer versions, and exit (attndbg env: the whole report)")
def main() -> None:
    """Record, replay, diff and explain LLM attention backends.

    \b
    Example:
      attndbg examples traces
      attndbg replay traces/verify_tree.pt --backend triton

    \b
    Shell completion (bash; zsh_source and fish_source for those shells), in ~/.bashrc:
      eval "$(_ATTNDBG_COMPLETE=bash_source attndbg)"
    """
    from attndbg.backends import environment
    from attndbg.detectors import registry as detectors

    # The environment is input too: one line, never a traceback.
    problem = environment.ENVIRONMENT.problem() or detectors.ENVIRONMENT.problem()
    if problem:
        click.echo(f"error: {problem}", err=True)
        sys.exit(EXIT_BAD_INPUT)
