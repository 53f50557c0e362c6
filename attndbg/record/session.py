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
  hold the engine process's GIL; the writer thread here only builds and packs each step.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from attndbg.record import problems
from attndbg.record.options import RecordOptions
from attndbg.record.writer_process import ProcessWriter
from attndbg.trace.io import append_to_recording
from attndbg.trace.schema import Trace, to_dict

# Steps waiting for the writer are bounded by their bytes, not their number: metadata-only steps
# are a few KB (thousands may wait while the writer process starts), tensor steps can be MBs.
MAX_PENDING_BYTES = 1 << 30


def capturing() -> bool:
    """True inside `torch.cuda.graph(...)` capture on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class HostCopy:
    """Tensors copied to (pinned) host memory without a device sync; `wait()` completes them."""

    def __init__(self, tensors: dict[str, Tensor | None]):
        self._host: dict[str, Tensor | None] = {}
        self._event: torch.cuda.Event | None = None
        self.nbytes = 0
        for name, t in tensors.items():
            if t is None:
                self._host[name] = None
                continue
            self.nbytes += t.numel() * t.element_size()
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                self._host[name] = host
                if self._event is None:
                    self._event = torch.cuda.Event()
            else:
                # A host tensor may be reused by the engine for the next step: copy it now.
                self._host[name] = t.detach().clone()
        if self._event is not None:
            self._event.record()

    def wait(self) -> dict[str, Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


Build = Callable[[dict[str, Tensor | None]], Trace | None]


@dataclass
class Stats:
    written: int = 0
    dropped_queue_full: int = 0  # steps dropped because MAX_PENDING_BYTES were waiting for the writer
    hook_seconds: float = 0.0  # time the engine's own thread spent in our hooks (adapters add to it)
    skipped_in_capture: int = 0
    bytes_written: int = 0
    stopped_reason: str | None = None
    files: list[str] = field(default_factory=list)


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
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[HostCopy, Build] | None] = queue.Queue()
        self._pending_bytes = 0
        self._bytes_at_start = sum(p.stat().st_size for p in self.out_dir.glob("*.pt"))
        # Started now: its Python and torch take seconds to import, and steps queue meanwhile.
        self._process = ProcessWriter(self.out_dir) if options.writer == "process" else None
        self._writer = threading.Thread(target=self._write_loop, name="attndbg-record-writer", daemon=True)
        self._writer.start()
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

    def snapshot(self, tensors: dict[str, Tensor | None]) -> HostCopy | None:
        """Start host copies of a step's tensors; None (and counted) inside a graph capture."""
        if capturing():
            self.stats.skipped_in_capture += 1
            return None
        return HostCopy(tensors)

    def submit(self, copy: HostCopy, build: Build) -> None:
        """Hand a step to the writer: `build(host_tensors)` runs on the writer thread."""
        if not self._enabled:
            return
        with self._lock:
            if self._pending_bytes + copy.nbytes > MAX_PENDING_BYTES:
                self.stats.dropped_queue_full += 1
                return
            self._pending_bytes += copy.nbytes
        self._queue.put_nowait((copy, build))

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run hook code; the first exception disables recording with one log line."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a recorder must never take the engine down
            self.disable(f"error in {where}: {type(e).__name__}: {e}")

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
                if self._enabled:
                    with self.guard("writing a step"):
                        self._write(*job)
                with self._lock:
                    self._pending_bytes -= job[0].nbytes
            finally:
                self._queue.task_done()

    def _write(self, copy: HostCopy, build: Build) -> None:
        trace = build(copy.wait())
        if trace is None:
            return
        rank = trace.source.tp_rank
        name = f"{self.options.file_prefix}step_{trace.source.step:06d}{f'_tp{rank}' if rank else ''}.pt"
        try:
            if self._process is not None:
                size = self._process.write(name, to_dict(trace))
            else:
                size = append_to_recording(self.out_dir, trace, name).stat().st_size
        except OSError as e:  # a full disk (ENOSPC), a quota, a read-only mount: stop, say where and why
            self.disable(f"cannot write {name} to {self.out_dir}: {os_reason(e)}")
            return
        self._written(name, size)

    def _written(self, name: str, size: int) -> None:
        self.stats.written += 1
        self.stats.bytes_written += size
        self.stats.files.append(name)
        total = self._bytes_at_start + self.stats.bytes_written
        if total >= self.options.max_bytes:
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
        if self._writer.is_alive():
            self.flush()
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._writer.join(timeout=5.0)
        if self._process is not None:
            self._process.close()


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
