"""The recorder's engine-neutral rules: options, sampling, the size cap, fail-once, the CLI, the startup hook."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.record.launch import recording_env
from attndbg.record.options import OptionError, RecordOptions, parse_layers, parse_size, parse_steps
from attndbg.record.session import HostCopy, RecordingSession
from attndbg.trace import io, synth


def test_option_parsing_and_errors() -> None:
    assert parse_steps("3:7") == (3, 7) and parse_steps("5:") == (5, None) and parse_steps(":4") == (0, 4) and parse_steps(None) == (0, None)
    assert parse_layers("5,0,5") == (0, 5) and parse_layers(None) == ()
    assert parse_size("2G") == 2 << 30 and parse_size("500M") == 500 << 20 and parse_size("123") == 123
    for bad, parse in [("7:3", parse_steps), ("x", parse_steps), ("0,a", parse_layers), ("-1", parse_layers), ("lots", parse_size), ("0", parse_size)]:
        with pytest.raises(OptionError):
            parse(bad)


def test_sampling_every_and_steps() -> None:
    options = RecordOptions(out_dir="x", every=3, first_step=2, last_step=11)
    assert [s for s in range(20) if options.wants_step(s)] == [2, 5, 8]
    assert RecordOptions.from_env({"ATTNDBG_RECORD": options.to_env()}) == options
    assert RecordOptions.from_env({}) is None


def _trace(step: int):
    from dataclasses import replace

    trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=3,9"]))
    return replace(trace, source=replace(trace.source, step=step))


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_session_writes_steps_in_order_and_stops_at_the_size_cap(tmp_path: Path, writer: str) -> None:
    size = len(io.save(_trace(0), tmp_path / "probe.pt").read_bytes())
    (tmp_path / "probe.pt").unlink()
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path / "rec"), max_bytes=int(2.5 * size), writer=writer), log=logs.append)
    for _ in range(5):
        step = session.next_step()
        session.submit(HostCopy({"x": torch.ones(2)}), lambda host, step=step: _trace(step))
    session.close()
    # Two steps fit under 2.5 files' worth; the third crosses the cap and stops recording.
    assert [e.step for e in io.read_manifest(tmp_path / "rec")] == [0, 1, 2]
    assert not session.enabled and len(logs) == 1 and "size cap" in logs[0]


def test_the_writer_process_writes_what_the_thread_writes_and_reports_a_bad_step(tmp_path: Path) -> None:
    from dataclasses import replace

    assert RecordOptions(out_dir="x").writer == "process"  # the default keeps saving off the engine
    for writer in ("process", "thread"):
        session = RecordingSession(RecordOptions(out_dir=str(tmp_path / writer), writer=writer))
        session.submit(HostCopy({}), lambda host: _trace(7))
        session.close()
    a, b = io.load(tmp_path / "process" / "step_000007.pt"), io.load(tmp_path / "thread" / "step_000007.pt")
    assert all(torch.equal(getattr(a.batch, f), getattr(b.batch, f)) for f in ("kv_lens", "slot_ids", "out_cache_loc", "positions"))
    assert a.model == b.model and a.source == b.source
    # A step the child's validator rejects: recording stops with one line naming the field.
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path / "bad")), log=logs.append)
    trace = _trace(1)
    bad = replace(trace, batch=replace(trace.batch, slot_ids=trace.batch.slot_ids + trace.batch.kv_cache_size))
    for _ in range(3):
        session.submit(HostCopy({}), lambda host: bad)
    session.close()
    assert not session.enabled and len(logs) == 1 and "batch.slot_ids" in logs[0]
    assert not (tmp_path / "bad" / "manifest.jsonl").exists()


def test_steps_beyond_the_pending_bytes_are_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from attndbg.record import session as session_module

    monkeypatch.setattr(session_module, "MAX_PENDING_BYTES", 100)
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path), writer="thread"))
    gate = threading.Event()

    def slow(host):  # noqa: ANN001 - a writer still busy with this step
        gate.wait(10)
        return _trace(int(host["x"][0]))

    session.submit(HostCopy({"x": torch.zeros(20)}), slow)  # 80 bytes waiting
    session.submit(HostCopy({"x": torch.ones(20)}), slow)  # 160 > 100: dropped, the engine does not wait
    gate.set()
    session.close()
    assert session.stats.dropped_queue_full == 1 and [e.step for e in io.read_manifest(tmp_path)] == [0]


def test_a_failing_build_disables_recording_once(tmp_path: Path) -> None:
    logs: list[str] = []
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path)), log=logs.append)

    def boom(host):  # noqa: ANN001
        raise KeyError("seq_lens")

    for _ in range(3):
        session.submit(HostCopy({}), boom)
    session.close()
    assert not session.enabled and len(logs) == 1 and "KeyError" in logs[0]
    with session.guard("a hook"):
        raise RuntimeError("never propagates")
    assert len(logs) == 1  # already stopped: no second line


def test_host_copy_is_taken_at_snapshot_time() -> None:
    t = torch.arange(4)
    copy = HostCopy({"t": t, "none": None})
    t.add_(100)  # the engine reuses its buffer for the next step
    assert copy.wait()["t"].tolist() == [0, 1, 2, 3] and copy.wait()["none"] is None


def test_record_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, message in [
        (["record", "--steps", "9:2", "--", "true"], "--steps"),
        (["record", "--layers", "a", "--", "true"], "--layers"),
        (["record", "--engine", "tgi", "--", "true"], "--engine"),
        (["record", "-o", str(tmp_path / "r"), "--", "no-such-command-xyz"], "command not found"),
    ]:
        result = runner.invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output


def test_record_passes_the_exit_code_on_and_arms_the_startup_hook(tmp_path: Path) -> None:
    # The child sees the options and the hook ran: the bootstrap is active in it.
    script = textwrap.dedent(
        """
        import sys
        import attndbg.record.bootstrap as b
        from attndbg.record.options import RecordOptions
        print("active", b._ACTIVE, RecordOptions.from_env().every)
        sys.exit(3)
        """
    )
    out = tmp_path / "rec"
    done = subprocess.run([sys.executable, "-m", "attndbg", "record", "-o", str(out), "--every", "4", "--", sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "active True 4" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == f"attndbg record: no step recorded ({out} not created); command exited 3"
    assert not out.exists()  # nothing was written into it: the folder is not left behind


@pytest.mark.parametrize(("signal_name", "shell_status"), [("SIGSEGV", 139), ("SIGKILL", 137)])
def test_a_command_killed_by_a_signal_exits_as_the_shell_says(tmp_path: Path, signal_name: str, shell_status: int) -> None:
    """128 + N, as `$?` reads after a crash (not Python's sys.exit(-N): 245 for SIGSEGV, 247 for SIGKILL)."""
    script = f"import os, signal; os.kill(os.getpid(), signal.{signal_name})"
    out = tmp_path / "rec"
    done = subprocess.run([sys.executable, "-m", "attndbg", "record", "-o", str(out), "--", sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == shell_status, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"; command killed by {signal_name}")
    assert not out.exists()


# A child that runs a hook which fails (through the session's guard, as every adapter's hooks do),
# records nothing, and exits 0 (the engine goes on); with "record" it records one step first.
FAILING_HOOK = textwrap.dedent(
    """
    import sys
    from attndbg.record.session import current_session
    from attndbg.trace import synth
    session = current_session()
    if sys.argv[1] == "record":  # hand the writer one real step, then fail
        from attndbg.record.session import HostCopy
        session.submit(HostCopy({}), lambda host: synth.build(synth.parse_spec(["decode-gqa"])))
        session.flush()
    with session.guard("toy compute_batch (before)"):
        raise AttributeError("'NoneType' object has no attribute 'layer_to_allocator'")
    print("engine done")
    """
)


@pytest.mark.parametrize("first", ["fail", "record"])
def test_record_names_a_failed_hook_and_exits_4_when_nothing_was_recorded(tmp_path: Path, first: str) -> None:
    out = tmp_path / "rec"
    command = [sys.executable, "-m", "attndbg", "record", "-o", str(out), "--", sys.executable, "-c", FAILING_HOOK, first]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert "engine done" in done.stdout  # the engine went on
    last = done.stderr.strip().splitlines()[-1]
    assert "toy compute_batch (before)" in last and "AttributeError" in last and "layer_to_allocator" in last
    if first == "fail":
        assert done.returncode == 4, done.stderr
        assert last.startswith("attndbg record: no step recorded: error in toy compute_batch (before)")
    else:  # a step was recorded before the hook failed: the command's exit code, the failure named
        assert done.returncode == 0, done.stderr
        assert f"1 step in {out}" in done.stderr and last.startswith("attndbg record: recording stopped early:")


def test_a_full_recording_directory_is_not_a_failed_hook(tmp_path: Path) -> None:
    """The size cap stops recording as asked: nothing is noted for `record` to fail on."""
    problems_file = tmp_path / "problems.jsonl"
    session = RecordingSession(RecordOptions(out_dir=str(tmp_path / "rec"), max_bytes=1, writer="thread", problems_file=str(problems_file)), log=lambda _: None)
    session.submit(HostCopy({}), lambda host: _trace(0))
    session.close()
    assert not session.enabled and "size cap" in (session.stats.stopped_reason or "")
    assert not problems_file.exists()


def test_startup_hook_installs_an_adapter_after_its_engine_module_is_imported(tmp_path: Path) -> None:
    # A stand-in engine package on the path; the trigger table is pointed at it for this child only.
    pkg = tmp_path / "fake_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text("VALUE = 1\n")
    script = textwrap.dedent(
        """
        import attndbg.record.bootstrap as b
        import sys
        hits = []
        def installer():
            hits.append(sys.modules["fake_engine.runner"].VALUE)
        sys.modules["fake_installer"] = type(sys)("fake_installer")
        sys.modules["fake_installer"].install = installer
        b._ACTIVE = False
        b.TRIGGERS = {"fake_engine.runner": ("transformers", "fake_installer:install")}
        b.activate()
        assert hits == []          # not imported yet: nothing installed
        import fake_engine.runner
        print("hits", hits)        # installed right after the module ran
        """
    )
    env = recording_env(RecordOptions(out_dir=str(tmp_path / "rec")))
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hits [1]" in done.stdout
