"""What SGLang sized at CUDA-graph capture, recorded with a graph replay.

The replay view comes from SGL-new's real `build_replay_fb_view` (wrapped as the recorder wraps
it) over the decode runner's static buffers of max_bs = 8 rows; the Triton backend is SGLang's
real class with the graph buffers `init_cuda_graph_state(max_bs, max_num_tokens)` allocates:
`cuda_graph_attn_logits` [max_num_tokens, H, max_kv_splits, Dv] and `cuda_graph_kv_indices`.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from attndbg.detectors.invariants.detect import check_trace
from attndbg.record.sglang.adapter import _wrap_view_builder
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.record.sglang.graph import STATIC_SIZES, capture_graph_from_runner, capture_graph_from_view, capture_sizes, graph_from_host
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.trace.schema import CaptureSizes, Plan, Trace
from tests.record.sglang_steps import decode_batch, make_trace, saved_and_loaded
from tests.record.test_sglang_graph import CAPTURE_BS, FILL, MAX_BS, RAW_BS, ROWS, graph_backend, runner_module, static_buffers

HEADS, V_HEAD_DIM = 4, 16


def captured_backend(max_kv_splits: int) -> object:
    backend = graph_backend()
    backend.cuda_graph_attn_logits = torch.zeros(MAX_BS, HEADS, max_kv_splits, V_HEAD_DIM)
    return backend


def recorded(tmp_path, backend: object) -> Trace:
    """The padded decode (2 requests replayed at bs 4) as the recorder builds it, saved and loaded."""
    pool = env.req_pool(ROWS)
    view = _wrap_view_builder(runner_module.build_replay_fb_view)(decode_batch(), static_buffers(), CAPTURE_BS, RAW_BS, CAPTURE_BS, None, FILL, env.ForwardMode.DECODE, False)
    assert getattr(view, STATIC_SIZES) == (MAX_BS, MAX_BS)  # the runner's buffers: 8 rows, 8 decode tokens
    info, tensors = capture_graph_from_view(view, fill_value=FILL, tokens_per_req=1, backend=backend)
    batch = batch_from_forward_batch(view, pool.req_to_token, 48, raw_bs=RAW_BS)
    plan = plan_from_backend(backend, graph_bs=CAPTURE_BS)
    plan = Plan(plan.backend, plan.tensors, {**plan.scalars, "seq_lens_sum": view.seq_lens_sum})
    trace = replace(make_trace(batch, plan=plan, graph=graph_from_host(info, tensors)), capture=info.capture)
    return saved_and_loaded(trace, tmp_path)[0]


def test_a_replay_records_the_sizes_its_graph_was_captured_with(tmp_path) -> None:
    trace = recorded(tmp_path, captured_backend(max_kv_splits=8))
    assert trace.capture == CaptureSizes(max_bs=MAX_BS, max_num_tokens=MAX_BS, max_kv_splits=8, kv_indices_capacity=64)
    assert check_trace(trace) == []


def test_splits_past_the_captured_scratch_are_named_by_it(tmp_path) -> None:
    # The backend's setting says 8, but the graph's stage-1 scratch was captured with 2 splits per
    # request; the replay planned 3 for request 1.
    trace = recorded(tmp_path, captured_backend(max_kv_splits=2))
    assert trace.plan.scalars["max_kv_splits"] == 8 and trace.capture.max_kv_splits == 2
    [found] = check_trace(trace)
    assert (found.check, found.location.field, found.location.request) == ("num-kv-splits", "plan.num_kv_splits[1]", 1)
    assert "plan.num_kv_splits[1] = 3, expected a value in [1, 2] (capture.max_kv_splits = 2)" in found.evidence
    assert "captured" in found.cause


def test_classic_runner_sizes_and_other_capture_buffers() -> None:
    backend = captured_backend(max_kv_splits=8)
    backend.cuda_graph_custom_mask = torch.ones(1000, dtype=torch.bool)  # classic verify mask buffer
    buffers = static_buffers()
    runner = SimpleNamespace(
        bs=CAPTURE_BS, raw_bs=RAW_BS, seq_len_fill_value=FILL, num_tokens_per_bs=1, max_bs=MAX_BS, max_num_token=MAX_BS,
        seq_lens=buffers.seq_lens, seq_lens_cpu=buffers.seq_lens_cpu, req_pool_indices=buffers.req_pool_indices,
        out_cache_loc=buffers.out_cache_loc, positions=buffers.positions, model_runner=SimpleNamespace(attn_backend=backend),
    )  # fmt: skip
    info, _ = capture_graph_from_runner(runner)
    assert info.capture == CaptureSizes(max_bs=MAX_BS, max_num_tokens=MAX_BS, max_kv_splits=8, mask_capacity=1000, kv_indices_capacity=64)
    # FlashMLA's graph buffer is a page table of max_bs rows: its width, not a flat capacity.
    flashmla = SimpleNamespace(cuda_graph_kv_indices=torch.ones(MAX_BS, 5, dtype=torch.int32))
    assert capture_sizes(flashmla, max_bs=MAX_BS, max_num_tokens=None) == CaptureSizes(max_bs=MAX_BS, block_table_width=5)
    # Nothing readable: no record rather than zeros.
    assert capture_sizes(SimpleNamespace(), max_bs=None, max_num_tokens=None) is None
