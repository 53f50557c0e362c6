"""invariants on the recorded plan against the batch: index dtypes, the batch size it covers, each
request's KV indices and length, query offsets and split counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.plan_layout import KvEnd
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import DRAFT_EXTEND_QUERIES, KIND, _first
from attndbg.detectors.invariants.capture import captured_split_limit
from attndbg.detectors.invariants.indptr import _indptr_ends
from attndbg.detectors.invariants.structure import worded
from attndbg.plans.kv import needed_start
from attndbg.plans.problems import ProblemKind
from attndbg.plans.reading import PlanReading
from attndbg.trace.schema import ForwardMode, Plan, Trace


CAUSE_WRONG_ROW = "the engine built request {b}'s kv_indices from request {c}'s req_to_token row (a wrong req_pool_indices entry)"
CAUSE_SHIFTED = "the engine's indices for request {b} start {k} column(s) too {direction} (a wrong kv_start_idx or window offset)"
CAUSE_STALE_ROW = "the engine built request {b}'s indices from a stale or overwritten req_to_token row"
CAUSE_GARBAGE = (
    "the engine read a req_to_token entry that was never written (garbage from a torch.empty pool, SGLang #1782) "
    "or read past the row's used length"
)


CAUSE_UNSAFE = (
    "a kernel given this plan reads past one of its tensors or outside the KV cache (an illegal memory access, "
    "or arbitrary device memory): replay does not launch it"
)
# Verify-step mask fields are tree-mask's to explain (this module's docstring: division of labour).
_TREE_MASK_FIELDS = ("custom_mask", "mask_indptr", "expand_")


def _check_plan(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    _check_fields(trace, reading, out)
    _check_launchable(trace, reading, out)


def _check_launchable(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    """A plan the replay guard refuses is a finding, unless a finding above already names its field:
    what the guard refuses is never launched, so nothing else would report it. Refusals naming no
    field are not: a plan of no attndbg backend (vLLM's own) is never replayed, one of a backend
    without a plan view is refused at replay with that reason, and one covering more requests than
    the step is plan-batch-size. Nor is a plan the guard could not read (a field its layout declares
    missing or unreadable): incomplete is not unsafe, and the verdict names it (PlanReading.unread)."""
    found = reading.refusal
    if found is None or found.field is None or found.unread:
        return
    if any((f.location.field or "").startswith(f"plan.{found.field}") for f in out):
        return
    if trace.is_tree_verify and _tree_mask_names(reading, found.field):
        return
    out.append(finding(KIND, "plan-unsafe", step=trace.source.step, field=f"plan.{found.field}", evidence=found.message, cause=CAUSE_UNSAFE))


def _tree_mask_names(reading: PlanReading, field: str) -> bool:
    """Whether tree-mask words the refusal of this verify step's plan field: its mask fields, and a
    packed mask shorter than its blocks (tree-mask's mask-length names the request and first byte)."""
    if field.startswith(_TREE_MASK_FIELDS):
        return True
    packed = reading.layout.packed_mask if reading.layout is not None else None
    return packed is not None and field in (packed.tensor, packed.indptr) and any(p.kind is ProblemKind.MASK_LENGTH for p in reading.mask_problems)


def _check_fields(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    out += [worded(trace, problem) for problem in (*reading.index_problems, *reading.offsets_problems)]
    tensors = reading.tensors
    sane = set(reading.well_formed_offsets)
    _indptr_ends(trace, tensors, sane, out)
    layout, kv = reading.layout, reading.kv
    # Offsets that end elsewhere than their ids do are indptr-end's: their requests are not judged.
    if layout is None or (layout.csr and layout.count not in sane):
        return
    out += [worded(trace, problem) for problem in reading.kv_problems]
    if kv is None:
        return
    bs = trace.batch.batch_size
    graph = trace.graph
    allowed = {bs} | ({graph.capture_bs} if graph is not None and graph.is_graph_replay else set())
    if kv.requests not in allowed:
        out.append(
            finding(
                KIND,
                "plan-batch-size",
                step=trace.source.step,
                field=f"plan.{layout.count}",
                evidence=f"plan.{layout.count} describes {kv.requests} requests, the batch has {bs}"
                + (f" (graph capture_bs {graph.capture_bs})" if graph is not None and graph.is_graph_replay else ""),
                cause="the plan was built for another batch (stale metadata, or padded to the wrong capture size)",
                expected=bs,
                found=kv.requests,
            )
        )
        return
    outside = _check_in_cache(trace, reading, out)
    _check_requests(trace, reading, outside, out)
    _check_qo(trace, tensors, sane, kv.requests, out)
    _check_query_lengths(trace, reading.plan, tensors, out)
    _check_splits(trace, reading.plan, tensors, kv.requests, out)


def _check_in_cache(trace: Trace, reading: PlanReading, out: list[Finding]) -> set[int]:
    """index-outside-cache over every request (padded ones too); returns the requests it names."""
    kv = reading.kv
    limit = trace.batch.kv_cache_size // kv.page_size
    unit = "slot" if kv.page_size == 1 else "page"
    for b in range(kv.requests):
        units, _ = kv.of(b)
        j = _first((units < 0) | (units >= limit))
        if j < 0:
            continue
        padded = b >= trace.batch.batch_size
        span = None if padded else reading.request_coverage(b)
        column = (span[0] if span else 0) + j * kv.page_size
        where = f"KV column {column}" if span or padded else f"entry {j}"
        out.append(
            finding(
                KIND,
                "index-outside-cache",
                step=trace.source.step,
                request=b,
                column=column if span or padded else None,
                field=kv.name(b, j),
                evidence=f"{kv.name(b, j)} = {int(units[j])} ({'padded ' if padded else ''}request {b}, {where}) is outside the KV cache: {unit} ids are in [0, {limit})",
                cause=CAUSE_GARBAGE,
                found=int(units[j]),
                limit=limit,
            )
        )
        return {b}
    return set()


def _check_requests(trace: Trace, reading: PlanReading, skip: set[int], out: list[Finding]) -> None:
    batch = trace.batch
    kv = reading.kv
    ps = kv.page_size
    rows = [batch.request_slots(b) for b in range(batch.batch_size)]
    for b in range(batch.batch_size):
        if b in skip:
            continue
        found, length = kv.of(b)
        ends = {k: {KvEnd.PREFIX: int(batch.prefix_lens[b]), KvEnd.KV: int(batch.kv_lens[b])}[k] for k in reading.ends}
        span = reading.request_coverage(b)
        if span is None:
            out.append(_length_finding(trace, reading, b, length, ends, needed_start(trace, b)))
            continue
        start, end = span
        expected = rows[b][start:end][::ps] // ps
        if found.numel() != expected.numel():
            out.append(_length_finding(trace, reading, b, found.numel() * ps, ends, needed_start(trace, b)))
            continue
        j = _first(found != expected)
        if j < 0:
            continue
        count = int((found != expected).sum())
        unit = "slot" if ps == 1 else "page"
        out.append(
            finding(
                KIND,
                "kv-index",
                step=trace.source.step,
                request=b,
                column=start + j * ps,
                field=kv.name(b, j),
                evidence=f"{kv.name(b, j)} = {int(found[j])} (request {b}, KV column {start + j * ps}), expected {unit} {int(expected[j])} from its req_to_token row; {count} of {found.numel()} entries differ",
                cause=_index_cause(b, found, rows, start, end, ps),
                expected=int(expected[j]),
                found=int(found[j]),
                differing=count,
            )
        )


def _index_cause(b: int, found: Tensor, rows: list[Tensor], start: int, end: int, ps: int) -> str:
    for c, row in enumerate(rows):
        if c == b:
            continue
        for other in (row[start:end][::ps] // ps, row[::ps] // ps):
            k = min(other.numel(), found.numel())
            # Past the other row's used length, a req_to_token row holds zeros.
            if k and torch.equal(found[:k], other[:k]) and not bool(found[k:].any()):
                return CAUSE_WRONG_ROW.format(b=b, c=c)
    own = rows[b][::ps] // ps
    first = start // ps
    for shift in (-2, -1, 1, 2):
        lo = first + shift
        if lo < 0 or lo + found.numel() > own.numel():
            continue
        if torch.equal(found, own[lo : lo + found.numel()]):
            return CAUSE_SHIFTED.format(b=b, k=abs(shift) * ps, direction="late" if shift > 0 else "early")
    return CAUSE_STALE_ROW.format(b=b)


def _length_finding(trace: Trace, reading: PlanReading, b: int, found: int, ends: dict[KvEnd, int], needed: int) -> Finding:
    batch = trace.batch
    window = trace.model.sliding_window
    main = next(iter(ends.values()))
    if window >= 0 and needed > 0:
        expected_text = " or ".join(f"between {e - needed} and {e}" for e in ends.values()) + f" (sliding window {window})"
    else:
        expected_text = " or ".join(f"{k.value} = {e}" for k, e in ends.items())
    n = trace.spec.draft_token_num if trace.spec is not None else 0
    if trace.is_tree_verify and found == main - n:
        cause = "the draft tokens were not added: SGLang's verify seq_lens exclude them and the backend must add draft_token_num"
    elif trace.is_tree_verify and found == main + n:
        cause = "the draft tokens were counted twice (the seq_lens given to the backend already included them)"
    elif batch.forward_mode is ForwardMode.DECODE and found == main - 1:
        cause = "the length was taken before the decode step's seq_lens += 1, so the current token is missing"
    elif found == main + 1:
        cause = "one column too many: the current token was counted twice"
    elif not trace.is_tree_verify and (extend := int(batch.extend_lens[b])) > 1 and found == main + extend:
        if KvEnd.PREFIX in ends and main == ends[KvEnd.PREFIX]:
            cause = f"the prefix list runs over this step's {extend} new tokens, which the kernel also takes from its inputs: built from seq_lens instead of extend_prefix_lens"
        else:
            cause = (
                f"this step's {extend} new tokens are counted twice: extend_seq_lens added to seq_lens that already hold them "
                "(SGLang #26512 on DRAFT_EXTEND_V2, whose seq_lens are prefix + the whole window)"
            )
    elif any(found == int(v) for v in batch.kv_lens) or any(found == int(v) for v in batch.prefix_lens):
        cause = "the length belongs to another request (lengths in the wrong order, or a wrong req_pool_indices entry)"
    else:
        cause = "the plan's lengths were not computed from this batch's seq_lens (a stale or partially updated buffer)"
    return finding(
        KIND,
        "kv-length",
        step=trace.source.step,
        request=b,
        field=f"plan.{reading.layout.length_field}",
        evidence=f"the plan gives request {b} {found} KV columns ({reading.layout.length_field}), expected {expected_text}",
        cause=cause,
        expected=main,
        found=found,
    )


def _check_qo(trace: Trace, t: dict[str, Tensor], sane: set[str], requests: int, out: list[Finding]) -> None:
    batch = trace.batch
    for name in ("qo_indptr", "cu_seqlens_q"):
        if name not in sane:
            continue
        values = t[name]
        if values.numel() != requests + 1:
            out.append(finding(KIND, "qo-lens", step=trace.source.step, field=f"plan.{name}", evidence=f"plan.{name} has {values.numel()} entries, expected {requests + 1}", cause="the query offsets were built for another batch size"))
            continue
        lens = values.diff()[: batch.batch_size]
        b = _first(lens != batch.extend_lens)
        if b < 0:
            continue
        if batch.forward_mode is ForwardMode.DECODE or trace.is_tree_verify:
            cause = "the query offsets assume another number of tokens per request (decode 1, verify draft_token_num)"
        elif batch.forward_mode is ForwardMode.DRAFT_EXTEND:
            cause = f"the query offsets count other queries than the step runs: {DRAFT_EXTEND_QUERIES}{_replayed_layout(trace)}"
        else:
            cause = "the query offsets were computed from stale extend lengths (or prefix lengths taken as extend lengths)"
        out.append(
            finding(
                KIND,
                "qo-lens",
                step=trace.source.step,
                request=b,
                field=f"plan.{name}[{b + 1}]",
                evidence=f"plan.{name} gives request {b} {int(lens[b])} query tokens ({name}[{b + 1}] - {name}[{b}]), the batch has extend_lens[{b}] = {int(batch.extend_lens[b])}",
                cause=cause,
                expected=int(batch.extend_lens[b]),
                found=int(lens[b]),
            )
        )


def _replayed_layout(trace: Trace) -> str:
    """What a draft extend's graph replay adds to a wrong query layout: its kernels and padded
    query were captured with one (SGLang #21987: trtllm_mla's capture strode cu_seqlens_q by
    num_draft_tokens, its replay by accept_length + 1)."""
    graph = trace.graph
    if graph is None or not graph.is_graph_replay:
        return ""
    return (
        "; a graph replay keeps the query layout its kernels were captured with (num_tokens_per_req rows per request, a "
        "uniform stride): offsets refilled with another stride (from the accepted lengths) make the captured kernel read "
        "other requests' query rows"
    )


def _check_query_lengths(trace: Trace, plan: Plan, t: dict[str, Tensor], out: list[Finding]) -> None:
    """A plan's per-request query lengths (seq_lens_q) and their bound (max_seq_len_q), where it
    keeps them beside its offsets (trtllm_mla's draft extend pads each request's queries to
    max_seq_len_q rows from them): each length is the request's extend length, the bound their
    maximum or more."""
    batch = trace.batch
    cause = f"the query lengths count other queries than the step runs: {DRAFT_EXTEND_QUERIES}{_replayed_layout(trace)}"
    lens = t.get("seq_lens_q")
    if lens is not None and lens.dim() == 1 and lens.numel() >= batch.batch_size:
        b = _first(lens[: batch.batch_size].to(batch.extend_lens.dtype) != batch.extend_lens)
        if b >= 0:
            expected, found = int(batch.extend_lens[b]), int(lens[b])
            evidence = f"plan.seq_lens_q[{b}] = {found}, the batch has extend_lens[{b}] = {expected}"
            out.append(finding(KIND, "qo-lens", step=trace.source.step, request=b, field=f"plan.seq_lens_q[{b}]", evidence=evidence, cause=cause, expected=expected, found=found))
    top = plan.scalars.get("max_seq_len_q")
    if isinstance(top, int) and not isinstance(top, bool) and batch.batch_size:
        longest = int(batch.extend_lens[: batch.batch_size].max())
        if top < longest:
            b = _first(batch.extend_lens[: batch.batch_size] > top)
            evidence = f"plan max_seq_len_q = {top}, request {b} runs {int(batch.extend_lens[b])} query tokens (extend_lens[{b}]; the longest {longest})"
            out.append(finding(KIND, "qo-lens", step=trace.source.step, request=b, field="scalars.max_seq_len_q", evidence=evidence, cause=cause, expected=longest, found=top))


def _check_splits(trace: Trace, plan: Plan, t: dict[str, Tensor], requests: int, out: list[Finding]) -> None:
    splits = t.get("num_kv_splits")
    if splits is None:
        return
    if splits.numel() != requests:
        out.append(finding(KIND, "num-kv-splits", step=trace.source.step, field="plan.num_kv_splits", evidence=f"plan.num_kv_splits has {splits.numel()} entries for {requests} requests", cause="the split counts were sized for another batch"))
        return
    top = plan.scalars.get("max_kv_splits")
    top = int(top) if isinstance(top, int) and not isinstance(top, bool) else None
    # A graph replay's stage 1 writes into the scratch captured at startup (capture.max_kv_splits,
    # the captured attn_logits' split dimension): the tighter of the two bounds holds.
    captured = captured_split_limit(trace)
    by_capture = captured is not None and (top is None or captured < top)
    if by_capture:
        top = captured
    bad = (splits < 1) | ((splits > top) if top is not None else torch.zeros_like(splits, dtype=torch.bool))
    b = _first(bad)
    if b < 0:
        return
    value = int(splits[b])
    if value < 1:
        cause = "a request with no KV split is skipped by stage 1 and merged from nothing in stage 2 (NaN or stale output)"
    elif by_capture:
        cause = (
            "the graph's stage-1 scratch was captured with room for capture.max_kv_splits partials per request; "
            "a replay planning more splits writes past it (the split count was chosen for another, larger scratch)"
        )
    else:
        cause = "the stage-1 scratch holds max_kv_splits partials per request; more splits write past it"
    name = "capture.max_kv_splits" if by_capture else "max_kv_splits"
    out.append(
        finding(
            KIND,
            "num-kv-splits",
            step=trace.source.step,
            request=b,
            field=f"plan.num_kv_splits[{b}]",
            evidence=f"plan.num_kv_splits[{b}] = {value}, expected a value in [1, {top if top is not None else 'max_kv_splits'}]"
            + (f" ({name} = {top})" if by_capture else ""),
            cause=cause,
            found=value,
            maximum=top,
        )
    )
