"""Output that fits a terminal and survives a log: at 80 columns findings are stacked, one field a
line, and no line is wider than the terminal except a token that cannot be broken; identifiers are
never split; on a terminal the verdict wraps at word boundaries, piped it is one line whatever the
width, never cut with '…', and it ends with the time the command took; piped without $COLUMNS,
lines are as long as their content, with no trailing spaces; --steps/--sample verdicts say which
steps of how many."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.detectors import registry as detectors
from attndbg.cli import main
from attndbg.trace import io
from tests.factories import make_trace

SMALL = ("heads=2:1", "head_dim=32")


@pytest.fixture(scope="module")
def bad_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step with two invariants findings whose evidence is full of identifiers (kv_indptr[3], ...)."""
    trace = detectors.inject(make_trace("decode-mha", "kv_lens=3,20,7", *SMALL, plan=True), "invariants:decreasing-indptr")
    return io.save(trace, tmp_path_factory.mktemp("width") / "a_step_with_a_rather_long_file_name_to_wrap.pt")


def _check(path: Path, tmp_path: Path, env: dict[str, str], *options: str) -> tuple[list[str], dict]:
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--json", str(report), *options], env=env)
    assert result.exit_code == 1, result.output
    return result.stdout.splitlines(), json.loads(report.read_text())  # stdout: a terminal's progress display is on stderr


TOOK = r"; took \d+(\.\d)? s"


def _is_verdict(line: str, verdict: str) -> bool:
    """The JSON's verdict line, then the time the command took (which the JSON leaves out: the
    same trace must give the same JSON)."""
    return re.fullmatch(re.escape(verdict) + TOOK, line) is not None


def _words(data: dict) -> set[str]:
    """Every identifier-like word of the findings as the JSON holds them (what must never be split)."""
    words = set()
    for step in data["steps"]:
        for f in step["findings"]:
            for text in (f["check"], f["class"], f["evidence"], f["cause"]):
                words.update(w for w in text.split() if len(w) > 3)
    return words


@pytest.mark.parametrize("columns", ["80", "100", "130"])
def test_no_line_is_wider_than_the_terminal_and_identifiers_stay_whole(bad_step: Path, tmp_path: Path, columns: str) -> None:
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": columns})
    verdict = data["verdict"]["line"]
    assert _is_verdict(lines[-1], verdict), lines[-1]  # piped: one line, whole, at any width
    width = int(columns)
    for line in lines[:-1]:
        if len(line.rstrip()) > width:  # only a token no break can shorten
            assert max(len(token) for token in line.split()) > width - 8, (columns, line)
    text = "\n".join(lines)
    for word in _words(data):
        assert any(word in line for line in lines), (columns, word, text)


def test_narrow_terminals_get_findings_stacked(bad_step: Path, tmp_path: Path) -> None:
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": "80"})
    finding = data["steps"][0]["findings"][0]
    stripped = [line.strip() for line in lines]
    assert f"{finding['class']} / {finding['check']}" in stripped
    assert any(line.startswith("where ") for line in stripped) and any(line.startswith("evidence ") for line in stripped)
    assert any(line.startswith("cause ") for line in stripped)
    assert not any("┃" in line or "│" in line for line in lines)  # no table at 80 columns


def test_wide_terminals_keep_the_table(bad_step: Path, tmp_path: Path) -> None:
    lines, _ = _check(bad_step, tmp_path, {"COLUMNS": "160"})
    assert any("likely cause" in line and "┃" in line for line in lines)


def test_piped_output_keeps_the_verdict_on_one_line(bad_step: Path, tmp_path: Path) -> None:
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": ""})
    assert _is_verdict(lines[-1], data["verdict"]["line"]) and "…" not in lines[-1]


def test_piped_output_is_as_wide_as_its_content(bad_step: Path, tmp_path: Path) -> None:
    """No $COLUMNS, no terminal: nothing is wrapped or padded; findings stacked, each field whole."""
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": ""})
    assert all(line == line.rstrip() for line in lines), [line for line in lines if line != line.rstrip()]
    finding = data["steps"][0]["findings"][0]
    stripped = [line.strip() for line in lines]
    assert f"{finding['class']} / {finding['check']}" in stripped
    assert any(line.split(None, 1) == ["evidence", finding["evidence"]] for line in stripped)  # whole, on one line
    assert any(line.split(None, 1) == ["cause", finding["cause"]] for line in stripped)
    assert not any("┃" in line or "│" in line for line in lines)


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_on_a_terminal_the_verdict_wraps_at_word_boundaries(bad_step: Path, tmp_path: Path, columns: int) -> None:
    """TTY_COMPATIBLE=1: rich's word for 'this is a terminal' (what a pty gives a real user)."""
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": str(columns), "TTY_COMPATIBLE": "1"}, "--no-color")
    verdict = data["verdict"]["line"]
    words = len(re.findall(r"\S+", verdict + "; took 0.1 s"))
    tail: list[str] = []
    for line in reversed(lines):  # the verdict's lines: from the end, until they hold all its words
        tail.insert(0, line)
        if len(" ".join(tail).split()) >= words:
            break
    assert all(len(line) <= columns for line in tail), tail
    assert _is_verdict(" ".join(line.strip() for line in tail), verdict), tail  # only spaces were broken
    if len(verdict) > columns:
        assert len(tail) > 1


def test_quiet_prints_the_verdict_only(bad_step: Path, tmp_path: Path) -> None:
    lines, data = _check(bad_step, tmp_path, {"COLUMNS": ""}, "-q")
    assert len(lines) == 1 and _is_verdict(lines[0], data["verdict"]["line"])


def test_replay_verdict_names_every_skipped_backend_whole_at_80_columns() -> None:
    trace = str(Path(__file__).resolve().parents[2] / "traces" / "decode_gqa.pt")
    result = CliRunner().invoke(main, ["replay", trace, "--backend", "reference,fa3,mla"], env={"COLUMNS": "80"})
    last = result.output.splitlines()[-1]
    assert last.startswith("INCOMPLETE: ") and "…" not in last and re.search(TOOK + "$", last), result.output
    assert "fa3 unavailable: " in last and "mla unsupported: " in last and len(last) > 80


def test_sample_and_steps_verdicts_name_the_selection(tmp_path: Path) -> None:
    folder = tmp_path / "steps"
    folder.mkdir()
    for step in range(5):
        io.save(make_trace("decode-mha", "kv_lens=3,20", *SMALL), folder / f"s{step}.pt")
    out = lambda *args: CliRunner().invoke(main, ["check", str(folder), "--only", "invariants", *args]).output.splitlines()[-1]  # noqa: E731
    assert out("--sample", "2").startswith("checked 2 of 2 steps selected from 5 (steps 0, 4; --sample 2);")
    assert out("--steps", "1:5").startswith("checked 4 of 4 steps selected from 5 (steps 1-4; --steps 1:5);")
    assert out("--steps", "1:", "--sample", "3").startswith("checked 3 of 3 steps selected from 5 (steps 1, 3, 4; --steps 1: --sample 3);")
    assert out().startswith("checked 5 of 5 steps;")
    data = json.loads(CliRunner().invoke(main, ["check", str(folder), "--only", "invariants", "--sample", "2", "--json", "-"]).stdout)
    assert data["verdict"]["selection"] == {"recording_steps": 5, "steps": [0, 4], "options": "--sample 2"}
    assert json.loads(CliRunner().invoke(main, ["check", str(folder), "--only", "invariants", "--json", "-"]).stdout)["verdict"]["selection"] is None
