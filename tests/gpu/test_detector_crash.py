"""Crash isolation for a detector's own launch on a real GPU: on the H100 an
illegal memory access in split-merge's own launch poisoned its worker's CUDA context, and the next
4 steps that worker took came back "not checked: ... illegal memory access". Here a test detector
(tests/gpu/fault_detector.py) really poisons the context on step 1 of a 4-step recording (in its
own kernel, announced or not, or in split-merge's stage-2 probe launched through the runner), checked by
one worker (--jobs 1, so the same worker would take steps 2 and 3): step 1 gets one backend-crash
finding, and every later step is still checked, Triton's kernels compared on each. Batch-invariance's
sub-batch replays go through the runner too: a backend that faults only on a request alone is that
step's crash, named with the sub-batch. The same logic runs on the CPU with a simulated fault in
tests/checks/test_crash_isolation.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from tests.factories import make_trace

pytestmark = pytest.mark.gpu

FAULT_STEP = 1
DETECTOR = "gpu-fault=tests.gpu.fault_detector:DETECTOR"
ARGS = ["--only", "fill-value,gpu-fault", "--backend", "triton"]


def _recording(directory: Path) -> Path:
    for step, kv in enumerate(("3,20", "5,9,40", "17", "8,8")):
        trace = make_trace("decode-mha", f"kv_lens={kv}", "heads=4:1", "head_dim=64", plan=True)
        io.append_to_recording(directory, replace(trace, source=replace(trace.source, step=step)))
    return directory


@pytest.mark.parametrize(
    ("how", "backend", "rechecked", "error"),
    [
        ("launch", "triton", "without-backend", "an illegal memory access was encountered"),
        ("kernel", "", "without-detector", "an illegal memory access was encountered"),  # split-merge's H100 case
        ("raise", "triton", "without-backend", "an illegal memory access was encountered"),  # a fault, then a host-side error
        ("assert", "", "without-detector", "device-side assert triggered"),
        ("merge", "triton", "without-backend", "an illegal memory access was encountered"),  # split-merge's probe, through the runner
    ],
)
def test_a_detectors_own_launch_that_poisons_the_context_costs_only_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, backend: str, rechecked: str, error: str
) -> None:
    monkeypatch.setenv("ATTNDBG_DETECTORS", DETECTOR)
    monkeypatch.setenv("ATTNDBG_TEST_FAULT_STEP", str(FAULT_STEP))
    monkeypatch.setenv("ATTNDBG_TEST_FAULT", how)
    rec = _recording(tmp_path / "rec")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(rec), *ARGS, "--jobs", "1", "--json", str(report)])
    assert result.exit_code == 1, result.output  # the crash is a finding
    steps = json.loads(report.read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(s["checked"] for s in steps), [s["error"] for s in steps]
    crashes = [f for f in steps[FAULT_STEP]["findings"] if f["class"] == "backend-crash"]
    assert len(crashes) == 1, steps[FAULT_STEP]["findings"]
    data = crashes[0]["data"]
    assert (data["backend"], data["detector"], data["rechecked"]) == (backend, "gpu-fault", rechecked)
    assert error in data["error"], data
    if how == "merge":
        assert data["variant"] == "decode_stage2 on crafted partials", data
    assert all(not s["findings"] for i, s in enumerate(steps) if i != FAULT_STEP)
    # Triton compared on every step: on step 1 too unless it was the backend left out after its crash.
    assert f"triton ({3 if backend == 'triton' else 4} steps)" in result.output, result.output


def test_a_crash_in_a_batch_invariance_sub_batch_costs_only_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "oob-alone=tests.gpu.out_of_bounds_backend:SubBatchOutOfBoundsBackend")
    monkeypatch.setenv("ATTNDBG_TEST_FAULT_STEP", str(FAULT_STEP))
    rec = _recording(tmp_path / "rec")
    report = tmp_path / "r.json"
    args = ["check", str(rec), "--only", "batch-invariance", "--backend", "oob-alone,triton", "--jobs", "1", "--json", str(report)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output  # the crash is a finding
    steps = json.loads(report.read_text())["steps"]
    assert all(s["checked"] for s in steps), [s["error"] for s in steps]
    [crash] = [f for f in steps[FAULT_STEP]["findings"] if f["class"] == "backend-crash"]
    data = crash["data"]
    assert (data["backend"], data["variant"], data["detector"], data["rechecked"]) == ("oob-alone", "eager, request 0 alone", "batch-invariance", "without-backend"), data
    assert "an illegal memory access was encountered" in data["error"], data
    assert all(not s["findings"] for i, s in enumerate(steps) if i != FAULT_STEP)


def test_in_one_process_a_poisoned_context_leaves_the_later_steps_not_checked_for_one_reason(tmp_path: Path) -> None:
    """--in-process, in a process of its own (a poisoned context is not recoverable, and must not be
    this test process's): the crash is step 1's finding, steps 2 and 3 are not checked, one reason."""
    rec = _recording(tmp_path / "rec")
    report = tmp_path / "r.json"
    env = {**os.environ, "ATTNDBG_DETECTORS": DETECTOR, "ATTNDBG_TEST_FAULT_STEP": str(FAULT_STEP), "ATTNDBG_TEST_FAULT": "kernel"}
    done = subprocess.run(
        [sys.executable, "-m", "attndbg", "check", str(rec), *ARGS, "--in-process", "--json", str(report)],
        env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    steps = json.loads(report.read_text())["steps"]
    assert [s["checked"] for s in steps] == [True, True, False, False], [s["error"] for s in steps]
    [crash] = [f for f in steps[FAULT_STEP]["findings"] if f["class"] == "backend-crash"]
    assert crash["data"]["detector"] == "gpu-fault" and crash["data"]["rechecked"] == "in-process"
    assert "an illegal memory access was encountered" in crash["data"]["error"]
    reasons = {s["error"] for s in steps[FAULT_STEP + 1 :]}
    assert len(reasons) == 1 and next(iter(reasons)).startswith("not checked: this process's CUDA context was lost to a crash on step 1")
