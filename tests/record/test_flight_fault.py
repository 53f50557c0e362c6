"""The flight recorder after a CUDA error, without a GPU: the event and copy objects stand in for a
faulted device (they raise torch.AcceleratorError, as torch does once an error is sticky), and
every call on them after the first error fails the test, since on a GPU such a call may abort the
process (device_fault.py). The ring is written in the thread that saw the error, from the host
copies that landed; steps whose copies did not land are left out, the others marked in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg.record import device_fault
from attndbg.record.host_copy import CopyLost, HostCopy
from attndbg.record.options import RecordOptions
from attndbg.record.probes import GraphProbes, Reading
from attndbg.record.session import RecordingSession
from attndbg.trace import io, synth

ASSERT = "CUDA error: device-side assert triggered"


class _FaultedEvent:
    """Raises like an event of a faulted device, once; any later call is a call the recorder
    must not make."""

    def __init__(self, *, raises: bool = True):
        self.raises, self.calls = raises, 0

    def _call(self) -> bool:
        self.calls += 1
        assert self.calls == 1, "a CUDA call after the device faulted"
        if self.raises:
            raise torch.AcceleratorError(ASSERT)
        return True

    def query(self) -> bool:
        return self._call()

    def synchronize(self) -> None:
        self._call()


class _UntouchableEvent:
    def query(self) -> bool:
        raise AssertionError("an event queried after the device faulted")

    def synchronize(self) -> None:
        raise AssertionError("an event waited on after the device faulted")

    def record(self, stream: object = None) -> None:
        raise AssertionError("an event recorded after the device faulted")


def _device_copy(landed: bool, event: object, **host: torch.Tensor) -> HostCopy:
    """A host copy as a device step leaves it: its tensors, the marker (1 once the copies landed)
    and the event after them."""
    copy = HostCopy({})
    copy._host.update(host)
    copy._markers.append(torch.full((1,), int(landed), dtype=torch.int32))
    copy._events.append(event)  # type: ignore[arg-type]
    return copy


def _trace(step: int):
    trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=3,9"]))
    return replace(trace, source=replace(trace.source, step=step))


@pytest.fixture(autouse=True)
def healthy_device() -> Iterator[None]:
    device_fault.reset()
    yield
    device_fault.reset()


def test_after_a_cuda_error_a_copy_reads_only_what_landed_and_keeps_its_pinned_memory() -> None:
    landed = _device_copy(True, _FaultedEvent(), x=torch.arange(3.0))
    assert torch.equal(landed.wait()["x"], torch.arange(3.0))  # the error ends the wait; the data is there
    assert device_fault.faulted() and "device-side assert" in device_fault.reason()
    lost = _device_copy(False, _UntouchableEvent(), x=torch.zeros(2))
    with pytest.raises(CopyLost, match="never completed"):
        lost.wait()
    assert HostCopy({"y": torch.ones(2)}).wait()["y"].sum() == 2  # host-only copies go on as before
    kept = device_fault.kept_count()
    del landed, lost  # on a GPU, freeing their pinned tensors now would abort the process
    assert device_fault.kept_count() == kept + 4  # two markers, two tensors
    # A fault not reported yet: the copy's last event tells it as the copy is dropped.
    device_fault.reset()
    kept = device_fault.kept_count()
    copy = _device_copy(True, _FaultedEvent(), x=torch.ones(1))
    del copy
    assert device_fault.faulted() and device_fault.kept_count() == kept + 2
    # The clean twin: a healthy device's copy frees its memory.
    device_fault.reset()
    kept = device_fault.kept_count()
    copy = _device_copy(True, _FaultedEvent(raises=False), x=torch.ones(1))
    assert copy.wait()["x"].item() == 1
    del copy
    assert not device_fault.faulted() and device_fault.kept_count() == kept


def test_a_cuda_error_writes_the_ring_in_the_thread_that_saw_it_before_anything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=2, writer="thread"), log=logs.append)

    def queued(*args: object, **kwargs: object) -> None:
        raise AssertionError("queued to the writer thread after a CUDA error")

    monkeypatch.setattr(session, "write", queued)
    monkeypatch.setattr(session, "write_line", queued)
    for step in range(2):  # host-only steps: finished as they close
        session.submit(HostCopy({}), lambda host, step=step: _trace(step), step=session.next_step())
    # Step 2 faulted on the device: its metadata landed (copied ahead of its kernels), its event raises.
    faulted = session.open_step(session.next_step(), _device_copy(True, _FaultedEvent(), x=torch.ones(1)), lambda host: _trace(2))
    session.flight.ring.close(faulted.entry, _FaultedEvent())  # type: ignore[arg-type]
    # The engine's thread opens step 3, whose copies were queued behind the fault and never ran:
    # the ring's poll meets the error and fires, writing at once, in this thread.
    session.open_step(session.next_step(), _device_copy(False, _UntouchableEvent()), lambda host: _trace(3))
    assert [(e.step, e.in_flight) for e in io.read_manifest(tmp_path)] == [(0, False), (1, False), (2, True)], logs
    [trigger] = io.read_triggers(tmp_path)
    assert (trigger.kind, trigger.step) == ("cuda-error", 2) and ASSERT in trigger.message and "seen by the flight recorder" in trigger.message
    assert any("a step in flight was not written: its host copies never completed" in line for line in logs)
    assert "3 of 4 step(s), in flight: [2, 3]" in logs[-1]
    # From now on, host memory only: no new device copy, no event for a closing step.
    assert session.snapshot({"x": torch.ones(1)}) is None
    later = session.open_step(session.next_step(), HostCopy({}), lambda host: _trace(4))
    session.close_step(later)
    assert session.flight.ring.first_in_flight() == 4  # no event recorded: it stays in flight
    monkeypatch.undo()
    session.close()
    assert [t.kind for t in io.read_triggers(tmp_path)] == ["cuda-error"]


def test_a_probe_reading_after_a_cuda_error_reads_the_staging_without_waiting() -> None:
    probes = GraphProbes(staging={"out": torch.arange(4.0)}, stamps={"out": torch.tensor([1])})
    reading = Reading(probes=probes, replay=1, done=_FaultedEvent())  # type: ignore[arg-type]
    assert torch.equal(reading.wait()["out"], torch.arange(4.0)) and device_fault.faulted()
    later = Reading(probes=probes, replay=2, done=_UntouchableEvent())  # type: ignore[arg-type]
    assert not later.ready() and later.wait() == {} and later.notes == ["out: not copied (the replay did not reach it)"]
