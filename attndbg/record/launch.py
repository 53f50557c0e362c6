"""`attndbg record -- CMD`: run an engine command with the recording hooks armed.

The command runs as a child process with this package's `startup/` folder first on
PYTHONPATH (its sitecustomize arms the adapters in every Python process the engine starts) and
the options in ATTNDBG_RECORD. We wait for it, pass its exit code on, and summarise the
recording from its manifest.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from attndbg.record.options import ENV_VAR, RecordOptions
from attndbg.trace.io import MANIFEST, ManifestEntry, read_manifest

STARTUP_DIR = Path(__file__).resolve().parent / "startup"


@dataclass(frozen=True)
class RecordResult:
    exit_code: int
    out_dir: Path
    entries: list[ManifestEntry]


def recording_env(options: RecordOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[ENV_VAR] = options.to_env()
    env["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_recorded(command: list[str], options: RecordOptions) -> RecordResult:
    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, env=recording_env(options))
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        code = process.wait()
    entries = read_manifest(out_dir) if (out_dir / MANIFEST).exists() else []
    return RecordResult(exit_code=code, out_dir=out_dir, entries=entries)
