"""The side of `--timeline` in a process the command spawned (a check worker; an engine's process
under `record`): CUPTI is per process, so each collects its own records and appends them, as JSON
lines, to `<dir>/worker-<pid>.jsonl`; the parent merges the files (`files`, `read_file`: merge.py)
into one timeline with a pid per process. Collection starts at the process's first attndbg range (`profiling.phase`): an
engine's process that never records a step starts no CUPTI.

A worker writes when no phase is open and a second has passed since its last write (between
detectors, between steps), and once more at exit: a worker killed by a crash loses at most the
records of its last second.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

from attndbg import profiling
from attndbg.timeline.collector import Collector
from attndbg.timeline.records import ProcessRecords, from_json, to_json

WRITE_EVERY_S = 1.0
LABEL = "attndbg check worker"  # unless the parent names its processes otherwise (profiling.TIMELINE_LABEL_VARIABLE)


class _Writer:
    """The worker's phase observer: the collector's, plus a write between phases."""

    def __init__(self, collector: Collector, path: Path):
        self.collector = collector
        self.path = path
        self.last = time.monotonic()

    def push(self, message: str) -> None:
        self.collector.push(message)

    def pop(self) -> None:
        self.collector.pop()
        if self.collector.depth == 0 and time.monotonic() - self.last >= WRITE_EVERY_S:
            self.write(self.collector.take())

    def write(self, batch: ProcessRecords) -> None:
        self.last = time.monotonic()
        if batch.empty() and not batch.notes:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(to_json(batch), separators=(",", ":")) + "\n")

    def close(self) -> None:
        profiling.observe(None)
        self.write(self.collector.stop())


def attach(directory: str, label: str | None = None) -> None:
    """Start collecting in this process (called by its first phase, before any NVTX call)."""
    label = label or LABEL
    path = Path(directory) / f"worker-{os.getpid()}.jsonl"
    collector = Collector(label)
    try:
        collector.start()
    except Exception as e:  # noqa: BLE001 - cupti's own error types live in the optional package; a timeline must never stop a check
        failed = ProcessRecords(pid=os.getpid(), label=label, notes=[f"{label} {os.getpid()}: CUPTI did not start: {type(e).__name__}: {e}"])
        _Writer(collector, path).write(failed)
        return
    writer = _Writer(collector, path)
    profiling.observe(writer)
    atexit.register(writer.close)


def files(directory: str | Path) -> list[Path]:
    """The processes' files, in the order of their pids (a file per process)."""
    def pid(file: Path) -> tuple[int, str]:
        digits = file.stem.removeprefix("worker-")
        return (int(digits) if digits.isdigit() else -1, file.name)

    return sorted(Path(directory).glob("worker-*.jsonl"), key=pid)


def read_file(file: str | Path) -> list[ProcessRecords]:
    """One file's records, one per pid (one pid, as each process writes its own). A line cut short
    (a process killed while writing) is skipped."""
    by_pid: dict[int, ProcessRecords] = {}
    for line in Path(file).read_text().splitlines():
        if not line.strip():
            continue
        try:
            batch = from_json(json.loads(line))
        except (ValueError, KeyError, TypeError):
            continue
        by_pid.setdefault(batch.pid, ProcessRecords(pid=batch.pid, label=batch.label)).extend(batch)
    return [by_pid[pid] for pid in sorted(by_pid)]


def read(directory: str | Path) -> list[ProcessRecords]:
    """Every process's records, one per pid, in pid order (a file per process, `files` in pid order)."""
    return [records for file in files(directory) for records in read_file(file)]
