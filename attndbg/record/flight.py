"""The flight recorder of one engine process (`attndbg record --ring K`): steps go to a ring in
host memory (ring.py); a trigger (triggers.py) writes the ring to the recording directory as a
normal recording, the steps in flight marked, then one `trigger` manifest line.

Where triggers come from:
- the adapters: an exception through the engine's step (`RecordingSession.fail_step`), an engine's
  own error handler, a moved metadata buffer (pointer_audit.py), an acceptance rate;
- the flight thread (`attndbg-flight`): with `--when nan` it follows each closed step until its
  device work is done (a blocking-sync event: the thread sleeps, no device sync on the engine's
  thread) and judges what landed (in-graph probe readings included, host_copy.py); a CUDA error
  seen there fires at once. Without it, the engine's thread polls the events of the steps in the
  ring when it opens the next (a query each), which is all in-flight marking needs; it leaves the
  steps this thread follows to it, and a trigger asks every event before it names the oldest step
  in flight or takes the ring. A step that carries in-graph probe readings is followed too, its
  readings read from the graph's staging on this thread once its replay is done: else they would
  be read on the engine's thread, just before the same graph replays again (probes.py);
- signals (signals.py): SIGUSR1 asks for the ring; a process ended by SIGTERM or SIGHUP (their
  default action) first leaves its ring for `record`;
- exceptions the engine does not hand to our hooks: an uncaught one (sys.excepthook,
  threading.excepthook), or one an engine catches and logs at ERROR with its traceback or a CUDA
  error's words (SGLang's scheduler logs "Scheduler hit an exception: ..." and has its parent kill
  the process tree, so no exit hook of its own would run): `install_exception_hooks`;
- the exit: at interpreter exit a CUDA error still pending fires; the steps not written are left in
  the spool (spool.py) for `record`, which keeps them when the command fails.

Each kind fires once per process (a NaN that stays would otherwise write every step), but SIGUSR1
writes each time it is sent. A signal handler only enqueues (queue.SimpleQueue is reentrant); the
flight thread does the work.

A CUDA error is written differently: the process may abort at any moment after one (a C++
destructor meeting the sticky error, device_fault.py), so the thread that sees it writes the ring
itself, at once, before returning: the steps whose host copies landed, then the trigger line,
each file and line on disk before the next is started. From then on the recorder touches host
memory only: no event, no copy, no device sync.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attndbg.record import device_fault, spool
from attndbg.record.ring import Ring, RingEntry
from attndbg.record.host_copy import HostCopy, PinnedPool
from attndbg.record.session import Build, RecordingSession
from attndbg.record.triggers import CUDA_ERROR_WORDS, LOGITS_FINITE, Trigger, TriggerKind, from_exception, is_cuda_error, nonfinite, parse_when
from attndbg.trace.io import trigger_line

EXIT_WAIT_SECONDS = 30.0
TERMINATE_WAIT_SECONDS = 20.0  # how long a SIGTERM'd process may spend leaving its ring  # at exit, how long pending steps may take to finish before they count as in flight


@dataclass(frozen=True)
class _Watch:
    entry: RingEntry


@dataclass(frozen=True)
class _Fire:
    trigger: Trigger


@dataclass(frozen=True)
class _Check:
    """Evaluate a host-side condition on the flight thread (an acceptance rate once its copy landed)."""

    copy: HostCopy
    judge: Callable[[dict[str, Any]], Trigger | None]


class FlightRecorder:
    def __init__(self, session: RecordingSession):
        self.session = session
        self.ring = Ring(session.options.ring)
        # The ring's pinned buffers, reused as entries leave it (host_copy.py: `session.snapshot`
        # takes from it in ring mode).
        self.pool = PinnedPool()
        self.when = parse_when(session.options.when)
        # Names of recorded tensors `--when nan` judges (the adapters' keys); a flag tensor of bools
        # (LOGITS_FINITE) is a finiteness check the device made.
        self.watched: tuple[str, ...] = tuple(f"layer{layer}.output" for layer in session.options.layers) + (LOGITS_FINITE,)
        self.fired: list[Trigger] = []
        self.skipped: dict[TriggerKind, int] = {}  # a kind that fired already, firing again
        self._fired_kinds: set[TriggerKind] = set()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Watch | _Fire | _Check | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending_jobs = 0
        self._thread = threading.Thread(target=self._run, name="attndbg-flight", daemon=True)
        self._thread.start()
        spool.register(session.options, os.getpid())
        install_exception_hooks()

    # -- what the session and the adapters call -------------------------------------------------

    def open(self, step: int, copy: HostCopy, build: Build) -> RingEntry:
        error = self.ring.poll(followed=False)  # the steps the flight thread follows are its to mark
        entry = RingEntry(step=step, copy=copy, build=build)
        # Held while the engine's call runs (released by close): a trigger may take and write the
        # step meanwhile, but its copy still receives the call's tensors.
        copy.hold()
        self.ring.add(entry)
        if error is not None:  # an earlier step's work ended in a CUDA error
            self.fire(from_exception(error, self.in_flight_step(), "seen by the flight recorder"))
        return entry

    def close(self, entry: RingEntry, *, stream: torch.cuda.Stream | None = None, done: torch.cuda.Event | None = None) -> None:
        """The step's call returned. `done`: a blocking event the caller already recorded on
        `stream` after all of the step's work (a probe reading's), marking where the step ends
        instead of a second event recorded at the same point; None: one is recorded here."""
        if device_fault.faulted():  # no event can be recorded: the step stays in flight
            self.ring.close(entry, None, lost=True)
            entry.copy.release()
            return
        if done is None and torch.cuda.is_initialized():  # (is_available() asks NVML: too slow for every step)
            # Blocking sync: the flight thread waiting on it sleeps instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        watch = self.when.nan or entry.copy.has_readings()
        if watch:
            entry.copy.hold()  # before the ring may evict it: the flight thread reads it
        self.ring.close(entry, done, followed=watch)
        if watch:
            self._put(_Watch(entry))
        entry.copy.release()  # open's hold

    def keep(self, step: int, copy: HostCopy, build: Build) -> None:
        """A step handed over whole (`submit`: the engines whose hooks run after the call)."""
        self.close(self.open(step, copy, build))

    def check(self, copy: HostCopy, judge: Callable[[dict[str, Any]], Trigger | None]) -> None:
        """Judge `copy` on the flight thread once it landed; `judge` returns the trigger to fire."""
        copy.hold()
        self._put(_Check(copy, judge))

    def request(self, trigger: Trigger) -> None:
        """Fire from anywhere, a signal handler included: the flight thread writes."""
        self._jobs.put(_Fire(trigger))

    def fire(self, trigger: Trigger) -> None:
        """Write the ring now: its steps (in flight marked), then the trigger line. On a CUDA error
        (or once the device faulted) in this thread, synchronously (the module docstring)."""
        if trigger.kind is TriggerKind.CUDA_ERROR:
            device_fault.latch(trigger.message)
        now = device_fault.faulted()
        with self._lock:
            if trigger.kind in self._fired_kinds and trigger.kind is not TriggerKind.SIGNAL:
                self.skipped[trigger.kind] = self.skipped.get(trigger.kind, 0) + 1
                return
            self._fired_kinds.add(trigger.kind)
            self.fired.append(trigger)
            taken = self.ring.take()
            # Under the lock: a trigger's line follows its own steps, whichever thread fires.
            if now:
                written = [entry.step for entry, in_flight in taken if self.session.write_now(entry.copy, entry.build, in_flight=in_flight)]
                self.session.write_line_now(trigger_line(trigger.line(os.getpid())))
            else:
                for entry, in_flight in taken:
                    self.session.write(entry.copy, entry.build, in_flight=in_flight, evidence=True)  # the writer holds it now
                self.session.write_line(trigger_line(trigger.line(os.getpid())))
            for entry, _ in taken:
                entry.copy.release()  # the ring's hold, which take() handed over
        flying = [entry.step for entry, in_flight in taken if in_flight]
        where = f"step {trigger.step}" if trigger.step is not None else "no step yet"
        count = f"{len(written)} of {len(taken)}" if now else f"{len(taken)}"
        self.session.log(
            f"ring written to {self.session.out_dir} on {trigger.kind.value} at {where}: {trigger.message}; "
            f"{count} step(s){f', in flight: {flying}' if flying else ''}"
        )

    def in_flight_step(self) -> int | None:
        """The step an error that surfaced now most likely belongs to: the oldest in flight, else the last."""
        first = self.ring.first_in_flight()
        return first if first is not None else self.session.last_step

    # -- the flight thread ----------------------------------------------------------------------

    def _put(self, job: _Watch | _Fire | _Check) -> None:
        with self._lock:
            self._pending_jobs += 1
            self._idle.clear()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with self.session.guard("the flight recorder"):
                    if isinstance(job, _Fire):
                        self.fire(job.trigger)
                    elif isinstance(job, _Watch):
                        self._follow(job.entry)
                    else:
                        self._judge(job)
            finally:
                if isinstance(job, _Watch):
                    job.entry.copy.release()
                elif isinstance(job, _Check):
                    job.copy.release()
                if not isinstance(job, _Fire):
                    with self._lock:
                        self._pending_jobs -= 1
                        if self._pending_jobs == 0:
                            self._idle.set()

    def _follow(self, entry: RingEntry) -> None:
        """Wait until the step's device work is done, read its probe readings, judge `--when nan`."""
        if device_fault.faulted():
            return  # no event may be waited on; the ring was written when the fault was seen
        if entry.done is not None:
            try:
                entry.done.synchronize()
            except RuntimeError as e:  # the device faulted: this step, or one before it, did it
                if is_cuda_error(e):
                    self.fire(from_exception(e, self.in_flight_step(), "seen by the flight recorder"))
                return
            self.ring.mark_finished(entry)
        entry.copy.collect_readings()
        if self.when.nan:
            self._judge(_Check(entry.copy, lambda host, step=entry.step: self._nan(host, step)))

    def _nan(self, host: dict[str, Any], step: int) -> Trigger | None:
        found = nonfinite(host, self.watched)
        return None if found is None else Trigger(kind=TriggerKind.NAN, step=step, message=found)

    def _judge(self, job: _Check) -> None:
        try:
            host = job.copy.wait()
        except RuntimeError as e:
            if is_cuda_error(e):
                self.fire(from_exception(e, self.in_flight_step(), "seen by the flight recorder"))
            return
        trigger = job.judge(host)
        if trigger is not None:
            self.fire(trigger)

    def drain(self, timeout: float) -> bool:
        """Wait until the flight thread followed every step handed to it (bounded)."""
        return self._idle.wait(timeout)

    # -- exit -----------------------------------------------------------------------------------

    def at_exit(self) -> None:
        """A CUDA error not yet surfaced fires; the steps not written go to the spool."""
        self.drain(EXIT_WAIT_SECONDS)
        while True:  # fires requested (a signal) but not handled yet
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Fire):
                self.fire(job.trigger)
        if not device_fault.faulted() and torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                torch.cuda.synchronize()
            except RuntimeError as e:
                if is_cuda_error(e):
                    self.fire(from_exception(e, self.in_flight_step(), "seen at exit"))
        self._jobs.put(None)
        self.session.flush()
        spool.leave(self.session, self.ring.take())


def _fire_current(error: BaseException | None, where: str, *, cuda_line: str = "") -> None:
    """Fire this process's ring (if one records) for `error`, or for a CUDA error known only by
    the line a log names it in."""
    from attndbg.record import session as session_module

    session = session_module._SESSION
    if session is None or session.flight is None or not session.enabled:
        return
    with contextlib.suppress(Exception):  # never in the way of the engine's own error handling
        step = session.flight.in_flight_step()
        if error is not None:
            session.flight.fire(from_exception(error, step, where))
        else:
            session.flight.fire(Trigger(kind=TriggerKind.CUDA_ERROR, step=step, message=f"{cuda_line[:300]} ({where})"))


class _ErrorLog(logging.Handler):
    """ERROR records carrying an exception, or a CUDA error's words, fire the ring."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            _fire_current(record.exc_info[1], f"logged by {record.name}")
            return
        with contextlib.suppress(Exception):
            text = record.getMessage()
            if CUDA_ERROR_WORDS.search(text):
                _fire_current(None, f"logged by {record.name}", cuda_line=_cuda_line(text))


def _cuda_line(text: str) -> str:
    """The line of a logged traceback that names the CUDA error."""
    return next((line.strip() for line in text.splitlines() if CUDA_ERROR_WORDS.search(line)), text.strip().splitlines()[0] if text.strip() else "")


_HOOKS_INSTALLED = False


def install_exception_hooks() -> None:
    """Chain sys.excepthook and threading.excepthook, and add the ERROR handler to the root logger
    (once per process; each passes through when no ring is recording)."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    previous_sys, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        _fire_current(error, "uncaught")
        previous_sys(kind, error, tb)

    def thread_excepthook(args: Any) -> None:
        if args.exc_value is not None:
            _fire_current(args.exc_value, f"uncaught in thread {getattr(args.thread, 'name', '?')}")
        previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    logging.getLogger().addHandler(_ErrorLog())
