"""The spinner shows what runs on a terminal, steps aside for output, and writes nothing when piped."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from attndbg.report.progress import StepProgress


def test_spinner_on_a_terminal_names_the_step_and_keeps_output() -> None:
    spinner_stream, out_stream = io.StringIO(), io.StringIO()
    terminal = Console(file=spinner_stream, force_terminal=True, width=80)
    with StepProgress(2, "replaying", console=terminal) as progress:
        progress.show("1/2 a.pt: triton")
        progress.print(Console(file=out_stream, width=80), Text("table of a.pt"))
    assert "replaying 1/2 a.pt: triton" in spinner_stream.getvalue()
    assert out_stream.getvalue() == "table of a.pt\n"


def test_nothing_is_written_when_piped() -> None:
    piped, out = io.StringIO(), io.StringIO()
    with StepProgress(1, "replaying", console=Console(file=piped, force_terminal=False)) as progress:
        progress.show("1/1 a.pt: triton")
        progress.print(Console(file=out), Text("table"))
    assert piped.getvalue() == "" and out.getvalue() == "table\n"
