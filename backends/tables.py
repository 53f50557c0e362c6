"""Per-request tables that several adapters build the same way: each request's KV row (padded
for a CUDA graph as engines pad) and a page/block table over those rows. Shared by fa3, mla and
third-party adapters, which should not have to import another backend for them."""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.base import Padding
from attndbg.trace.schema import ForwardMode, Trace


def padded_requests(trace: Trace, padding: Padding | None) -> tuple[list[Tensor], list[int]]:
    """Each request's KV row (slot ids) and query length; with `padding`, then the padded requests.

    Padded requests are SGLang's graph-runner padding: `fill_value` KV columns at the dummy slot,
    plus, for verify, their n draft tokens, whose K/V go to the dummy slot too (SGLang verify
    seq_lens exclude the drafts; the backend adds n).
    """
    batch = trace.batch
    rows = [batch.request_slots(b) for b in range(batch.batch_size)]
    q_lens = batch.extend_lens.tolist()
    if padding is None:
        return rows, q_lens
    mode = batch.forward_mode
    if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        raise ValueError(f"only decode and verify steps are padded for CUDA graphs, not {mode.value}")
    pad = padding.capture_bs - batch.batch_size
    if pad < 0:
        raise ValueError(f"capture_bs {padding.capture_bs} is smaller than the batch ({batch.batch_size} requests)")
    tokens = 1 if mode is ForwardMode.DECODE else trace.spec.draft_token_num
    kv = padding.fill_value + (0 if mode is ForwardMode.DECODE else tokens)
    rows += [torch.full((kv,), padding.dummy_slot, dtype=torch.int64)] * pad
    q_lens += [tokens] * pad
    return rows, q_lens


def build_page_table(rows: list[Tensor], page_size: int) -> Tensor:
    """[bs, max_pages] int32: the page id of every page of each request's KV row (SGLang:
    `req_to_token[:, ::page_size] // page_size`). Columns past a request's pages hold 0, the
    dummy page, as a zeroed req_to_token row does."""
    pages = [r[::page_size] // page_size for r in rows]
    table = torch.zeros(len(rows), max([1] + [p.numel() for p in pages]), dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, : p.numel()] = p.to(torch.int32)
    return table
