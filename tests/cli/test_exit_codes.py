"""Exit codes say what happened: 3 (not run here) wherever something asked for needs a CUDA GPU this
machine lacks; 2 with the reason for an empty --only and a --steps range that selects nothing (with
the step count to choose from)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from attndbg import machine
from attndbg.trace import io
from tests.cli.helpers import invoke, one_line_error, one_line_not_run, with_nogpu  # noqa: F401 - a fixture
from tests.factories import make_trace

TRACE = str(Path(__file__).resolve().parents[2] / "traces" / "decode_gqa.pt")


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: False)


@pytest.mark.parametrize("command", ["replay", "check"])
def test_cuda_graph_without_a_gpu_is_not_run_here(no_gpu: None, command: str) -> None:
    one_line_not_run(invoke(command, TRACE, "--cuda-graph", "--only" if command == "check" else "--backend", "invariants" if command == "check" else "reference"), "--cuda-graph needs a CUDA GPU")


@pytest.mark.parametrize("command", ["check", "compile", "minimize"])
def test_an_empty_only_is_bad_input(tmp_path: Path, command: str) -> None:
    extra = ["-o", str(tmp_path / "m.pt")] if command == "minimize" else []
    for empty in ("", " , "):
        one_line_error(invoke(command, TRACE, "--only", empty, *extra), "--only", "names no detector")


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rec = tmp_path_factory.mktemp("rec")
    trace = make_trace("decode-mha", "kv_lens=3,20", "heads=2:1", "head_dim=32")
    for step in range(10, 15):
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    return rec


@pytest.mark.parametrize("command", ["check", "compile"])
def test_steps_out_of_range_say_how_many_steps_there_are(recording: Path, command: str) -> None:
    one_line_error(invoke(command, str(recording), "--steps", "100:200"), "--steps", "it has 5 steps, numbered 10-14")


def test_minimize_with_a_backend_that_cannot_run_here_is_not_run(tmp_path: Path, with_nogpu: None) -> None:
    one_line_not_run(invoke("minimize", TRACE, "--backend", "nogpu", "-o", str(tmp_path / "m.pt")), "minimize --backend nogpu: nogpu cannot run here (no CUDA GPU")
    assert not (tmp_path / "m.pt").exists()
