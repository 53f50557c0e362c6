"""Every example runs when pasted: each ```bash block of README.md and docs/*.md, and the examples of
every command's --help, run from a fresh empty folder against the wheel installed in a clean venv
(conftest.py), on the CPU. The marker grammar is in tests/packaging/examples.py.

Blocks run two at a time (the machine has 2 cores; one command is mostly one Python process); the
whole test takes a few minutes, most of it Triton interpreted and each command's start-up.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from attndbg.cli import main
from tests.packaging.conftest import ROOT
from tests.packaging.examples import Block, Line, Needs, help_block, markdown_blocks, parse_line

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# One example line's limit: the slowest (minimize, a check of every detector) take about 30 s here.
LINE_TIMEOUT_S = 300


def _commands(group: click.Group = main, prefix: str = "attndbg") -> dict[str, click.Command]:
    """Every command a user can ask --help of: the group itself and each leaf, subgroups walked."""
    found: dict[str, click.Command] = {prefix: group}
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found.update({k: v for k, v in _commands(command, f"{prefix} {name}").items() if k != f"{prefix} {name}"})
        else:
            found[f"{prefix} {name}"] = command
    return found


def _help_text(command: str) -> str:
    result = CliRunner().invoke(main, [*command.split()[1:], "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


HELP_BLOCKS = {command: help_block(command, _help_text(command)) for command in _commands()}
BLOCKS: list[Block] = [block for page in PAGES for block in markdown_blocks(page, ROOT)]
BLOCKS += [block for block in HELP_BLOCKS.values() if block is not None]


@dataclass(frozen=True)
class Outcome:
    line: Line
    exit_code: int | None  # None: skipped
    seconds: float
    output: str  # the end of stdout and stderr


def _environment(venv: Path) -> dict[str, str]:
    """The user's shell after `. venv/bin/activate`: no PYTHONPATH into the checkout, no interpreter
    flag of ours (attndbg sets TRITON_INTERPRET itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run_block(block: Block, venv: Path) -> list[Outcome]:
    outcomes = []
    folder = Path(tempfile.mkdtemp(prefix="attndbg-example-"))
    try:
        for line in block.lines:
            if line.needs is Needs.ELSEWHERE:
                outcomes.append(Outcome(line, None, 0.0, ""))
                continue
            start = time.monotonic()
            try:
                ran = subprocess.run(["bash", "-o", "pipefail", "-c", line.command], cwd=folder, env=_environment(venv), capture_output=True, text=True, timeout=LINE_TIMEOUT_S, stdin=subprocess.DEVNULL)
                code, output = ran.returncode, (ran.stdout[-1500:] + "\n--- stderr ---\n" + ran.stderr[-3000:])
            except subprocess.TimeoutExpired:
                code, output = -1, f"did not finish in {LINE_TIMEOUT_S} s"
            outcomes.append(Outcome(line, code, time.monotonic() - start, output))
            if code != line.exit_code:
                break  # the lines after it build on it
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return outcomes


def _runs(block: Block) -> tuple[tuple[str, Needs, int], ...]:
    """What running a block does: its commands and what each expects (comments aside)."""
    return tuple((line.command, line.needs, line.exit_code) for line in block.lines)


def _longest_first(blocks: list[Block]) -> tuple[list[Block], dict[str, Block]]:
    """The blocks to run, and for each other block the run whose first lines are its own. A block
    runs in a fresh empty folder, so one that starts as another (a --help example that the docs
    continue) has the same outcomes as that one's first lines: it is run once."""
    to_run: list[Block] = []
    covered: dict[str, Block] = {}
    for block in sorted(blocks, key=lambda b: -len(b.lines)):
        runs = _runs(block)
        longer = next((other for other in to_run if _runs(other)[: len(runs)] == runs), None)
        if longer is None:
            to_run.append(block)
        covered[block.where] = longer or block
    return to_run, covered


@pytest.fixture(scope="module")
def outcomes(wheel_venv: Path) -> dict[str, list[Outcome]]:
    runnable = [block for block in BLOCKS if block.skipped is None]
    to_run, covered = _longest_first(runnable)
    start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with ThreadPoolExecutor(max_workers=2) as pool:
        ran = dict(zip([b.where for b in to_run], pool.map(lambda b: _run_block(b, wheel_venv), to_run)))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # what a loaded machine's wall time hides
    lines = sum(len(o) for o in ran.values())
    print(f"\n{len(runnable)} example blocks, {len(to_run)} run, {lines} lines, in {time.monotonic() - start:.0f} s ({cpu:.0f} CPU s)")
    for where, block_outcomes in ran.items():
        for o in block_outcomes:
            said = "skipped: " + o.line.comment if o.exit_code is None else f"exit {o.exit_code}, {o.seconds:.1f} s"
            print(f"  {where}: {o.line.command[:90]}  [{said}]")
    return {block.where: ran[covered[block.where].where][: len(block.lines)] for block in runnable}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skipped is None], ids=lambda b: b.where)
def test_the_example_runs_when_pasted(block: Block, outcomes: dict[str, list[Outcome]]) -> None:
    if all(line.needs is Needs.ELSEWHERE for line in block.lines):
        pytest.skip("; ".join(line.comment for line in block.lines))
    ran = outcomes[block.where]
    for outcome in ran:
        if outcome.exit_code is None:
            continue
        assert "Traceback (most recent call last)" not in outcome.output, f"{block.where}: {outcome.line.command}\n{outcome.output}"
        assert outcome.exit_code == outcome.line.exit_code, (
            f"{block.where}: `{outcome.line.command}` exited {outcome.exit_code}, the example says {outcome.line.exit_code}"
            f" ({outcome.line.needs.value})\n{outcome.output}"
        )
        if outcome.line.needs is Needs.GPU:
            assert "gpu" in outcome.output.lower(), f"{block.where}: `{outcome.line.command}` failed without naming the GPU\n{outcome.output}"
    assert len(ran) == len(block.lines), f"{block.where}: stopped after a line that did not do what it says"


def test_a_block_that_starts_as_a_longer_one_is_run_once() -> None:
    line = parse_line("attndbg env")
    short, long, other = Block("a", (line,)), Block("b", (line, parse_line("attndbg env --json e.json   # the same, as JSON"))), Block("c", (parse_line("attndbg backends"),))
    to_run, covered = _longest_first([short, long, other])
    assert [b.where for b in to_run] == ["b", "c"] and covered == {"a": long, "b": long, "c": other}


def test_every_command_carries_an_example() -> None:
    assert [command for command, block in HELP_BLOCKS.items() if block is None or not block.lines] == []


def test_the_markers_read_as_documented() -> None:
    assert parse_line("attndbg check bad.pt   # exit 1: the packing") == Line("attndbg check bad.pt", "exit 1: the packing", Needs.NOTHING, 1)
    assert parse_line("attndbg bench t.pt --backend flashinfer   # GPU") == Line("attndbg bench t.pt --backend flashinfer", "GPU", Needs.GPU, 3)
    assert parse_line("attndbg record -o rec -- vllm serve m   # needs vLLM and a model").needs is Needs.ELSEWHERE
    assert parse_line("attndbg show t.pt   # 3 s") == Line("attndbg show t.pt", "3 s", Needs.NOTHING, 0)
    assert parse_line("attndbg show t.pt") == Line("attndbg show t.pt", "", Needs.NOTHING, 0)


def test_a_shell_block_not_marked_bash_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```sh\nattndbg env\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="write commands as ```bash"):
        markdown_blocks(page, tmp_path)
    page.write_text("<!-- not an example: installs packages -->\n```bash\npip install x \\\n  y\n```\n", encoding="utf-8")
    (block,) = markdown_blocks(page, tmp_path)
    assert block.skipped == "installs packages" and [line.command for line in block.lines] == ["pip install x    y"]
