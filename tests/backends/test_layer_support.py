"""Which backend takes which layer kind (capabilities and configuration, worded for a reader), and
the plans the GPU adapters derive for them, written out by hand; runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from attndbg.backends.base import AttentionInputs
from attndbg.backends.fa3 import FA3Backend, FA3Call
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.reference import ReferenceBackend
from attndbg.backends.triton import TritonBackend
from attndbg.backends.vllm_paged import VllmPagedBackend
from attndbg.replay.step_data import StepData
from attndbg.trace.visibility import visibility
from tests.factories import make_trace

# The nine commands (the clean properties each one stands for).
NINE = {
    "sinks": ("decode-mha", "sinks=1"),
    "non-causal": ("extend-prefix", "causal=0"),
    "fp8 scales": ("decode-gqa", "kv_dtype=float8_e4m3fn", "k_scale=0.5", "v_scale=2.0"),
    "right window": ("window", "window_right=8"),
    "cross": ("extend-prefix", "cross=1"),
    "extend mask": ("extend-prefix", "extend_mask=random"),
    "parents": ("verify", "parents=-1,0,0,1,2"),
    "slots": ("decode-paged", "slots=shuffled_pages"),
    "mixed graph": ("mixed", "graph_mode=mixed", "capture_bs=8"),
}

# What each backend says of each (None: it claims support). Reasons are the declared ones.
EXPECTED = {
    "flashinfer": {
        "right window": "a right sliding window (model.window_right = 8): FlashInfer's MHA kernels take a left window only (plan() and run() take window_left only",
        "cross": "request 0 has no KV (kv_len 0): FlashInfer's MHA kernels need at least one key per request (its decode kernels need seq_len >= 1",
    },
    "fa3": {
        "sinks": "attention sinks (model.sinks): FlashAttention-3 kernels have no sink term (the sink term",
        "fp8 scales": "FlashAttention-3 kernels take fp16 or bf16 KV; this trace's is float8_e4m3fn",
        "extend mask": "a custom mask on this extend step (batch.custom_mask): FlashAttention-3 kernels take none there (FA3 masks are causal or sliding-window only)",
    },
    "vllm_paged": {
        name: "MHA " for name in ("non-causal", "right window", "cross", "extend mask", "parents", "mixed graph")
    }
    | {"sinks": "attention sinks (model.sinks): vLLM's PagedAttention v2 kernels have no sink term", "fp8 scales": "vLLM's PagedAttention v2 kernels take fp16, bf16 or fp32 KV"},
}


@pytest.mark.parametrize("backend", [ReferenceBackend(), TritonBackend(), FlashInferBackend(), FA3Backend(), VllmPagedBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("prop", list(NINE))
def test_each_backend_claims_or_says_why(backend, prop: str) -> None:
    reason = backend.unsupported_reason(make_trace(*NINE[prop]))
    expected = EXPECTED.get(backend.name, {}).get(prop)
    if expected is None:
        assert reason is None, reason
    else:
        assert reason is not None and reason.startswith(expected), reason


def test_mla_kernels_say_why() -> None:
    flashinfer_mla = MLABackend(MLAOptions(impl="flashinfer"))
    assert flashinfer_mla.unsupported_reason(make_trace("mla-decode", "sinks=1")) == "attention sinks (model.sinks): FlashInfer's MLA kernels have no sink term"
    assert MLABackend(MLAOptions(impl="triton")).unsupported_reason(make_trace("mla-decode", "sinks=1", "kv_lens=0,9", "cross=1")) is None


def test_mla_triton_sinks_against_the_reference() -> None:
    trace = make_trace("mla-decode", "heads=4", "kv_lora_rank=64", "rope_dim=16", "kv_lens=1,40", "sinks=1")
    backend = MLABackend(MLAOptions(impl="triton"))
    data = StepData(trace, device=backend.device())
    assert data.compare(backend.run(trace, data.inputs, backend.derive_plan(trace))).passed


def test_flashinfer_configurations_it_refuses() -> None:
    fi = FlashInferBackend()
    assert fi.unsupported_reason(make_trace("softcap", "sinks=1")) == "attention sinks with a logit soft-cap: FlashInfer's AttentionSink variant applies no soft-cap"
    assert fi.unsupported_reason(make_trace("verify", "sinks=1")).startswith("attention sinks with a custom mask")
    ragged = FlashInferBackend(FlashInferBackend.options_class(extend_path="ragged"))
    assert ragged.unsupported_reason(make_trace("extend-noprefix", "causal=0")).startswith("extend_path=ragged: a non-causal layer is run in one pass")


def test_flashinfer_plans_one_paged_pass() -> None:
    fi = FlashInferBackend()
    # Non-causal extend: paged over each whole row, causal off.
    trace = make_trace("extend-prefix", "prefix_lens=0,5", "extend_lens=3,2", "causal=0", "scatter=0", "shared_prefix=0")
    plan = fi.derive_plan(trace)
    assert plan.scalars["path"] == "paged" and plan.scalars["causal"] is False
    assert plan.tensors["kv_indices"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and plan.tensors["kv_indptr"].tolist() == [0, 3, 10]
    assert plan.tensors["qo_indptr"].tolist() == [0, 3, 5]
    # Sinks on a decode step: the sink wrapper is a prefill wrapper, one query row per request.
    plan = fi.derive_plan(make_trace("decode-mha", "kv_lens=2,3", "sinks=1", "scatter=0"))
    assert plan.scalars["path"] == "paged" and plan.scalars["causal"] is True
    assert plan.tensors["qo_indptr"].tolist() == [0, 1, 2] and plan.tensors["kv_indices"].tolist() == [1, 2, 3, 4, 5]
    # Cross-attention, causal: the encoder's rows, FlashInfer's causal mask aligned bottom-right.
    plan = fi.derive_plan(make_trace("extend-prefix", "prefix_lens=2,4", "extend_lens=3,1", "cross=1", "causal=1", "scatter=0", "shared_prefix=0"))
    assert plan.tensors["kv_indptr"].tolist() == [0, 2, 6] and plan.tensors["qo_indptr"].tolist() == [0, 3, 4] and plan.scalars["causal"] is True
    # An extend's own mask: the whole row, the blocks as visibility says, the window folded in.
    trace = make_trace("extend-prefix", "prefix_lens=0,5", "extend_lens=3,2", "extend_mask=random", "window=3")
    plan = fi.derive_plan(trace)
    expected = torch.cat([visibility(trace, b).flatten() for b in range(2)])
    assert torch.equal(plan.tensors["custom_mask"], expected) and plan.scalars["window_left"] == -1
    assert plan.tensors["mask_indptr"].tolist() == [0, 9, 23]


def test_flashinfer_hands_the_scales_to_run() -> None:
    from attndbg.backends.flashinfer import _kv_scales

    assert _kv_scales(make_trace("fp8-scaled").model) == {"k_scale": 0.5, "v_scale": 2.0}
    assert _kv_scales(make_trace("decode-gqa", "kv_dtype=float8_e4m3fn").model) == {}  # unscaled calls stay as they were


def test_fa3_plans() -> None:
    fa3 = FA3Backend()
    plan = fa3.derive_plan(make_trace("window", "prefix_lens=4", "extend_lens=3", "window_right=2", "window=5"))
    assert plan.scalars["causal"] is False and plan.scalars["window_right"] == 2 and plan.scalars["window_left"] == 5
    call = FA3Call.from_plan(plan)
    assert (call.window_left, call.window_right) == (5, 2)
    assert "window_right" not in fa3.derive_plan(make_trace("window")).scalars  # plans without it stay as they were


def test_fa3_rows_without_keys() -> None:
    """The rows whose LSE the adapter maps to -inf: an empty request's, and, causal, the top rows of
    a request with more queries than keys."""
    plan = FA3Backend().derive_plan(make_trace("extend-prefix", "prefix_lens=0,2,5", "extend_lens=2,4,1", "cross=1", "causal=1"))
    assert FA3Call.from_plan(plan).rows_without_keys().tolist() == [True, True, True, True, False, False, False]
    plan = FA3Backend().derive_plan(make_trace("extend-prefix", "prefix_lens=0,2,5", "extend_lens=2,4,1", "cross=1"))
    assert FA3Call.from_plan(plan).rows_without_keys().tolist() == [True, True, False, False, False, False, False]


def test_backends_command_shows_the_layer_kinds() -> None:
    from click.testing import CliRunner

    from attndbg.cli import main

    result = CliRunner().invoke(main, ["backends", "--capabilities"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    kinds = " ".join(result.output.split("layer kinds each takes", 1)[1].split())
    assert "triton: takes non-causal, right window, sinks, KV scales, cross-attention, extend mask, empty KV" in kinds
    assert "not right window (plan() and run() take window_left only" in kinds.split("flashinfer: ", 1)[1]
    fa3 = kinds.split("fa3: ", 1)[1].split(" mla: ", 1)[0]
    assert "KV scales (an fp8 cache with scales is not wired into this adapter)" in fa3, fa3
