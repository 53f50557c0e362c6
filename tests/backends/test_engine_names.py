"""Engine backend names: each resolves to the adapter that declares it (or to engine_names.py's
table), so fill-value judges a vLLM step's padding by the kernel that consumes it."""

from __future__ import annotations

import pytest

from attndbg.backends import engine_names
from attndbg.backends.fa3 import FA3Backend
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends.mla import MLABackend
from attndbg.backends.triton import TritonBackend
from attndbg.detectors.fill_value import detect as fill_value
from tests.checks.test_fill_value import decode, on, with_graph


@pytest.mark.parametrize(
    "name,adapter",
    [("flashinfer", FlashInferBackend), ("FLASHINFER", FlashInferBackend), ("fa3", FA3Backend), ("FLASH_ATTN", FA3Backend), ("triton", TritonBackend), ("flashmla", MLABackend), ("mla", MLABackend)],
)
def test_each_engine_name_answers_to_its_adapter(name: str, adapter: type) -> None:
    assert engine_names.adapter_for(name) is adapter
    assert engine_names.fill_requirement(name) is not None


def test_names_no_adapter_reproduces_are_data_and_unknown_names_are_not_judged() -> None:
    assert engine_names.adapter_for("TRITON_ATTN") is None
    assert engine_names.fill_requirement("TRITON_ATTN").min_seq_len == 0
    assert engine_names.fill_requirement("ascend").min_seq_len == 0
    assert engine_names.fill_requirement("no-such-backend") is None


@pytest.mark.parametrize("name,unsupported", [("FLASHINFER", True), ("FLASH_ATTN", False), ("TRITON_ATTN", False)])
def test_a_vllm_step_padded_with_seq_len_0_is_judged_by_its_kernel(name: str, unsupported: bool) -> None:
    """vLLM pads with seq_len 0: FlashInfer's kernels cannot take it (vLLM #38436), FlashAttention's
    and vLLM's unified Triton attention can."""
    trace = on(decode(4), name, engine="vllm")
    bs = trace.batch.batch_size
    seq_lens = trace.graph.padded_seq_lens.clone()
    seq_lens[bs:] = 0
    findings = fill_value.recorded_padding(with_graph(trace, padded_seq_lens=seq_lens, fill_value=0))
    hits = [f for f in findings if f.check == "padded-seq-len-unsupported"]
    assert bool(hits) is unsupported, [f.check for f in findings]
    if unsupported:
        assert f"ran on {name}, which needs >= 1" in hits[0].evidence and "#38436" in hits[0].cause
