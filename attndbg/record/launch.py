"""`attndbg record -- CMD`: run an engine command with the recording hooks armed.

The command runs as a child process with this package's `startup/` folder first on
PYTHONPATH (its sitecustomize arms the adapters in every Python process the engine starts) and
the options in ATTNDBG_RECORD. We wait for it, pass its exit status on (exit_status.py), and
summarise the recording from its manifest and from what its processes noted when they stopped
recording (record/problems.py). In ring mode the processes write nothing until a trigger fires;
what they leave at exit is kept here when the command failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from attndbg.record import problems, spool
from attndbg.record.options import ENV_VAR, RecordOptions
from attndbg.record.exit_status import command_exit
from attndbg.trace.io import MANIFEST, ManifestEntry, TriggerLine, read_manifest, read_triggers

STARTUP_DIR = Path(__file__).resolve().parent / "startup"


@dataclass(frozen=True)
class RecordResult:
    exit_code: int  # the command's returncode as subprocess gives it (negative N: killed by signal N)
    out_dir: Path
    entries: list[ManifestEntry]
    problems: tuple[str, ...] = ()  # why processes stopped recording (a hook's error), in order
    triggers: tuple[TriggerLine, ...] = ()  # ring mode: why the ring was written, in order

    @property
    def hook_failed_before_any_step(self) -> bool:
        """The command succeeded, nothing was recorded, and a hook's failure is why."""
        return self.exit_code == 0 and not self.entries and bool(self.problems)


def recording_env(options: RecordOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[ENV_VAR] = options.to_env()
    env["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def missing_layers(options: RecordOptions, entries: list[ManifestEntry]) -> list[int]:
    """Layers asked for with --layers that no recorded step carries tensors of (a model with fewer
    layers, say). Empty when nothing was recorded: then there is nothing to judge by."""
    if not entries:
        return []
    seen = {layer for e in entries for layer in e.layers}
    return [layer for layer in options.layers if layer not in seen]


def run_recorded(command: list[str], options: RecordOptions) -> RecordResult:
    """Run `command` recorded; in ring mode (options.ring), keep the rings its processes left when
    it exits non-zero or is killed (spool.py), and pass SIGUSR1 on to the processes holding one."""
    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attndbg-record-") as scratch:
        options = replace(options, problems_file=str(Path(scratch) / "problems.jsonl"))
        if options.ring:
            options = replace(options, spool_dir=str(Path(scratch) / "spool"))
        previous = _forward_usr1(options.spool_dir) if options.ring else None
        try:
            process = subprocess.Popen(command, env=recording_env(options))
            try:
                returncode = process.wait()
            except KeyboardInterrupt:
                process.send_signal(signal.SIGINT)
                returncode = process.wait()
        finally:
            if previous is not None:
                signal.signal(signal.SIGUSR1, previous)
        ended = command_exit(returncode)
        if options.ring and ended.status != 0:
            spool.promote(options.spool_dir, out_dir, code=ended.status, words=ended.text)
        noted = problems.read(options.problems_file)
    entries = read_manifest(out_dir) if (out_dir / MANIFEST).exists() else []
    triggers = tuple(read_triggers(out_dir)) if (out_dir / MANIFEST).exists() else ()
    return RecordResult(exit_code=returncode, out_dir=out_dir, entries=entries, problems=tuple(noted), triggers=triggers)


def _forward_usr1(spool_dir: str) -> Any:
    """While the command runs, SIGUSR1 to `record` goes to every process holding a ring; returns
    the handler it replaced (None off the main thread, where Python allows no handler)."""

    def forward(signum: int, frame: Any) -> None:
        for pid in spool.ring_pids(spool_dir):
            with contextlib.suppress(OSError):  # a process that already exited
                os.kill(pid, signal.SIGUSR1)

    try:
        return signal.signal(signal.SIGUSR1, forward)
    except ValueError:
        return None
