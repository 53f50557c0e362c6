"""Real FlashInfer dumps (bench/make_flashinfer_dumps.py on a GPU, FlashInfer 0.7.2.post1, kept as
tests/fixtures/flashinfer_dumps.tar): the CPU test imports them and checks with Triton; the GPU test
replays every step through FlashInfer and compares with FlashInfer's own recorded outputs. Without
the tar the CPU test is skipped; on a GPU the dumps are made afresh when the tar is absent."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.compare.saved import load_replay
from attndbg.trace import io

FIXTURE = Path(__file__).parents[1] / "fixtures" / "flashinfer_dumps.tar"
BENCH = Path(__file__).parents[2] / "bench" / "make_flashinfer_dumps.py"


def _dump_dir(tmp: Path, *, make: bool) -> Path:
    tar_path = FIXTURE
    if not tar_path.exists():
        if not make or importlib.util.find_spec("flashinfer") is None:
            pytest.skip(f"{FIXTURE.name} not in tests/fixtures (made on a GPU by {BENCH.name})")
        tar_path = tmp / "dumps.tar"
        subprocess.run([sys.executable, str(BENCH), "--out", str(tar_path)], check=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "flashinfer_dumps"


def _import(tmp: Path, make: bool) -> Path:
    result = CliRunner().invoke(main, ["import", "flashinfer", str(_dump_dir(tmp, make=make)), "-o", str(tmp / "rec")])
    assert result.exit_code == 0, result.output
    return tmp / "rec"


def test_real_dumps_import_and_check_clean_on_cpu(tmp_path: Path) -> None:
    rec = _import(tmp_path, make=False)
    modes = [e.mode for e in io.read_manifest(rec)]
    assert {"DECODE", "EXTEND", "TARGET_VERIFY"} <= set(modes) and sum(e.graph for e in io.read_manifest(rec)) == 2
    result = CliRunner().invoke(main, ["check", str(rec), "--backend", "triton"])
    assert result.exit_code == 0, result.output
    assert " 0 findings" in result.output


@pytest.mark.gpu
def test_flashinfer_replay_agrees_with_its_recorded_outputs(tmp_path: Path) -> None:
    rec = _import(tmp_path, make=True)
    runner = CliRunner()
    for path in io.trace_paths(rec):
        trace = io.load(path)
        backend = "mla" if trace.model.attention.value == "mla" else "flashinfer"
        saved = tmp_path / f"{path.stem}.replay"
        result = runner.invoke(main, ["replay", str(path), "--backend", backend, "--save", str(saved)])
        assert result.exit_code == 0, result.output
        layer = trace.tensors[min(trace.tensors)]
        ours = load_replay(saved).results[backend]
        # FlashInfer's own replay check is allclose(rtol=1e-3, atol=1e-3) against the same kernel;
        # ours may run another of its kernels (the batch's own plan), so fp16 rounding twice.
        assert torch.allclose(ours.output, layer.output.float(), rtol=1e-2, atol=4e-3), f"{path.name}: output"
        if layer.lse is not None:
            assert torch.allclose(ours.lse, layer.lse.float() * math.log(2), rtol=1e-3, atol=1e-3), f"{path.name}: LSE (base 2 recorded)"
    check = runner.invoke(main, ["check", str(rec), "--backend", "flashinfer,mla"])
    assert check.exit_code == 0, check.output
