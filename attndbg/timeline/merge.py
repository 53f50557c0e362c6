"""The end of a timeline spread over processes: each spawned process's file (worker.py) read,
matched and written as trace events, one helper process per file, all at once; this process adds
up their summaries and joins their texts.

Why: done one after another in the command's own process, after its work, this is what a
`--timeline` check waits for last. On the H200, `check --timeline` of 200 server-shaped steps
(104,679 kernels in 4 workers' files) spent 4.4 s of its 31 s there, serially: reading the files
1.6 s, matching 1.1 s, the trace events 1.2 s (cProfile of the command).

Two rounds, so that the file is the very text one process writes (`chrome.event_parts`): each
helper reads and matches its file and answers, per process, its kernels' names, its earliest time,
how many launch arrows it draws and its summary; then, told the origin of all, where its arrows'
ids start, its processes' numbers and what the file calls each kernel, it answers its events' text
and its kernel table. Small runs (one file, or little to read) stay in this process: starting
the helpers costs more than it saves there.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from attndbg.timeline import chrome, summary, worker
from attndbg.timeline.matching import Matched, match
from attndbg.timeline.records import ProcessRecords

# Below this much to read, one process does it all: a helper's start (~0.3 s: Python, numpy, these
# modules) is what reading, matching and writing 2-3 MiB of a worker's lines takes on a slow core
# (bench/timeline_merge.py: 16.5 MiB, 104,832 kernels, 2.6-3.2 s in one process).
HELPERS_FROM_BYTES = 4 << 20
HELPER_TIMEOUT_S = 600.0


def _matched(file: str | Path) -> list[Matched]:
    """A file's processes, matched; one with nothing in it but notes is kept for its notes."""
    return [match(records) for records in worker.read_file(file) if not records.empty() or records.notes]


def _serve(connection: Connection, file: str) -> None:
    """A helper: round 1 and round 2 of the module docstring for one file."""
    processes = _matched(file)
    connection.send([(chrome.kernels_of(m), chrome.earliest(m), chrome.arrows(m), summary.summarize([m])) for m in processes])
    origin, first_flows, numbers, naming = connection.recv()
    connection.send([chrome.process_part(m, origin, flow, number, naming) for m, flow, number in zip(processes, first_flows, numbers)])
    connection.close()


def render(own: ProcessRecords | None, files: Sequence[Path]) -> tuple[str, chrome.Tables, summary.Summary, str | None]:
    """The trace events' text, the kernel tables and the summary of `own` (this process's records,
    first in the file) and of the processes whose files these are (in pid order, as `worker.files`
    lists them), and a note when the helpers failed and it was all done here instead (the same
    file, later)."""
    local = [match(own)] if own is not None else []
    if len(files) < 2 or _cores() < 4 or sum(f.stat().st_size for f in files) < HELPERS_FROM_BYTES:
        return (*_here(local, files), None)
    try:
        return (*_in_helpers(local, files), None)
    except (OSError, EOFError, ValueError, multiprocessing.ProcessError) as e:
        note = f"the timeline's files were merged in this process: a helper process failed ({type(e).__name__}: {e})"
        return (*_here(local, files), note)


def _cores() -> int:
    """The cores this process may run on: helpers on fewer than 4 only take turns (2 cores: no faster)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _here(local: list[Matched], files: Sequence[Path]) -> tuple[str, chrome.Tables, summary.Summary]:
    processes = local + [m for file in files for m in _matched(file)]
    return (*chrome.event_parts(processes), summary.summarize(processes))


def _in_helpers(local: list[Matched], files: Sequence[Path]) -> tuple[str, chrome.Tables, summary.Summary]:
    context = multiprocessing.get_context("spawn")  # never fork a process holding CUDA and CUPTI's threads
    helpers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for file in files:
            ours, theirs = context.Pipe()
            helper = context.Process(target=_serve, args=(theirs, str(file)), daemon=True, name=f"attndbg timeline merge {file.name}")
            helper.start()
            theirs.close()
            helpers.append((helper, ours))
        firsts = [_receive(connection, helper) for helper, connection in helpers]
        # This process's records first, then each file's processes: the order `_here` writes them in.
        stamps = [chrome.earliest(m) for m in local] + [stamp for first in firsts for _, stamp, _, _ in first]
        origin = min((s for s in stamps if s is not None), default=0)
        naming = chrome.kernel_naming([name for m in local for name in chrome.kernels_of(m)] + [name for first in firsts for names, _, _, _ in first for name in names])
        parts = [chrome.process_part(m, origin, 0, number, naming) for number, m in enumerate(local, start=1)]
        flow = sum(chrome.arrows(m) for m in local)
        number = len(local)
        for (_, connection), first in zip(helpers, firsts):
            starts, numbers = [], []
            for _, _, arrows, _ in first:
                starts.append(flow)
                flow += arrows
                number += 1
                numbers.append(number)
            connection.send((origin, starts, numbers, {raw: naming[raw] for names, _, _, _ in first for raw in names}))
        for (helper, connection), first in zip(helpers, firsts):
            parts.extend(_receive(connection, helper))
        summaries = [summary.summarize(local)] + [part for first in firsts for _, _, _, part in first]
        return ",".join(text for text, _ in parts), chrome.merge_tables(table for _, table in parts), summary.merge(summaries)
    finally:
        for helper, connection in helpers:
            connection.close()
            helper.join(timeout=5)
            if helper.is_alive():
                helper.kill()


def _receive(connection: Connection, helper: multiprocessing.process.BaseProcess) -> list:
    if not connection.poll(HELPER_TIMEOUT_S):
        raise multiprocessing.ProcessError(f"{helper.name} answered nothing in {HELPER_TIMEOUT_S:.0f} s")
    return connection.recv()  # EOFError: the helper died first
