"""The ring's reused pinned buffers (record/host_copy.py PinnedPool), on the CPU: a buffer goes back
to the pool only once its device copy landed and nobody will read it again (the ring evicted its
entry, the writer wrote it, the flight thread judged it), and a step packed into a reused buffer is
written with the same bytes as one packed into a fresh buffer.

A machine without CUDA has no pinned memory and no device tensors: the pool allocates plain host
memory here, every tensor is packed as a device tensor would be, and the copy's event is a
stand-in that is done at once. The copies themselves are tests/gpu/test_host_copy.py's."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from attndbg.record import device_fault, host_copy
from attndbg.record.host_copy import HostCopy, PinnedPool, _pack, size_class
from attndbg.record.options import RecordOptions
from attndbg.record.ring import Ring, RingEntry
from attndbg.record.session import RecordingSession
from attndbg.trace import synth


class _Done:
    """A stand-in for the event after a step's copies: complete at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _plain(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


@pytest.fixture(autouse=True)
def packed_on_the_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(host_copy, "_copied_on_device", lambda t: True)
    monkeypatch.setattr(host_copy, "_event_after", lambda stream: _Done())
    monkeypatch.setattr(host_copy, "_pinned", _plain)  # a buffer without a pool
    gc.collect()  # a stand-in faulted copy an earlier test left would latch the fault as it is collected
    device_fault.reset()
    yield
    device_fault.reset()


def _tensors(i: int) -> dict[str, torch.Tensor | None]:
    return {
        "cu_seq_lens_q": torch.arange(0, 3 * (i % 5 + 2), 3, dtype=torch.int32),
        "position_ids": torch.arange(i, i + 7, dtype=torch.int64) * (1 << 33),
        "flag": torch.tensor([True, i % 2 == 0, False]),
        "none": None,
    }


def _slabs(copy: HostCopy) -> list[int]:
    return [pack.slab.data_ptr() for pack in copy._packs if pack.slab is not None]


def _pool_ptrs(pool: PinnedPool) -> set[int]:
    return {b.data_ptr() for free in pool._free.values() for b in free}


def test_size_classes_waste_at_most_a_quarter_and_the_pool_is_bounded() -> None:
    for n in (1, 255, 256, 257, 1000, 4096, 4097, 123457, 1 << 24):
        assert n <= size_class(n) <= max(256, n * 1.25), n
    assert size_class(1000) == size_class(1020)  # near sizes share buffers
    pool = PinnedPool(per_class=2, allocate=_plain)
    buffers = [pool.take(300) for _ in range(3)]
    pool.give(buffers)
    assert pool.free_count() == 2 and pool.allocated == 3
    assert pool.take(300).data_ptr() in {b.data_ptr() for b in buffers[:2]} and pool.reused == 1


def test_growing_steps_reuse_the_buffers_their_ring_gives_back() -> None:
    # A decode batch's metadata grows with its KV index lists (32 requests, 8 bytes a token a step),
    # and a buffer comes back only when its entry leaves a ring of 64, when steps ask for more: the
    # H100's record_overhead run reused 3 buffers in 259 steps when a class had to match exactly.
    pool = PinnedPool(allocate=_plain)
    ring: list[Tensor] = []
    for step in range(400):
        n = 60_000 + 32 * 8 * step
        buffer = pool.take(n)
        assert buffer.numel() >= n
        ring.append(buffer)
        if len(ring) > 64:
            pool.give([ring.pop(0)])
    assert pool.reused >= 0.9 * (400 - 65), (pool.reused, pool.allocated)
    # and a larger free buffer serves a small step only up to REUSE_SPAN times its class: a
    # prefill's slab is not pinned for a decode step's few hundred bytes
    pool.give([pool.take(1 << 20)])
    assert pool.take(300).numel() < 1 << 20


def test_a_reused_dirty_buffer_packs_the_same_bytes_as_a_fresh_one() -> None:
    pool = PinnedPool(allocate=lambda n: torch.full((n,), 0xAB, dtype=torch.uint8))  # stale bytes everywhere
    for i in range(6):
        parts = [(k, t) for k, t in _tensors(i).items() if t is not None]
        fresh, fresh_marker = _pack(parts)
        pooled, pooled_marker = _pack(parts, pool)
        assert pooled.slab is not None and pooled.buffer.data_ptr() == pooled.slab.data_ptr()
        data = sum(n for *_, n in fresh.layout)  # the bytes read back (the padding before the marker is not)
        assert torch.equal(fresh.buffer[:data], pooled.buffer[:data]) and int(pooled_marker[0]) == int(fresh_marker[0]) == 1
        got = pooled.unpack()
        for name, t in parts:
            assert torch.equal(got[name], t), name
        pool.give([pooled.slab])
    assert pool.reused >= 4


def test_a_buffer_waits_for_its_copy_and_for_every_reader() -> None:
    pool = PinnedPool(allocate=_plain)
    copy = HostCopy(_tensors(0), pool=pool)
    slabs = _slabs(copy)
    assert slabs
    copy.hold()  # the ring
    copy.hold()  # the writer
    copy.release()
    assert pool.free_count() == 0, "handed back while the writer still reads it"
    copy._markers[0].zero_()  # the device copy has not landed yet
    copy.release()
    assert pool.free_count() == 0, "handed back while the device still copies into it"
    assert copy.wait()["position_ids"].tolist() == _tensors(0)["position_ids"].tolist()  # left to torch, still readable

    done = HostCopy(_tensors(1), pool=pool)
    done_slabs = set(_slabs(done))
    done.hold()
    done.release()
    assert _pool_ptrs(pool) == done_slabs
    with pytest.raises(RuntimeError, match="went back to the pool"):
        done.wait()


def test_the_ring_hands_a_buffer_back_only_when_it_evicts_the_entry() -> None:
    pool = PinnedPool(allocate=_plain)
    ring = Ring(2)
    entries, slabs = [], []
    for step in range(4):
        entry = RingEntry(step=step, copy=HostCopy(_tensors(step), pool=pool), build=lambda host: None)
        slabs.append(set(_slabs(entry.copy)))
        in_ring = {p for e, s in zip(entries, slabs) if not e.evicted for p in s}
        assert not slabs[-1] & in_ring, f"step {step} got a buffer of an entry still in the ring"
        ring.add(entry)
        ring.close(entry, None)
        entries.append(entry)
    # step 0 left as step 2 came in, and step 3 took its buffer; step 1's is free
    assert ring.steps() == [2, 3] and pool.reused == 1 and _pool_ptrs(pool) == slabs[1]
    assert slabs[3] == slabs[0] and entries[0].copy._recycled and not entries[2].copy._recycled
    taken = ring.take()
    assert pool.free_count() == 1, "take() keeps the ring's hold for the taker"
    for entry, _ in taken:
        entry.copy.release()
    assert pool.free_count() == 3


def test_an_evicted_entry_under_judgement_keeps_its_buffer(tmp_path: Path) -> None:
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=1))
    try:
        flight = session.flight
        flight.pool = pool = PinnedPool(allocate=_plain)
        gate = threading.Event()
        judged: list[list[int]] = []

        def judge(host):  # type: ignore[no-untyped-def]
            gate.wait(10)
            judged.append(host["position_ids"].tolist())

        first = session.snapshot(_tensors(0))
        assert first is not None
        session.close_step(session.open_step(0, first, lambda host: None))
        flight.check(first, judge)
        for step in (1, 2):
            copy = session.snapshot(_tensors(step))
            session.close_step(session.open_step(step, copy, lambda host: None))
        assert 0 not in session.flight.ring.steps()
        assert not set(_slabs(first)) & _pool_ptrs(pool), "reused while the flight thread still had to judge it"
        gate.set()
        assert flight.drain(10)
        assert judged == [_tensors(0)["position_ids"].tolist()]
        assert first._recycled
    finally:
        session.close()


def test_a_step_taken_while_open_keeps_its_buffers_until_its_call_returns(tmp_path: Path) -> None:
    """A trigger may take and write a step while the engine's call still runs: the copy still
    receives the call's tensors (and the flight thread may still judge it) after it was written."""
    from attndbg.record.triggers import Trigger, TriggerKind

    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=2, when=("nan",)))
    try:
        flight = session.flight
        flight.pool = pool = PinnedPool(allocate=_plain)
        copy = session.snapshot(_tensors(0))
        handle = session.open_step(0, copy, lambda host: None)
        slabs = set(_slabs(copy))
        flight.fire(Trigger(kind=TriggerKind.SIGNAL, step=0, message="test"))
        session.flush()  # written while the call runs
        assert not slabs & _pool_ptrs(pool) and not copy._recycled
        copy.add({"layer0.output": torch.ones(2, 3)})
        session.close_step(handle)  # --when nan: the flight thread judges it now
        assert flight.drain(10)
        assert copy._recycled and slabs <= _pool_ptrs(pool)
    finally:
        session.close()


def _write_ring(tmp_path: Path, *, pooled: bool) -> dict[str, bytes]:
    """Twelve steps through a ring of 3 whose step files carry their copied values; the ring is
    fired while the writer is held up, then steps go on (reusing buffers) until it is written."""
    from attndbg.record.triggers import Trigger, TriggerKind

    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=3))
    hold_up = threading.Event()
    try:
        flight = session.flight
        flight.pool = PinnedPool(allocate=lambda n: torch.full((n,), 0x5A, dtype=torch.uint8)) if pooled else None

        def build(host, step):  # type: ignore[no-untyped-def]
            hold_up.wait(10)
            lens = host["cu_seq_lens_q"].diff().tolist()
            kv = ",".join(str(int(v) + int(host["position_ids"][0] >> 33)) for v in lens)
            trace = synth.build(synth.parse_spec(["decode-gqa", f"kv_lens={kv}"]))
            return replace(trace, source=replace(trace.source, step=step))

        copies = {}
        for step in range(12):
            copies[step] = copy = session.snapshot(_tensors(step))
            session.close_step(session.open_step(step, copy, lambda host, step=step: build(host, step)))
            if step == 7:
                flight.fire(Trigger(kind=TriggerKind.SIGNAL, step=step, message="test"))
        if pooled:  # steps 5-7 wait for the writer: their buffers are neither free nor reused by 8-11
            waiting = {p for step in (5, 6, 7) for p in _slabs(copies[step])}
            later = {p for step in range(8, 12) for p in _slabs(copies[step])}
            assert len(waiting) == 3 and not waiting & (_pool_ptrs(flight.pool) | later)
            assert flight.pool.reused > 0
        hold_up.set()
        session.flush()
    finally:
        hold_up.set()
        session.close()
    return {p.name: p.read_bytes() for p in sorted(tmp_path.glob("*.pt"))}


def test_a_fired_ring_writes_the_same_bytes_with_reused_buffers(tmp_path: Path) -> None:
    fresh = _write_ring(tmp_path / "fresh", pooled=False)
    pooled = _write_ring(tmp_path / "pooled", pooled=True)
    assert sorted(fresh) == ["step_000005.pt", "step_000006.pt", "step_000007.pt"]
    assert pooled == fresh
