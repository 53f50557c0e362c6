"""CUDA-graph padding of an SGLang step, as the runner filled its static buffers.

Classic SGLang (`CudaGraphRunner.replay_prepare`) keeps the buffers on the runner: `seq_lens`,
`req_pool_indices`, `out_cache_loc`, `positions`, with `bs`/`raw_bs` set after the call. SGL-new
hands the backend a replay view (`build_replay_fb_view`) with the padded `seq_lens`,
`req_pool_indices` and `positions` and `num_padding = bs - raw_bs`; its `out_cache_loc` is the
unpadded one, so the adapter attaches the padded buffer to the view when it builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.schema import Graph

PADDED_OUT_CACHE_LOC = "attndbg_padded_out_cache_loc"  # attribute the adapter adds to SGL-new views


@dataclass(frozen=True)
class GraphInfo:
    capture_bs: int
    raw_bs: int
    fill_value: int
    # the padded seq_lens' host mirror (the runner's seq_lens_cpu[:bs]), None when the engine keeps
    # none: what the graph's kernels read is known from it without a device sync
    host_seq_lens: tuple[int, ...] | None = None


def _host_rows(seq_lens_cpu: Any, bs: int) -> tuple[int, ...] | None:
    if isinstance(seq_lens_cpu, Tensor) and seq_lens_cpu.device.type == "cpu" and seq_lens_cpu.numel() >= bs:
        return tuple(int(v) for v in seq_lens_cpu[:bs].tolist())
    return None


def capture_graph_from_runner(runner: Any) -> tuple[GraphInfo, dict[str, Tensor]]:
    """Classic CudaGraphRunner after `replay_prepare`: its padded static buffers."""
    bs, raw_bs = int(runner.bs), int(runner.raw_bs)
    tokens = bs * int(getattr(runner, "num_tokens_per_bs", 1))
    info = GraphInfo(capture_bs=bs, raw_bs=raw_bs, fill_value=int(runner.seq_len_fill_value), host_seq_lens=_host_rows(getattr(runner, "seq_lens_cpu", None), bs))
    return info, {
        "padded_seq_lens": runner.seq_lens[:bs],
        "padded_req_pool_indices": runner.req_pool_indices[:bs],
        "padded_out_cache_loc": runner.out_cache_loc[:tokens],
        "padded_positions": runner.positions[:tokens],
    }


def capture_graph_from_view(view: Any, *, fill_value: int, tokens_per_req: int) -> tuple[GraphInfo, dict[str, Tensor]]:
    """SGL-new replay view (`num_padding` set): its padded buffers."""
    bs = int(view.batch_size)
    raw_bs = bs - int(view.num_padding)
    tokens = bs * tokens_per_req
    out_cache_loc = getattr(view, PADDED_OUT_CACHE_LOC, None)
    if out_cache_loc is None:
        raise ValueError("the replay view carries no padded out_cache_loc (build_replay_fb_view was not wrapped)")
    info = GraphInfo(capture_bs=bs, raw_bs=raw_bs, fill_value=fill_value, host_seq_lens=_host_rows(getattr(view, "seq_lens_cpu", None), bs))
    return info, {
        "padded_seq_lens": view.seq_lens[:bs],
        "padded_req_pool_indices": view.req_pool_indices[:bs],
        "padded_out_cache_loc": out_cache_loc[:tokens],
        "padded_positions": view.positions[:tokens],
    }


def graph_from_host(info: GraphInfo, host: dict[str, Tensor]) -> Graph:
    return Graph(
        is_graph_replay=True,
        capture_bs=info.capture_bs,
        fill_value=info.fill_value,
        **{name: host[name].to(torch.int64) for name in ("padded_seq_lens", "padded_req_pool_indices", "padded_out_cache_loc", "padded_positions")},
    )


def graph_from_replay(
    *, capture_bs: int, fill_value: int, seq_lens: Tensor, req_pool_indices: Tensor, out_cache_loc: Tensor, positions: Tensor
) -> Graph:
    """A Graph from the runner's padded buffers, already on the host (the first capture_bs rows)."""
    tokens_per_req = max(out_cache_loc.numel() // max(seq_lens.numel(), 1), 1)
    host = {
        "padded_seq_lens": seq_lens[:capture_bs],
        "padded_req_pool_indices": req_pool_indices[:capture_bs],
        "padded_out_cache_loc": out_cache_loc[: capture_bs * tokens_per_req],
        "padded_positions": positions[: capture_bs * tokens_per_req],
    }
    return graph_from_host(GraphInfo(capture_bs=capture_bs, raw_bs=-1, fill_value=fill_value), {k: v.detach().cpu() for k, v in host.items()})
