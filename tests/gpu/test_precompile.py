"""check's compile phase on the real FlashInfer (GPU only): the modules the adapters declare for a step
are built up front, and a check of that step then loads only declared modules, none of them unbuilt.

A fresh FlashInfer cache is set up through FLASHINFER_WORKSPACE_BASE in a subprocess, so this run's
own cache is untouched: the test compiles one decode module (tens of seconds on an H100)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg.machine import module_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason="flashinfer is not installed")]

_CHILD = r"""
import json, sys
from pathlib import Path
from attndbg.backends import flashinfer_jit, flashinfer_modules
from attndbg.checks.precompile import declared
from attndbg.checks.selection import parse_only
from attndbg.checks.step import check_one
from attndbg.detector_api.context import CheckOptions
path = sys.argv[1]
# fill-value replays the step on the backend (invariants alone reads metadata and launches nothing)
only = parse_only("fill-value")
options = CheckOptions(backends=("flashinfer",))
specs = declared([Path(path)], only, options, flashinfer_modules.target())
missing = flashinfer_jit.unbuilt(list(specs.values()))
flashinfer_jit.build(missing)
with flashinfer_jit.watching_modules() as seen:
    warm = check_one(path, only, options).report
print(json.dumps({
    "declared": sorted(specs), "built": sorted(m.name for m in missing if m.library.exists()),
    "unbuilt_after": sorted(seen.unbuilt), "used_after": sorted(seen.used),
    "warm_backends": list(warm.backends), "warm_findings": [f.check for f in warm.findings],
}))
"""


def test_declared_modules_are_built_and_the_check_loads_nothing_else(tmp_path: Path) -> None:
    from attndbg.trace import io, synth

    path = tmp_path / "decode.pt"
    io.save(synth.build(synth.parse_spec(["decode-gqa", "heads=8:2", "head_dim=128", "kv_lens=33,70"])), path)
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["declared"] and got["built"] == got["declared"], got  # a fresh cache: every declared module built
    assert got["unbuilt_after"] == [] and set(got["used_after"]) <= set(got["declared"]), got  # nothing missed
    assert got["warm_backends"] == ["flashinfer"] and got["warm_findings"] == []


def test_compile_command_then_check_compiles_nothing(tmp_path: Path) -> None:
    """`attndbg compile` on a fresh cache (modules declared, built at once), then `check` of the same
    steps: the check rebuilds nothing (no library is rewritten: FlashInfer's own ninja, run at the
    first load, found every module up to date; it once rebuilt them all and, the libraries
    being there, said nothing), and a second `compile` has nothing to do."""
    from attndbg.trace import io, synth

    rec = tmp_path / "rec"
    rec.mkdir()
    for i, words in enumerate([["decode-gqa", "kv_lens=33,70"], ["extend-prefix", "prefix_lens=0,40", "extend_lens=20,9"], ["verify", "prefix_lens=20,33"]]):
        io.save(synth.build(synth.parse_spec([*words, "heads=8:2", "head_dim=128"])), rec / f"step_{i:03d}.pt")
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")}
    run = lambda *args: subprocess.run([sys.executable, "-m", "attndbg", *args], env=env, capture_output=True, text=True, timeout=1200)  # noqa: E731
    first = run("compile", str(rec), "--backend", "flashinfer,fa3")
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    assert "compile phase done" in first.stderr and "FlashInfer modules the steps need compiled" in first.stdout
    libraries = lambda: {p: p.stat().st_mtime_ns for p in (tmp_path / "fi").rglob("*.so")}  # noqa: E731
    built = libraries()
    assert built, "the compile phase left no library"
    check = run("check", str(rec), "--backend", "flashinfer,fa3", "--jobs", "2")
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]
    assert "Building JIT module" not in check.stderr
    assert libraries() == built  # nothing rebuilt, nothing new
    again = run("compile", str(rec), "--backend", "flashinfer,fa3")
    assert again.returncode == 0 and "nothing to compile" in again.stdout
