"""`--timeline` around a command: this process's records and each worker's file become one trace
with a pid per process; phases reach the collector; the worker variable is set only meanwhile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attndbg import machine, profiling
from attndbg.timeline import availability, session, worker
from attndbg.timeline.records import ProcessRecords, to_json
from tests.timeline.factory import replay_step


class _Collector:
    """Stands in for the CUPTI collector (records come from the factory, not from cupti)."""

    def __init__(self, label: str):
        self.label = label
        self.pushed: list[str] = []

    def start(self) -> None:
        if self.label == "attndbg broken":
            raise OSError("libcupti.so.13: cannot open shared object file")

    def push(self, message: str) -> None:
        self.pushed.append(message)

    def pop(self) -> None:
        pass

    def stop(self) -> ProcessRecords:
        records = replay_step(pid=os.getpid())
        records.label = self.label
        return records


def test_recording_merges_this_process_and_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    made: list[_Collector] = []
    monkeypatch.setattr(session, "Collector", lambda label: made.append(_Collector(label)) or made[-1])
    monkeypatch.delenv(profiling.TIMELINE_VARIABLE, raising=False)
    out = tmp_path / "timeline.json"
    recording = session.start(str(out), command="check")
    directory = Path(os.environ[profiling.TIMELINE_VARIABLE])
    (directory / "worker-77.jsonl").write_text(json.dumps(to_json(replay_step(pid=77, step=3))) + "\n")
    with profiling.phase("data", "step=9"):
        pass
    recording.finish()
    assert profiling.TIMELINE_VARIABLE not in os.environ and not directory.exists()
    assert made[0].pushed == ["attndbg/data step=9"] and made[0].label == "attndbg check"
    doc = json.loads(out.read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {1: f"attndbg check (pid {os.getpid()})", 2: "attndbg replay (pid 77)"}  # numbered in file order
    assert doc["otherData"]["attndbg"]["kernels"] == 14 and doc["otherData"]["command"] == "check"
    err = capsys.readouterr().err
    assert err.startswith(f"timeline: {out} (open in https://ui.perfetto.dev or chrome://tracing): 14 kernels")


def test_a_worker_starts_collecting_at_its_first_phase(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A spawned worker never runs the CLI: its first phase reads the variables the parent set (the
    directory, and what the timeline calls the process: an engine's, under record)."""
    attached: list[tuple[str, str | None]] = []
    monkeypatch.setattr(worker, "attach", lambda directory, label=None: attached.append((directory, label)))
    monkeypatch.setattr(profiling, "_environment_read", False)
    monkeypatch.setattr(profiling, "_observer", None)
    monkeypatch.setenv(profiling.TIMELINE_VARIABLE, str(tmp_path))
    monkeypatch.setenv(profiling.TIMELINE_LABEL_VARIABLE, "engine process")
    with profiling.phase("data"), profiling.phase("reference"):
        pass
    assert attached == [(str(tmp_path), "engine process")]


def test_refused_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)  # without a GPU, that is said first
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    line = availability.refusal()
    assert line is not None and "\n" not in line
    assert "cupti-python" in line and "pip install 'attndbg[timeline]'" in line


def test_cupti_that_does_not_start_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session, "Collector", _Collector)
    with pytest.raises(availability.Unavailable, match=r"^--timeline: CUPTI did not start here: OSError: libcupti.so.13: cannot open"):
        session.start("t.json", command="broken")
    assert profiling.TIMELINE_VARIABLE not in os.environ
