"""CUDA-graph padding of an SGLang step, as the runner filled its static buffers.

Classic SGLang (`CudaGraphRunner.replay_prepare`) keeps the buffers on the runner: `seq_lens`,
`req_pool_indices`, `out_cache_loc`, `positions`, with `bs`/`raw_bs` set after the call. SGL-new
hands the backend a replay view (`build_replay_fb_view`) with the padded `seq_lens`,
`req_pool_indices` and `positions` and `num_padding = bs - raw_bs`; its `out_cache_loc` is the
unpadded one, so the adapter attaches the padded buffer to the view when it builds it, and the
static buffers' sizes (the runner's max_bs and max_num_token) beside it.

Neither runner keeps query offsets or a page table among its static buffers (the backends' graph
buffers hold those, recorded as the plan), so `Graph.padded_qo_indptr` / `padded_block_table` stay
None for SGLang. What the graphs were sized for at capture is `CaptureSizes` (`capture_sizes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.schema import CaptureSizes, Graph

PADDED_OUT_CACHE_LOC = "attndbg_padded_out_cache_loc"  # attribute the adapter adds to SGL-new views
STATIC_SIZES = "attndbg_static_sizes"  # (max_bs, max_num_tokens) of the SGL-new runner's buffers, added beside it


@dataclass(frozen=True)
class GraphInfo:
    capture_bs: int
    raw_bs: int
    fill_value: int
    # the padded seq_lens' host mirror (the runner's seq_lens_cpu[:bs]), None when the engine keeps
    # none: what the graph's kernels read is known from it without a device sync
    host_seq_lens: tuple[int, ...] | None = None
    capture: CaptureSizes | None = None  # what the graphs were sized for (None: nothing readable)


def _size(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _kv_indices_buffer(backend: Any) -> Tensor | None:
    """The backend's graph kv_indices buffer. FlashInfer keeps a list, one per wrapper, the first
    the buffer it was given (a multi-step draft backend hands each step's sub-backend its row of
    the [num_steps, width] buffer) and the others clones of it."""
    kv = getattr(backend, "cuda_graph_kv_indices", None)
    if isinstance(kv, list) and kv:
        kv = kv[0]
    return kv if isinstance(kv, Tensor) else None


def _graph_state(backend: Any) -> Any:
    """The backend holding the CUDA-graph buffers: `backend`, or the first child of a wrapper
    (`attn_backend_list`) that has them."""
    for candidate in [backend, *(getattr(backend, "attn_backend_list", None) or [])]:
        if _kv_indices_buffer(candidate) is not None or any(isinstance(getattr(candidate, name, None), Tensor) for name in ("cuda_graph_attn_logits", "workspace_buffer")):
            return candidate
    return backend


def capture_sizes(backend: Any, *, max_bs: int | None, max_num_tokens: int | None) -> CaptureSizes | None:
    """What the runner and `backend` sized at capture (`init_cuda_graph_state(max_bs,
    max_num_tokens)`), read from the buffers' shapes (no device sync); None when nothing is known.

    Triton: `cuda_graph_attn_logits` [max_num_tokens, H, max_kv_splits, Dv] (the stage-1 scratch),
    `cuda_graph_kv_indices` (flat); FlashMLA: `cuda_graph_kv_indices` [max_bs, pages] (a page
    table); the verify mask (SGL-new `verify_mask.buffer`, classic `cuda_graph_custom_mask`);
    FlashInfer: `workspace_buffer`.
    """
    state = _graph_state(backend)
    logits = getattr(state, "cuda_graph_attn_logits", None)
    kv = _kv_indices_buffer(state)
    verify_mask = getattr(state, "verify_mask", None) or getattr(state, "_verify_mask", None)
    mask = getattr(verify_mask, "buffer", None)
    if not isinstance(mask, Tensor):
        mask = getattr(state, "cuda_graph_custom_mask", None)
    workspace = getattr(state, "workspace_buffer", None)
    logits = logits if isinstance(logits, Tensor) and logits.dim() == 4 else None
    if max_num_tokens is None and logits is not None:
        max_num_tokens = int(logits.shape[0])  # allocated with the runner's max_num_tokens rows
    sizes = CaptureSizes(
        max_bs=_size(max_bs),
        max_num_tokens=_size(max_num_tokens),
        max_kv_splits=int(logits.shape[2]) if logits is not None else None,
        mask_capacity=mask.numel() if isinstance(mask, Tensor) and mask.numel() else None,
        kv_indices_capacity=kv.numel() if kv is not None and kv.dim() == 1 else None,
        # A 2-D buffer of max_bs rows is a page table (FlashMLA); other 2-D ones (a multi-step
        # draft backend's per-step lists) are not.
        block_table_width=int(kv.shape[1]) if kv is not None and kv.dim() == 2 and max_bs is not None and kv.shape[0] == max_bs else None,
        workspace_bytes=workspace.nbytes if isinstance(workspace, Tensor) else None,
    )
    return sizes if sizes.known() else None


def _host_rows(seq_lens_cpu: Any, bs: int) -> tuple[int, ...] | None:
    if isinstance(seq_lens_cpu, Tensor) and seq_lens_cpu.device.type == "cpu" and seq_lens_cpu.numel() >= bs:
        return tuple(int(v) for v in seq_lens_cpu[:bs].tolist())
    return None


def capture_graph_from_runner(runner: Any) -> tuple[GraphInfo, dict[str, Tensor]]:
    """Classic CudaGraphRunner after `replay_prepare`: its padded static buffers."""
    bs, raw_bs = int(runner.bs), int(runner.raw_bs)
    tokens = bs * int(getattr(runner, "num_tokens_per_bs", 1))
    backend = getattr(getattr(runner, "model_runner", None), "attn_backend", None)
    sizes = capture_sizes(backend, max_bs=getattr(runner, "max_bs", None), max_num_tokens=getattr(runner, "max_num_token", None))
    info = GraphInfo(
        capture_bs=bs, raw_bs=raw_bs, fill_value=int(runner.seq_len_fill_value), host_seq_lens=_host_rows(getattr(runner, "seq_lens_cpu", None), bs), capture=sizes
    )
    return info, {
        "padded_seq_lens": runner.seq_lens[:bs],
        "padded_req_pool_indices": runner.req_pool_indices[:bs],
        "padded_out_cache_loc": runner.out_cache_loc[:tokens],
        "padded_positions": runner.positions[:tokens],
    }


def capture_graph_from_view(
    view: Any, *, fill_value: int, tokens_per_req: int, backend: Any = None, num_padding: int | None = None, slots_per_req: int | None = None
) -> tuple[GraphInfo, dict[str, Tensor]]:
    """SGL-new replay view (`num_padding` set, or given): its padded buffers; with `backend`, the
    sizes its graphs were captured for (the runner's from the view's STATIC_SIZES).
    `slots_per_req`: out_cache_loc entries per request when they differ from its tokens (a draft
    decode's out_cache_loc holds every step's slots)."""
    bs = int(view.batch_size)
    raw_bs = bs - int(view.num_padding if num_padding is None else num_padding)
    tokens = bs * tokens_per_req
    slots = bs * (tokens_per_req if slots_per_req is None else slots_per_req)
    out_cache_loc = getattr(view, PADDED_OUT_CACHE_LOC, None)
    if out_cache_loc is None:
        raise ValueError("the replay view carries no padded out_cache_loc (build_replay_fb_view was not wrapped)")
    max_bs, max_num_tokens = getattr(view, STATIC_SIZES, None) or (None, None)
    sizes = capture_sizes(backend, max_bs=max_bs, max_num_tokens=max_num_tokens) if backend is not None else None
    info = GraphInfo(capture_bs=bs, raw_bs=raw_bs, fill_value=fill_value, host_seq_lens=_host_rows(getattr(view, "seq_lens_cpu", None), bs), capture=sizes)
    return info, {
        "padded_seq_lens": view.seq_lens[:bs],
        "padded_req_pool_indices": view.req_pool_indices[:bs],
        "padded_out_cache_loc": out_cache_loc[:slots],
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
