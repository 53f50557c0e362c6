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
    evicted: bool = False  # left the ring (evicted or taken): no longer counted or polled
    followed: bool = False  # the flight thread waits on its event and marks it finished (flight.py)


class Ring:
    """Thread-safe: the engine's thread adds and closes, the flight thread polls, a trigger takes.

    Every step costs the engine's thread an add, a close and a poll, none of which walks the ring:
    the finished steps are counted as they finish, and a poll asks only the closed steps still
    waiting on their device work (the ones the device has not caught up with), oldest first. The
    engine's poll leaves out the steps the flight thread follows (it marks them as their events
    complete and fires on an error it meets); a trigger's poll asks every step."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"a ring holds at least one step, got {depth}")
        self.depth = depth
        self._entries: deque[RingEntry] = deque()
        self._waiting: deque[RingEntry] = deque()  # closed with an event, not seen finished, in close order
        self._finished = 0  # entries of the ring marked finished
        self._lock = threading.Lock()

    def add(self, entry: RingEntry) -> None:
        entry.copy.hold()
        with self._lock:
            self._entries.append(entry)
            self._finished += entry.finished
            self._evict()

    def close(self, entry: RingEntry, done: torch.cuda.Event | None, *, lost: bool = False, followed: bool = False) -> None:
        """The engine's call returned; `done` marks where its device work ends (None: host work
        only, finished now). `lost`: the device had faulted, no event could be recorded: in flight.
        `followed`: the flight thread will wait on `done` (the engine's poll need not ask it)."""
        with self._lock:
            entry.done = done
            entry.closed = True
            entry.followed = followed
            if done is None and not lost:
                self._finish(entry)
            elif done is not None and not entry.finished:
                self._waiting.append(entry)
            self._evict()

    def mark_finished(self, entry: RingEntry) -> None:
        """Its device work was seen complete elsewhere (the flight thread waited on its event)."""
        with self._lock:
            self._finish(entry)
            self._evict()

    def poll(self, *, followed: bool = True) -> RuntimeError | None:
        """Mark the closed steps whose device work completed (a cheap event query each). A CUDA
        error raised by a query leaves that step and the later ones unfinished (in flight) and is
        returned, for the caller to fire on; after one, nothing is queried (device_fault.py).
        `followed=False`: the steps the flight thread follows are left to it."""
        if not self._waiting:  # nothing closed waits on the device (the ring is already evicted down)
            return None
        error = None
        with self._lock:
            still: deque[RingEntry] = deque()
            for i, entry in enumerate(self._waiting):
                if entry.finished or entry.evicted:
                    continue
                if entry.followed and not followed:
                    still.append(entry)
                    continue
                if device_fault.faulted():
                    still.extend(self._waiting[j] for j in range(i, len(self._waiting)))
                    break
                try:
                    done = bool(entry.done.query())  # type: ignore[union-attr] - a waiting entry holds an event
                except RuntimeError as e:
                    if device_fault.seen_in(e):
                        error = e
                    still.extend(self._waiting[j] for j in range(i, len(self._waiting)))
                    break
                if done:
                    self._finish(entry)
                else:
                    still.append(entry)
            self._waiting = still
            self._evict()
        return error

    def take(self) -> list[tuple[RingEntry, bool]]:
        """Empty the ring: every entry, oldest first, with whether it was in flight. Each entry's
        copy is still held for the taker (release it once written, or never)."""
        self.poll()
        with self._lock:
            taken = [(entry, not entry.finished) for entry in self._entries]
            for entry in self._entries:
                entry.evicted = True
            self._entries.clear()
            self._waiting.clear()
            self._finished = 0
        return taken

    def steps(self) -> list[int]:
        with self._lock:
            return [entry.step for entry in self._entries]

    def first_in_flight(self) -> int | None:
        """The oldest step not seen finished (the likeliest to have faulted), or None. Asks the
        events first (the steps the flight thread follows may not be marked yet)."""
        self.poll()
        with self._lock:
            return next((entry.step for entry in self._entries if not entry.finished), None)

    def _finish(self, entry: RingEntry) -> None:
        if not entry.finished:
            entry.finished = True
            self._finished += not entry.evicted

    def _evict(self) -> None:
        while self._finished > self.depth:
            if self._entries[0].finished:  # as in most steps: the front entry, finished long ago
                oldest = self._entries.popleft()
            else:
                oldest = next(entry for entry in self._entries if entry.finished)
                self._entries.remove(oldest)  # the oldest finished is near the front: cheap
            oldest.evicted = True
            self._finished -= 1
            oldest.copy.release()
        while len(self._entries) > self.depth + MAX_IN_FLIGHT:
            gone = self._entries.popleft()
            gone.evicted = True
            self._finished -= gone.finished
            gone.copy.release()  # in flight: its buffers go back only if its copies landed
