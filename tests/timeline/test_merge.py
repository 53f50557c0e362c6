"""The end of a timeline over several processes: helper processes read, match and write each
file's processes, and the file is the very text one process writes (chrome.event_parts)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from attndbg.timeline import chrome, merge, summary, worker
from attndbg.timeline.matching import match
from attndbg.timeline.records import to_json
from tests.timeline.factory import engine_steps, replay_step


def _files(directory: Path) -> list[Path]:
    """Three processes' files, each written in two batches as a worker writes them (one second apart)."""
    for pid, records in ((9001, replay_step(pid=9001, step=1)), (870, replay_step(pid=870, step=2)), (12000, engine_steps(pid=12000))):
        half = len(records.kernels) // 2
        first, rest = to_json(records), to_json(records)
        first["kernels"], rest["kernels"] = first["kernels"][:half], rest["kernels"][half:]
        for name in ("ranges", "api_calls", "external_ids", "markers"):
            rest[name] = []
        (directory / f"worker-{pid}.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(rest) + "\n")
    return worker.files(directory)


def test_files_are_listed_in_pid_order(tmp_path: Path) -> None:
    assert [f.name for f in _files(tmp_path)] == ["worker-870.jsonl", "worker-9001.jsonl", "worker-12000.jsonl"]


def test_helpers_write_what_one_process_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path)
    own = replay_step(pid=5, step=0)
    serial_events, serial_tables, serial_summary, note = merge.render(own, files)  # small: in this process
    assert note is None
    processes = [match(own)] + [match(r) for r in worker.read(tmp_path)]
    assert (serial_events, serial_tables) == chrome.event_parts(processes)
    monkeypatch.setattr(merge, "HELPERS_FROM_BYTES", 0)
    monkeypatch.setattr(merge, "_cores", lambda: 16)
    events, tables, result, note = merge.render(own, files)
    assert note is None
    assert events == serial_events and tables == serial_tables  # same origin, same arrow ids, same order
    assert result.as_json() == serial_summary.as_json() == summary.summarize(processes).as_json()
    doc = json.loads(chrome.assemble(events, tables, result, command="check"))
    flows = [e["id"] for e in doc["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == len(set(flows)) == sum(chrome.arrows(m) for m in processes) > 0


def test_merged_summaries_are_the_summary_of_all() -> None:
    processes = [match(replay_step(pid=1, step=0)), match(replay_step(pid=2, step=3)), match(engine_steps(pid=3))]
    parts = [summary.summarize([m]) for m in processes]
    assert summary.merge(parts).as_json() == summary.summarize(processes).as_json()
    assert summary.merge([]).as_json() == summary.summarize([]).as_json()


def test_a_failing_helper_is_said_and_the_file_is_written_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path)
    monkeypatch.setattr(merge, "HELPERS_FROM_BYTES", 0)
    monkeypatch.setattr(merge, "_cores", lambda: 16)

    def broken(local, files):  # noqa: ANN001, ANN202 - merge._in_helpers' signature
        raise EOFError("helper exited")

    monkeypatch.setattr(merge, "_in_helpers", broken)
    events, tables, result, note = merge.render(None, files)
    assert (events, tables) == chrome.event_parts([match(r) for r in worker.read(tmp_path)])
    assert note == "the timeline's files were merged in this process: a helper process failed (EOFError: helper exited)"


def test_a_helper_that_dies_or_hangs_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    helper = context.Process(name="helper")
    theirs.close()
    with pytest.raises(EOFError):
        merge._receive(ours, helper)  # the other end closed: died before answering
    ours, theirs = context.Pipe()
    monkeypatch.setattr(merge, "HELPER_TIMEOUT_S", 0.01)
    with pytest.raises(multiprocessing.ProcessError, match="helper answered nothing"):
        merge._receive(ours, helper)
