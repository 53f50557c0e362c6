"""Mistakes of which keys a request reads: another request's KV row, or a KV length / query
position one off.

Each is the reference run on the step's own q and KV cache with the batch a kernel was wrongly
given (`PartialStates.under`): the same math, other metadata.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, with_batch
from attndbg.trace.schema import ForwardMode, Trace
from attndbg.trace.visibility import visibility

# Every other request is tried as the one whose row was read up to this batch size; above it only
# the neighbours (an index off by one), so a large batch costs two reference passes, not bs.
ALL_PAIRS_MAX_BATCH = 8


class OtherRequestRow(MistakeModel):
    """Request b read request c's KV slots (c another request of the step):

    row             all of b's columns from c's req_to_token row, for b's own length (its row index,
                    req_pool_indices, pointed at c's row; a paged kernel reads every key from the cache);
    prefix          b's prefix columns from c's row, its new tokens' own K/V (kernels that take this
                    step's K/V separately: SGLang's Triton extend, FlashInfer's ragged + paged);
    row and length  decode: b's kv_indptr entries were c's, so its query read all of c's keys.
    """

    name = "other-request-row"
    cause = (
        "The request's attention read another request's KV slots: its req_to_token row index (req_pool_indices) "
        "or its kv_indptr entries pointed at the other request's row, as with a permuted or stale batch index."
    )

    def applies(self, trace: Trace) -> bool:
        return trace.batch.batch_size >= 2 and trace.batch.forward_mode is not ForwardMode.IDLE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        batch = trace.batch
        bs = batch.batch_size
        kv, prefix = batch.kv_lens.tolist(), batch.prefix_lens.tolist()
        decode = batch.forward_mode is ForwardMode.DECODE
        own = [batch.request_slots(b) for b in range(bs)]
        for shift in range(1, bs) if bs <= ALL_PAIRS_MAX_BATCH else (1, bs - 1):
            other = [(b + shift) % bs for b in range(bs)]
            # Requests the variant does not apply to keep their own row in the wrong batch.
            row = [kv[other[b]] >= kv[b] for b in range(bs)]
            yield from self._of(states, ("row", shift), _reading(trace, [own[other[b]][: kv[b]] if row[b] else own[b] for b in range(bs)], kv), requests, other, row, "row", "attention that read another request's req_to_token row, for its own KV length")
            if decode:
                whole = [kv[other[b]] != kv[b] for b in range(bs)]
                lens = [kv[other[b]] if whole[b] else kv[b] for b in range(bs)]
                yield from self._of(states, ("row-and-length", shift), _reading(trace, [own[other[b]] if whole[b] else own[b] for b in range(bs)], lens), requests, other, whole, "row and length", "decode attention that read another request's KV row and length (its kv_indptr entries)")
            else:
                part = [0 < prefix[b] <= kv[other[b]] for b in range(bs)]
                rows = [torch.cat([own[other[b]][: prefix[b]], own[b][prefix[b] :]]) if part[b] else own[b] for b in range(bs)]
                yield from self._of(states, ("prefix", shift), _reading(trace, rows, kv), requests, other, part, "prefix", "attention that read its prefix from another request's req_to_token row, its new tokens' own K/V")

    def _of(self, states: PartialStates, key: tuple, wrong: Trace, requests: list[int], other: list[int], valid: list[bool], variant: str, summary: str) -> Iterator[Candidate]:
        wanted = [b for b in requests if valid[b]]
        if not wanted:
            return
        output = states.under(key, wrong)
        for b in wanted:
            c = other[b]
            off = " (the next request)" if c == b + 1 else " (the previous request)" if c == b - 1 else ""
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary=summary,
                detail=f"request {b} read request {c}'s {variant}{off}",
                params={"read_request": c, "variant": variant},
            )


def _reading(trace: Trace, rows: list[torch.Tensor], kv_lens: list[int]) -> Trace:
    """The step as a kernel sees it when request b's KV row is rows[b] (kv_lens[b] columns), its
    queries at the end of that row as the step's own are at the end of theirs."""
    batch = trace.batch
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    shift = torch.repeat_interleave(lens - batch.kv_lens, batch.extend_lens, output_size=batch.num_tokens)
    return with_batch(
        trace,
        slot_ids=torch.cat(rows) if rows else batch.slot_ids,
        slot_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        kv_lens=lens,
        prefix_lens=lens - batch.extend_lens,
        query_cols=batch.query_cols + shift,
    )


class KeyOffByOne(MistakeModel):
    """Each query of a request sat one column off in its KV row: a seq_len (or position) one short,
    so the query misses its own key, or one ahead, so it also sees the next token's key (the last
    query of a request has none to see). Plain causal steps only: a verify step's columns come from
    its tree."""

    name = "key-off-by-one"
    cause = (
        "The kernel was given the request's KV length or query positions one off (a seq_lens that includes or "
        "excludes the current token by the other engine's convention, positions not advanced), moving the causal edge by one key."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        return not trace.is_tree_verify and not batch.selective and batch.forward_mode is not ForwardMode.IDLE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        batch = trace.batch
        for step, words in ((-1, "one short: each query misses its own key"), (1, "one ahead: each query also sees the next token's key")):
            moved = [b for b in requests if _moves(trace, b, step)]
            if not moved:
                continue
            output = states.under(("query-cols", step), with_batch(trace, query_cols=batch.query_cols + step))
            for b in moved:
                yield Candidate(
                    request=b,
                    output=output[states.rows(b)].double(),
                    summary=f"attention with the request's KV length / query positions {words}",
                    detail=f"request {b}, kv {int(batch.kv_lens[b])}, {int(batch.extend_lens[b])} queries",
                    params={"offset": step},
                )


def _moves(trace: Trace, b: int, step: int) -> bool:
    """Whether moving request b's queries by `step` columns changes which keys any of them sees."""
    batch = trace.batch
    if int(batch.extend_lens[b]) == 0:
        return False
    moved = with_batch(trace, query_cols=batch.query_cols + step)
    return not torch.equal(visibility(trace, b), visibility(moved, b))
