"""In-graph probes: tensors of a CUDA-graph-replayed step, copied to the host by the graph itself.

Under a CUDA graph the attention's Python runs only at capture, so a hook cannot copy anything at
replay. A probe is captured *into* the graph instead: at capture, each probed tensor gets a
device-to-host copy into a pinned staging buffer allocated for it (staging addresses are fixed in
the graph, as graphs require), and the graph carries a replay counter, a device int64 the graph
increments at its first probe. After each probed tensor's copy, the counter's value is copied
into that tensor's pinned stamp. Stream order inside the graph makes a stamp land after its
tensor: a stamp equal to the replay's number says the staging holds that replay's values; a
larger one, that a later replay overwrote them; a smaller one, that they have not landed.

The host pairs readings with steps: it counts its replays of each graph, so the step that
replayed graph G for the n-th time reads G's staging expecting stamp n. Reading (a host memcpy
of the staging) happens once the replay's work is done: on the thread that writes or judges the
step, and at the latest on the engine's thread just before the same graph is replayed again
(`ProbeBook.before_replay`), which is the last moment the values exist. Nothing here
synchronises the device.

Staging is allocated before capture, from the tensors' shapes at the eager forward an engine runs
before capturing (transformers' warm-up, SGLang's and vLLM's warm-up runs): no host allocation
happens inside a capture. Engine-neutral: an adapter says which graph a step captures or replays
(`begin`), and calls `probe(name, tensor)` where its hooks see the tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attndbg.record import device_fault
from attndbg.record.session import capturing


class Phase:
    EAGER = "eager"  # no graph: the adapter records tensors as usual
    # A step that captures a graph: its eager warm-up forward (tensors recorded as usual, staging
    # sized), then the capture (`capturing()`: probes captured into the graph).
    CAPTURE = "capture"
    REPLAY = "replay"  # a replay: no Python runs inside; the readings come from staging


@dataclass(eq=False)
class GraphProbes:
    """The probes captured into one graph."""

    staging: dict[str, Tensor] = field(default_factory=dict)  # pinned, the probed tensors' shapes
    stamps: dict[str, Tensor] = field(default_factory=dict)  # pinned int64 [1] per probe
    counter: Tensor | None = None  # device int64 [1]: replays of this graph, counted by the graph
    counted: bool = False  # the capture already captured the counter's increment
    replays: int = 0  # replays the host launched
    skipped: list[str] = field(default_factory=list)  # probes that could not be captured, and why
    last: Reading | None = None

    def prepare(self, name: str, tensor: Tensor) -> None:
        """Size `name`'s staging from the warm-up forward (outside the capture)."""
        if tensor.device.type != "cuda":
            return
        if self.counter is None:
            self.counter = torch.zeros(1, dtype=torch.int64, device=tensor.device)
        staged = self.staging.get(name)
        if staged is None or staged.shape != tensor.shape or staged.dtype != tensor.dtype:
            self.staging[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.stamps[name] = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            # Held for the process's life: a graph copies into them, and freeing them after a CUDA
            # error would abort the process (device_fault.py); a staging resized leaves the old one.
            device_fault.keep([self.staging[name], self.stamps[name]])

    def capture(self, name: str, tensor: Tensor) -> None:
        """Inside the capture: the copy into staging, then the stamp."""
        staged = self.staging.get(name)
        if staged is None or self.counter is None or staged.shape != tensor.shape or staged.dtype != tensor.dtype:
            self.skipped.append(f"{name}: shape {list(tensor.shape)} at capture, no staging sized for it at the warm-up")
            return
        if not self.counted:
            self.counter.add_(1)
            self.counted = True
        staged.copy_(tensor.detach(), non_blocking=True)
        self.stamps[name].copy_(self.counter, non_blocking=True)


@dataclass(eq=False)
class Reading:
    """One replay's probe values, read from the graph's staging once the replay is done."""

    probes: GraphProbes
    replay: int  # the counter value this replay leaves in the stamps
    done: torch.cuda.Event | None  # recorded after the replay was launched
    shape: Callable[[dict[str, Tensor]], dict[str, Tensor]] = lambda host: host  # the adapter's trimming (views, each name kept)
    values: dict[str, Tensor] | None = None
    notes: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ready(self) -> bool:
        """The replay's work is done (False, never an exception, after a CUDA error)."""
        if device_fault.faulted():
            return False
        try:
            return self.done is None or bool(self.done.query())
        except RuntimeError as e:
            device_fault.seen_in(e)
            return False

    def collect(self) -> dict[str, Tensor]:
        """The values (once; later calls return the same): only stamps equal to this replay's.

        The adapter's trimming is applied to the staging's views before anything is copied: a
        graph's staging is sized for its padded tokens (a varlen graph's thousands), the step's
        real rows are often a few, and this copy may run on the engine's thread
        (`ProbeBook.before_replay`)."""
        with self._lock:
            if self.values is not None:
                return self.values
            landed: dict[str, Tensor] = {}
            for name, staged in self.probes.staging.items():
                stamp = int(self.probes.stamps[name][0])
                if stamp == self.replay:
                    landed[name] = staged
                elif stamp > self.replay:
                    self.notes.append(f"{name}: overwritten by a later replay before it was read")
                else:
                    self.notes.append(f"{name}: not copied (the replay did not reach it)")
            values = {name: view.clone() for name, view in self.shape(landed).items()}
            # A stamp read before the values: re-check that no replay overwrote them meanwhile.
            for name in list(values):
                if int(self.probes.stamps[name][0]) != self.replay:
                    del values[name]
                    self.notes.append(f"{name}: overwritten by a later replay while it was read")
            self.values = values
            return self.values

    def wait(self) -> dict[str, Tensor]:
        """Wait for the replay (a CUDA error ends the wait: what landed is read) and collect."""
        if self.done is not None and not device_fault.faulted():
            try:
                self.done.synchronize()
            except RuntimeError as e:
                device_fault.seen_in(e)
        return self.collect()


class ProbeBook:
    """Every graph's probes in this process, and the phase of the step running on each thread."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, GraphProbes] = {}
        self._local = threading.local()

    def begin(self, key: Hashable, phase: str) -> None:
        """The step on this thread runs graph `key` in `phase` (Phase.*)."""
        probes = self._graphs.setdefault(key, GraphProbes())
        if phase == Phase.CAPTURE:
            # A new capture of this key (an engine may capture a key again): its graph counts
            # from where the counter stands, as the host does.
            probes.counted = False
            probes.skipped.clear()
        self._local.current = (probes, phase)

    def end(self) -> None:
        self._local.current = None

    def phase(self) -> str:
        current = getattr(self._local, "current", None)
        return current[1] if current is not None else Phase.EAGER

    def probe(self, name: str, tensor: Tensor) -> None:
        """Where an adapter's hook sees a probed tensor: sized at the warm-up, captured at capture."""
        current = getattr(self._local, "current", None)
        if current is None:
            return
        probes, phase = current
        if phase != Phase.CAPTURE:
            return
        if capturing():
            probes.capture(name, tensor)
        else:
            probes.prepare(name, tensor)

    def skipped(self, key: Hashable) -> list[str]:
        probes = self._graphs.get(key)
        return list(probes.skipped) if probes is not None else []

    def before_replay(self, key: Hashable) -> None:
        """On the engine's thread, before graph `key` replays again: its last reading is taken now
        if its replay is done (a host memcpy), since this replay will overwrite the staging."""
        probes = self._graphs.get(key)
        last = probes.last if probes is not None else None
        if last is not None and last.values is None and last.ready():
            last.collect()

    def replayed(
        self, key: Hashable, *, stream: torch.cuda.Stream | None = None, shape: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None, read: bool = True
    ) -> Reading | None:
        """Graph `key` was just launched: the reading of this replay (None: the graph has no probes,
        or `read` is False: a replay of a step not recorded, counted so the stamps stay paired)."""
        probes = self._graphs.get(key)
        if probes is None or not probes.staging or not probes.counted:
            return None
        probes.replays += 1
        if not read:
            return None
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
        reading = Reading(probes=probes, replay=probes.replays, done=done)
        if shape is not None:
            reading.shape = shape
        probes.last = reading
        return reading
