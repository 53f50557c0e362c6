"""The mla backend on the real kernels: FlashInfer's BatchMLAPagedAttentionWrapper and our Triton
MLA decode, against the float64 reference (GPU only). Errors are recorded per test
(`record_property`); see test_fa3.py for the shared checking and CUDA-graph helpers."""

from __future__ import annotations

import math

import pytest
import torch

from attndbg.backends.mla import MLABackend, MLAImpl, MLAOptions
from attndbg.replay.runner import RunStatus, replay
from tests.gpu.test_fa3 import check, graph_replay_check, record_and_assert, runner_graph_replay_check, spec_trace

pytestmark = pytest.mark.gpu

LN2 = math.log(2.0)
IMPLS = ["flashinfer", "triton"]


def test_auto_is_flashinfer_here_and_says_so():
    backend = MLABackend()
    assert backend.impl() is MLAImpl.FLASHINFER
    assert "BatchMLAPagedAttentionWrapper(backend='fa3')" in backend.describe()


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_replays_clean_through_the_registry(dtype, page_size, record_property):
    trace = spec_trace("mla-decode", f"dtype={dtype}", f"page_size={page_size}")
    run = replay(trace, "mla-decode", ["mla"]).runs[0]
    assert run.status in (RunStatus.PASSED, RunStatus.FAILED), f"{run.status.value}: {run.reason}"
    record_and_assert(record_property, run.comparison)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "words",
    [("mla-decode",), ("mla-decode", "kv_lens=1,2,65,1000,4097", "heads=128")],
    ids=["decode", "decode-128-heads"],
)
def test_decode(words, impl, dtype, page_size, record_property):
    checked = check(MLABackend(MLAOptions(impl)), spec_trace(*words, f"dtype={dtype}", f"page_size={page_size}"))
    assert checked.plan.scalars["impl"] == impl
    record_and_assert(record_property, checked.comparison)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize(
    "words",
    [
        ("mode=extend", "prefix_lens=0,40,129", "extend_lens=37,5,64"),
        ("mode=mixed", "prefix_lens=48,0,90,33", "extend_lens=40,25,1,1"),
        ("mode=verify", "prefix_lens=31,64", "topk=1", "steps=4", "draft_tokens=5"),
    ],
    ids=["extend", "mixed", "verify-chain"],
)
def test_flashinfer_causal_q_len_above_one(words, page_size, record_property):
    checked = check(MLABackend(MLAOptions("flashinfer")), spec_trace("mla-decode", *words, f"page_size={page_size}"))
    assert checked.plan.scalars["causal"] is True
    record_and_assert(record_property, checked.comparison)


@pytest.mark.parametrize(
    ("impl", "words", "expected"),
    [
        ("flashinfer", ("mode=verify", "prefix_lens=10,20", "topk=2", "steps=2", "draft_tokens=4"), "FlashInfer's MLA kernels take no custom mask"),
        ("triton", ("mode=extend", "prefix_lens=3,4", "extend_lens=2,5"), "MLA decode only"),
        ("flashinfer", ("logit_cap=30",), "no logit soft-cap"),
    ],
)
def test_unsupported_cases_say_why(impl, words, expected):
    reason = MLABackend(MLAOptions(impl)).unsupported_reason(spec_trace("mla-decode", *words))
    assert reason is not None and expected in reason


def test_mha_trace_is_refused():
    run = replay(spec_trace("decode-gqa"), "decode-gqa", ["mla"]).runs[0]
    assert run.status is RunStatus.UNSUPPORTED and "not an MLA model" in run.reason


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_is_natural_log(impl, record_property):
    checked = check(MLABackend(MLAOptions(impl)), spec_trace("mla-decode", "kv_lens=3,200,1500"))
    ref = checked.reference.lse
    lse = checked.result.lse.to(torch.float64)
    error = float((lse - ref).abs().max())
    record_property("max_lse_abs", f"{error:.3e}")
    assert error < 0.02
    # A base-2 LSE (FlashInfer's native one) would be off by |lse| (1/ln 2 - 1), far more.
    assert float((lse / LN2 - ref).abs().max()) > 0.5


@pytest.mark.parametrize(
    ("impl", "words", "decoy"),
    [
        ("flashinfer", ("mla-decode",), ("kv_lens=77,5,130,9,2", "seed=7")),
        ("flashinfer", ("mla-decode", "page_size=64"), ("kv_lens=77,5,130,9,2", "seed=7")),
        ("flashinfer", ("mla-decode", "mode=verify", "prefix_lens=31,64", "topk=1", "steps=4", "draft_tokens=5"), ("prefix_lens=9,40,11", "seed=7")),
        ("triton", ("mla-decode",), ("kv_lens=77,5,130,9,2", "seed=7")),
    ],
    ids=["flashinfer-decode", "flashinfer-decode-page64", "flashinfer-verify-chain", "triton-decode"],
)
def test_cuda_graph_replay(impl, words, decoy, record_property):
    backend = MLABackend(MLAOptions(impl))
    graph_replay_check(backend, spec_trace(*words), spec_trace(*words, *decoy), record_property)


@pytest.mark.parametrize(
    ("impl", "words"),
    [("flashinfer", ("mla-decode",)), ("flashinfer", ("mla-decode", "page_size=64")), ("triton", ("mla-decode",))],
    ids=["flashinfer", "flashinfer-page64", "triton"],
)
def test_the_runners_graph_replay(impl, words, record_property):
    runner_graph_replay_check(MLABackend(MLAOptions(impl)), spec_trace(*words), record_property)
