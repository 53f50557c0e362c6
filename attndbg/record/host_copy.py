"""Host copies of a step's tensors: started on the engine's stream without a device sync, completed
on the writer's thread (`wait`).

Each batch of device copies (the constructor's, then each `add`) is packed: the batch's device
tensors are concatenated as bytes on the device (widest elements first, so every tensor's offset
suits its type) and copied with one device-to-host copy into one pinned buffer, taken from torch's
caching host allocator once per batch. A per-tensor allocation and copy cost the engine's thread
most of the recorder's time per step on the H100 (bench/record_overhead.py --profile-hook); the
tensors are cut out of the buffer on the writer's thread (`wait`). The buffer ends with a 4-byte
marker the host zeroed, into which a device 1 is copied after the data: stream order makes the
marker land after the data, so `landed()` tells, by reading host memory alone, whether the data
arrived. That is what can still
be asked after a CUDA error, when every CUDA call (an event's query included) fails: the flight
recorder writes the steps whose copies landed and leaves out those whose copies never ran.

In ring mode the buffers come from the flight recorder's `PinnedPool` instead, and go back to it
once nobody will read them: torch's allocation of a pinned buffer (its lock, its event
bookkeeping) cost the engine's thread more per step than the copy itself. A copy counts who still
reads it (`hold`/`release`: the ring, the writer, the flight thread); the last release hands its
buffers back only when every marker shows the device copy into them done, else they are left to
torch's allocator, which frees them once their copy completed (as without a pool).

After a CUDA error (device_fault.py) a copy waits on no event, starts no new copy, and its pinned
tensors are never freed (freeing one would abort the process); nothing goes back to a pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record import device_fault


class CopyLost(RuntimeError):
    """A step's device-to-host copies never completed (the device faulted before they ran)."""


_ONES: dict[torch.device, Tensor] = {}  # a device int32 1 per device: the value each copy batch's marker receives


def _one_on(device: torch.device) -> Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.int32, device=device)
    return one


def _pinned(n: int) -> Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


REUSE_SPAN = 3  # a free buffer serves a copy of up to this many times fewer bytes (its class's)
HEADROOM_UP_TO = 1 << 20  # bytes: a new buffer up to this size is made twice what is asked


def size_class(n: int) -> int:
    """The pool's buffer size for `n` bytes: at least 256, else `n` rounded up to a quarter of its
    power of two (at most a quarter more than asked), so steps whose sizes differ a little share
    buffers."""
    if n <= 256:
        return 256
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


class PinnedPool:
    """Pinned byte buffers by size class, reused by later copies once handed back (`give`); `reused`
    and `allocated` count how often a copy found one free and how often it did not.

    Bounded: a class keeps at most `per_class` free buffers and the pool `max_free_bytes` free in
    all; a buffer beyond that goes back to torch's allocator. After a device fault nothing is taken
    back and no free buffer is ever freed (device_fault.py)."""

    def __init__(self, *, per_class: int = 8, max_free_bytes: int = 256 << 20, allocate: Any = _pinned):
        self._free: dict[int, list[Tensor]] = {}
        self._free_bytes = 0
        self._per_class = per_class
        self._max_free_bytes = max_free_bytes
        self._allocate = allocate  # tests: plain host memory on a machine without pinned memory
        self._lock = threading.Lock()
        self.allocated = 0  # buffers asked of the allocator
        self.reused = 0  # buffers handed out again

    def take(self, n: int) -> Tensor:
        """A buffer of at least `n` bytes (its contents are what the last copy left): the smallest
        free one of at most REUSE_SPAN times size_class(n), else a new one with headroom (twice
        `n` up to HEADROOM_UP_TO bytes, a quarter more above: a prefill's layer tensors are large).

        Why not the exact class: a step's metadata grows with its requests' KV (the flat KV index
        lists), and a buffer comes back only once its entry left the ring, `depth` steps later,
        when the steps ask for more. On the H100 (bench/record_overhead.py, ring of 64, 32
        decoding requests) exact classes reused 3 buffers in 259 steps."""
        size = size_class(n)
        with self._lock:
            fits = [c for c, free in self._free.items() if free and size <= c <= REUSE_SPAN * size]
            if fits:
                best = min(fits)
                self._free_bytes -= best
                self.reused += 1
                return self._free[best].pop()
            self.allocated += 1
        return self._allocate(size_class(n + (n if n <= HEADROOM_UP_TO else n // 4)))

    def give(self, buffers: list[Tensor]) -> None:
        """Buffers no copy will write into or be read from again."""
        if device_fault.faulted():
            device_fault.keep(buffers)
            return
        with self._lock:
            for buffer in buffers:
                size = buffer.numel()
                free = self._free.setdefault(size, [])
                if len(free) < self._per_class and self._free_bytes + size <= self._max_free_bytes:
                    free.append(buffer)
                    self._free_bytes += size

    def free_count(self) -> int:
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def __del__(self) -> None:
        free = getattr(self, "_free", None)
        faulted = getattr(device_fault, "faulted", None)  # None at interpreter exit: module globals are cleared
        if free and faulted is not None and faulted():  # freeing a buffer a copy used would abort the process
            device_fault.keep([buffer for buffers in free.values() for buffer in buffers])


@dataclass(frozen=True)
class _Packed:
    """One batch's device tensors in one pinned buffer: (name, dtype, shape, byte offset, bytes) each.
    `slab`: the pool's whole buffer that `buffer` is the start of (None: not from a pool)."""

    buffer: Tensor
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]
    slab: Tensor | None = None

    def unpack(self) -> dict[str, Tensor]:
        # Copies (on the writer's thread): a view would keep, and a saved trace would store, the
        # whole pinned buffer.
        return {name: self.buffer[offset : offset + n].view(dtype).view(shape).clone() for name, dtype, shape, offset, n in self.layout}


def _widest_first(part: tuple[str, Tensor]) -> int:
    return -part[1].itemsize


def packed_layout(parts: list[tuple[str, Tensor]]) -> tuple[tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...], list[Tensor], int]:
    """How `parts` pack: their layout (widest elements first, so every offset suits its type), each
    one's bytes as a flat uint8 tensor on its device (a copy only where it is not contiguous), and
    the total byte count."""
    # Each tensor is asked as little as it can be (every query costs the engine's thread a call
    # into torch, several tensors a step): its item size once, its byte count once.
    parts = sorted(parts, key=_widest_first)  # stable: widest first
    layout = []
    flat = []
    offset = 0
    for name, t in parts:
        n = t.nbytes
        layout.append((name, t.dtype, tuple(t.shape), offset, n))
        # A 1-D contiguous tensor (most metadata) is viewed as bytes as it is: one view, not three.
        flat.append(t.view(torch.uint8) if t.ndim == 1 and t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8))
        offset += n
    return tuple(layout), flat, offset


def _pack(parts: list[tuple[str, Tensor]], pool: PinnedPool | None = None) -> tuple[_Packed, Tensor]:
    """Queue one copy of `parts` (device tensors of one device) into a pinned buffer (new, or the
    pool's) on the current stream, then its marker's; the packed copy and the marker (zeroed) are
    returned.

    Concatenated on the device, then one copy: with the buffer reused, a copy per tensor straight
    into its place costs the host as much or more (on an H100, five metadata tensors of 0.7 to
    530 KB: 30-45 us a step concatenated, 43-46 us copied one by one; each copy is a driver call
    and an event the host allocator records)."""
    layout, flat, offset = packed_layout(parts)
    marker_at = -(-offset // 4) * 4
    slab = None if pool is None else pool.take(marker_at + 4)
    buffer = _pinned(marker_at + 4) if slab is None else slab[: marker_at + 4]
    marker = buffer[marker_at:].view(torch.int32)
    marker.zero_()
    if offset:
        buffer[:offset].copy_(flat[0] if len(flat) == 1 else torch.cat(flat), non_blocking=True)
    marker.copy_(_one_on(parts[0][1].device), non_blocking=True)
    return _Packed(buffer, layout, slab), marker


def _copied_on_device(t: Tensor) -> bool:
    """Whether `t` is packed into a pinned buffer (else cloned on the host now)."""
    return t.is_cuda


class _on:
    """Make `stream` the current stream meanwhile (None: leave the current one). With the current
    stream known (`current`, on the same device) it is set and set back without asking torch for
    the current stream again, as torch.cuda.stream() would. A class, not a generator: entered at
    every copy batch on the engine's thread."""

    __slots__ = ("_stream", "_current", "_torch")

    def __init__(self, stream: torch.cuda.Stream | None, current: torch.cuda.Stream | None):
        self._stream = stream
        self._current = current
        self._torch: Any = None  # torch.cuda.stream(stream), where torch switches

    def __enter__(self) -> None:
        stream, current = self._stream, self._current
        if stream is None:
            return
        if current is None or current.device_index != stream.device_index:
            self._torch = torch.cuda.stream(stream)
            self._torch.__enter__()
        else:
            torch.cuda.set_stream(stream)

    def __exit__(self, *error: Any) -> None:
        if self._stream is None:
            return
        if self._torch is not None:
            self._torch.__exit__(*error)
        else:
            torch.cuda.set_stream(self._current)


def _event_after(stream: torch.cuda.Stream | None) -> torch.cuda.Event:
    """An event recorded on `stream` (None: the current one) after the copies queued on it."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


class HostCopy:
    """Tensors copied to (pinned) host memory without a device sync; `wait()` completes them."""

    def __init__(
        self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None, pool: PinnedPool | None = None, current: torch.cuda.Stream | None = None
    ):
        self._pool = pool  # where the pinned buffers come from and go back to (None: torch's allocator)
        self._holds = 0  # readers still to come (the ring, the writer, the flight thread)
        self._recycled = False  # the buffers went back to the pool: nothing may be read from them
        self._host: dict[str, Tensor | None] = {}
        self._packs: list[_Packed] = []
        self._events: list[torch.cuda.Event] = []
        self._markers: list[Tensor] = []
        self._readings: list[Any] = []  # probes.Reading: values a graph replay copies (probes.py)
        self._lock = threading.Lock()
        self.nbytes = 0
        self.add(tensors, stream=stream, current=current)

    def add(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None, current: torch.cuda.Stream | None = None) -> None:
        """Copy more tensors (a step's layer tensors once its forward ran) into this copy, on
        `stream` (None: the current one). `current`: the current stream, where the caller already
        knows it (each lookup costs the engine's thread microseconds)."""
        host: dict[str, Tensor | None] = {}
        on_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
        nbytes = 0
        for name, t in tensors.items():
            if t is None:
                host[name] = None
                continue
            nbytes += t.nbytes
            if _copied_on_device(t):
                on_device.setdefault(t.device, []).append((name, t))
            else:
                # A host tensor may be reused by the engine for the next step: copy it now.
                host[name] = t.detach().clone()
        if on_device and device_fault.faulted():
            return  # no pinned allocation and no copy can succeed now: the tensors are lost (and not counted)
        self.nbytes += nbytes
        if on_device:
            with _on(stream, current):
                packed = [_pack(parts, self._pool) for parts in on_device.values()]
            event = _event_after(stream)
            with self._lock:
                for pack, marker in packed:
                    self._packs.append(pack)
                    self._markers.append(marker)
                self._events.append(event)
        with self._lock:
            self._host.update(host)

    def add_host(self, host: dict[str, Tensor]) -> None:
        """Add tensors already on the host and complete (probe readings)."""
        with self._lock:
            self._host.update(host)
            self.nbytes += sum(t.numel() * t.element_size() for t in host.values())

    def add_reading(self, reading: Any) -> None:
        """Values an in-graph probe copies (probes.Reading), collected when the copy is waited for."""
        with self._lock:
            self._readings.append(reading)
            self.nbytes += sum(t.numel() * t.element_size() for t in reading.probes.staging.values())

    def has_readings(self) -> bool:
        with self._lock:
            return bool(self._readings)

    def collect_readings(self) -> None:
        """Read the probe readings whose replay is done from their graphs' staging now (before a
        later replay of the same graph overwrites it); the others are left to `wait`."""
        with self._lock:
            readings = list(self._readings)
        for reading in readings:
            if reading.ready():
                reading.collect()

    def landed(self) -> bool:
        """Every device copy arrived (host memory only: safe after a CUDA error). Probe readings
        judge their own values by their stamps (probes.py)."""
        with self._lock:
            return self._landed()

    def _landed(self) -> bool:  # under self._lock
        # item(): the host memory read alone (indexing first would build a view per marker)
        return all(m.item() == 1 for m in self._markers)

    def hold(self) -> None:
        """One more reader will read this copy (release() when it did)."""
        with self._lock:
            if self._recycled:
                raise RuntimeError("a host copy was held after its buffers went back to the pool")
            self._holds += 1

    def release(self) -> None:
        """A reader is done. The last one hands the pinned buffers back to the pool, if the device
        copies into them are done (every marker landed: host memory only); a buffer still being
        copied into is left to torch's allocator, which waits for its copy before reusing it."""
        with self._lock:
            self._holds -= 1
            if self._holds > 0 or self._pool is None or self._recycled or not self._packs or device_fault.faulted():
                return
            if not self._landed():
                return
            slabs = [pack.slab for pack in self._packs if pack.slab is not None]
            self._recycled = True
            self._packs, self._markers = [], []
        self._pool.give(slabs)

    def wait(self) -> dict[str, Tensor | None]:
        """The host tensors once every copy completed; CopyLost when the device faulted first."""
        with self._lock:
            if self._recycled:
                raise RuntimeError("a host copy was read after its buffers went back to the pool")
            events = list(self._events)
        for event in events:
            if device_fault.faulted():  # no event may be waited on: what landed is all there is
                if not self.landed():
                    raise CopyLost(f"its host copies never completed (the device faulted: {device_fault.reason()})")
                break
            try:
                event.synchronize()
            except RuntimeError as e:  # a CUDA error (torch.AcceleratorError is a RuntimeError)
                device_fault.seen_in(e)
                if not self.landed():
                    raise CopyLost(f"its host copies never completed ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
                break
        with self._lock:
            host, packs, readings = dict(self._host), list(self._packs), list(self._readings)
        for pack in packs:
            host.update(pack.unpack())
        for reading in readings:
            host.update(reading.wait())
        return host

    def __del__(self) -> None:
        """Freeing pinned memory a copy used aborts the process once the device faulted: then the
        tensors are kept instead. The last event tells a fault not yet reported (it raises)."""
        events, markers = getattr(self, "_events", None), getattr(self, "_markers", None)
        if not events or not markers:
            return  # no device copy: plain host memory
        if not device_fault.faulted():
            try:
                events[-1].query()
                return
            except Exception as e:  # noqa: BLE001 - a destructor must not raise
                if not device_fault.seen_in(e):
                    return
        kept = [*markers, *(pack.buffer for pack in getattr(self, "_packs", ())), *(t for t in self._host.values() if t is not None)]
        device_fault.keep(kept)  # no is_pinned(): a CUDA call


class StepCopies(HostCopy):
    """Several host copies handed to the writer as one (a step's metadata, then one copy per
    recorded layer), each part's keys prefixed with its name."""

    def __init__(self, parts: dict[str, HostCopy]):  # noqa: D107 - no super(): the parts hold the copies
        self._parts = parts
        self._pool = None
        self._lock = threading.Lock()
        self.nbytes = sum(part.nbytes for part in parts.values())

    def add(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None, current: torch.cuda.Stream | None = None) -> None:
        raise TypeError("add to a part, not to the merged copy")

    def add_host(self, host: dict[str, Tensor]) -> None:
        raise TypeError("add to a part, not to the merged copy")

    def hold(self) -> None:
        for part in self._parts.values():
            part.hold()

    def release(self) -> None:
        for part in self._parts.values():
            part.release()

    def has_readings(self) -> bool:
        return any(part.has_readings() for part in self._parts.values())

    def collect_readings(self) -> None:
        for part in self._parts.values():
            part.collect_readings()

    def landed(self) -> bool:
        return all(part.landed() for part in self._parts.values())

    def wait(self) -> dict[str, Tensor | None]:
        host: dict[str, Tensor | None] = {}
        for prefix, part in self._parts.items():
            host.update({prefix + name: t for name, t in part.wait().items()})
        return host
