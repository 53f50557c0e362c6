"""Mistakes of which keys a request reads: another request's KV row, the slots a wrong recorded plan
names, the capture batch's lengths left in a graph, a KV length / query position one off,
positions left from the previous chunk, or new tokens' keys read twice (listed and passed apart).

Each is the reference run on the step's own q and KV cache with the batch a kernel was wrongly
given (`PartialStates.under`): the same math, other metadata.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from attndbg.backends.plan_layout import KvEnd
from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, plan_kv, plan_slots, with_batch, with_rows
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
            yield from self._of(states, ("row", shift), with_rows(trace, [own[other[b]][: kv[b]] if row[b] else own[b] for b in range(bs)], kv), requests, other, row, "row", "attention that read another request's req_to_token row, for its own KV length")
            if decode:
                whole = [kv[other[b]] != kv[b] for b in range(bs)]
                lens = [kv[other[b]] if whole[b] else kv[b] for b in range(bs)]
                yield from self._of(states, ("row-and-length", shift), with_rows(trace, [own[other[b]] if whole[b] else own[b] for b in range(bs)], lens), requests, other, whole, "row and length", "decode attention that read another request's KV row and length (its kv_indptr entries)")
            else:
                part = [0 < prefix[b] <= kv[other[b]] for b in range(bs)]
                rows = [torch.cat([own[other[b]][: prefix[b]], own[b][prefix[b] :]]) if part[b] else own[b] for b in range(bs)]
                yield from self._of(states, ("prefix", shift), with_rows(trace, rows, kv), requests, other, part, "prefix", "attention that read its prefix from another request's req_to_token row, its new tokens' own K/V")

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


class RecordedPlanKV(MistakeModel):
    """The kernel read the KV slots its recorded plan names (kv_indices / page table by the plan's
    backend view), where they differ from the request's row: a stale kv_indptr tail after the
    batch shrank, a plan built for another batch (the warm-up or capture one), a permuted row.
    invariants says how the plan is wrong; this says the engine's output came from it. Plans the
    guard refuses (indices outside the cache) are never read."""

    name = "recorded-plan-kv"
    cause = (
        "The kernel read the KV slots its recorded plan names, which differ from the request's own row (a stale "
        "indptr tail after the batch shrank, a plan left from another batch such as the capture or warm-up one); "
        "invariants names the plan field at fault."
    )

    def applies(self, trace: Trace) -> bool:
        return trace.plan is not None and trace.batch.forward_mode is not ForwardMode.IDLE

    def shown_by_metadata(self, trace: Trace) -> bool:
        return self.applies(trace)  # candidates come only from a recorded plan that differs from the batch

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        kv = plan_kv(states.plan)
        if kv is None:
            return
        batch = trace.batch
        decode = batch.forward_mode is ForwardMode.DECODE
        rows = [batch.request_slots(b) for b in range(batch.batch_size)]
        lens = batch.kv_lens.tolist()
        wrong: dict[int, str] = {}
        for b in requests:
            ids, length = kv.of(b)
            slots = plan_slots(ids, length, kv.page_size)
            own, n, prefix = rows[b], int(batch.kv_lens[b]), int(batch.prefix_lens[b])
            if slots.numel() != length:
                continue
            if length == n:
                row, what = slots, "its KV row"
            elif decode and trace.model.sliding_window >= 0 and length < n:
                row, what = torch.cat([own[: n - length], slots]), "its window's keys"  # a window plan reads the row's tail
            elif not decode and length == prefix:
                row, what = torch.cat([slots, own[prefix:]]), "its prefix"  # the new tokens' K/V come separately
            elif decode and length >= 1:
                row, what = slots, f"{length} keys where its row has {n}"
            else:
                continue
            if row.numel() == own.numel() and torch.equal(row, own):
                continue
            rows[b], lens[b], wrong[b] = row, row.numel(), what
        if not wrong:
            return
        output = states.under("recorded-plan-kv", with_rows(trace, rows, lens))
        for b, what in wrong.items():
            differ = int((rows[b][: min(lens[b], int(batch.kv_lens[b]))] != batch.request_slots(b)[: min(lens[b], int(batch.kv_lens[b]))]).sum())
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary=f"attention over the KV slots the recorded {trace.plan.backend} plan names, not the request's own",
                detail=f"request {b}: {what}, {differ} slots differ",
                params={"read": what, "slots_differ": differ},
            )


class PlanFromCapture(MistakeModel):
    """A graph-replayed decode step whose kernel did not read this step's metadata: the capture
    batch's left in the graph's buffers, every request reading only `fill` keys of its row (the
    seq_len the runner fills capture and padded rows with; fill 0 reads nothing, output 0), or
    metadata rebuilt at replay into fresh tensors the graph never saw, so every request attended
    KV slot 0 alone."""

    name = "plan-from-capture"
    cause = (
        "The CUDA graph replayed without this step's metadata: the plan was not copied into the buffers the graph "
        "captured (the capture batch's seq_lens remained), or was rebuilt into fresh tensors the graph never reads "
        "(SGLang PR #26019's review: every request attended KV slot 0)."
    )

    def applies(self, trace: Trace) -> bool:
        graph = trace.graph
        return graph is not None and graph.is_graph_replay and trace.batch.forward_mode is ForwardMode.DECODE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        batch, fill = trace.batch, trace.graph.fill_value
        summary = f"decode attention with the capture batch's seq_len {fill} (the graph's plan never updated)"
        hit = [b for b in requests if int(batch.kv_lens[b]) > max(fill, 0)]
        if hit and fill <= 0:
            for b in hit:
                rows = states.rows(b)
                zero = torch.zeros(rows.stop - rows.start, trace.model.num_qo_heads, trace.model.v_head_dim, dtype=torch.float64)
                yield Candidate(request=b, output=zero, summary=summary, detail=f"request {b}, kv {int(batch.kv_lens[b])} read as 0", params={"fill": fill})
        elif hit:
            yield from self._reading_rows(states, ("capture-fill", fill), hit, lambda b: batch.request_slots(b)[:fill], summary, lambda b: f"request {b}, kv {int(batch.kv_lens[b])} read as {fill}", {"fill": fill})
        slot0 = torch.zeros(1, dtype=torch.int64)
        alone = [b for b in requests if not torch.equal(batch.request_slots(b), slot0)]
        yield from self._reading_rows(states, "slot-0", alone, lambda b: slot0, "decode attention over KV slot 0 alone (metadata the graph never read)", lambda b: f"request {b}, kv {int(batch.kv_lens[b])} read as slot 0", {"slot": 0})

    def _reading_rows(self, states: PartialStates, key: object, hit: list[int], row_of, summary: str, detail_of, params: dict) -> Iterator[Candidate]:
        """Candidates for requests `hit`, each reading row_of(b) (its query at the row's end)."""
        if not hit:
            return
        batch = states.trace.batch
        rows = [row_of(b) if b in hit else batch.request_slots(b) for b in range(batch.batch_size)]
        output = states.under(key, with_rows(states.trace, rows, [r.numel() for r in rows]))
        for b in hit:
            yield Candidate(request=b, output=output[states.rows(b)].double(), summary=summary, detail=detail_of(b), params=params)


class StalePositions(MistakeModel):
    """An extend whose query positions were the previous chunk's (positions not advanced by the
    request's extend length): each query sits extend_len columns early and misses the keys after.
    Decode's one-token case is key-off-by-one's."""

    name = "positions-stale"
    cause = (
        "The query positions were left from the previous chunk (not advanced by the request's extend length), so "
        "each query's causal edge sat that many keys early."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        return not trace.is_tree_verify and not batch.selective and bool((batch.extend_lens >= 2).any()) and batch.forward_mode is not ForwardMode.DECODE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace = states.trace
        batch = trace.batch
        moved = [b for b in requests if int(batch.extend_lens[b]) >= 2 and int(batch.prefix_lens[b]) > 0]
        if not moved:
            return
        shift = torch.repeat_interleave(batch.extend_lens, batch.extend_lens, output_size=batch.num_tokens)
        output = states.under("positions-stale", with_batch(trace, query_cols=batch.query_cols - shift))
        for b in moved:
            e = int(batch.extend_lens[b])
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary="attention with the query positions of the previous chunk (not advanced by the extend length)",
                detail=f"request {b}, {e} queries {e} columns early",
                params={"shift": -e},
            )


class NewTokensTwice(MistakeModel):
    """An extend (or draft extend) whose kernel takes this step's new K/V from its inputs (the plan
    lists only the prefix: SGLang's Triton extend) while its plan's list ran on past the prefix
    into the request's new tokens' columns: those keys were read twice, once from the cache (where
    the engine wrote them before the kernel) as if prefix keys every query sees, once from the
    inputs, causally. SGLang #27738: Triton's DRAFT_EXTEND kv_indices built over seq_lens (prefix +
    accepted tokens) instead of extend_prefix_lens."""

    name = "new-tokens-twice"
    cause = (
        "The kernel takes this step's new K/V from its inputs, but its prefix KV list ran past the prefix over the "
        "new tokens' own columns (built from seq_lens instead of extend_prefix_lens, as SGLang #27738's draft extend "
        "did with the accepted tokens), so their keys were attended twice."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        return trace.plan is not None and not trace.is_tree_verify and not batch.selective and batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.IDLE)

    def shown_by_metadata(self, trace: Trace) -> bool:
        return self.applies(trace)  # candidates come only from a recorded plan whose list runs past the prefix

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        trace, reading = states.trace, states.plan
        kv = plan_kv(reading)
        if kv is None or reading.ends != (KvEnd.PREFIX,):
            return  # the plan's kernel reads the new tokens from its list, or cannot be read safely
        batch = trace.batch
        rows = [batch.request_slots(b) for b in range(batch.batch_size)]
        twice: dict[int, int] = {}
        for b in requests:
            ids, length = kv.of(b)
            own, prefix = rows[b], int(batch.prefix_lens[b])
            listed = plan_slots(ids, length, kv.page_size)
            if listed.numel() != length or not prefix < length <= own.numel() or not torch.equal(listed, own[:length]):
                continue  # not the request's own row from column 0 past its prefix (recorded-plan-kv's case)
            rows[b], twice[b] = torch.cat([listed, own[prefix:]]), length - prefix
        if not twice:
            return
        output = states.under("new-tokens-twice", with_rows(trace, rows, [r.numel() for r in rows]))
        tokens = "accepted tokens" if batch.forward_mode is ForwardMode.DRAFT_EXTEND else "new tokens"
        for b, count in twice.items():
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary=f"attention that read the {tokens}' K/V twice: the prefix list ran over their columns, and the kernel read them again from its inputs",
                detail=f"request {b}, prefix {int(batch.prefix_lens[b])} listed as {int(batch.prefix_lens[b]) + count}, {count} of its {int(batch.extend_lens[b])} {tokens} twice",
                params={"listed": int(batch.prefix_lens[b]) + count, "prefix": int(batch.prefix_lens[b]), "twice": count},
            )
