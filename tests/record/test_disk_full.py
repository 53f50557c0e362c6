"""When the disk fills, recording stops with one log line naming the directory and the reason, and
the engine goes on.

A full disk is real where it can be: a manifest that is a link to /dev/full gets ENOSPC from the
kernel in whichever process writes it (the writer child included). A step file's own write is
made to fail by replacing `os.fsync` in this process (the thread writer), the OS call being what
is simulated, not attndbg. The size cap (--max-size) is tested in test_recorder_core.py.
"""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg import atomic
from attndbg.record import session as session_module
from attndbg.record.options import RecordOptions
from attndbg.record.session import HostCopy, RecordingSession, current_session, end_session, start_session
from attndbg.trace import io, synth
from tests.record.engines import import_engine

DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this system")


def _trace(step: int):
    trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=3,9"]))
    return replace(trace, source=replace(trace.source, step=step))


def _full_manifest(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / io.MANIFEST).symlink_to(DEV_FULL)  # every append gets ENOSPC (never read it back: it is endless zeros)
    return directory


def _engine_steps(session: RecordingSession, steps: int) -> list[int]:
    """What an engine's hooks do per step; returns the steps the 'engine' ran past them."""
    ran = []
    for _ in range(steps):
        step = session.next_step()
        if session.wants(step):
            session.submit(HostCopy({"x": torch.ones(2)}), lambda host, step=step: _trace(step))
        ran.append(step)
    return ran


@needs_dev_full
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_enospc_on_the_manifest_stops_recording_with_one_line(tmp_path: Path, writer: str) -> None:
    rec = _full_manifest(tmp_path / "rec")
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(rec), writer=writer), log=logs.append)
    assert _engine_steps(session, 4) == [0, 1, 2, 3]
    session.close()
    assert not session.enabled and len(logs) == 1, logs
    assert f"to {rec}: ENOSPC: No space left on device" in logs[0] and "the engine goes on" in logs[0]
    assert session.stats.written == 0 and not list(rec.glob(".*.tmp"))


def test_enospc_on_a_step_file_keeps_the_steps_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = tmp_path / "rec"
    real_fsync, calls = os.fsync, []

    def fills_after_one(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fills_after_one)
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(rec), writer="thread"), log=logs.append)
    assert _engine_steps(session, 1) == [0]
    session.flush()
    assert _engine_steps(session, 3) == [1, 2, 3]  # the engine runs on, the disk fills under step 1
    session.close()
    assert len(logs) == 1 and f"cannot write step_000001.pt to {rec}: ENOSPC" in logs[0], logs
    assert [e.step for e in io.read_manifest(rec)] == [0] and not list(rec.glob(".*.tmp"))
    assert len(calls) == 2  # stopped: steps 2 and 3 were never written


def test_a_log_line_that_cannot_be_written_is_not_raised_into_the_engine(tmp_path: Path) -> None:
    def full_stderr(message: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), writer="thread"), log=full_stderr)
    with session.guard("a hook"):
        raise RuntimeError("the hook failed")
    assert not session.enabled
    session.close()


def test_a_directory_that_cannot_be_made_is_one_line_and_no_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNDBG_RECORD", RecordOptions(out_dir=str(blocker / "rec")).to_env())
    monkeypatch.setattr(session_module, "_SESSION", None)
    try:
        assert current_session() is None and current_session() is None  # asked on every hook: tried once
    finally:
        end_session()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"recording not started, the engine goes on (cannot write to {blocker / 'rec'}: ENOTDIR" in err


@needs_dev_full
@pytest.mark.parametrize("max_bytes", [None, 1], ids=["enospc", "max-size"])
def test_a_live_engine_generates_the_same_tokens_when_recording_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], max_bytes: int | None
) -> None:
    """transformers' continuous batching, recorded by its adapter with the writer child: the disk
    fills at the first step (or the first step reaches --max-size); the generation is unchanged."""
    import_engine("transformers.generation.continuous_batching")
    from attndbg.record.transformers import adapter as transformers_cb
    from attndbg.examples import transformers_generate as live

    model = live.tiny_llama()
    expected = live.generate(model, max_new_tokens=3)
    rec = tmp_path / "rec"
    if max_bytes is None:
        _full_manifest(rec)
    session = start_session(RecordOptions(out_dir=str(rec), max_bytes=max_bytes or 2 << 30))
    transformers_cb.install()
    try:
        assert live.generate(model, max_new_tokens=3) == expected
        session.flush()
    finally:
        stats = end_session()
        transformers_cb.uninstall()
    assert stats is not None and not session.enabled
    err = capsys.readouterr().err
    assert err.count("recording stopped") == 1, err
    if max_bytes is None:
        assert stats.written == 0 and f"to {rec}: ENOSPC: No space left on device" in err
    else:
        assert stats.written == 1 and "size cap reached" in err and [e.step for e in io.read_manifest(rec)] == [0]
