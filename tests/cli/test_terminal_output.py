"""How commands read on a terminal (COLUMNS 80, 120, 200; TTY_COMPATIBLE=1 is rich's word for a
terminal) and piped (no $COLUMNS: lines as long as their content, no trailing spaces): the backends'
capabilities stacked where their table does not fit and in a pipe, install commands whole on lines
of their own, --color/--no-color, and shell completion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.measure import Measurement

from attndbg.backends import registry
from attndbg.cli import main
from attndbg.report.backends import BackendStatus, backend_status, render_capabilities
from attndbg.report.terminal import PIPED_WIDTH
from tests.cli.helpers import NoGpuBackend, invoke, with_nogpu  # noqa: F401 - a fixture

TRACE = str(Path(__file__).resolve().parents[2] / "traces" / "verify_tree.pt")
TERMINAL = {"TTY_COMPATIBLE": "1"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _statuses() -> list[BackendStatus]:
    return [backend_status(name, registry.create(name)) for name in registry.backend_names()]


@pytest.mark.parametrize("columns", [80, 120, 200, 400])
def test_capabilities_fit_the_terminal_stacked_where_the_table_would_not(columns: int) -> None:
    result = invoke("backends", "--capabilities", "--no-color", columns=columns)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= columns for line in lines), max(lines, key=len)
    assert "…" not in result.stdout  # no cell cut
    stacked = any(line.strip().startswith("attention: modes ") for line in lines)
    wide = Console(width=PIPED_WIDTH)
    whole = Measurement.get(wide, wide.options, render_capabilities(_statuses())).maximum  # some 360 columns
    assert stacked == (columns < whole), (whole, result.stdout)
    for name in registry.backend_names():
        assert any(line.strip().split() == [name] for line in lines) or not stacked, name


def test_piped_capabilities_are_stacked_and_lines_carry_no_padding() -> None:
    result = invoke("backends", "--capabilities")
    lines = result.stdout.splitlines()
    assert all(line == line.rstrip() for line in lines)
    assert any(line.strip().startswith("attention: modes mha: decode") for line in lines)
    # The status table is as wide as its longest reason, no wider.
    table = [line for line in lines if line.startswith("│")]
    assert len({len(line) for line in table}) == 1
    longest = max(len(s.unavailable or s.description) for s in _statuses())
    assert len(table[0]) < longest + 40


def test_install_commands_are_whole_lines_to_paste(with_nogpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    hint = "no FlashAttention-3 implementation is installed: install one: `pip install sgl-kernel`, `git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && python setup.py install`"
    monkeypatch.setattr(NoGpuBackend, "unavailable_reason", lambda self: hint)
    for columns in (40, 80, None):
        result = invoke("backends", "--no-color", columns=columns)
        lines = result.stdout.splitlines()
        assert "  nogpu: pip install sgl-kernel" in lines, (columns, result.stdout)
        assert "  nogpu: git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && python setup.py install" in lines
        assert "`" not in result.stdout


def test_show_piped_panels_are_as_wide_as_their_content() -> None:
    result = invoke("show", TRACE)
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and all(line == line.rstrip() for line in lines)
    source = lines[1:lines.index(next(line for line in lines if line.startswith("╰")))]
    assert lines[1].startswith("╭─ source ") and len(lines[1]) == len(source[1]) < 60  # not 65,536 columns


def test_color_on_a_terminal_only_unless_told() -> None:
    def check(*options: str, terminal: bool) -> str:
        env = {"COLUMNS": "120", **(TERMINAL if terminal else {})}
        return CliRunner().invoke(main, ["check", TRACE, "--only", "invariants", *options], env=env).stdout

    assert ANSI.search(check(terminal=True)) and not ANSI.search(check(terminal=False))
    assert ANSI.search(check("--color", terminal=False))  # piped, coloured because asked (less -R)
    assert not ANSI.search(check("--no-color", terminal=True))
    assert ANSI.search(invoke("show", TRACE, "--color").stdout)


def test_shell_completion_answers(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`_ATTNDBG_COMPLETE=bash_source attndbg` prints the bash script (docs/terminal.md); the
    completion itself lists a command's options."""
    monkeypatch.setenv("_ATTNDBG_COMPLETE", "bash_source")
    with pytest.raises(SystemExit) as done:
        main.main(args=[], prog_name="attndbg")
    assert done.value.code == 0 and "_attndbg_completion" in capsys.readouterr().out
    monkeypatch.setenv("_ATTNDBG_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", "attndbg check --no")
    monkeypatch.setenv("COMP_CWORD", "2")
    with pytest.raises(SystemExit):
        main.main(args=[], prog_name="attndbg")
    assert "plain,--no-color" in capsys.readouterr().out.splitlines()
