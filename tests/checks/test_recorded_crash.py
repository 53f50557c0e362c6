"""A step whose call crashed where it ran (`source.crash`, as `attndbg import flashinfer` marks a
call that never returned) is run again by check and replay in a worker of its own: the crash is a
`backend-crash` finding, reproduced (a defect) or not (a hazard), and a crash that kills the worker
never ends the check. The library is a CPU stand-in (tests/checks/crashing_call_backend.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from tests.factories import make_trace

LOGGED = "CUDA error: an illegal memory access was encountered"


@pytest.fixture
def crashed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A decode step whose recorded plan the stand-in library built, marked crashed."""
    monkeypatch.setenv("ATTNDBG_BACKENDS", "crashing_call=tests.checks.crashing_call_backend:CrashingCallBackend")
    trace = make_trace("decode-mha", "kv_lens=3,9", "heads=2:1", "head_dim=32", plan=True)
    trace = replace(trace, plan=replace(trace.plan, backend="crashing_call"), source=replace(trace.source, crash=LOGGED))
    return io.save(trace, tmp_path / "crashed.pt")


def _check(path: Path, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "check.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants", "--json", str(report)])
    return result.exit_code, json.loads(report.read_text())


@pytest.mark.parametrize("how", ["cuda", "segfault"])
def test_a_crash_that_comes_back_is_a_reproduced_defect(crashed_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv("ATTNDBG_TEST_CRASH", how)
    code, report = _check(crashed_step, tmp_path)
    assert code == 1, report
    (crash,) = [f for f in report["steps"][0]["findings"] if f["class"] == "backend-crash"]
    assert crash["check"] == "recorded-crash" and crash["severity"] == "defect"
    assert crash["data"]["reproduced"] is True and crash["data"]["recorded_error"] == LOGGED
    assert ("illegal memory access" if how == "cuda" else "SIGSEGV") in crash["data"]["error"]


def test_a_crash_that_does_not_come_back_is_a_hazard(crashed_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_TEST_CRASH", "none")
    code, report = _check(crashed_step, tmp_path)
    assert code == 0, report  # a hazard fails only --strict
    (crash,) = report["steps"][0]["findings"]
    assert (crash["check"], crash["severity"], crash["data"]["reproduced"]) == ("recorded-crash-not-reproduced", "hazard", False)


def test_replay_runs_the_crashed_call_in_a_worker_of_its_own(crashed_step: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_TEST_CRASH", "segfault")  # in this process it would end the replay
    result = CliRunner().invoke(main, ["replay", str(crashed_step), "--backend", "crashing_call,reference"])
    assert result.exit_code == 1, result.output
    assert "run again in a fresh worker: reproduced: crashing_call crashed again (the worker was killed by SIGSEGV)" in " ".join(result.output.split())
    assert "recorded crash reproduced on 1 step" in result.output


def test_a_crashed_call_that_cannot_run_here_is_said_and_incomplete(crashed_step: Path, tmp_path: Path) -> None:
    trace = io.load(crashed_step)
    io.save(replace(trace, plan=replace(trace.plan, backend="flashinfer")), crashed_step)  # no GPU here
    code, report = _check(crashed_step, tmp_path)
    assert code == 3, report
    assert not [f for f in report["steps"][0]["findings"] if f["class"] == "backend-crash"]
    assert list(report["verdict"]["crashes_not_run"]) == ["no CUDA GPU: FlashInfer's kernels run only on NVIDIA GPUs"]
