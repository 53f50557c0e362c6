"""A CUDA-graph-padded SGLang decode step: 2 real requests replayed in a graph captured at bs 4.

The replay view comes from SGL-new's own `build_replay_fb_view` over static buffers filled the way
its runner fills them (seq_lens padded with the fill value 1; req_pool_indices, out_cache_loc and
positions zeroed); the plan is read from the Triton backend's graph buffers, which SGLang refills
in place at replay while `forward_metadata` still describes the capture."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.record import sglang_env as env  # skips this file without SGLang
from tests.record.engines import import_engine
from attndbg.record.sglang.adapter import _wrap_view_builder
from attndbg.record.sglang.batch import batch_from_forward_batch
from attndbg.record.sglang.graph import capture_graph_from_view, graph_from_host, graph_from_replay
from attndbg.record.sglang.plan import plan_from_backend
from attndbg.trace.schema import Plan
from tests.record.sglang_steps import assert_checks_clean, assert_replays_clean, decode_batch, decode_metadata, make_trace, saved_and_loaded, triton_backend

runner_module = import_engine("sglang.srt.model_executor.runner.decode_cuda_graph_runner")

I64, I32 = env.I64, env.I32
ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}
CAPTURE_BS, RAW_BS, FILL = 4, 2, 1
MAX_BS = 8


def static_buffers() -> SimpleNamespace:
    """The decode runner's static buffers after load_batch for our 2 requests (SGL-new policy)."""
    return SimpleNamespace(
        input_ids=torch.tensor([101, 102, 7, 7] + [0] * 4, dtype=I64),
        req_pool_indices=torch.tensor([1, 5] + [0] * 6, dtype=I64),
        seq_lens=torch.tensor([5, 9] + [FILL] * 6, dtype=I64),
        seq_lens_cpu=torch.tensor([5, 9] + [FILL] * 6, dtype=I64),
        out_cache_loc=torch.tensor([15, 38] + [0] * 6, dtype=I64),
        positions=torch.tensor([4, 8] + [0] * 6, dtype=I64),
        encoder_lens=None,
        mamba_track_indices=None,
    )


def graph_backend() -> object:
    """The Triton backend's CUDA-graph buffers after replay refilled them for bs 4; its
    forward_metadata is the stale capture-time object of another batch size."""
    backend = triton_backend(decode_metadata([0, 1, 2, 3, 4, 5, 6, 7, 8], [0] * 8, [8] * 8))
    backend.kv_indptr = torch.zeros(MAX_BS + 1, dtype=I32)
    backend.kv_indptr[: CAPTURE_BS + 1] = torch.tensor([0, 5, 14, 15, 16], dtype=I32)
    backend.cuda_graph_kv_indices = torch.zeros(64, dtype=I64)
    # Padded requests read req_to_token row 0 (all zeros): slot 0, the dummy slot.
    backend.cuda_graph_kv_indices[:16] = torch.tensor(ROWS[1] + ROWS[5] + [0, 0], dtype=I64)
    backend.cuda_graph_num_kv_splits = torch.full((MAX_BS,), 8, dtype=I32)
    backend.cuda_graph_num_kv_splits[:CAPTURE_BS] = torch.tensor([2, 3, 1, 1], dtype=I32)
    return backend


def test_graph_padded_decode(tmp_path) -> None:
    pool = env.req_pool(ROWS)
    fb = decode_batch()  # RAW_BS = 2 requests
    build_view = _wrap_view_builder(runner_module.build_replay_fb_view)
    view = build_view(fb, static_buffers(), CAPTURE_BS, RAW_BS, CAPTURE_BS, None, FILL, env.ForwardMode.DECODE, False)
    assert view.num_padding == 2 and view.seq_lens_sum == 16  # SGLang's own arithmetic: 14 + 2 x fill 1

    batch = batch_from_forward_batch(view, pool.req_to_token, 48, raw_bs=view.batch_size - view.num_padding)
    assert batch.batch_size == RAW_BS
    assert batch.kv_lens.tolist() == [5, 9]
    assert batch.out_cache_loc.tolist() == [15, 38]
    assert batch.positions.tolist() == [4, 8]

    info, tensors = capture_graph_from_view(view, fill_value=FILL, tokens_per_req=1)
    graph = graph_from_host(info, tensors)
    assert (graph.capture_bs, graph.fill_value, info.raw_bs) == (CAPTURE_BS, FILL, RAW_BS)
    assert graph.padded_seq_lens.tolist() == [5, 9, 1, 1]
    assert graph.padded_req_pool_indices.tolist() == [1, 5, 0, 0]
    assert graph.padded_out_cache_loc.tolist() == [15, 38, 0, 0]
    assert graph.padded_positions.tolist() == [4, 8, 0, 0]

    plan = plan_from_backend(graph_backend(), graph_bs=CAPTURE_BS)
    assert plan.tensors["kv_indptr"].tolist() == [0, 5, 14, 15, 16]
    assert plan.tensors["kv_indices"].tolist() == ROWS[1] + ROWS[5] + [0, 0]
    assert plan.tensors["num_kv_splits"].tolist() == [2, 3, 1, 1]
    plan = Plan(plan.backend, plan.tensors, {**plan.scalars, "seq_lens_sum": view.seq_lens_sum})

    trace, path = saved_and_loaded(make_trace(batch, plan=plan, graph=graph), tmp_path)
    assert trace.graph.is_graph_replay
    assert_replays_clean(trace, path)
    assert_checks_clean(path)


def test_graph_from_classic_runner_buffers() -> None:
    """SGL-classic leaves padded req_pool_indices and positions stale: recorded as they are."""
    graph = graph_from_replay(
        capture_bs=CAPTURE_BS,
        fill_value=FILL,
        seq_lens=torch.tensor([5, 9, 1, 1, 1, 1, 1, 1]),
        req_pool_indices=torch.tensor([1, 5, 3, 2, 0, 0, 0, 0]),
        out_cache_loc=torch.tensor([15, 38, 0, 0, 0, 0, 0, 0]),
        positions=torch.tensor([4, 8, 17, 3, 0, 0, 0, 0]),
    )
    assert graph.padded_req_pool_indices.tolist() == [1, 5, 3, 2]
    assert graph.padded_positions.tolist() == [4, 8, 17, 3]
