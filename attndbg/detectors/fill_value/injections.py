"""fill-value mistakes: CUDA-graph padding recorded the way a buggy graph runner fills it.

Every injection needs a step recorded as a graph replay with padded rows (`synth ... capture_bs=N`
with N above the batch) and changes only what the runner recorded: the `graph` section's static
buffers, or the recorded plan's scalars/indptrs. The batch (the ground truth) is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

# zero-fill is a mistake of SGLang's FlashInfer backend: the step is relabelled as its.
from attndbg.backends.flashinfer import SGLANG_NAME as SGLANG_FLASHINFER
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.trace.schema import Graph, Plan, Trace

# What an uninitialised int32 buffer (torch.empty; SGLang's classic req_pool_indices is int32)
# often holds after float traffic: the bits of float32 1.0, a row id far past any request pool.
GARBAGE_ROW = 0x3F80_0000  # 1_065_353_216
# Names under which a plan stores per-request offsets (SGLang/FlashInfer/FA3 vocabulary).
INDPTR_NAMES = ("kv_indptr", "cu_seqlens_k", "qo_indptr", "cu_seqlens_q")


def _padded_graph(trace: Trace, kind: str) -> Graph:
    """The trace's graph section, or a ValueError saying how to make one that applies."""
    graph = trace.graph
    bs = trace.batch.batch_size
    if graph is None or not graph.is_graph_replay:
        raise ValueError(f"{kind} needs a step recorded as a CUDA-graph replay: synth with capture_bs=N (N > {bs})")
    if graph.capture_bs <= bs:
        raise ValueError(f"{kind} needs padded rows: capture_bs={graph.capture_bs} is not above the batch's {bs} requests")
    return graph


def zero_fill(trace: Trace) -> Trace:
    """SGLang #1469/#1779: a FlashInfer decode graph padded with seq_len 0 (illegal memory access, NaN rows).

    The step is recorded from SGLang's FlashInfer backend with the fill value its oldest version
    returned (0). A plan built by another backend cannot have come from that engine, so it is
    dropped (recording a plan is optional); a FlashInfer plan is kept.
    """
    graph = _padded_graph(trace, "fill-value:zero-fill")
    bs = trace.batch.batch_size
    seq_lens = graph.padded_seq_lens.clone()
    seq_lens[bs:] = 0
    source = replace(trace.source, backend=SGLANG_FLASHINFER)
    plan = trace.plan if trace.plan is not None and trace.plan.backend == FlashInferBackend.name else None
    return replace(trace, source=source, plan=plan, graph=replace(graph, fill_value=0, padded_seq_lens=seq_lens))


def padded_kv_write(trace: Trace) -> Trace:
    """SGLang graph runner: padded out_cache_loc not zeroed, so padded tokens write over live KV slots.

    The static out_cache_loc keeps the previous step's values past the real tokens: the slots the
    batch's requests wrote one step ago, which are now cached columns of those requests.
    """
    graph = _padded_graph(trace, "fill-value:padded-kv-write")
    batch = trace.batch
    qo = batch.qo_indptr
    stale = []
    for b in range(batch.batch_size):
        first_col = int(batch.query_cols[int(qo[b])]) if int(batch.extend_lens[b]) else int(batch.kv_lens[b])
        if first_col >= 1:
            stale.append(int(batch.request_slots(b)[first_col - 1]))  # last step's new token
    if not stale:
        raise ValueError("fill-value:padded-kv-write needs a request with a cached column (every request here starts empty)")
    loc = graph.padded_out_cache_loc.clone()
    tail = loc.numel() - batch.num_tokens
    loc[batch.num_tokens :] = torch.tensor([stale[i % len(stale)] for i in range(tail)], dtype=loc.dtype)
    return replace(trace, graph=replace(graph, padded_out_cache_loc=loc))


def _plan_indptr(plan: Plan | None, kind: str) -> str:
    if plan is None:
        raise ValueError(f"{kind} needs a recorded plan (synth records one)")
    for name in INDPTR_NAMES:
        if name in plan.tensors:
            return name
    raise ValueError(f"{kind}: the recorded plan has none of {', '.join(INDPTR_NAMES)}")


def decreasing_padded_indptr(trace: Trace) -> Trace:
    """Graph replay that writes kv_indptr[1:raw_bs+1] only: padded entries keep the buffer's zeros.

    SGLang's runners re-plan on the padded batch (`[:bs]` slices, bs = capture size); a refactor
    that plans on the raw batch leaves the captured kernels reading the static buffer's tail, which
    still holds its zero initialisation, so the recorded indptr decreases at the first padded row.
    """
    graph = _padded_graph(trace, "fill-value:decreasing-padded-indptr")
    name = _plan_indptr(trace.plan, "fill-value:decreasing-padded-indptr")
    bs = trace.batch.batch_size
    indptr = trace.plan.tensors[name]
    if int(indptr[bs]) == 0:
        raise ValueError(f"fill-value:decreasing-padded-indptr: {name}[{bs}] is 0, zeros after it cannot decrease")
    padded = torch.zeros(graph.capture_bs + 1, dtype=indptr.dtype)
    padded[: bs + 1] = indptr[: bs + 1]
    plan = replace(trace.plan, tensors={**trace.plan.tensors, name: padded})
    return replace(trace, plan=plan)


def stale_req_pool_index(trace: Trace) -> Trace:
    """SGLang #1779: padded req_pool_indices never reset, holding garbage past the request pool.

    The classic runner copies req_pool_indices[:raw_bs] only; a buffer allocated with torch.empty
    holds whatever bits were there, and the backend reads req_to_token[that row] for every padded
    request whose seq_len is at least 1.
    """
    graph = _padded_graph(trace, "fill-value:stale-req-pool-index")
    if graph.padded_req_pool_indices is None:
        raise ValueError("fill-value:stale-req-pool-index needs padded req_pool_indices; this step records none (its engine has no request pool)")
    bs = trace.batch.batch_size
    rows = graph.padded_req_pool_indices.clone()
    rows[bs:] = GARBAGE_ROW
    return replace(trace, graph=replace(graph, padded_req_pool_indices=rows))


def seq_lens_sum_ignores_padding(trace: Trace) -> Trace:
    """Graph replay given the raw batch's seq_lens_sum instead of seq_lens_sum + padded rows * fill.

    SGLang's runner passes `seq_lens_sum + (bs - raw_bs) * fill_value` to the backend, which sizes
    kv_indices from it; passing the raw sum leaves the padded rows' indices outside the buffer.
    """
    graph = _padded_graph(trace, "fill-value:seq-lens-sum-ignores-padding")
    if graph.fill_value <= 0:
        raise ValueError("fill-value:seq-lens-sum-ignores-padding needs padded rows with seq_len > 0 (fill_value >= 1)")
    if trace.plan is None:
        raise ValueError("fill-value:seq-lens-sum-ignores-padding needs a recorded plan (synth records one)")
    raw_sum = int(trace.batch.seq_lens_raw.sum())
    plan = replace(trace.plan, scalars={**trace.plan.scalars, "seq_lens_sum": raw_sum})
    return replace(trace, plan=plan)


INJECTIONS: dict[str, Callable[[Trace], Trace]] = {
    "fill-value:zero-fill": zero_fill,
    "fill-value:padded-kv-write": padded_kv_write,
    "fill-value:decreasing-padded-indptr": decreasing_padded_indptr,
    "fill-value:stale-req-pool-index": stale_req_pool_index,
    "fill-value:seq-lens-sum-ignores-padding": seq_lens_sum_ignores_padding,
}
