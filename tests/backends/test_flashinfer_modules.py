"""The FlashInfer modules each adapter declares for a step (`Backend.jit_specs`, backends/flashinfer_modules.py),
named without a GPU: with FlashInfer absent, nothing; with it importable (skipped otherwise), the URIs
FlashInfer's own spec functions give for the parameters the adapters pass.

The declarations run in a child process with FLASHINFER_WORKSPACE_BASE in a temporary directory (the
spec functions write generated sources under FlashInfer's JIT directory, read when flashinfer is
imported) and FLASHINFER_CUDA_ARCH_LIST=9.0a (an H100/H200; the arch FlashInfer's "auto" decides by)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg.backends import flashinfer_jit, flashinfer_modules, registry
from tests.factories import make_trace

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
from attndbg import machine
# fa3 runs on FlashInfer only where no other FlashAttention-3 library is installed.
available = machine.module_available
machine.module_available = lambda name: name not in ("vllm", "sgl_kernel", "flash_attn_interface") and available(name)
from attndbg.backends import flashinfer_modules as fm, registry
from attndbg.backends.options import parse
from attndbg.checks.precompile import declare
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from tests.factories import make_trace

H100, A100 = fm.Target((9, 0)), fm.Target((8, 0))
CASES = {
    "decode": ("flashinfer", ["decode-gqa", "heads=16:4", "head_dim=128"], (), H100),
    "decode tensor cores": ("flashinfer", ["decode-gqa", "heads=16:2", "head_dim=128"], (), H100),
    "decode window soft-cap fp16": ("flashinfer", ["window-decode", "head_dim=256", "logit_cap=30.0", "dtype=float16"], (), H100),
    "verify": ("flashinfer", ["verify", "head_dim=256", "window=40"], (), H100),
    "extend no prefix": ("flashinfer", ["extend-noprefix", "head_dim=128"], (), H100),
    "extend no prefix A100": ("flashinfer", ["extend-noprefix", "head_dim=128"], (), A100),
    "extend prefix": ("flashinfer", ["extend-prefix", "head_dim=64"], (), H100),
    "extend paged 192/128": ("flashinfer", ["extend-prefix", "head_dim=192", "v_head_dim=128"], ("flashinfer.extend_path=paged",), H100),
    "fa3 window": ("fa3", ["window-decode", "head_dim=128"], (), H100),
    "fa3 A100": ("fa3", ["window-decode", "head_dim=128"], (), A100),
    "mla": ("mla", ["mla-decode"], (), H100),
    "mla A100": ("mla", ["mla-decode", "dtype=float16"], (), A100),
}
out = {}
for label, (name, spec, options, at) in CASES.items():
    adapter = registry.create(name, options=parse(options))
    out[label] = sorted(s.name for s in adapter.jit_specs(make_trace(*spec, plan=True), at))
trace = make_trace("extend-prefix", "head_dim=64", plan=True)
only = parse_only(None)
out["check, extend prefix"] = sorted({s.name for s in declare(trace, only, CheckOptions(backends=("flashinfer",)), H100)})
out["check, extend prefix, no split-merge"] = sorted({s.name for s in declare(trace, parse_only("invariants"), CheckOptions(backends=("flashinfer",)), H100)})
print(json.dumps(out))
"""

BF16, F16 = "dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32", "dtype_q_f16_dtype_kv_f16_dtype_o_f16_dtype_idx_i32"


def _prefill(dtypes: str, dims: str, swa: bool, cap: bool, suffix: str) -> str:
    return f"batch_prefill_with_kv_cache_{dtypes}_head_dim_qk_{dims}_posenc_0_use_swa_{swa}_use_logits_cap_{cap}_f16qk_False{suffix}"


def _decode(dtypes: str, dims: str, swa: bool, cap: bool) -> str:
    return f"batch_decode_with_kv_cache_{dtypes}_head_dim_qk_{dims}_posenc_0_use_swa_{swa}_use_logits_cap_{cap}"


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    if not flashinfer_jit.available():
        pytest.skip("flashinfer is not importable here")
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path_factory.mktemp("fi")), flashinfer_modules.ARCH_VARIABLE: "9.0a", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_decode_on_cuda_cores_and_on_tensor_cores(declared: dict[str, list[str]]) -> None:
    assert declared["decode"] == [_decode(BF16, "128_head_dim_vo_128", False, False)]
    # SGLang's rule: GQA group 8 > 4 runs decode on tensor cores, through FA2's prefill module.
    assert declared["decode tensor cores"] == [_prefill(BF16, "128_head_dim_vo_128", False, False, "_kv_stride_equal")]
    assert declared["decode window soft-cap fp16"] == [_decode(F16, "256_head_dim_vo_256", True, True)]


def test_verify_folds_the_window_into_its_mask_and_packs_it(declared: dict[str, list[str]]) -> None:
    assert declared["verify"] == [_prefill(BF16, "256_head_dim_vo_256", False, False, "_kv_stride_equal"), "quantization"]


def test_ragged_auto_is_fa3_on_sm90_and_fa2_before(declared: dict[str, list[str]]) -> None:
    assert declared["extend no prefix"] == [_prefill(BF16, "128_head_dim_vo_128", False, False, "_sm90")]
    assert declared["extend no prefix A100"] == [_prefill(BF16, "128_head_dim_vo_128", False, False, "_kv_stride_equal")]


def test_cascade_is_ragged_paged_and_merge(declared: dict[str, list[str]]) -> None:
    dims = "64_head_dim_vo_64"
    assert declared["extend prefix"] == [_prefill(BF16, dims, False, False, "_kv_stride_equal"), _prefill(BF16, dims, False, False, "_sm90"), "cascade"]


def test_unequal_kv_strides_load_the_independent_module(declared: dict[str, list[str]]) -> None:
    dims = "192_head_dim_vo_128"
    assert declared["extend paged 192/128"] == [_prefill(BF16, dims, False, False, "_kv_stride_equal"), _prefill(BF16, dims, False, False, "_paged_kv_stride_independent")]


def test_fa3_on_flashinfer_only_on_sm90(declared: dict[str, list[str]]) -> None:
    assert declared["fa3 window"] == [_prefill(BF16, "128_head_dim_vo_128", True, False, "_sm90")]
    assert declared["fa3 A100"] == []


def test_mla_family_by_arch(declared: dict[str, list[str]]) -> None:
    mla = "batch_mla_attention_{}_head_dim_ckv_512_head_dim_kpe_64_profiler_False_planabi2{}"
    assert declared["mla"] == [mla.format(BF16, "_sm90")]
    assert declared["mla A100"] == [mla.format(F16, "")]


def test_a_check_declares_the_runs_split_merge_forces(declared: dict[str, list[str]]) -> None:
    """split-merge runs FlashInfer's cascade and paged paths on a cached extend: the same modules as
    the adapter's own cascade here; without that detector, still the adapter's own runs."""
    assert declared["check, extend prefix"] == declared["extend prefix"]
    assert declared["check, extend prefix, no split-merge"] == declared["extend prefix"]


@pytest.mark.skipif(flashinfer_jit.available(), reason="flashinfer is importable here")
def test_nothing_is_declared_without_flashinfer() -> None:
    at = flashinfer_modules.Target((9, 0))
    for name, spec in (("flashinfer", ["decode-gqa"]), ("flashinfer", ["extend-prefix"]), ("fa3", ["window-decode", "head_dim=128"]), ("mla", ["mla-decode"])):
        assert registry.create(name).jit_specs(make_trace(*spec, plan=True), at) == []


def test_the_target_arch_is_the_gpu_else_flashinfers_arch_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from attndbg import machine

    monkeypatch.setattr(machine, "gpu_info", lambda: None)
    monkeypatch.setenv(flashinfer_modules.ARCH_VARIABLE, "9.0a 10.0a")
    assert flashinfer_modules.target() == flashinfer_modules.Target((9, 0))
    monkeypatch.delenv(flashinfer_modules.ARCH_VARIABLE)
    assert flashinfer_modules.target() == flashinfer_modules.Target(None)
