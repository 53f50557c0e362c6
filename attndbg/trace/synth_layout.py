"""`attndbg synth`'s layouts: where each request's KV lies in the pool (`slots=`), and the custom
mask of an extend step (`extend_mask=`). Seeded draws only: the same spec gives the same layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attndbg.trace.schema import Batch
from attndbg.trace.synth_spec import SpecError

# Longest bidirectional span of `extend_mask=blocks` (an image's tokens, as Gemma 3 lets them see
# each other both ways inside a causal prefill).
MAX_SPAN = 8


def allocate_rows(
    kv_lens: list[int], shareable: list[int], *, page_size: int, shared_prefix: int, slots: str, g: torch.Generator
) -> tuple[list[Tensor], int]:
    """Give each request a req_to_token row of slot ids, paged, optionally sharing a prefix.

    Page 0 is reserved (the engine's dummy slot for padded tokens), as SGLang and vLLM reserve it.
    Shared prefixes are whole pages, as a paged radix cache matches them, and only columns already
    cached (`shareable`) are shared: slots written this step belong to one request.

    `slots` says how a request's own pages lie in the pool:
      contiguous         in pool order, one request after the other;
      scatter            drawn at random from the whole pool;
      shuffled_pages     one run of the pool per request, its pages in random order (an allocator
                         handing back freed pages);
      interleaved_pages  dealt round-robin among the requests (requests growing side by side);
      non_monotonic      one run per request in descending order, so a row's slots (and an
                         extend's out_cache_loc) decrease from page to page (SGLang's FA3 prefill
                         metadata assumes them increasing).
    """
    shared_pages = shared_prefix // page_size
    reused = [min(shared_pages, s // page_size) for s in shareable]
    pages_needed = [math.ceil(n / page_size) for n in kv_lens]
    own_pages = [p - r for p, r in zip(pages_needed, reused)]
    used = shared_pages + sum(own_pages)
    # Spare pages make the pool larger than the batch, so wrong indices can land on unused data.
    pool_pages = 1 + used + max(used // 4, 2)
    order = torch.randperm(pool_pages - 1, generator=g) + 1 if slots == "scatter" else torch.arange(1, pool_pages)
    shared = order[:shared_pages]
    own = _own_pages(order[shared_pages:], own_pages, slots, g)
    rows = []
    for n, mine, reuse in zip(kv_lens, own, reused):
        pages = torch.cat([shared[:reuse], mine])
        row = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        rows.append(row.to(torch.int64))
    return rows, pool_pages * page_size


def _own_pages(free: Tensor, counts: list[int], slots: str, g: torch.Generator) -> list[Tensor]:
    """Each request's own pages, taken from `free` (in pool or drawn order) as `slots` says."""
    if slots == "interleaved_pages":
        taken: list[list[int]] = [[] for _ in counts]
        cursor, turn = 0, 0
        while any(len(t) < c for t, c in zip(taken, counts)):
            if len(taken[turn]) < counts[turn]:
                taken[turn].append(int(free[cursor]))
                cursor += 1
            turn = (turn + 1) % len(counts)
        return [torch.tensor(t, dtype=torch.int64) for t in taken]
    out, cursor = [], 0
    for count in counts:
        run = free[cursor : cursor + count]
        cursor += count
        if slots == "shuffled_pages":
            run = run[torch.randperm(count, generator=g)]
        elif slots == "non_monotonic":
            run = run.flip(0)
        out.append(run)
    return out


def extend_mask(batch: Batch, kind: str, *, causal: bool, g: torch.Generator) -> Tensor:
    """[sum(extend_lens * kv_lens)] bool: per request a row-major [e, kv] block over its KV row.

    causal  each query sees the columns up to its own (non-causal layer: all): the rule written out;
    random  each key drawn with probability 1/2, a query's own column kept (a cross-attention row
            may be left seeing nothing: fully masked);
    blocks  causal, plus bidirectional spans of 1..MAX_SPAN consecutive new tokens that see each
            other both ways.
    """
    blocks = []
    qo = batch.qo_indptr
    for b in range(batch.batch_size):
        e, kv = int(batch.extend_lens[b]), int(batch.kv_lens[b])
        query_cols = batch.query_cols[int(qo[b]) : int(qo[b + 1])]
        cols = torch.arange(kv)
        rule = cols[None, :] <= query_cols[:, None] if causal else torch.ones(e, kv, dtype=torch.bool)
        if kind == "causal":
            block = rule
        elif kind == "random":
            block = torch.rand(e, kv, generator=g) < 0.5
            block |= cols[None, :] == query_cols[:, None]
        elif kind == "blocks":
            block = rule.clone()
            start = 0
            while start < e:
                span = int(torch.randint(1, MAX_SPAN + 1, (1,), generator=g))
                cols_span = query_cols[start : start + span]
                low, high = max(int(cols_span[0]), 0), int(cols_span[-1]) + 1  # cross rows may sit left of column 0
                block[start : start + span, low:high] = True
                start += span
        else:
            raise SpecError(f"extend_mask={kind!r}: expected causal, random or blocks")
        blocks.append(block.flatten())
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
