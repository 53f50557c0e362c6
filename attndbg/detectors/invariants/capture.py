"""invariants against the sizes the engine fixed when it captured its CUDA graphs (`Trace.capture`).

A graph replays with the buffers it was captured with: every static input, index list, mask and
scratch buffer was allocated once for the largest batch (`init_cuda_graph_state(max_bs,
max_num_tokens)` in SGLang; vLLM's persistent buffers of max_num_seqs rows). A replayed step that
needs more than that reads or writes past the buffer's end, silently. Checks, each only when both
the step's need and the captured size are recorded (a size the engine did not expose is None and
judges nothing):

    capture-batch-size      graph replay: capture_bs (the padded rows) <= capture.max_bs
    capture-num-tokens      graph replay: padded tokens (graph.padded_out_cache_loc) <= capture.max_num_tokens
    capture-kv-indices      graph replay: every request's end in plan.kv_indptr <= capture.kv_indices_capacity
    capture-mask            graph replay of a verify step: mask elements read (plan.mask_indptr's ends,
                            else the layout's length over the padded rows) <= capture.mask_capacity
    capture-block-table     every request's ceil(kv_len / page_size) blocks <= capture.block_table_width
                            (persistent tables serve eager steps too)

capture.max_kv_splits bounds `plan.num_kv_splits` in the existing `num-kv-splits` check (plan.py),
not here. vLLM's `block-table-short` (vllm.py) already names a recorded table narrower than
a request needs; capture-block-table then stays quiet for that request. A kv_indptr past the
captured kv_indices buffer is reported here instead of as the generic `indptr-end` (the buffer is
recorded cut at its capacity, so both would name the same overrun).
"""

from __future__ import annotations

from torch import Tensor

from attndbg.backends import plan_view as pv
from attndbg.backends.plan_view import PlanViewError
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.trace.engines import draft_decode
from attndbg.trace.mask_geometry import mask_length
from attndbg.trace.schema import CaptureSizes, ForwardMode, Trace

CAUSE_STATIC = (
    "a CUDA graph replays with the static buffers it was captured with; a step {what} than they were sized for "
    "reads and writes past their end (the runner should have run it eagerly, or captured a larger size)"
)


def _over(trace: Trace, check: str, *, field: str, evidence: str, cause: str, limit: int, need: int, **where: int | None) -> Finding:
    """A step needing `need` of what the capture sized at `limit` (data: expected = the captured size)."""
    return finding(KIND, check, step=trace.source.step, **where, field=field, evidence=evidence, cause=cause, expected=limit, found=need)


def check_capture(trace: Trace, out: list[Finding]) -> None:
    capture = trace.capture
    if capture is None:
        return
    graph = trace.graph
    if graph is not None and graph.is_graph_replay:
        _batch_size(trace, capture, out)
        _num_tokens(trace, capture, out)
        _kv_indices(trace, capture, out)
        _mask(trace, capture, out)
    _block_table(trace, capture, out)


def captured_split_limit(trace: Trace) -> int | None:
    """The stage-1 scratch width a graph replay's split counts must fit: capture.max_kv_splits
    (the captured attn_logits' split dimension); None for eager steps or when not recorded."""
    graph, capture = trace.graph, trace.capture
    if capture is None or capture.max_kv_splits is None or graph is None or not graph.is_graph_replay:
        return None
    return capture.max_kv_splits


def _batch_size(trace: Trace, capture: CaptureSizes, out: list[Finding]) -> None:
    assert trace.graph is not None
    rows, top = trace.graph.capture_bs, capture.max_bs
    if top is None or rows <= top:
        return
    out.append(
        _over(
            trace,
            "capture-batch-size",
            request=top,
            field=f"graph.padded_seq_lens[{top}]",
            evidence=f"the step replayed a graph of capture_bs = {rows} requests, but the static buffers hold capture.max_bs = {top} "
            f"(requests {top}..{rows - 1} lie past them; first: graph.padded_seq_lens[{top}])",
            cause=CAUSE_STATIC.format(what="with more requests"),
            limit=top,
            need=rows,
        )
    )


def _num_tokens(trace: Trace, capture: CaptureSizes, out: list[Finding]) -> None:
    assert trace.graph is not None
    tokens, top = trace.graph.padded_out_cache_loc.numel(), capture.max_num_tokens
    if top is None or tokens <= top:
        return
    out.append(
        _over(
            trace,
            "capture-num-tokens",
            field=f"graph.padded_out_cache_loc[{top}]",
            evidence=f"the replayed graph runs {tokens} tokens (graph.padded_out_cache_loc), but the largest captured graph holds "
            f"capture.max_num_tokens = {top} (first token past it: graph.padded_out_cache_loc[{top}])",
            cause=CAUSE_STATIC.format(what="with more tokens"),
            limit=top,
            need=tokens,
        )
    )


def _plan_offsets(trace: Trace, name: str) -> Tensor | None:
    """plan.<name> as int64 when it is a usable 1-D offset list (plan_view.index's reading); None
    otherwise (its shape and dtype are the generic checks' to report)."""
    if trace.plan is None or name not in trace.plan.tensors:
        return None
    try:
        values = pv.index(trace.plan, name)
    except PlanViewError:
        return None
    return values if values.numel() >= 2 else None


def _first_past(indptr: Tensor, capacity: int) -> int:
    """The first request whose span ends past `capacity` (indptr[b+1] > capacity)."""
    return _first(indptr[1:] > capacity)


def _kv_indices(trace: Trace, capture: CaptureSizes, out: list[Finding]) -> None:
    indptr, top = _plan_offsets(trace, "kv_indptr"), capture.kv_indices_capacity
    # The furthest end any request reads (== indptr[-1] unless the offsets decrease, which
    # indptr-decreases reports; a request's end past the buffer is an overrun either way).
    if indptr is None or top is None or int(indptr.max()) <= top:
        return
    b = _first_past(indptr, top)
    # The recorded kv_indices is the buffer cut at its capacity, so the generic indptr-end names
    # the same overrun without its reason: this finding replaces it.
    out[:] = [f for f in out if not (f.check == "indptr-end" and f.location.field == "plan.kv_indptr[-1]")]
    out.append(
        _over(
            trace,
            "capture-kv-indices",
            request=b,
            field=f"plan.kv_indptr[{b + 1}]",
            evidence=f"plan.kv_indptr[{b + 1}] = {int(indptr[b + 1])} (request {b}'s end) is past the kv_indices buffer captured with "
            f"capture.kv_indices_capacity = {top} elements; the step reads {int(indptr.max())}",
            cause=_kv_indices_cause(trace, top, int(indptr.max())),
            limit=top,
            need=int(indptr.max()),
        )
    )


def _kv_indices_cause(trace: Trace, top: int, need: int) -> str:
    """Why a replay reads past the captured kv_indices buffer: a draft decode step whose need fits
    topk times the buffer had its buffer sized for one row per request, not per branch."""
    draft = draft_decode(trace)
    if draft is not None and draft[0] > 1 and need <= top * draft[0]:
        topk, step = draft
        return (
            f"the draft decode's graph kv_indices buffer was sized without the topk factor: each request has {topk} branch rows, "
            f"so a step lists seq_lens_sum x topk + bs x topk x (step + 1) ids ({need} at step {step}): more than the "
            f"{top} the buffer holds, within topk times that (sized max_bs x max_context_len rather than "
            f"max_bs x topk x max_context_len); the kernel writes past the row into the next one (SGLang #27338, #27460)"
        )
    return CAUSE_STATIC.format(what="reading more KV indices")


def _mask(trace: Trace, capture: CaptureSizes, out: list[Finding]) -> None:
    top, spec, graph = capture.mask_capacity, trace.spec, trace.graph
    if top is None or spec is None or graph is None or trace.batch.forward_mode is not ForwardMode.TARGET_VERIFY:
        return
    indptr = _plan_offsets(trace, "mask_indptr")
    if indptr is not None:
        need = int(indptr.max())  # the furthest end, as for kv_indices
        if need <= top:
            return
        b = _first_past(indptr, top)
        field, where = f"plan.mask_indptr[{b + 1}]", f"plan.mask_indptr[{b + 1}] = {int(indptr[b + 1])} (request {b}'s end)"
    else:
        # No offsets recorded: the mask the layout needs over every row the graph ran (padded
        # rows hold the fill seq_len; SGLang's verify seq_lens are the prefixes).
        rows = graph.capture_bs
        need = mask_length(spec.mask_layout, batch_size=rows, draft_token_num=spec.draft_token_num, prefix_sum=int(graph.padded_seq_lens[:rows].sum()))
        if need <= top:
            return
        b = None
        field, where = f"spec.custom_mask[{top}]", f"layout {spec.mask_layout.value} over the {rows} replayed rows needs {need} elements"
    out.append(
        _over(
            trace,
            "capture-mask",
            request=b,
            field=field,
            evidence=f"{where}, past the custom-mask buffer captured with capture.mask_capacity = {top} elements; the step reads {need}",
            cause=CAUSE_STATIC.format(what="whose tree mask is larger"),
            limit=top,
            need=need,
        )
    )


def _block_table(trace: Trace, capture: CaptureSizes, out: list[Finding]) -> None:
    top = capture.block_table_width
    if top is None:
        return
    page = trace.model.page_size
    blocks = (trace.batch.kv_lens + page - 1) // page
    short = {f.location.request for f in out if f.check == "block-table-short"}
    bad = blocks > top
    for b in short:
        if b is not None and 0 <= b < bad.numel():
            bad[b] = False
    b = _first(bad)
    if b < 0:
        return
    out.append(
        _over(
            trace,
            "capture-block-table",
            request=b,
            column=top * page,
            field=f"batch.kv_lens[{b}]",
            evidence=f"request {b} reads {int(trace.batch.kv_lens[b])} KV columns = {int(blocks[b])} blocks of {page}, but the block table "
            f"was allocated {top} blocks wide (capture.block_table_width); column {top * page} onward has no entry",
            cause="the block table's width was fixed at startup (max_model_len / block_size) for shorter sequences than this one: "
            "the kernel reads the next row's (or past the table's) entries for the blocks past the width",
            limit=top,
            need=int(blocks[b]),
        )
    )
