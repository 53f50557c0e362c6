"""invariants over what a vLLM metadata builder handed its kernels, against the CommonAttentionMetadata
it was built from (the plan reading's engine facts, attndbg/plans/engine_metadata.py):

    builder-copy        each builder tensor that copies an engine field (query_start_loc, seq_lens,
                        block_table, slot_mapping; MLA's decode and prefill parts) equals it on the
                        real requests (padded rows are fill-value's: a builder may clamp them)
    builder-rows        a builder's paged-KV lists have no row past the step's requests that lists
                        pages (a row per token where the kernel takes a row per request, vLLM #39773)
    builder-counts      num_decodes + num_prefills cover the requests; num_decode_tokens covers the
                        decode requests' query tokens; num_prefill_tokens is the rest of them; the
                        counts' tokens fit the step's num_actual_tokens
    kv-length, kv-last-page-len
                        a builder's paged-KV lists (FlashInfer's, AITER MLA's paged_kv_indptr and
                        paged_kv_last_page_len) give each real request ceil(seq_len / page) pages,
                        the last one holding seq_len - (pages - 1) * page tokens, at the kernel's
                        page size (the model's)
    split-bound         a CUDA-graph replay whose split-KV schedule the builder computed at this
                        step (FA3's ahead-of-time scheduler_metadata) carries a bound on the split
                        count (max_num_splits > 0): the captured kernel's split buffers were sized
                        for one count, the schedule is made afresh each step

A builder that makes a batch of its own (chunked local attention's virtual batches) copies nothing
and is not judged here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.plans.engine_metadata import BuilderCopy, EngineField, PagedKv, SplitSchedule
from attndbg.plans.reading import PlanReading
from attndbg.trace.schema import Trace

CAUSE_COPY = (
    "the builder built this tensor from other values than the step's CommonAttentionMetadata (a stale persistent "
    "buffer, a slice taken with the wrong count, or a clamp meant for padded rows that reached real ones): the kernel "
    "reads what the batch does not say"
)


def check_builder(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    seq = reading.engine_field("seq_lens")
    qsl = reading.engine_field("query_start_loc")
    if seq is None or qsl is None:
        return
    for copy in reading.builder_copies:
        own = reading.engine_field(copy.declared.meaning)
        if own is not None:
            _copy(trace, copy, own, seq.values.reshape(-1), qsl.values.reshape(-1), out)
    _counts(trace, reading.builder_counts, qsl.values.reshape(-1), seq.values.numel(), out)
    for lists in reading.builder_paged_kv:
        _paged_kv(trace, lists, seq, reading.builder_counts, out)
    _split_bound(trace, reading.builder_split_schedule, out)


def _split_bound(trace: Trace, schedule: SplitSchedule | None, out: list[Finding]) -> None:
    graph = trace.graph
    if schedule is None or schedule.bound > 0 or graph is None or not graph.is_graph_replay:
        return
    out.append(
        finding(
            KIND,
            "split-bound",
            step=trace.source.step,
            field=f"plan.scalars.{schedule.bound_name}",
            evidence=f"plan.scalars.{schedule.bound_name} = {schedule.bound} (no bound) while the builder computed this step's "
            f"split schedule (plan.{schedule.schedule}) for a CUDA-graph replay of {graph.capture_bs} rows",
            cause="the split-KV schedule is computed at every step outside the graph with no bound on the split count, while "
            "the captured kernel's split accumulators were sized for the count chosen at capture: a step whose schedule "
            "picks more splits writes past them (an illegal memory access; vLLM #20301 bounds it by max_num_splits at "
            "capture and at run time)",
            expected=">= 1",
            found=schedule.bound,
        )
    )


def _rows_compared(trace: Trace, copy: BuilderCopy, rows: int) -> range:
    """The real requests the copy's rows cover."""
    return range(copy.first_row, min(copy.first_row + rows, trace.batch.batch_size))


def _copy(trace: Trace, copy: BuilderCopy, own: EngineField, seq: Tensor, qsl: Tensor, out: list[Finding]) -> None:
    meaning, name = copy.declared.meaning, copy.declared.name
    values, theirs = copy.values, own.values
    real = trace.batch.batch_size
    if meaning == "query_start_loc":
        # Offsets of the requests from first_row on, re-based at theirs (MLA's prefill part).
        n = min(values.numel(), theirs.numel() - copy.first_row, real + 1 - copy.first_row)
        expected = theirs[copy.first_row : copy.first_row + n] - theirs[copy.first_row]
        pairs = [(i, int(values[i]), int(expected[i]), copy.first_row + max(i - 1, 0)) for i in range(n)]
    elif meaning == "slot_mapping":
        tokens = int(qsl[real]) if qsl.numel() > real else 0
        n = min(values.numel(), theirs.numel(), tokens)
        pairs = [(i, int(values[i]), int(theirs[i]), None) for i in range(n)]
    elif meaning == "block_table":
        if values.dim() != 2 or theirs.dim() != 2:
            return
        pairs = []
        page = trace.model.page_size
        for i in range(min(values.shape[0], theirs.shape[0] - copy.first_row)):
            b = copy.first_row + i
            if b >= real:
                break
            need = -(-int(seq[b]) // page)
            cols = min(need, theirs.shape[1])
            if values.shape[1] < cols:
                pairs.append(((i, values.shape[1]), None, int(theirs[b, values.shape[1]]), b))
                continue
            pairs += [((i, j), int(values[i, j]), int(theirs[b, j]), b) for j in range(cols)]
    else:
        rows = _rows_compared(trace, copy, values.numel())
        pairs = [(b - copy.first_row, int(values[b - copy.first_row]), int(theirs[b]), b) for b in rows if b < theirs.numel()]
    bad = next(((at, found, expected, b) for at, found, expected, b in pairs if found != expected), None)
    if bad is None:
        return
    at, found, expected, b = bad
    index = f"{at[0]}, {at[1]}" if isinstance(at, tuple) else str(at)
    count = sum(1 for _, f, e, _ in pairs if f != e)
    where = f" (request {b})" if b is not None else ""
    out.append(
        finding(
            KIND,
            "builder-copy",
            step=trace.source.step,
            request=b,
            field=f"plan.{name}[{index}]",
            evidence=f"plan.{name}[{index}] = {found if found is not None else 'missing'}, but plan.{own.name} gives {expected}{where}: "
            f"the builder's {meaning} disagrees with the CommonAttentionMetadata it was built from in {count} entries",
            cause=CAUSE_COPY,
            expected=expected,
            found=found,
            differing=count,
        )
    )


def _counts(trace: Trace, counts: dict[str, int], qsl: Tensor, rows: int, out: list[Finding]) -> None:
    decodes = counts.get("num_decodes")
    if decodes is None or qsl.numel() < 2:
        return
    real = trace.batch.batch_size
    last = min(rows, qsl.numel() - 1)
    problems = []
    prefills = counts.get("num_prefills")
    if prefills is not None and decodes + prefills not in (real, rows):
        problems.append(("num_prefills", prefills, f"num_decodes + num_prefills = {decodes + prefills}, the step has {real} requests ({rows} rows)", real - decodes))
    if decodes > last:
        problems.append(("num_decodes", decodes, f"num_decodes = {decodes} but the step has {rows} rows", last))
    else:
        decode_tokens = int(qsl[decodes] - qsl[0])
        given = counts.get("num_decode_tokens")
        if given is not None and given < decode_tokens:
            problems.append(("num_decode_tokens", given, f"the first {decodes} requests (the decodes) have {decode_tokens} query tokens (query_start_loc[{decodes}])", decode_tokens))
        prefill_tokens = int(qsl[max(real, decodes)] - qsl[decodes]) if decodes <= real else 0
        given = counts.get("num_prefill_tokens")
        if given is not None and given != prefill_tokens:
            problems.append(("num_prefill_tokens", given, f"requests {decodes}..{real - 1} (the prefills) have {prefill_tokens} query tokens", prefill_tokens))
    total = counts.get("num_actual_tokens")
    summed = sum(counts.get(k, 0) for k in ("num_decode_tokens", "num_prefill_tokens"))
    if total is not None and summed > total:
        problems.append(("num_decode_tokens", counts.get("num_decode_tokens", 0), f"num_decode_tokens + num_prefill_tokens = {summed} > num_actual_tokens = {total}", total))
    if not problems:
        return
    name, found, why, expected = problems[0]
    out.append(
        finding(
            KIND,
            "builder-counts",
            step=trace.source.step,
            field=f"plan.scalars.{name}",
            evidence=f"plan.scalars.{name} = {found}: {why}",
            cause="the builder counted decodes and prefills from other offsets than the step's query_start_loc (decodes come first): "
            "the kernels given each part get the other part's rows or miss their own",
            expected=expected,
            found=found,
        )
    )


def _paged_kv(trace: Trace, lists: PagedKv, seq: EngineField, counts: dict[str, int], out: list[Finding]) -> None:
    page = trace.model.page_size
    real = trace.batch.batch_size
    rows = real if not lists.prefix else min(real, counts.get("num_decodes", real))
    seqs = seq.values.reshape(-1)[:rows]
    pages = (seqs + page - 1) // page
    if lists.last_page_len is not None:
        last = lists.last_page_len.reshape(-1)[: min(rows, lists.last_page_len.numel())]
        expected = seqs[: last.numel()] - (pages[: last.numel()] - 1) * page
        b = _first((last != expected) & (seqs[: last.numel()] > 0))
        if b >= 0:
            name = f"{lists.prefix}paged_kv_last_page_len"
            value = int(last[b])
            held_len = value == int(seqs[b]) and page < value
            out.append(
                finding(
                    KIND,
                    "kv-last-page-len",
                    step=trace.source.step,
                    request=b,
                    field=f"plan.{name}[{b}]",
                    evidence=f"plan.{name}[{b}] = {value}, expected {int(expected[b])}: request {b}'s seq_len {int(seqs[b])} fills "
                    f"{int(pages[b])} pages of {page} (the kernel's page size), the last one with {int(expected[b])} tokens",
                    cause=(
                        f"last_page_len was set to the whole sequence length instead of the tokens in its last page (pages of {page}): "
                        "the kernel reads past the last page into KV that is not the request's"
                        if held_len
                        else f"last_page_len was computed at another page size than the kernel's ({page}), or from a stale length"
                    ),
                    expected=int(expected[b]),
                    found=value,
                )
            )
    if lists.indptr is not None:
        indptr = lists.indptr.reshape(-1)
        _rows_past_requests(trace, lists, indptr, seq.values.numel() if not lists.prefix else rows, counts, out)
        n = min(rows, indptr.numel() - 1)
        given = indptr[1 : n + 1] - indptr[:n]
        b = _first(given != pages[:n])
        if b >= 0:
            name = f"{lists.prefix}paged_kv_indptr"
            out.append(
                finding(
                    KIND,
                    "kv-length",
                    step=trace.source.step,
                    request=b,
                    field=f"plan.{name}[{b + 1}]",
                    evidence=f"plan.{name} gives request {b} {int(given[b])} pages, its seq_len {int(seqs[b])} needs {int(pages[b])} of {page}",
                    cause=f"the builder counted pages at another page size than the kernel's ({page}), or from other seq_lens than the step's",
                    expected=int(pages[b]),
                    found=int(given[b]),
                )
            )


def _rows_past_requests(trace: Trace, lists: PagedKv, indptr: Tensor, requests: int, counts: dict[str, int], out: list[Finding]) -> None:
    """Rows of the paged-KV lists past the step's rows (its requests, padded ones included) are
    no request: they must list no page. vLLM's FlashInfer builder plans its native decode with a
    row per decode token; a batch whose tokens are padded but not its requests (a PIECEWISE graph)
    gets rows past the requests, read from stale entries of its persistent buffer (vLLM #39773)."""
    if indptr.numel() <= requests + 1:
        return
    end = int(indptr[requests])
    r = _first(indptr[requests + 1 :] != end)
    if r < 0:
        return
    row = requests + r  # the list row whose end entry lists pages
    name = f"{lists.prefix}paged_kv_indptr"
    tokens = counts.get("num_decode_tokens")
    out.append(
        finding(
            KIND,
            "builder-rows",
            step=trace.source.step,
            row=row,
            field=f"plan.{name}[{row + 1}]",
            evidence=f"plan.{name} has {indptr.numel()} entries for {requests} requests"
            + (f" (num_decode_tokens = {tokens})" if tokens is not None else "")
            + f": row {row} is no request, yet plan.{name}[{row + 1}] = {int(indptr[row + 1])} lists pages past the {end} the requests list",
            cause="the builder planned its kernel with more rows than the step has requests (FlashInfer's native decode takes a row per "
            "decode token, and a PIECEWISE graph pads the tokens but not the requests, vLLM #39773): the rows past the requests "
            "come from stale entries of its persistent buffers, so the kernel reads page ids past the ones listed for this step",
            expected=end,
            found=int(indptr[row + 1]),
        )
    )
