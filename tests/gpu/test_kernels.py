"""The kernels detector on the real libraries (GPU only): every backend that can take a step runs
it, on every mode, clean steps stay silent, and FlashInfer 0.7.2's decode defect at head_dim 80
(docs/benchmarks.md) is found by `check` itself, named with its release,
and reproduced by the finding's repro command alone.

FlashInfer JIT-compiles each kernel on first use (7-60 s): these few steps cost a few minutes cold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg.backends.flashinfer import INSTALL_HINT, FlashInferBackend
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detectors.kernels import detect as kernels
from attndbg.machine import module_available
from attndbg.trace import io, synth

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]

SHAPE = ("heads=16:4", "head_dim=128", "dtype=bfloat16", "shared_prefix=0")
MODES = {
    "decode": ("decode-gqa", *SHAPE, "kv_lens=1,37,300,2100"),
    "extend": ("extend-prefix", *SHAPE, "prefix_lens=0,40,1200", "extend_lens=37,5,300", "page_size=16"),
    "mixed": ("mixed", *SHAPE, "prefix_lens=48,0,900,33", "extend_lens=40,25,1,1"),
    "verify": ("verify", *SHAPE, "prefix_lens=20,75,1300"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_backend_that_can_take_a_clean_step_is_compared_and_silent(mode: str) -> None:
    trace = synth.build(synth.parse_spec(list(MODES[mode])))
    ctx = CheckContext(trace=trace, path="t.pt", options=CheckOptions(backends=("triton", "flashinfer", "fa3")))
    assert kernels.detect(ctx) == []
    assert "flashinfer" in ctx.backends() and set(ctx.backends_consulted()) == set(ctx.backends())


def _head_dim_80(tmp_path: Path) -> Path:
    trace = synth.build(synth.parse_spec(["decode-mha", "heads=4:4", "head_dim=80", "kv_lens=37,91", "dtype=bfloat16"]))
    if FlashInferBackend().known_defect(trace) is None:
        pytest.skip("the installed FlashInfer is not a release measured with the head_dim-80 decode defect")
    return io.save(trace, tmp_path / "step.pt")


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_a_known_flashinfer_decode_defect_is_found_by_check_and_reproduced_alone(tmp_path: Path, tensor_cores: bool) -> None:
    """Replay refuses the step (its declared defect); check runs it in a worker: a wrong answer is a
    kernels finding that says it was predicted, an illegal memory access the worker's backend-crash;
    either names FlashInfer's release and gives the repro command, whose script reproduces it."""
    path = _head_dim_80(tmp_path)
    report = tmp_path / "check.json"
    option = f"flashinfer.decode_tensor_cores={'true' if tensor_cores else 'false'}"
    command = [sys.executable, "-m", "attndbg", "check", str(path), "--backend", "flashinfer,triton", "--only", "kernels", "--backend-option", option, "--json", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert done.returncode == 1, done.stdout + done.stderr
    [step] = json.loads(report.read_text())["steps"]
    found = [f for f in step["findings"] if f["data"].get("backend") == "flashinfer"]
    assert found, step
    first = found[0]
    assert first["class"] in ("kernels", "backend-crash"), first
    assert first["data"]["library"] == "FlashInfer" and first["data"]["version"].startswith("0.7.2")
    assert "head_dim 80" in first["data"]["shape"] and f"use_tensor_cores {'true' if tensor_cores else 'false'}" in first["data"]["shape"]
    if first["class"] == "kernels":
        assert first["check"] in ("kernel-fails-reference", "kernel-raised") and first["data"]["predicted"]
        assert first["data"]["passing"] == ["triton"]
    repro = first["data"]["repro"]
    assert f"--backend-option {option}" in repro
    script = subprocess.run(["bash", "-c", repro.replace("attndbg repro", f"{sys.executable} -m attndbg repro", 1).replace("&& python", f"&& {sys.executable}", 1)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    print(script.stdout[-2000:], script.stderr[-2000:])
    assert script.returncode != 0, "the repro script did not reproduce the defect"
