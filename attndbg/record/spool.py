"""The ring a process leaves at exit, and how `attndbg record` keeps it when the command failed.

A non-zero exit is only known once the process is gone, and often only to its parent (the engine
runs under `sh -c '... && exit 3'`, or a launcher). So every ring process, as it exits, writes
the steps its ring still holds to `<spool>/<pid>/` (a recording of its own: step files and a
manifest), and `record` decides: when the command exited non-zero or was killed, each spooled
ring is moved into the recording directory with an `exit` trigger line naming the process, its
last step and the exit; when it exited 0, the spool is dropped with the scratch directory.

`<spool>/pids/<pid>` lists the processes that hold a ring, so that `record` can pass SIGUSR1 on to
them (a signal to the command alone would reach a shell, which SIGUSR1 kills).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from attndbg.record.options import RecordOptions
from attndbg.record.triggers import TriggerKind
from attndbg.trace.io import MANIFEST, TriggerLine, append_manifest_line, append_to_recording, read_manifest, read_triggers, trigger_line

PIDS = "pids"
LEFT = "left"  # `<spool>/left/<pid>`: the process ran its exit code (its ring, if any, is spooled)


def register(options: RecordOptions, pid: int) -> None:
    """Note that `pid` holds a ring (for SIGUSR1); nothing without a spool directory."""
    if not options.spool_dir:
        return
    with contextlib.suppress(OSError):
        folder = Path(options.spool_dir) / PIDS
        folder.mkdir(parents=True, exist_ok=True)
        (folder / str(pid)).touch()


def ring_pids(spool_dir: str | os.PathLike) -> list[int]:
    folder = Path(spool_dir) / PIDS
    try:
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    except OSError:
        return []


def leave(session: Any, taken: list[tuple[Any, bool]]) -> None:
    """Write the ring's remaining steps (RingEntry, in flight) to `<spool>/<pid>/` (this process's
    exit; in-process writes: the writer thread is stopping)."""
    spool_dir = session.options.spool_dir
    if not spool_dir:
        return
    try:
        _leave_steps(session, Path(spool_dir) / str(os.getpid()), taken)
    finally:
        with contextlib.suppress(OSError):
            (Path(spool_dir) / LEFT).mkdir(parents=True, exist_ok=True)
            (Path(spool_dir) / LEFT / str(os.getpid())).touch()


def _leave_steps(session: Any, folder: Path, taken: list[tuple[Any, bool]]) -> None:
    from attndbg.record.session import CopyLost, step_file_name

    for entry, in_flight in taken:
        try:
            trace = entry.build(entry.copy.wait())
            if trace is not None:
                folder.mkdir(parents=True, exist_ok=True)
                append_to_recording(folder, trace, step_file_name(session.options, trace), in_flight=in_flight)
        except CopyLost as e:
            session.log(f"step {entry.step} left out of the ring: {e}")
        except Exception as e:  # noqa: BLE001 - the process is exiting: one line, the other steps go on
            session.log(f"step {entry.step} left out of the ring ({type(e).__name__}: {e})")


def promote(spool_dir: str | os.PathLike, out_dir: str | os.PathLike, *, code: int, words: str) -> list[TriggerLine]:
    """Move every spooled ring into `out_dir` and write an `exit` trigger line for each process that
    held a ring (after its steps); returns the trigger lines written. A file name already taken gets
    the process id as prefix.

    A process that spooled nothing still gets its line, naming the last step its own triggers named
    (what it wrote when they fired stays in `out_dir` as it was): its ring was empty, or it never
    ran its exit code (killed by SIGABRT, SIGKILL or SIGSEGV; a CUDA error's abort among them),
    which the message says."""
    spool_dir, out_dir = Path(spool_dir), Path(out_dir)
    written = []
    spooled = {int(p.name): p for p in spool_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / MANIFEST).exists()} if spool_dir.is_dir() else {}
    left = {int(p.name) for p in (spool_dir / LEFT).iterdir() if p.name.isdigit()} if (spool_dir / LEFT).is_dir() else set()
    for pid in sorted(set(spooled) | set(ring_pids(spool_dir))):
        message = f"the command {words}"
        if pid in spooled:
            entries = read_manifest(spooled[pid])
            for entry in entries:
                name = entry.file if not (out_dir / entry.file).exists() else f"p{pid}_{entry.file}"
                shutil.move(str(spooled[pid] / entry.file), out_dir / name)
                append_manifest_line(out_dir, replace(entry, file=name).line())
            last = entries[-1].step if entries else None
        else:
            fired = [t for t in read_triggers(out_dir) if t.pid == pid] if (out_dir / MANIFEST).exists() else []
            last = next((t.step for t in reversed(fired) if t.step is not None), None)
            if pid not in left:
                message += f"; process {pid} ended without running its exit code: its ring is what its triggers wrote"
        line = TriggerLine(kind=TriggerKind.EXIT.value, step=last, message=message, code=code, pid=pid)
        append_manifest_line(out_dir, trigger_line(line))
        written.append(line)
    return written
