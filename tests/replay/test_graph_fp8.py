"""The graph harness writes this step's K/V into an fp8 cache (`index_copy_` has no fp8
kernel, on the GPU or the CPU, and graph replay of fp8-KV steps died with a traceback)."""

from __future__ import annotations

import torch

from attndbg.backends.base import AttentionResult, GraphState, Padding
from attndbg.backends.triton import TritonBackend
from attndbg.replay.data import build_inputs
from attndbg.replay.graph import GraphHarness, raw
from tests.factories import make_trace


class _KvWriteOnly(GraphState):
    """Test scaffold, not a kernel: attends to nothing, so the test sees the harness's KV write alone."""

    def __init__(self, tokens: int, heads: int, dv: int):
        self.out = AttentionResult(torch.zeros(tokens, heads, dv), torch.zeros(tokens, heads))

    def load_plan(self, plan) -> None:
        pass

    def forward(self, inputs) -> AttentionResult:
        return self.out


class _Probe(TritonBackend):
    def graph_state(self, trace, capacity):
        return _KvWriteOnly(capacity.max_tokens, trace.model.num_qo_heads, trace.model.v_head_dim)


def test_fp8_kv_is_written_bytewise_by_the_graph_step() -> None:
    trace = make_trace("decode-gqa", "kv_lens=3,30", "heads=4:2", "head_dim=16", "kv_dtype=float8_e4m3fn")
    inputs = build_inputs(trace)
    padding = Padding(capture_bs=4, fill_value=1)
    plan = TritonBackend().derive_plan(trace, padding)
    harness = GraphHarness(_Probe(), trace, inputs, padding=padding, plans=[plan], traces=[trace], seed=0)
    harness.load(trace, inputs, plan)
    harness.k_cache.zero_()
    harness.step()
    loc = trace.batch.out_cache_loc
    assert harness.k_cache.dtype == torch.float8_e4m3fn
    assert torch.equal(raw(harness.k_cache[loc]), raw(inputs.k_new))
    assert torch.equal(raw(harness.v_cache[loc]), raw(inputs.v_new))
    untouched = torch.ones(trace.batch.kv_cache_size, dtype=torch.bool)
    untouched[loc] = False
    untouched[padding.dummy_slot] = False  # padded tokens write garbage there
    assert not bool(raw(harness.k_cache[untouched]).any())
