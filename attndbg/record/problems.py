"""Why recording stopped, told by the engine's processes to `attndbg record`.

A hook that fails stops recording in its own process and the engine goes on (session.py); the
parent only sees the manifest. Each process that stops for a failure (a hook's exception, a step
the OS refused to write, a hook that could not be installed) appends one JSON line to the file
RecordOptions.problems_file names, so that `record` can name the hook and the error and refuse to
exit 0 when the engine ran and nothing was recorded. A size cap reached is not a problem.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from attndbg.record.options import RecordOptions


def note(options: RecordOptions, reason: str) -> None:
    """Append this process's reason; never raises (the engine's own thread may be calling)."""
    if not options.problems_file:
        return
    line = json.dumps({"pid": os.getpid(), "reason": reason}) + "\n"
    with contextlib.suppress(OSError), open(options.problems_file, "a", encoding="utf-8") as out:
        out.write(line)  # one short append per process: lines from several processes do not mix


def read(path: str | os.PathLike) -> list[str]:
    """The reasons in the order they were noted; a torn or foreign line is kept as text."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    reasons = []
    for line in filter(None, (raw.strip() for raw in lines)):
        try:
            reasons.append(str(json.loads(line)["reason"]))
        except (ValueError, KeyError, TypeError):
            reasons.append(line)
    return reasons
