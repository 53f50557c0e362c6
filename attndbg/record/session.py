"""One process's recording: step numbering, sampling, host copies, the writer thread, the rules.

The rules every engine hook follows through this class:
- nothing here synchronises the device: tensors are copied to pinned host memory with
  `non_blocking=True` on the engine's stream and an event marks when they are complete; the
  writer thread waits on that event, builds the trace and writes it, off the engine's path;
- nothing is copied while a CUDA graph is being captured (a copy there would be baked into the
  graph and a host wait would break the capture): `snapshot` refuses, the step is skipped;
- a hook that fails logs one line and recording stops; the engine goes on (`guard`);
- files are written atomically and the directory stops growing at `max_bytes`; a write the OS
  refuses (a full disk, a quota) stops recording with one line naming the directory and the errno;
- the engine never waits on the writer: when the queue is full, the step is dropped and counted;
- validating and saving run in a child process (`writer_process`), so that Python work does not
  hold the engine process's GIL; the writer thread here only builds and packs each step;
- with `--ring K` (options.ring) nothing is written as it comes: the flight recorder (`flight.py`)
  keeps the last steps' host copies and writes them, in this process, when a trigger fires.
Adapters hand a step over in two halves where the engine's call can fail or the device can fault:
`open_step` before the call (its metadata, copied before the kernels that read it), `close_step`
after it; in ring mode the step is in the ring from `open_step` on, so the step that faulted is kept.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attndbg.record import device_fault, problems
from attndbg.record.host_copy import CopyLost, HostCopy
from attndbg.record.options import RecordOptions
from attndbg.record.writer_process import ProcessWriter
from attndbg.trace.io import append_manifest_line, append_to_recording
from attndbg.trace.schema import Trace, to_dict

# Steps waiting for the writer are bounded by their bytes, not their number: metadata-only steps
# are a few KB (thousands may wait while the writer process starts), tensor steps can be MBs.
MAX_PENDING_BYTES = 1 << 30


def capturing() -> bool:
    """True inside `torch.cuda.graph(...)` capture on the current stream. (Nothing captures before
    CUDA is initialised; is_available() would ask the driver at every step.)"""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


Build = Callable[[dict[str, Tensor | None]], Trace | None]


@dataclass
class _StepJob:
    copy: HostCopy
    build: Build
    in_flight: bool = False  # written by the flight recorder while its device work was not seen done
    evidence: bool = False  # a ring written on a trigger: written even once recording stopped


@dataclass
class _LineJob:
    line: str  # a manifest line written after the steps queued before it (a flight-recorder trigger)


@dataclass
class OpenStep:
    """A step handed over before the engine's call (`open_step`); `close_step` completes it.

    `copy` takes the tensors the call produced (`copy.add`); in ring mode the step is already in
    the ring (`entry`), so a call that raises or a device that faults leaves it there."""

    step: int
    copy: HostCopy
    build: Build
    entry: Any = None  # flight.RingEntry in ring mode


@dataclass
class Stats:
    written: int = 0
    dropped_queue_full: int = 0  # steps dropped because MAX_PENDING_BYTES were waiting for the writer
    hook_seconds: float = 0.0  # time the engine's own thread spent in our hooks (adapters add to it)
    skipped_in_capture: int = 0
    bytes_written: int = 0
    stopped_reason: str | None = None
    files: list[str] = field(default_factory=list)


class _Guard:
    """`RecordingSession.guard`'s context manager. A plain class: a generator-based one costs the
    engine's thread a generator and two resumptions per guarded hook, several times a step."""

    __slots__ = ("_session", "_where")

    def __init__(self, session: RecordingSession, where: str):
        self._session = session
        self._where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool:
        if not isinstance(error, Exception):  # none, or one a recorder must not swallow (KeyboardInterrupt)
            return False
        self._session._guarded(error, self._where)  # a recorder must never take the engine down
        return True


class RecordingSession:
    """Owns the output directory of one process and the writer thread feeding it."""

    def __init__(self, options: RecordOptions, log: Callable[[str], None] | None = None):
        self.options = options
        self.out_dir = Path(options.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stats = Stats()
        self._log = log or _log_line
        self._enabled = True
        self._steps = 0
        self._noted: set[str] = set()
        self._stop_writing = False  # the directory refused a write or is full (--max-size): nothing more is tried
        self._lock = threading.Lock()
        self._queue: queue.Queue[_StepJob | _LineJob | None] = queue.Queue()
        self._pending_bytes = 0
        self._bytes_at_start = sum(p.stat().st_size for p in self.out_dir.glob("*.pt"))
        self._write_lock = threading.Lock()  # the writer thread and a synchronous write (a fault) take turns
        device_fault.reset()
        # Started now: its Python and torch take seconds to import, and steps queue meanwhile. Not
        # in ring mode: a ring is written rarely, in one burst, and a process per engine process
        # that may never write would cost every engine process seconds of CPU at start.
        self._process = ProcessWriter(self.out_dir) if options.writer == "process" and not options.ring else None
        self._writer = threading.Thread(target=self._write_loop, name="attndbg-record-writer", daemon=True)
        self._writer.start()
        self.flight: Any = None  # flight.FlightRecorder in ring mode
        if options.ring:
            from attndbg.record.flight import FlightRecorder

            self.flight = FlightRecorder(self)
        self._closed = False
        atexit.register(self.close)

    # -- what hooks ask -------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    def next_step(self) -> int:
        """This process's next step number (every forward counts, recorded or not)."""
        with self._lock:
            step = self._steps
            self._steps += 1
        return step

    def wants(self, step: int) -> bool:
        return self._enabled and self.options.wants_step(step)

    def wants_layer(self, layer: int) -> bool:
        return self._enabled and self.options.wants_layer(layer)

    def snapshot(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None, current: torch.cuda.Stream | None = None) -> HostCopy | None:
        """Start host copies of a step's tensors (on `stream`, else the current one; `current`: the
        current stream, where the caller already looked it up); None (and counted) inside a graph
        capture."""
        if capturing():
            self.stats.skipped_in_capture += 1
            return None
        if device_fault.faulted():  # nothing can be copied off the device any more (device_fault.py)
            return None
        extra: dict[str, Any] = {}
        if stream is not None:
            extra["stream"] = stream
        if current is not None:
            extra["current"] = current
        if self.flight is not None:
            extra["pool"] = self.flight.pool  # a ring's buffers are reused as its entries leave it
        return HostCopy(tensors, **extra)

    def submit(self, copy: HostCopy, build: Build, *, step: int | None = None) -> None:
        """Hand a step to the writer: `build(host_tensors)` runs on the writer thread. In ring mode
        the step goes to the ring instead (`step` names it there; None: the last step numbered)."""
        if not self._enabled:
            return
        if self.flight is not None:
            self.flight.keep(self._steps - 1 if step is None else step, copy, build)
            return
        self.write(copy, build)

    def open_step(self, step: int, copy: HostCopy, build: Build) -> OpenStep:
        """A step whose metadata is copied before the engine's call (see the module docstring)."""
        handle = OpenStep(step=step, copy=copy, build=build)
        if self.flight is not None and self._enabled:
            handle.entry = self.flight.open(step, copy, build)
        return handle

    def close_step(self, handle: OpenStep, *, stream: torch.cuda.Stream | None = None, done: torch.cuda.Event | None = None) -> None:
        """The engine's call returned: write the step (ring mode: mark where its device work ends,
        on `stream`, the stream the step ran on; `done`: an event already recorded there after all
        of its work, flight.FlightRecorder.close)."""
        if handle.entry is not None:
            self.flight.close(handle.entry, stream=stream, done=done)
        elif self._enabled:
            self.write(handle.copy, handle.build)

    def fail_step(self, handle: OpenStep | None, error: BaseException, where: str) -> None:
        """The engine's call raised: in ring mode that fires the ring (the step stays in it);
        otherwise the step is not written (its tensors are incomplete)."""
        if self.flight is not None:
            from attndbg.record.triggers import from_exception

            self.flight.fire(from_exception(error, handle.step if handle is not None else self.last_step, where))

    @property
    def last_step(self) -> int | None:
        """The last step number handed out (None before the first)."""
        return self._steps - 1 if self._steps else None

    def write(self, copy: HostCopy, build: Build, *, in_flight: bool = False, evidence: bool = False) -> None:
        """Queue a step for the writer thread. `evidence`: a ring written on a trigger, written even
        if recording stops meanwhile (a hook failing on the same CUDA error, say)."""
        if not self._enabled and not evidence:
            return
        with self._lock:
            if self._pending_bytes + copy.nbytes > MAX_PENDING_BYTES:
                self.stats.dropped_queue_full += 1
                return
            self._pending_bytes += copy.nbytes
        copy.hold()  # released once written (a pooled buffer is reused only then)
        self._queue.put_nowait(_StepJob(copy, build, in_flight, evidence))

    def write_line(self, line: str) -> None:
        """Queue a manifest line, written after the steps queued before it."""
        self._queue.put_nowait(_LineJob(line))

    def write_now(self, copy: HostCopy, build: Build, *, in_flight: bool) -> bool:
        """Write a step in this thread, from what already landed on the host (the device faulted:
        the process may abort at any moment, flight.py); whether it was written. Not through
        `guard`: the caller holds the flight recorder's lock, which a guard's firing would take."""
        if self._stop_writing:
            return False
        try:
            return self._write(_StepJob(copy, build, in_flight, evidence=True), in_process=True)
        except Exception as e:  # noqa: BLE001 - one step that cannot be built: the others go on
            self.log(f"a step of the ring was not written ({type(e).__name__}: {e})")
            return False

    def write_line_now(self, line: str) -> None:
        """Append a manifest line in this thread (after write_now's steps)."""
        try:
            with self._write_lock:
                append_manifest_line(self.out_dir, line)
        except OSError as e:
            self.log(f"cannot write the trigger line to {self.out_dir}: {os_reason(e)}")

    def guard(self, where: str) -> _Guard:
        """Run hook code (`with session.guard(where): ...`); the first exception disables recording
        with one log line. In ring mode a CUDA error (a hook's own CUDA call is where a device
        fault may surface first) fires the ring before that: the steps it holds are the evidence of
        the fault."""
        return _Guard(self, where)

    def _guarded(self, e: Exception, where: str) -> None:
        """What `guard` does with the exception `e` its code raised."""
        if self.flight is not None:
            from attndbg.record.triggers import from_exception, is_cuda_error

            if is_cuda_error(e):  # fire latches device_fault: host memory only from now on
                self.flight.fire(from_exception(e, self.flight.in_flight_step(), f"seen in {where}"))
        self.disable(f"error in {where}: {type(e).__name__}: {e}")

    def log(self, message: str) -> None:
        """One line on stderr (never raises: stderr may be a file on a disk that just filled)."""
        with contextlib.suppress(OSError):
            self._log(message)

    def note_once(self, message: str) -> None:
        """Log `message` once per process (a moved buffer, a probe that could not be captured)."""
        with self._lock:
            if message in self._noted:
                return
            self._noted.add(message)
        self.log(message)

    def disable(self, reason: str, *, failure: bool = True) -> None:
        """Stop recording in this process; a `failure` (not the size cap) is also noted for
        `attndbg record`, which names it and exits non-zero when no step was recorded."""
        if self._enabled:
            self._enabled = False
            self.stats.stopped_reason = reason
            if failure:
                problems.note(self.options, reason)
            # stderr may be a file on the disk that just filled: the line is lost, never raised.
            with contextlib.suppress(OSError):
                self._log(f"recording stopped, the engine goes on ({reason})")

    # -- writer -----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if isinstance(job, _LineJob):
                    with self.guard("writing a manifest line"), self._write_lock:
                        append_manifest_line(self.out_dir, job.line)
                    continue
                if self._enabled or (job.evidence and not self._stop_writing):
                    with self.guard("writing a step"):
                        self._write(job)
                with self._lock:
                    self._pending_bytes -= job.copy.nbytes
                job.copy.release()
            finally:
                self._queue.task_done()

    def _write(self, job: _StepJob, *, in_process: bool = False) -> bool:
        """Build and write one step; whether it was written. `in_process`: not through the writer
        process, whatever the options say (a write after a CUDA error)."""
        try:
            host = job.copy.wait()
        except CopyLost as e:  # a ring step behind a device fault: the others are still written
            self.log(f"a step in flight was not written: {e}")
            return False
        trace = job.build(host)
        if trace is None:
            return False
        name = step_file_name(self.options, trace)
        try:
            with self._write_lock:
                if self._process is not None and not in_process:
                    size = self._process.write(name, to_dict(trace), in_flight=job.in_flight)
                else:
                    size = append_to_recording(self.out_dir, trace, name, in_flight=job.in_flight).stat().st_size
        except OSError as e:  # a full disk (ENOSPC), a quota, a read-only mount: stop, say where and why
            self._stop_writing = True
            self.disable(f"cannot write {name} to {self.out_dir}: {os_reason(e)}")
            return False
        self._written(name, size)
        return True

    def _written(self, name: str, size: int) -> None:
        self.stats.written += 1
        self.stats.bytes_written += size
        self.stats.files.append(name)
        total = self._bytes_at_start + self.stats.bytes_written
        if total >= self.options.max_bytes:
            self._stop_writing = True
            self.disable(f"size cap reached: {self.out_dir} holds {total} bytes >= --max-size {self.options.max_bytes}", failure=False)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait (bounded) until every submitted step is written."""
        done = threading.Event()

        def join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        done.wait(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.flight is not None:
            self.flight.at_exit()  # may fire (a CUDA error seen at exit) and writes: before the writer stops
        if self._writer.is_alive():
            self.flush()
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._writer.join(timeout=5.0)
        if self._process is not None:
            self._process.close()


def step_file_name(options: RecordOptions, trace: Trace) -> str:
    """`step_000012.pt` (with --append's run prefix, and a TP rank's suffix past rank 0)."""
    rank = trace.source.tp_rank
    return f"{options.file_prefix}step_{trace.source.step:06d}{f'_tp{rank}' if rank else ''}.pt"


def os_reason(e: OSError) -> str:
    """'ENOSPC: No space left on device' (the errno's name, so a log search finds it)."""
    name = errno.errorcode.get(e.errno or 0)
    text = e.strerror or str(e)
    return f"{name}: {text}" if name else text


def _log_line(message: str) -> None:
    print(f"attndbg record: {message}", file=sys.stderr, flush=True)


_SESSION: RecordingSession | None = None
_SESSION_LOCK = threading.Lock()
_SESSION_FAILED = False  # the directory could not be set up: not retried on every hook call


def current_session() -> RecordingSession | None:
    """The process-wide session, created on first use from the environment (or None).

    Called from the engine's own thread: a directory that cannot be created or read (a full disk,
    a read-only mount) is one log line and no recording, never an exception in the engine."""
    global _SESSION, _SESSION_FAILED
    with _SESSION_LOCK:
        if _SESSION is None and not _SESSION_FAILED:
            options = RecordOptions.from_env()
            if options is not None:
                try:
                    _SESSION = RecordingSession(options)
                except OSError as e:
                    _SESSION_FAILED = True
                    reason = f"cannot write to {options.out_dir}: {os_reason(e)}"
                    problems.note(options, reason)
                    with contextlib.suppress(OSError):
                        _log_line(f"recording not started, the engine goes on ({reason})")
        return _SESSION


def start_session(options: RecordOptions) -> RecordingSession:
    """Start a session in this process (tests, benchmarks, in-process engines)."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is not None:
            _SESSION.close()
        _SESSION = RecordingSession(options)
        os.environ["ATTNDBG_RECORD"] = options.to_env()
        return _SESSION


def end_session() -> Stats | None:
    global _SESSION, _SESSION_FAILED
    with _SESSION_LOCK:
        session, _SESSION, _SESSION_FAILED = _SESSION, None, False
    os.environ.pop("ATTNDBG_RECORD", None)
    if session is None:
        return None
    session.close()
    return session.stats
