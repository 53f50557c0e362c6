"""The flight recorder's ring: the last K steps of one process, their host copies and how to build
each into a trace, kept in memory until a trigger writes them.

A step enters the ring before the engine's call (its metadata copy is already queued on the device
ahead of the kernels that read it) and is closed when the call returns, with an event marking
where its device work ends. A step is *finished* once that event was seen complete. CUDA errors
surface late: the step that faulted is one the host has moved past, whose work never finished.
So the ring keeps K finished steps and, besides them, every step not seen finished (up to
MAX_IN_FLIGHT more): those are the steps in flight when a trigger fires, and the manifest marks
them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from attndbg.record import device_fault
from attndbg.record.host_copy import HostCopy
from attndbg.record.session import Build

# Steps not seen finished kept beyond the ring's depth: an engine queues a few steps ahead of the
# device at most (SGLang's overlap scheduler one, transformers' async batching one), a fault
# surfaces within a few steps; past this the oldest goes, finished or not.
MAX_IN_FLIGHT = 16


@dataclass(eq=False)
class RingEntry:
    step: int
    copy: HostCopy
    build: Build
    done: torch.cuda.Event | None = None  # recorded after the step's work was queued (None: host only)
    closed: bool = False  # the engine's call returned
    finished: bool = False  # its device work was seen complete


class Ring:
    """Thread-safe: the engine's thread adds and closes, the flight thread polls, a trigger takes."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"a ring holds at least one step, got {depth}")
        self.depth = depth
        self._entries: deque[RingEntry] = deque()
        self._lock = threading.Lock()

    def add(self, entry: RingEntry) -> None:
        with self._lock:
            self._entries.append(entry)
            self._evict()

    def close(self, entry: RingEntry, done: torch.cuda.Event | None, *, lost: bool = False) -> None:
        """The engine's call returned; `done` marks where its device work ends (None: host work
        only, finished now). `lost`: the device had faulted, no event could be recorded: in flight."""
        with self._lock:
            entry.done = done
            entry.closed = True
            if done is None and not lost:
                entry.finished = True
            self._evict()

    def poll(self) -> RuntimeError | None:
        """Mark the closed steps whose device work completed (a cheap event query each). A CUDA
        error raised by a query leaves that step and the later ones unfinished (in flight) and is
        returned, for the caller to fire on; after one, nothing is queried (device_fault.py)."""
        error = None
        with self._lock:
            for entry in self._entries:
                if device_fault.faulted():
                    break
                if entry.closed and not entry.finished and entry.done is not None:
                    try:
                        entry.finished = bool(entry.done.query())
                    except RuntimeError as e:
                        if device_fault.seen_in(e):
                            error = e
                        break
            self._evict()
        return error

    def take(self) -> list[tuple[RingEntry, bool]]:
        """Empty the ring: every entry, oldest first, with whether it was in flight."""
        self.poll()
        with self._lock:
            taken = [(entry, not entry.finished) for entry in self._entries]
            self._entries.clear()
        return taken

    def steps(self) -> list[int]:
        with self._lock:
            return [entry.step for entry in self._entries]

    def first_in_flight(self) -> int | None:
        """The oldest step not seen finished (the likeliest to have faulted), or None."""
        with self._lock:
            return next((entry.step for entry in self._entries if not entry.finished), None)

    def _evict(self) -> None:
        finished = sum(1 for entry in self._entries if entry.finished)
        while finished > self.depth:
            oldest = next(entry for entry in self._entries if entry.finished)
            self._entries.remove(oldest)
            finished -= 1
        while len(self._entries) > self.depth + MAX_IN_FLIGHT:
            gone = self._entries.popleft()
            finished -= gone.finished
