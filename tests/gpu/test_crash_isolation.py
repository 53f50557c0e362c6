"""Crash isolation on a real GPU: a backend whose kernel makes an illegal memory access
poisons its process's CUDA context. `attndbg check` runs kernels in worker processes: the step gets
a backend-crash finding naming the backend, the variant and the CUDA error, the step is checked
again without that backend (the Triton run still compares), and the other steps go on."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.trace import io
from tests.factories import make_trace

pytestmark = pytest.mark.gpu


def test_an_illegal_memory_access_is_a_finding_and_the_check_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "oob-triton=tests.gpu.out_of_bounds_backend:OutOfBoundsBackend")
    rec = tmp_path / "rec"
    for step, kv in enumerate(("3,20", "5,9,40", "17")):
        trace = make_trace("decode-mha", f"kv_lens={kv}", "heads=4:1", "head_dim=64", plan=True)
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    report = tmp_path / "r.json"
    result = CliRunner().invoke(
        main, ["check", str(rec), "--only", "fill-value", "--backend", "oob-triton,triton", "--jobs", "1", "--json", str(report)]
    )
    assert result.exit_code == 1, result.output  # the crashes are findings
    steps = json.loads(report.read_text())["steps"]
    assert len(steps) == 3 and all(s["checked"] for s in steps)
    for s in steps:
        crash = s["findings"][0]
        assert crash["class"] == "backend-crash" and crash["data"]["backend"] == "oob-triton"
        assert "illegal memory access" in crash["data"]["error"], crash
        assert [f["class"] for f in s["findings"][1:]] == []  # the step is clean without the faulty backend
    assert "triton (3 steps)" in result.output  # Triton still compared on every step
