"""SGLang KV lists one key short or one page-table column short: the list a kernel reads ends before
the keys the request may see.

- sgl-project/sglang#32087 (2026-07): the Triton backend's sliding-window decode list held
  min(seq_len, sliding_window_size) keys, but the window radius W lets a query see W + 1 keys (the
  FlashInfer and FA3 backends keep W + 1); the oldest in-window key was silently dropped.
- sgl-project/sglang#35985 (2026-08, issue #34239): FA3's CUDA-graph page table was sized from the
  model's context length while speculative verify publishes cache_seqlens = seq_lens + draft
  tokens; near the context wall the kernel read past the table (illegal memory access).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.corpus import sglang_engine as sg
from tests.corpus.bug import Capability, RealBug

I64, I32 = torch.int64, torch.int32
WINDOW = 4  # sliding_window_size: SGLang's radius (config.sliding_window - 1), W + 1 keys per query
DECODE_ROWS = {1: [11, 12, 13, 14, 15], 5: [30, 31, 32, 33, 34, 35, 36, 37, 38]}


def _window_decode(keys_per_query: int) -> sg.Plan:
    def plan(made: Any, fb: Any) -> None:
        """update_sliding_window_buffer: each request's last `keys_per_query` columns."""
        md = sg.triton_decode_metadata(made, fb)
        lens = fb.seq_lens.to(I64)
        kept = torch.clamp(lens, max=keys_per_query)
        rows = made.req_to_token_pool.req_to_token[fb.req_pool_indices]
        md.window_kv_indptr = torch.nn.functional.pad(torch.cumsum(kept, 0), (1, 0)).to(I32)
        md.window_kv_indices = torch.cat([rows[b, int(lens[b] - kept[b]) : int(lens[b])] for b in range(lens.numel())]).to(I64)
        md.window_num_kv_splits = torch.ones(lens.numel(), dtype=I32)
        made.forward_metadata = md

    return plan


def _window_list(out: Path, keys_per_query: int) -> None:
    with sg.recording(out) as session:
        layer = sg.layer(window=WINDOW)  # noqa: F841
        made = sg.backend(sg.CorpusTriton, DECODE_ROWS, _window_decode(keys_per_query))
        made.sliding_window_size = WINDOW
        sg.record_eager(session, made, sg.decode_batch(DECODE_ROWS, [5, 9]))


def write_32087(bug: Path, twin: Path) -> None:
    _window_list(bug, WINDOW)
    _window_list(twin, WINDOW + 1)


N = 4  # draft tokens per verify request (topk 1: a chain)
VERIFY_ROWS = {2: list(range(40, 58)), 4: list(range(60, 70))}
VERIFY_PREFIX = [14, 6]  # request 0 is near the context wall: 14 + 4 columns


def _fa3_verify_graph(width: int) -> sg.Plan:
    def plan(made: Any, view: Any) -> None:
        """FA3's target-verify replay (topk <= 1): cache_seqlens = seq_lens + n over the padded
        batch, cu_seqlens_q = arange(0, bs*n + 1, n), page_table = req_to_token rows cut to the
        graph buffer's `width` columns (page size 1)."""
        lens = view.seq_lens.to(I64)
        bs = lens.numel()
        cache = (lens + N).to(I32)
        table = made.req_to_token_pool.req_to_token[view.req_pool_indices.to(torch.long), :width].to(I32)
        made.forward_metadata = sg.FlashAttentionMetadata(
            cache_seqlens_int32=cache,
            max_seq_len_q=N,
            max_seq_len_k=int(cache.max()),
            cu_seqlens_q=torch.arange(0, bs * N + 1, N, dtype=I32),
            cu_seqlens_k=torch.nn.functional.pad(torch.cumsum(cache, 0), (1, 0)).to(I32),
            page_table=table,
        )

    return plan


CONTEXT_LEN = 16  # the model's context length: the page table's columns before the fix


def _fa3_verify(out: Path, width: int) -> None:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusFA3, VERIFY_ROWS, _fa3_verify_graph(width))
        made.topk = 1
        made.speculative_num_draft_tokens = N
        fb = sg.verify_batch(VERIFY_ROWS, VERIFY_PREFIX, [[-1, 0, 1, 2]] * 2)
        sg.record_replay(session, made, sg.replay_view(fb, capture_bs=3, fill=1, per_req=N))


def write_35985(bug: Path, twin: Path) -> None:
    _fa3_verify(bug, CONTEXT_LEN)
    _fa3_verify(twin, CONTEXT_LEN + N)


BUGS = (
    RealBug(
        id="sglang-32087",
        title="Triton sliding-window decode list one key short (the oldest in-window key dropped)",
        links=("https://github.com/sgl-project/sglang/pull/32087",),
        date="2026-07",
        engine="SGLang triton",
        mode="DECODE",
        mechanism="update_sliding_window_buffer capped the decode window list at sliding_window_size keys; the radius W "
        "lets a query see W + 1 keys (FlashInfer clamps to W + 1, FA3 runs window (W, 0)); the Triton decode kernel reads "
        "the list verbatim, so every step past the window lost its oldest in-window key",
        encoding="2 decodes (kv 5, 9) of a window-4 layer; Triton ForwardMetadata with window_kv_indptr/indices of min(seq_len, 4) keys",
        expected=("invariants/window-kv",),
        keywords=("sliding_window_size + 1", "W + 1"),
        capabilities=(Capability.ALREADY,),
        write=write_32087,
    ),
    RealBug(
        id="sglang-35985",
        title="FA3 graph page table sized from the context length, cache_seqlens = seq_lens + draft tokens past it",
        links=("https://github.com/sgl-project/sglang/pull/35985", "https://github.com/sgl-project/sglang/issues/34239"),
        date="2026-08",
        engine="SGLang fa3",
        mode="TARGET_VERIFY graph",
        mechanism="FlashAttentionBackend sized its CUDA-graph page table (max_num_pages) from model_config.context_len; "
        "target_verify publishes cache_seqlens = seq_lens + speculative_num_draft_tokens, so a request near the context "
        "wall needs more columns than the table has: the kernel indexes past it (illegal memory access)",
        encoding="2 chain verifies (n=4, prefixes 14 and 6) in a bs-3 graph; FA3 metadata whose page_table has the context "
        "length's 16 columns while request 0 reads 18",
        expected=("invariants/page-table", "invariants/kv-length", "invariants/block-table-short"),
        keywords=("capture", "context length", "draft tokens"),
        capabilities=(Capability.SPLITS_VS_CAPTURE,),
        write=write_35985,
    ),
)
