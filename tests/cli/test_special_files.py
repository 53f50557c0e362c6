"""A FIFO, a device or a socket where a recording's manifest or a trace is expected is refused at
once (exit 2, one line naming it), never read: reading a FIFO blocks until someone writes, a device
never ends. And an output folder exists only once something was written into it: a failed or empty
import, export or record leaves none behind."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from attndbg.cli import main
from tests.cli.helpers import one_line_error

TRACES = Path(__file__).resolve().parents[2] / "traces"
# The bound the refusal is held to: a blocked read is a hang, not a slow answer.
WITHIN_S = 5.0


def _invoke_within(args: list[str], unblock: Path | None = None) -> Result:
    """Invoke in a thread; a command still running after WITHIN_S is a hang (its FIFO is then
    opened for writing once and closed, which ends the blocked read, so the test can fail)."""
    done: list[Result] = []
    thread = threading.Thread(target=lambda: done.append(CliRunner().invoke(main, args)), daemon=True)
    thread.start()
    thread.join(WITHIN_S)
    if thread.is_alive() and unblock is not None:
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
    assert done and not thread.is_alive(), f"{args} still running after {WITHIN_S} s"
    return done[0]


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    yield path
    server.close()


def _recording_with(tmp_path: Path, make_manifest) -> Path:
    rec = tmp_path / "rec"
    rec.mkdir(parents=True)
    shutil.copy(TRACES / "decode_gqa.pt", rec / "step_000000.pt")
    make_manifest(rec / "manifest.jsonl")
    return rec


@pytest.mark.parametrize("command", ["check REC", "replay REC", "diff REC REC", "export fib REC -o OUT"])
def test_a_fifo_manifest_is_refused_at_once(tmp_path: Path, command: str) -> None:
    rec = _recording_with(tmp_path, os.mkfifo)
    args = [{"REC": str(rec), "OUT": str(tmp_path / "out")}.get(word, word) for word in command.split()]
    result = _invoke_within(args, unblock=rec / "manifest.jsonl")
    one_line_error(result, f"{rec / 'manifest.jsonl'}: file: is a FIFO, not a regular file: refused")
    assert not (tmp_path / "out").exists()


def test_a_device_or_socket_manifest_is_refused(tmp_path: Path, unix_socket: Path) -> None:
    for name, target in (("device", "/dev/zero"), ("socket", str(unix_socket))):
        rec = _recording_with(tmp_path / name, lambda p, target=target: p.symlink_to(target))
        what = "a character device" if name == "device" else "a socket"
        one_line_error(_invoke_within(["check", str(rec)]), f"is {what}, not a regular file: refused")


def test_a_socket_trace_is_refused(unix_socket: Path) -> None:
    for command in ("show", "check", "replay"):
        one_line_error(_invoke_within([command, str(unix_socket)]), f"{unix_socket}: file: is a socket, not a regular file: refused")


def test_a_failed_import_leaves_no_folder(tmp_path: Path) -> None:
    cases = tmp_path / "cases_rank0.jsonl"
    cases.write_text(json.dumps({"not": "a case"}) + "\n")
    out = tmp_path / "new" / "rec"  # its parent does not exist either
    result = CliRunner().invoke(main, ["import", "trtllm", str(cases), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "new").exists()


def test_a_failed_import_keeps_a_folder_that_was_there(tmp_path: Path) -> None:
    cases = tmp_path / "cases_rank0.jsonl"
    cases.write_text(json.dumps({"not": "a case"}) + "\n")
    out = tmp_path / "rec"
    out.mkdir()
    assert CliRunner().invoke(main, ["import", "trtllm", str(cases), "-o", str(out)]).exit_code == 2
    assert out.is_dir() and not list(out.iterdir())


def test_an_export_with_nothing_to_write_leaves_no_folder(tmp_path: Path) -> None:
    out = tmp_path / "trace_set"
    result = CliRunner().invoke(main, ["export", "fib", str(TRACES / "verify_tree.pt"), "-o", str(out)])  # no definition takes a tree mask
    assert result.exit_code == 3, result.output
    assert "0 workloads of 0 definitions" in result.stderr and not out.exists()
