"""`--timeline FILE` around one command: collect in this process and in the check workers it
spawns, then match, summarise and write the Chrome trace (`chrome.py`).

    refusal = availability.refusal()      # before any work: exit 2 with this line
    timeline = start(path, command="replay")   # Unavailable: CUPTI would not start (exit 2 too)
    try:
        ...                               # the command's work; its phases are the ranges
    finally:
        timeline.finish()                 # also when the command fails: that timeline is the one most wanted
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from attndbg import profiling
from attndbg.timeline import chrome, summary, worker
from attndbg.timeline.availability import Unavailable
from attndbg.timeline.collector import Collector
from attndbg.timeline.matching import match


@dataclass
class Recording:
    path: str
    command: str
    collector: Collector
    directory: str  # where the check workers write their records
    previous: str | None  # the worker variable as it was before

    def finish(self) -> None:
        """Stop collecting, merge the workers' records, write the file, print the summary on stderr."""
        if self.previous is None:
            os.environ.pop(profiling.TIMELINE_VARIABLE, None)
        else:
            os.environ[profiling.TIMELINE_VARIABLE] = self.previous
        profiling.observe(None)
        own = self.collector.stop()
        workers = worker.read(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)
        processes = [match(records) for records in [own, *workers] if records is own or not records.empty() or records.notes]
        result = summary.summarize(processes)
        chrome.write(self.path, chrome.text(processes, result, command=self.command))
        for line in summary.render(result, self.path):
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def start(path: str, *, command: str) -> Recording:
    collector = Collector(f"attndbg {command}")
    try:
        collector.start()
    except Exception as e:  # noqa: BLE001 - cupti's errors (cuptiError, NotSupportedError) live in the optional package
        raise Unavailable(f"--timeline: CUPTI did not start here: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None
    # This process's observer first, then the variable: the parent must not start a worker's collection too.
    profiling.observe(collector)
    directory = tempfile.mkdtemp(prefix="attndbg-timeline-")
    previous = os.environ.get(profiling.TIMELINE_VARIABLE)
    os.environ[profiling.TIMELINE_VARIABLE] = directory  # spawned workers inherit it
    return Recording(path=path, command=command, collector=collector, directory=directory, previous=previous)
