"""What a repro script says and how it exits, whatever happens where it runs: 1 and "reproduced:
<error>" when the library call crashes (in a child process for a step recorded as crashed, so a
crash that kills the process is reported too), 2 and one line when a package or the GPU it needs
is missing, and a last line naming the symptom. And repro itself: a recorded plan missing a scalar
its launch reads is one line, exit 2; repro/ names no backend and patches no adapter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends import registry as backends
from attndbg.cli import main
from attndbg.repro.script import build, write
from attndbg.trace import io
from tests.factories import make_trace
from tests.repro.test_repro import ISOLATED

SMALL = ("decode-mha", "heads=2:1", "head_dim=32", "kv_lens=3,9")
FAULTS = Path(__file__).parent / "faulting_triton"
REPRO = Path(__file__).parents[2] / "attndbg" / "repro"


def _run(script: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """The script with attndbg refused, under the Triton interpreter; `fault`: its kernels fault (raise or kill)."""
    env = {"PATH": os.environ.get("PATH", ""), "TRITON_INTERPRET": "1", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(FAULTS)}
    if fault:
        env["REPRO_TEST_FAULT"] = fault
    return subprocess.run([sys.executable, "-c", ISOLATED, str(script)], capture_output=True, text=True, env=env, cwd=script.parent, timeout=300)


def _script(tmp_path: Path, trace, backend: str = "triton") -> Path:
    return write(build(trace, backend), tmp_path / "repro.py")[0]


def test_a_library_call_that_raises_is_reproduced_as_a_crash(tmp_path: Path) -> None:
    done = _run(_script(tmp_path, make_trace(*SMALL)), fault="raise")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert "reproduced: the library call crashed: RuntimeError: CUDA error: an illegal memory access was encountered" in lines
    assert lines[-1] == "symptom: crash"


def test_a_crashed_step_is_made_in_a_child_so_a_killed_process_is_reported(tmp_path: Path) -> None:
    trace = make_trace(*SMALL)
    trace = replace(trace, source=replace(trace.source, crash="CUDA error: an illegal memory access was encountered"))
    script = _script(tmp_path, trace)
    killed = _run(script, fault="kill")
    assert killed.returncode == 1, killed.stdout + killed.stderr
    assert killed.stdout.strip().splitlines()[-2:] == ["reproduced: the library call killed the process (SIGSEGV)", "symptom: crash"]
    raised = _run(script, fault="raise")
    assert raised.returncode == 1 and "where the step was recorded it crashed too: CUDA error: an illegal memory access was encountered" in raised.stdout
    returned = _run(script)
    assert returned.returncode == 0, returned.stdout + returned.stderr
    assert "here it returned" in returned.stdout and returned.stdout.strip().splitlines()[-1] == "symptom: none"


def test_a_missing_library_is_exit_2_in_one_line(tmp_path: Path) -> None:
    """FlashInfer is not installed here: the flashinfer script says so and exits 2, not 1."""
    trace = make_trace(*SMALL, plan=False)
    script = _script(tmp_path, trace, "flashinfer")
    done = _run(script)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip() == "could not run here: No module named 'flashinfer' (pip install flashinfer-python)"


def test_a_recorded_plan_missing_a_scalar_is_one_line_exit_2(tmp_path: Path) -> None:
    trace = make_trace(*SMALL, plan=False)
    plan = backends.create("flashinfer").derive_plan(trace)
    scalars = {k: v for k, v in plan.scalars.items() if k != "window_left"}
    path = io.save(replace(trace, plan=replace(plan, scalars=scalars)), tmp_path / "step.pt")
    result = CliRunner().invoke(main, ["repro", str(path), "--backend", "flashinfer", "-o", str(tmp_path / "r.py")])
    assert result.exit_code == 2, result.output
    assert "the recorded flashinfer plan has no window_left" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_repro_names_no_backend_and_patches_no_adapter() -> None:
    """The library calls come through the Backend contract (script_library, library_calls,
    script_merge): no backend's name in repro/, no patch of anything in attndbg.backends."""
    names = set(backends.ADAPTERS)
    for path in sorted(REPRO.glob("*.py")):
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not names & strings, f"{path.name} names a backend: {names & strings}"
        patched = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and "patch" in ast.unparse(n.func) and "backends" in ast.unparse(n)]
        assert not patched, f"{path.name} patches an adapter: {patched}"
