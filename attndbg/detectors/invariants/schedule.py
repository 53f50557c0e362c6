"""invariants against the kernel library's own schedule of the plan (`plan.plan_info`, read in
attndbg/plans/schedule.py): the work items FlashInfer's plan() wrote for the batch its kernels read.

Every kernel launch of a planned wrapper runs one thread block per work item; a plan left from an
earlier batch (the engine refilled kv_indptr in place but skipped plan(), or planned another
wrapper) hands the kernel tiles for that batch's lengths. A CUDA-graph plan without split-KV pads the
grid too but, in FlashInfer 0.7.2.post1, writes no block_valid_mask: its padded blocks run over
entries plan() never wrote (FlashInfer #4002; flashinfer#5176 writes the mask), and a bad entry
there is named so. Checks, each naming the schedule's array and its first bad element:

    plan-info-request-index      a valid work item's request_indices entry is a request of the plan
    plan-info-qo-tiles           each (request, qo tile) the batch needs is listed once, none past its rows
    plan-info-kv-tiles           each request's KV tiles (kv_tile_indices x kv_chunk_size) cover exactly
                                 its KV length: none missing, none past it
    plan-info-repeated-item      a work item listed twice (a hazard: both blocks write the same state)
    plan-info-padded-batch-size  padded_batch_size holds every work item the batch needs
    plan-info-valid-mask         block_valid_mask (split-KV; any graph plan with flashinfer#5176) true
                                 on the work items, false exactly on the padding past them
    plan-info-o-indptr           o_indptr: each request's partial outputs, kv tiles (x rows, prefill)
    plan-info-merge-indptr       merge_indptr (prefill split-KV): each row's kv tiles
    plan-info-total-rows         total_num_rows (and a graph plan's device copy of the rows) against
                                 the plan's query rows
    plan-info-chunk-size         kv_chunk_size > 0 under split-KV, cta_tile_q > 0 for a prefill

Judged: decode schedules (FlashInfer's CUDA-core decode), and prefill schedules (its prefill
kernels, and its decode on tensor cores) planned for a CUDA graph: on the H100 with FlashInfer
0.7.2.post1 the real wrappers' schedules of both read clean here (tests/gpu/test_flashinfer_plan_info.py).
A prefill schedule planned eagerly is read and shown but not judged: the same test found correct
eager prefill schedules read as missing their query tiles, so our reading of that layout does not
yet match the library's, and a finding would be a false claim.

Each is a defect but one: a missing tile leaves keys unread or a partial state unwritten, a tile or
request past the batch reads and writes another request's memory, an offset list for another batch
merges the wrong partials. A work item listed twice (or a padding item left valid that repeats a
listed one) only computes the same state twice: a hazard, wrong once the two blocks see different
inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.flashinfer_plan_info import ScheduleKind
from attndbg.detector_api.findings import Finding, Severity, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.plans.schedule import PlanSchedule
from attndbg.trace.schema import Trace, indptr

CAUSE_REPEATED = (
    "two thread blocks compute and write the same partial state: the output is unaffected while both read the same inputs "
    "(deterministic kernels), but the schedule lists more work than the batch has, as a schedule made for another batch does"
)
CAUSE_STALE = (
    "the wrapper's schedule (plan()'s work items in the int workspace) was made for another batch than the one its kernels "
    "read: a plan left from an earlier batch (indptrs refilled in place without plan()), or a schedule of another wrapper"
)
CAUSE_PADDED = (
    "the CUDA-graph plan without split-KV pads the grid past its work items with no block_valid_mask, so the padded thread "
    "blocks run and read schedule entries plan() never wrote (what the int workspace held there, an earlier plan's: "
    "FlashInfer #4002, fixed by a mask under every graph plan, flashinfer#5176, or an exact grid)"
)


def judged(facts: PlanSchedule) -> bool:
    """Whether this schedule's layout is one our reading was seen to match on the real library (see
    the module docstring): a decode schedule, or a prefill schedule planned for a CUDA graph."""
    s = facts.schedule
    return s.kind is ScheduleKind.DECODE or bool(s.graph)


def check_schedule(trace: Trace, facts: PlanSchedule | None, out: list[Finding]) -> None:
    if facts is None or not judged(facts):
        return
    s = facts.schedule
    step = trace.source.step

    def add(check: str, field: str, evidence: str, cause: str = CAUSE_STALE, severity: Severity = Severity.DEFECT, **data: object) -> None:
        out.append(finding(KIND, check, step=step, field=f"plan.plan_info.{field}", evidence=evidence, cause=cause, severity=severity, **data))

    if s.split_kv and s.kv_chunk_size <= 0:
        add("plan-info-chunk-size", "kv_chunk_size[0]", f"kv_chunk_size = {s.kv_chunk_size} under split-KV, expected a positive token count", found=s.kv_chunk_size)
        return
    if s.kind is ScheduleKind.PREFILL and s.cta_tile_q <= 0:
        add("plan-info-chunk-size", "cta_tile_q", f"cta_tile_q = {s.cta_tile_q}, expected a positive tile height", found=s.cta_tile_q)
        return
    qo_tiles, kv_tiles = facts.tiles_needed()
    items = int((qo_tiles * kv_tiles).sum())
    repeated = _check_items(facts, qo_tiles, kv_tiles, add)
    padded = s.padded_batch_size
    if items > padded:
        add(
            "plan-info-padded-batch-size",
            "padded_batch_size",
            f"padded_batch_size = {padded}, but the plan's {facts.requests} requests need {items} work items; the kernel runs {padded} blocks",
            expected=items,
            found=padded,
        )
    mask = s.arrays.get("block_valid_mask")
    if mask is not None:
        want = torch.arange(mask.numel()) < items
        bad = _first(mask != want)
        if bad >= 0:
            needed = bool(want[bad])
            what = "a work item the batch needs" if needed else "padding past the batch's work items"
            # A valid padding item that repeats a listed tile computes that tile again (harmless while
            # inputs agree); one that is no tile of the batch is named by the item checks, and is harm.
            harmless = not needed and bad in repeated
            add(
                "plan-info-valid-mask",
                f"block_valid_mask[{bad}]",
                f"block_valid_mask[{bad}] = {bool(mask[bad])} on {what} ({items} work items, padded to {padded})" + (", which repeats a listed work item" if harmless else ""),
                cause=CAUSE_REPEATED if harmless else CAUSE_STALE,
                severity=Severity.HAZARD if harmless else Severity.DEFECT,
                expected=needed,
                found=bool(mask[bad]),
            )
    _check_offsets(facts, kv_tiles, add)


def _check_items(facts: PlanSchedule, qo_tiles: Tensor, kv_tiles: Tensor, add) -> set[int]:
    """Walk the valid work items; name the first out-of-batch request, stray or repeated tile, then
    the first (request, qo tile) or KV tile the batch needs that no item lists. Returns the indices
    of the items that repeat an earlier one (and are otherwise tiles of the batch)."""
    s = facts.schedule
    arrays = s.arrays
    request, kv_tile = arrays["request_indices"], arrays["kv_tile_indices"]
    qo_tile = arrays.get("qo_tile_indices", torch.zeros_like(request))
    mask = arrays.get("block_valid_mask")
    # A graph plan without split-KV and without a mask (FlashInfer 0.7.2.post1) runs every padded
    # block: an entry at or past the work items the batch needs is one plan() never wrote.
    unmasked_padding = int((qo_tiles * kv_tiles).sum()) if s.graph and not s.split_kv and mask is None else None

    def cause(i: int) -> str:
        return CAUSE_PADDED if unmasked_padding is not None and i >= unmasked_padding else CAUSE_STALE

    seen: dict[tuple[int, int], set[int]] = {}
    flagged: set[str] = set()
    repeated: set[int] = set()
    for i in range(s.padded_batch_size):
        if mask is not None and not bool(mask[i]):
            continue
        r, qt, kt = int(request[i]), int(qo_tile[i]), int(kv_tile[i])
        if not 0 <= r < facts.requests:
            if "request" not in flagged:
                flagged.add("request")
                add("plan-info-request-index", f"request_indices[{i}]", f"request_indices[{i}] = {r}: the plan has {facts.requests} requests", cause(i), found=r, maximum=facts.requests - 1)
            continue
        if qt >= int(qo_tiles[r]):
            if "qo" not in flagged:
                flagged.add("qo")
                add(
                    "plan-info-qo-tiles",
                    f"qo_tile_indices[{i}]",
                    f"qo_tile_indices[{i}] = {qt} for request {r}, whose {int(facts.qo_lens[r])} query rows (x group {facts.group}) make {int(qo_tiles[r])} tiles of {s.cta_tile_q}",
                    cause(i),
                    request=r,
                    found=qt,
                    expected=int(qo_tiles[r]) - 1,
                )
            continue
        if kt >= int(kv_tiles[r]):
            if "kv" not in flagged:
                flagged.add("kv")
                add("plan-info-kv-tiles", f"kv_tile_indices[{i}]", _kv_evidence(facts, r, int(kv_tiles[r]), f"kv_tile_indices[{i}] = {kt}"), cause(i), request=r, found=kt, expected=int(kv_tiles[r]) - 1)
            continue
        listed = seen.setdefault((r, qt), set())
        if kt in listed:
            repeated.add(i)
            if "repeat" not in flagged:
                flagged.add("repeat")
                add(
                    "plan-info-repeated-item",
                    f"kv_tile_indices[{i}]",
                    f"work item {i} repeats request {r}'s qo tile {qt}, KV tile {kt}",
                    cause=CAUSE_REPEATED,
                    severity=Severity.HAZARD,
                    request=r,
                    found=kt,
                )
        listed.add(kt)
    # The first tile the batch needs that no item lists. Bounded by what is listed, not by what the
    # batch needs (a hostile qo_indptr can claim 2^40 rows): a request's walk stops at its first
    # unlisted qo tile, and an unlisted KV tile is found among the first len(listed) + 1.
    for r in range(facts.requests):
        if {"qo", "kv"} <= flagged:
            break
        for qt in range(int(qo_tiles[r])):
            listed = seen.get((r, qt))
            if listed is None:
                if "qo" not in flagged:
                    flagged.add("qo")
                    add("plan-info-qo-tiles", "request_indices", f"request {r}'s qo tile {qt} is in no work item ({int(qo_tiles[r])} tiles needed for {int(facts.qo_lens[r])} query rows)", request=r, expected=qt)
                break
            if len(listed) < int(kv_tiles[r]) and "kv" not in flagged:
                first = next(k for k in range(len(listed) + 1) if k not in listed)
                flagged.add("kv")
                add("plan-info-kv-tiles", "kv_tile_indices", _kv_evidence(facts, r, int(kv_tiles[r]), f"KV tile {first} of qo tile {qt} is in no work item"), request=r, expected=first)
    return repeated


def _kv_evidence(facts: PlanSchedule, r: int, tiles: int, what: str) -> str:
    s = facts.schedule
    size = f"{s.kv_chunk_size}-token chunks" if s.split_kv else "one tile (no split-KV)"
    return f"request {r}: {what}; its KV list holds {int(facts.kv_lens[r])} tokens ({int(facts.kv_pages[r])} pages of {facts.page_size}), {tiles} tiles in {size}"


def _check_offsets(facts: PlanSchedule, kv_tiles: Tensor, add) -> None:
    s = facts.schedule
    arrays = s.arrays
    rows = int(facts.qo_lens.sum())
    decode = s.kind is ScheduleKind.DECODE
    if not decode or s.split_kv:
        # Decode reads o_indptr only for split-KV partials; prefill always (the output's row offsets).
        per_request = kv_tiles if decode else facts.qo_lens * kv_tiles
        want = indptr(per_request)
        got = arrays["o_indptr"][: want.numel()]
        bad = _first(got != want[: got.numel()])
        if bad >= 0:
            add("plan-info-o-indptr", f"o_indptr[{bad}]", f"o_indptr[{bad}] = {int(got[bad])}, expected {int(want[bad])} (the partial outputs of requests 0..{bad - 1})", expected=int(want[bad]), found=int(got[bad]))
    if decode:
        return
    total = s.info["total_num_rows"]
    if (total < rows) if s.graph else (total != rows):
        add("plan-info-total-rows", "total_num_rows", f"total_num_rows = {total}, the plan's qo_indptr lists {rows} query rows" + (" (a graph plan may hold more, never fewer)" if s.graph else ""), expected=rows, found=total)
    host = arrays.get("total_num_rows_host")
    if host is not None and int(host[0]) != rows and total >= rows:
        add("plan-info-total-rows", "total_num_rows_host[0]", f"the rows the merge reads under a graph = {int(host[0])}, the plan's qo_indptr lists {rows}", expected=rows, found=int(host[0]))
    merge = arrays.get("merge_indptr")
    if merge is not None:
        # Each row's KV tiles, over the rows the array holds (more rows than it holds: total_num_rows
        # is named above; a hostile qo_indptr's claim is never materialised).
        held = facts.qo_lens.clamp(max=merge.numel()).cumsum(0).clamp(max=merge.numel() - 1)
        want = indptr(torch.repeat_interleave(kv_tiles, held.diff(prepend=held.new_zeros(1))))
        got = merge[: want.numel()]
        bad = _first(got != want)
        if bad >= 0:
            add("plan-info-merge-indptr", f"merge_indptr[{bad}]", f"merge_indptr[{bad}] = {int(got[bad])}, expected {int(want[bad])} (the KV tiles of query rows 0..{bad - 1})", expected=int(want[bad]), found=int(got[bad]))
