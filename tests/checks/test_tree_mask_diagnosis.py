"""tree-mask names the mask mistake that reproduces a failing verify run (attndbg/diagnose's mask
models): a third party's adapter whose plans carry the tree mask transposed, run through our real
Triton kernel, is reported with 'reproduced: ... transposed'; the real Triton adapter is clean."""

from __future__ import annotations

import pytest

from attndbg import machine
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.detectors.tree_mask.detect import detect
from tests.factories import make_trace

machine.select_triton_mode()

VERIFY = ("verify", "heads=2:1", "head_dim=32", "prefix_lens=20,33")


@pytest.fixture
def transposed_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "transposed_mask=tests.checks.transposed_mask_backend:TransposedMaskBackend")


def test_a_kernel_fed_a_transposed_mask_is_named(transposed_mask: None) -> None:
    trace = make_trace(*VERIFY)
    findings = detect(CheckContext(trace=trace, path="t", options=CheckOptions(backends=("transposed_mask", "triton"))))
    assert [(f.check, f.data["backend"]) for f in findings] == [("verify-output", "transposed_mask")]
    reps = findings[0].data["reproductions"]
    assert [r["mechanism"] for r in reps] == ["mask-transposed"] and reps[0]["requests"] == [0, 1]
    assert "reproduced: the kernel's output equals verify attention with the tree mask read transposed" in findings[0].evidence
    assert "descendants" in findings[0].cause


def test_the_real_triton_adapter_is_clean() -> None:
    trace = make_trace(*VERIFY)
    assert detect(CheckContext(trace=trace, path="t", options=CheckOptions(backends=("triton",)))) == []
