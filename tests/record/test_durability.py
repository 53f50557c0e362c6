"""A recording survives its recorder being killed: steps are renamed into place whole, and a
manifest line cut by the kill is not a step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attndbg.trace import io

# Appends steps the way the recorder's writer process does (io.append_to_recording: atomic save,
# then one manifest line), as fast as it can, until it is killed.
_WRITER = """
import sys
from dataclasses import replace
from attndbg.trace import io, synth
out = sys.argv[1]
trace = synth.build(synth.parse_spec(["decode-gqa", "kv_lens=300,2000,4000", "heads=8:2"]))
step = 0
while True:
    io.append_to_recording(out, replace(trace, source=replace(trace.source, step=step)))
    step += 1
    if step == 3:
        open(out + ".ready", "w").close()
"""


def test_kill_9_mid_write_leaves_whole_steps_and_a_readable_manifest(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(rec)])
    deadline = time.monotonic() + 120
    while not Path(str(rec) + ".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    time.sleep(0.37)  # somewhere inside a later step's save or append
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    entries = io.read_manifest(rec)
    assert len(entries) >= 3
    for path in io.trace_paths(rec):
        io.load(path)  # every step the manifest names is whole
    assert all(p.suffix == ".pt" or p.name == io.MANIFEST or p.name.endswith(".tmp") for p in rec.iterdir())


def test_a_manifest_line_cut_by_a_kill_is_not_a_step(tmp_path: Path) -> None:
    from tests.factories import make_trace

    rec = tmp_path / "rec"
    for step in range(2):
        io.append_to_recording(rec, make_trace("decode-mha", f"seed={step}"), f"s{step}.pt")
    manifest = rec / io.MANIFEST
    whole = manifest.read_text()
    manifest.write_text(whole + whole.splitlines()[0][:25])  # the kill came mid-line
    assert [e.file for e in io.read_manifest(rec)] == ["s0.pt", "s1.pt"]
    manifest.write_text(whole.splitlines()[0][:25] + "\n" + whole)  # a cut line in the middle is corruption
    with pytest.raises(io.TraceError, match="line 1"):
        io.read_manifest(rec)
