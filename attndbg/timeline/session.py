"""`--timeline FILE` around one command: collect in this process and in the processes it spawns
(check workers; under `record`, the engine's processes, and not this one: it launches no kernel),
then match, summarise and write the Chrome trace (`chrome.py`).

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
from attndbg.timeline import chrome, merge, summary, worker
from attndbg.timeline.availability import Unavailable
from attndbg.timeline.collector import Collector


@dataclass
class Recording:
    path: str
    command: str
    collector: Collector | None  # None: nothing is collected in this process (record)
    directory: str  # where the spawned processes write their records
    previous: dict[str, str | None]  # the variables the spawned processes read, as they were before

    def finish(self) -> None:
        """Stop collecting, merge the workers' records, write the file, print the summary on stderr."""
        for name, value in self.previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        own = None
        if self.collector is not None:
            profiling.observe(None)
            own = self.collector.stop()
        files = worker.files(self.directory)
        events, tables, result, note = merge.render(own, files)
        shutil.rmtree(self.directory, ignore_errors=True)
        if note is not None:
            result.notes.append(note)
        if self.collector is None and not files:
            result.notes.append(
                "no process the command started opened an attndbg range: nothing was collected (did the engine record a step, on a GPU? "
                "Only the transformers adapter pushes a range per step so far: SGLang and vLLM steps are recorded without one)"
            )
        chrome.write(self.path, chrome.assemble(events, tables, result, command=self.command))
        for line in summary.render(result, self.path):
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def start(path: str, *, command: str, spawned_label: str | None = None, collect_here: bool = True) -> Recording:
    """Collect in this process (unless `collect_here` is False) and in each process it spawns that
    opens an attndbg range, those named `spawned_label` in the timeline (default: check workers)."""
    collector = None
    if collect_here:
        collector = Collector(f"attndbg {command}")
        try:
            collector.start()
        except Exception as e:  # noqa: BLE001 - cupti's errors (cuptiError, NotSupportedError) live in the optional package
            raise Unavailable(f"--timeline: CUPTI did not start here: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None
        # This process's observer first, then the variable: the parent must not start a worker's collection too.
        profiling.observe(collector)
    directory = tempfile.mkdtemp(prefix="attndbg-timeline-")
    variables = {profiling.TIMELINE_VARIABLE: directory, profiling.TIMELINE_LABEL_VARIABLE: spawned_label or worker.LABEL}
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)  # spawned processes inherit them
    return Recording(path=path, command=command, collector=collector, directory=directory, previous=previous)
