"""`--timeline FILE` around one command: collect in this process and in the check workers it
spawns, then match, summarise and write the Chrome trace (`chrome.py`).

    refusal = availability.refusal()      # before any work: exit 2 with this line
    with recording(path, command="replay"):
        ...                               # the command's work; its phases are the ranges
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

from attndbg import profiling
from attndbg.timeline import chrome, summary, worker
from attndbg.timeline.collector import Collector
from attndbg.timeline.matching import match


@contextlib.contextmanager
def recording(path: str, *, command: str) -> Iterator[None]:
    """Collect while the block runs; write `path` and print the summary on stderr after it, also
    when it ends by an exception (a failed check's timeline is the one most wanted)."""
    collector = Collector(f"attndbg {command}")
    collector.start()
    # This process's observer first, then the variable: the parent must not start a worker's collection too.
    profiling.observe(collector)
    directory = tempfile.mkdtemp(prefix="attndbg-timeline-")
    previous = os.environ.get(profiling.TIMELINE_VARIABLE)
    os.environ[profiling.TIMELINE_VARIABLE] = directory  # spawned workers inherit it
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(profiling.TIMELINE_VARIABLE, None)
        else:
            os.environ[profiling.TIMELINE_VARIABLE] = previous
        profiling.observe(None)
        own = collector.stop()
        workers = worker.read(directory)
        shutil.rmtree(directory, ignore_errors=True)
        processes = [match(records) for records in [own, *workers] if records is own or not records.empty() or records.notes]
        result = summary.summarize(processes)
        chrome.write(path, chrome.document(processes, result, command=command))
        for line in summary.render(result, path):
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
