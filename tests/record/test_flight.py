"""The flight recorder's engine-neutral parts: the ring, the triggers, the manifest's trigger lines,
the spool `record` keeps on a failed exit, the pointer audit and the pairing of in-graph probe
readings with their replays (tests/record/test_flight_live.py runs them on a live engine)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg.record import device_fault, signals, spool
from attndbg.record.options import OptionError, RecordOptions
from attndbg.record.pointer_audit import PointerAudit, addresses
from attndbg.record.probes import GraphProbes, Reading
from attndbg.record.ring import MAX_IN_FLIGHT, Ring, RingEntry
from attndbg.record.session import HostCopy, RecordingSession
from attndbg.record.triggers import LOGITS_FINITE, Trigger, TriggerKind, from_exception, nonfinite, parse_when
from attndbg.trace import io, synth
from attndbg.trace.validate import TraceError


@pytest.fixture(autouse=True)
def healthy_device() -> Iterator[None]:
    """A stand-in event that raises latches the process-wide fault (device_fault.py): each test
    starts and ends with a healthy device."""
    device_fault.reset()
    yield
    device_fault.reset()


def _trace(step: int):
    trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=3,9"]))
    return replace(trace, source=replace(trace.source, step=step))


class _Event:
    """A stand-in for a CUDA event: done when told, or raising like a faulted device."""

    def __init__(self, done: bool = False, error: bool = False):
        self.done, self.error = done, error

    def query(self) -> bool:
        if self.error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done


def _entry(step: int) -> RingEntry:
    return RingEntry(step=step, copy=HostCopy({}), build=lambda host, step=step: _trace(step))


def test_the_ring_keeps_k_finished_steps_and_every_step_in_flight() -> None:
    ring = Ring(3)
    events = {}
    for step in range(6):
        entry = _entry(step)
        ring.add(entry)
        events[step] = _Event(done=True)
        ring.close(entry, events[step])
        ring.poll()
    assert ring.steps() == [3, 4, 5]
    # Steps 6-8 are queued on a device that faults at step 6: none is seen finished, all are kept.
    for step in (6, 7, 8):
        entry = _entry(step)
        ring.add(entry)
        ring.close(entry, _Event(error=True))
    assert ring.steps() == [3, 4, 5, 6, 7, 8] and ring.first_in_flight() == 6
    taken = ring.take()
    assert [(e.step, flying) for e, flying in taken] == [(3, False), (4, False), (5, False), (6, True), (7, True), (8, True)]
    assert ring.steps() == []
    # A step whose call raised is never closed: it stays in flight; past MAX_IN_FLIGHT the oldest goes.
    for step in range(3 + MAX_IN_FLIGHT + 2):
        ring.add(_entry(step))
    assert len(ring.steps()) == 3 + MAX_IN_FLIGHT and ring.steps()[0] == 2


def test_the_ring_counts_steps_finished_out_of_order_and_by_the_flight_thread() -> None:
    """A later step seen done before an earlier one (another stream), a step the flight thread
    waited on (mark_finished), a step taken while open: the ring keeps exactly K finished steps and
    marks in flight exactly the steps not seen done."""
    ring = Ring(2)
    events = {step: _Event() for step in range(5)}
    entries = {step: _entry(step) for step in range(5)}
    for step in range(5):
        ring.add(entries[step])
        ring.close(entries[step], events[step])
    events[3].done = True  # step 3 done while 0-2 are not
    ring.poll()
    assert entries[3].finished and ring.first_in_flight() == 0 and ring.steps() == [0, 1, 2, 3, 4]
    ring.mark_finished(entries[1])  # the flight thread waited on step 1's event
    events[0].done = events[2].done = True
    ring.poll()  # finished: 0, 1, 2, 3; the ring keeps the newest two of them and step 4
    assert ring.steps() == [2, 3, 4] and ring.first_in_flight() == 4
    open_entry = _entry(5)
    ring.add(open_entry)
    taken = ring.take()  # a trigger takes the ring while step 5 is open
    assert [(e.step, flying) for e, flying in taken] == [(2, False), (3, False), (4, True), (5, True)]
    ring.close(open_entry, None)  # its call returns after the take: not back in the ring, not counted
    for step in range(6, 9):
        entry = _entry(step)
        ring.add(entry)
        ring.close(entry, None)
    assert ring.steps() == [7, 8]


def test_the_engine_s_poll_leaves_followed_steps_to_the_flight_thread() -> None:
    """A step the flight thread follows is not asked by the engine's poll (the flight thread marks
    it); a trigger asks it before naming the oldest step in flight or taking the ring, so the
    steps written and their in-flight marks are what asking every step would give."""

    class _Counted(_Event):
        asked = 0

        def query(self) -> bool:
            type(self).asked += 1
            return super().query()

    ring = Ring(2)
    entries = {step: _entry(step) for step in range(4)}
    events = {step: _Counted(done=True) for step in range(4)}
    for step in range(4):
        assert ring.poll(followed=False) is None
        ring.add(entries[step])
        ring.close(entries[step], events[step], followed=True)
    assert _Counted.asked == 0 and ring.steps() == [0, 1, 2, 3]
    ring.mark_finished(entries[0])  # the flight thread saw step 0 done
    assert ring.first_in_flight() is None and _Counted.asked == 3  # steps 1-3 asked, all done
    assert ring.steps() == [2, 3]
    events[4] = _Counted()  # not done
    entries[4] = _entry(4)
    ring.add(entries[4])
    ring.close(entries[4], events[4], followed=True)
    assert [(e.step, flying) for e, flying in ring.take()] == [(2, False), (3, False), (4, True)]


def test_a_step_closed_with_its_probe_reading_s_event_is_finished_by_that_event(tmp_path: Path) -> None:
    """A replayed step whose probe reading recorded an event after all of its work is marked by
    that event (no second one recorded at the same point): in flight until it completes."""
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), writer="thread", ring=2))
    flight = session.flight
    done = _Event()
    entry = flight.open(0, HostCopy({}), lambda host: _trace(0))
    flight.close(entry, done=done)  # type: ignore[arg-type] - a stand-in event
    assert entry.done is done and flight.in_flight_step() == 0
    done.done = True
    assert flight.in_flight_step() is None and entry.finished
    session.close()


def test_when_conditions_parse_and_bad_ones_name_themselves() -> None:
    assert parse_when(["nan"]).nan and parse_when(["nan"]).accept_below is None
    both = parse_when(["nan, accept<0.2"])
    assert both.nan and both.accept_below == 0.2 and both.any
    assert not parse_when([]).any
    for bad in ("inf", "accept>0.2", "accept<0", "accept<1.5", "accept<"):
        with pytest.raises(OptionError, match="--when"):
            parse_when([bad])


def test_exceptions_are_told_apart_by_their_cuda_words() -> None:
    cuda = from_exception(RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be ..."), 7, "here")
    assert cuda.kind is TriggerKind.CUDA_ERROR and cuda.step == 7 and cuda.message == "RuntimeError: CUDA error: device-side assert triggered (here)"
    plain = from_exception(ValueError("no requests"), None, "there")
    assert plain.kind is TriggerKind.EXCEPTION and plain.step is None


def test_nonfinite_finds_nan_in_outputs_and_false_logits_flags() -> None:
    clean = {"layer0.output": torch.ones(4, 2, 8), LOGITS_FINITE: torch.ones(3, dtype=torch.bool)}
    assert nonfinite(clean, ("layer0.output", LOGITS_FINITE)) is None
    output = torch.ones(4, 2, 8)
    output[2, 1, 3] = float("inf")
    assert nonfinite({"layer0.output": output}, ("layer0.output",)) == "layer0.output: 1 NaN/Inf value(s), first in row 2"
    flags = torch.tensor([True, False, False])
    assert nonfinite({LOGITS_FINITE: flags}, (LOGITS_FINITE,)) == "logits: row 1 is not finite (2 row(s))"
    assert nonfinite({"layer0.output": output}, (LOGITS_FINITE,)) is None  # only what is watched


def test_manifest_trigger_lines_are_read_apart_from_steps(tmp_path: Path) -> None:
    io.append_to_recording(tmp_path, _trace(4))
    io.append_to_recording(tmp_path, _trace(5), in_flight=True)
    io.append_manifest_line(tmp_path, io.trigger_line(io.TriggerLine(kind="cuda-error", step=5, message="boom", pid=12)))
    lines = (tmp_path / io.MANIFEST).read_text().splitlines()
    assert "in_flight" not in lines[0] and json.loads(lines[1])["in_flight"] is True  # stored only when true
    entries = io.read_manifest(tmp_path)
    assert [(e.step, e.in_flight) for e in entries] == [(4, False), (5, True)]
    assert io.read_triggers(tmp_path) == [io.TriggerLine(kind="cuda-error", step=5, message="boom", code=None, pid=12)]
    assert io.trace_paths(tmp_path) == [tmp_path / "step_000004.pt", tmp_path / "step_000005.pt"]
    io.append_manifest_line(tmp_path, json.dumps({"trigger": {"kind": "exit", "message": 3}}))
    with pytest.raises(TraceError, match=r"line 4\.trigger\.message"):
        io.read_triggers(tmp_path)
    (tmp_path / io.MANIFEST).write_text(lines[0] + "\n" + json.dumps({"trigger": {"kind": "exit", "message": "x", "color": "red"}}) + "\n")
    with pytest.raises(TraceError, match=r"line 2\.trigger\.color"):
        io.read_triggers(tmp_path)
    (tmp_path / io.MANIFEST).write_text(lines[0] + "\n" + json.dumps({"trigger": {}, "file": "x"}) + "\n")
    with pytest.raises(TraceError, match="line 2"):  # a step line with a stray key is still refused
        io.read_manifest(tmp_path)


def test_a_fired_ring_is_written_with_its_steps_in_flight_marked(tmp_path: Path) -> None:
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=2, writer="thread"), log=logs.append)
    for step in range(5):
        assert session.next_step() == step
        session.submit(HostCopy({"x": torch.ones(2)}), lambda host, step=step: _trace(step))
    handle = session.open_step(session.next_step(), HostCopy({}), lambda host: _trace(5))  # its call never returns
    assert not (tmp_path / io.MANIFEST).exists()  # a ring writes nothing until a trigger fires
    session.fail_step(handle, ValueError("the engine broke"), "a test")
    session.flight.fire(Trigger(kind=TriggerKind.EXCEPTION, step=9, message="again"))  # a kind fires once
    session.close()
    assert [(e.step, e.in_flight) for e in io.read_manifest(tmp_path)] == [(3, False), (4, False), (5, True)]
    assert [(t.kind, t.step, t.pid) for t in io.read_triggers(tmp_path)] == [("exception", 5, os.getpid())]
    assert session.flight.skipped == {TriggerKind.EXCEPTION: 1}
    assert len(logs) == 1 and "on exception at step 5" in logs[0] and "in flight: [5]" in logs[0]


def test_sigusr1_writes_the_ring_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from attndbg.record import session as session_module

    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=4, writer="thread"), log=lambda _: None)
    monkeypatch.setattr(session_module, "_SESSION", session)
    for step in range(3):
        session.next_step()
        session.submit(HostCopy({}), lambda host, step=step: _trace(step))
    signals._on_usr1(signal.SIGUSR1, None)  # what the handler does: enqueue, the flight thread writes
    session.flight.drain(10)
    session.next_step()
    session.submit(HostCopy({}), lambda host: _trace(3))
    signals._on_usr1(signal.SIGUSR1, None)
    session.close()
    assert [e.step for e in io.read_manifest(tmp_path)] == [0, 1, 2, 3]
    assert [(t.kind, t.step) for t in io.read_triggers(tmp_path)] == [("signal", 2), ("signal", 3)]


def test_signal_handlers_leave_an_engine_s_own_handler_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {}
    own = lambda signum, frame: None  # noqa: E731 - an engine's handler
    current = {signal.SIGUSR1: signal.SIG_DFL, signal.SIGTERM: own, signal.SIGHUP: signal.SIG_DFL}
    monkeypatch.setattr(signal, "getsignal", lambda signum: current[signum])
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.setdefault(signum, handler))
    signals.install()
    assert installed == {signal.SIGUSR1: signals._on_usr1, signal.SIGHUP: signals._on_terminate}


def test_the_spool_is_promoted_with_an_exit_trigger_per_process(tmp_path: Path) -> None:
    spool_dir, out = tmp_path / "spool", tmp_path / "rec"
    out.mkdir()
    for pid, steps in ((101, (3, 4)), (202, (4,))):
        for step in steps:
            io.append_to_recording(spool_dir / str(pid), _trace(step), in_flight=step == 4 and pid == 101)
    spool.register(RecordOptions(out_dir=str(out), spool_dir=str(spool_dir)), 101)
    assert spool.ring_pids(spool_dir) == [101]
    written = spool.promote(spool_dir, out, code=139, words="killed by SIGSEGV")
    assert [(t.kind, t.step, t.code, t.pid) for t in written] == [("exit", 4, 139, 101), ("exit", 4, 139, 202)]
    entries = io.read_manifest(out)
    # Both processes recorded a step 4: the second keeps it under its process id.
    assert [(e.file, e.in_flight) for e in entries] == [("step_000003.pt", False), ("step_000004.pt", True), ("p202_step_000004.pt", False)]
    assert all(io.load(out / e.file).source.step == e.step for e in entries)
    assert io.read_triggers(out)[0].message == "the command killed by SIGSEGV"


def test_pointer_audit_names_a_moved_buffer_once_and_passes_a_stable_one() -> None:
    everything = lambda t: True  # noqa: E731 - CPU tensors stand in for the device's here
    audit = PointerAudit(keep=everything)
    static = {"kv_indptr": torch.zeros(9, dtype=torch.int32), "lens": {"full": torch.zeros(8)}, "rows": [torch.zeros(4)]}
    audit.captured(("decode", 8), static)
    assert audit.replayed(("decode", 8), static) == []  # the correct twin: buffers written in place
    static["kv_indptr"].copy_(torch.arange(9))
    assert audit.replayed(("decode", 8), static) == []
    moved = dict(static, lens={"full": torch.zeros(8)})  # reallocated before the replay
    found = audit.replayed(("decode", 8), moved)
    assert [m.path for m in found] == ["lens.full"] and "lens.full moved since its CUDA graph ('decode', 8)" in found[0].message("batch")
    assert audit.replayed(("decode", 8), moved) == []  # said once
    assert audit.replayed(("decode", 4), moved) == []  # a graph never captured is not judged
    assert set(addresses(static, keep=everything)) == {"kv_indptr", "lens.full", "rows.0"}
    assert addresses(static) == {}  # by default only device tensors: host mirrors are rebuilt by design


def test_pointer_audit_judges_each_path_as_before_when_any_pointer_differs() -> None:
    """A replay where every pointer is the captured one is one comparison; any difference (a moved
    buffer, a path gone, a tensor the audit does not keep) falls back to the path-by-path judgement."""
    device_like = lambda t: t.dtype != torch.float64  # noqa: E731 - float64 tensors stand in for host mirrors
    audit = PointerAudit(keep=device_like)
    static = {"a": torch.zeros(4, dtype=torch.int32), "b": torch.zeros(4, dtype=torch.int32), "c": [torch.zeros(2)], "host": torch.zeros(2, dtype=torch.float64)}
    audit.captured("g", static)
    assert audit.replayed("g", dict(static, a=static["a"][:2])) == []  # a view at the same address
    assert audit.replayed("g", dict(static, b=None)) == []  # gone since capture: not compared
    assert audit.replayed("g", dict(static, b=torch.zeros(4, dtype=torch.float64))) == []  # not kept now
    assert audit.replayed("g", dict(static, host=torch.zeros(2, dtype=torch.float64))) == []  # never audited
    found = audit.replayed("g", dict(static, b=None, c=[torch.zeros(2)]))
    assert [m.path for m in found] == ["c.0"] and found[0].captured == static["c"][0].data_ptr()
    audit.captured("empty", {"host": static["host"]})
    assert audit.replayed("empty", {"host": torch.zeros(1)}) == []


def test_probe_readings_pair_stamps_with_their_replay() -> None:
    probes = GraphProbes(staging={"layer0.q": torch.arange(6.0).reshape(3, 2), "layer0.output": torch.zeros(3, 2)}, stamps={"layer0.q": torch.tensor([2]), "layer0.output": torch.tensor([1])})
    reading = Reading(probes=probes, replay=2, done=None, shape=lambda host: {k: v[:2] for k, v in host.items()})
    values = reading.collect()
    assert list(values) == ["layer0.q"] and torch.equal(values["layer0.q"], torch.arange(4.0).reshape(2, 2))
    assert reading.notes == ["layer0.output: not copied (the replay did not reach it)"]
    assert reading.collect() is values  # once
    late = Reading(probes=probes, replay=1, done=None)
    assert list(late.collect()) == ["layer0.output"] and late.notes == ["layer0.q: overwritten by a later replay before it was read"]
    probes.staging["layer0.q"][0, 0] = 99.0  # the staging is copied out, never handed over
    assert values["layer0.q"][0, 0] == 0.0


def test_sglang_graph_metadata_audit_and_verify_acceptance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's hooks (attndbg/record/sglang/flight.py) on stand-ins of its objects: a backend whose
    forward_metadata is rebuilt before a replay fires the ring once, one written in place does
    not; a verify step accepting 1 of 9 drafts fires `accept<0.2`, one accepting 8 of 9 does not."""
    from types import SimpleNamespace

    from attndbg.record import session as session_module
    from attndbg.record.sglang import flight as sglang_flight

    monkeypatch.setattr(sglang_flight, "AUDIT", PointerAudit(keep=lambda t: True))  # CPU tensors stand in
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=4, writer="thread", when=("accept<0.2",)), log=lambda _: None)
    monkeypatch.setattr(session_module, "_SESSION", session)
    decode = SimpleNamespace(name="DECODE")
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(kv_indptr=torch.zeros(9, dtype=torch.int32), kv_indices=torch.zeros(64, dtype=torch.int32)))
    sglang_flight.audit_out_graph(backend, SimpleNamespace(batch_size=8, forward_mode=decode), in_capture=True)
    view = SimpleNamespace(batch_size=8, forward_mode=decode, num_padding=3)
    for step in range(2):
        session.next_step()
        session.submit(HostCopy({}), lambda host, step=step: _trace(step))
        sglang_flight.audit_out_graph(backend, view, in_capture=False)  # buffers kept: the correct twin
    assert session.flight.fired == []
    backend.forward_metadata.kv_indices = torch.zeros(64, dtype=torch.int32)  # rebuilt instead of written in place
    sglang_flight.audit_out_graph(backend, view, in_capture=False)
    sglang_flight.audit_out_graph(backend, view, in_capture=False)
    [fired] = session.flight.fired
    assert fired.kind is TriggerKind.POINTER and fired.step == 2 and "kv_indices moved since its CUDA graph" in fired.message

    class Worker:
        speculative_num_draft_tokens = 4

        def __init__(self, accept_lens: list[int]):
            self.accept_lens = accept_lens

        def verify(self, batch: object) -> SimpleNamespace:
            return SimpleNamespace(accept_lens=torch.tensor(self.accept_lens))  # bonus token included

    Worker.verify = sglang_flight.wrap_verify(Worker.verify)
    Worker([4, 4, 3]).verify(None)  # 8 of 9 drafts accepted
    session.flight.drain(10)
    assert [t.kind for t in session.flight.fired] == [TriggerKind.POINTER]
    Worker([1, 1, 2]).verify(None)  # 1 of 9
    session.flight.drain(10)
    assert session.flight.fired[-1].kind is TriggerKind.ACCEPT and "accepted 1 of 9 draft tokens (0.111 < 0.2)" in session.flight.fired[-1].message
    session.close()
    assert [t.kind for t in io.read_triggers(tmp_path)] == ["pointer", "accept"]


def test_an_error_the_engine_only_logs_fires_the_ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's scheduler catches its exception, logs the traceback and has its parent kill it: the
    ERROR record is where the ring can still be written. A logged error without an exception or
    CUDA error words (a bad request) fires nothing."""
    import logging

    from attndbg.record import session as session_module

    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), ring=2, writer="thread"), log=lambda _: None)
    monkeypatch.setattr(session_module, "_SESSION", session)
    session.next_step()
    session.submit(HostCopy({}), lambda host: _trace(0))
    logger = logging.getLogger("sglang.srt.managers.scheduler")
    logger.error("Error processing request: prompt too long")
    assert session.flight.fired == []
    logger.error("Scheduler hit an exception: Traceback (most recent call last):\n  File ...\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    [fired] = session.flight.fired
    assert fired.kind is TriggerKind.CUDA_ERROR and fired.step == 0
    assert fired.message == "RuntimeError: CUDA error: an illegal memory access was encountered (logged by sglang.srt.managers.scheduler)"
    session.close()
    assert [e.step for e in io.read_manifest(tmp_path)] == [0]


def test_a_hook_failing_on_a_cuda_error_writes_the_ring_before_recording_stops(tmp_path: Path) -> None:
    """A device fault may surface first in one of the recorder's own CUDA calls: the hook's guard
    fires the ring (its steps written although recording then stops); any other hook error only
    stops recording, as outside ring mode."""
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path / "cuda"), ring=3, writer="thread"), log=logs.append)
    for step in range(4):
        session.next_step()
        session.submit(HostCopy({}), lambda host, step=step: _trace(step))
    with session.guard("a test hook"):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert not session.enabled
    session.close()
    assert [e.step for e in io.read_manifest(tmp_path / "cuda")] == [1, 2, 3]
    assert [(t.kind, t.step) for t in io.read_triggers(tmp_path / "cuda")] == [("cuda-error", 3)]
    assert "recording stopped" in logs[-1]
    other = RecordingSession(RecordOptions(out_dir=str(tmp_path / "bug"), ring=3, writer="thread"), log=lambda _: None)
    other.next_step()
    other.submit(HostCopy({}), lambda host: _trace(0))
    with other.guard("a test hook"):
        raise KeyError("layout changed")
    other.close()
    assert not other.enabled and not (tmp_path / "bug" / io.MANIFEST).exists()
