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

After a CUDA error (device_fault.py) a copy waits on no event, starts no new copy, and its pinned
tensors are never freed (freeing one would abort the process).
"""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True)
class _Packed:
    """One batch's device tensors in one pinned buffer: (name, dtype, shape, byte offset, bytes) each."""

    buffer: Tensor
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]

    def unpack(self) -> dict[str, Tensor]:
        # Copies (on the writer's thread): a view would keep, and a saved trace would store, the
        # whole pinned buffer.
        return {name: self.buffer[offset : offset + n].view(dtype).view(shape).clone() for name, dtype, shape, offset, n in self.layout}


def packed_layout(parts: list[tuple[str, Tensor]]) -> tuple[tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...], list[Tensor], int]:
    """How `parts` pack: their layout (widest elements first, so every offset suits its type), each
    one's bytes as a flat uint8 tensor on its device (a copy only where it is not contiguous), and
    the total byte count."""
    parts = sorted(parts, key=lambda part: -part[1].element_size())  # stable: widest first
    layout = []
    flat = []
    offset = 0
    for name, t in parts:
        n = t.numel() * t.element_size()
        layout.append((name, t.dtype, tuple(t.shape), offset, n))
        # A 1-D contiguous tensor (most metadata) is viewed as bytes as it is: one view, not three.
        flat.append(t.view(torch.uint8) if t.dim() == 1 and t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8))
        offset += n
    return tuple(layout), flat, offset


def _pack(parts: list[tuple[str, Tensor]]) -> tuple[_Packed, Tensor]:
    """Queue one copy of `parts` (device tensors of one device) into a new pinned buffer on the
    current stream, then its marker's; the packed copy and the marker (zeroed) are returned."""
    layout, flat, offset = packed_layout(parts)
    marker_at = -(-offset // 4) * 4
    buffer = torch.empty(marker_at + 4, dtype=torch.uint8, pin_memory=True)
    marker = buffer[marker_at:].view(torch.int32)
    marker.zero_()
    if offset:
        buffer[:offset].copy_(flat[0] if len(flat) == 1 else torch.cat(flat), non_blocking=True)
    marker.copy_(_one_on(parts[0][1].device), non_blocking=True)
    return _Packed(buffer, layout), marker


class HostCopy:
    """Tensors copied to (pinned) host memory without a device sync; `wait()` completes them."""

    def __init__(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None):
        self._host: dict[str, Tensor | None] = {}
        self._packs: list[_Packed] = []
        self._events: list[torch.cuda.Event] = []
        self._markers: list[Tensor] = []
        self._readings: list[Any] = []  # probes.Reading: values a graph replay copies (probes.py)
        self._lock = threading.Lock()
        self.nbytes = 0
        self.add(tensors, stream=stream)

    def add(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None) -> None:
        """Copy more tensors (a step's layer tensors once its forward ran) into this copy."""
        host: dict[str, Tensor | None] = {}
        on_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
        nbytes = 0
        for name, t in tensors.items():
            if t is None:
                host[name] = None
                continue
            nbytes += t.numel() * t.element_size()
            if t.is_cuda:
                on_device.setdefault(t.device, []).append((name, t))
            else:
                # A host tensor may be reused by the engine for the next step: copy it now.
                host[name] = t.detach().clone()
        if on_device and device_fault.faulted():
            return  # no pinned allocation and no copy can succeed now: the tensors are lost (and not counted)
        self.nbytes += nbytes
        if on_device:
            with contextlib.ExitStack() as on_stream:
                if stream is not None:
                    on_stream.enter_context(torch.cuda.stream(stream))
                packed = [_pack(parts) for parts in on_device.values()]
                event = torch.cuda.Event()
                event.record()
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
            return all(int(m[0]) == 1 for m in self._markers)

    def wait(self) -> dict[str, Tensor | None]:
        """The host tensors once every copy completed; CopyLost when the device faulted first."""
        with self._lock:
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
        self._lock = threading.Lock()
        self.nbytes = sum(part.nbytes for part in parts.values())

    def add(self, tensors: dict[str, Tensor | None], *, stream: torch.cuda.Stream | None = None) -> None:
        raise TypeError("add to a part, not to the merged copy")

    def add_host(self, host: dict[str, Tensor]) -> None:
        raise TypeError("add to a part, not to the merged copy")

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
