"""Before a *recorded* plan reaches a kernel: would it read outside the KV cache or the step's rows?

A wrong engine plan is what users bring us to find, but handing a kernel indices past the end of
the cache turns a finding into an illegal memory access that kills the process (and on a GPU the
CUDA context). This is the minimal bounds check that keeps replay alive; the invariants detector
explains the rest.
"""

from __future__ import annotations

import torch

from attndbg.trace.schema import Plan, Trace

# Per-request offsets by name, and the flat tensor each one indexes (None: query rows).
_INDPTRS = {"qo_indptr": None, "kv_indptr": "kv_indices", "mask_indptr": "custom_mask", "cu_seqlens_q": None, "cu_seqlens_k": None}
_QUERY_INDPTRS = ("qo_indptr", "cu_seqlens_q")


def _request_count(plan: Plan) -> int | None:
    counts = [int(plan.tensors[name].numel()) - 1 for name in _INDPTRS if name in plan.tensors and plan.tensors[name].numel()]
    return max(counts) if counts else None


def real_requests_only(trace: Trace, plan: Plan) -> Plan:
    """The real requests' part of a plan recorded at a CUDA-graph replay.

    Such a plan covers the graph's capture_bs requests, padding included (SGLang builds it that
    way). Replayed eagerly on the step's real batch, its padded requests would read query rows that
    do not exist: keep the first batch_size requests of every per-request tensor, and of each flat
    tensor the part those requests index. Any other plan is returned as it is.
    """
    graph, bs = trace.graph, trace.batch.batch_size
    n = _request_count(plan)
    if graph is None or not graph.is_graph_replay or n is None or n <= bs or n != graph.capture_bs:
        return plan
    tensors = dict(plan.tensors)
    flat = {target for target in _INDPTRS.values() if target}
    for name, target in _INDPTRS.items():
        values = plan.tensors.get(name)
        if values is None or values.numel() != n + 1:
            continue
        tensors[name] = values[: bs + 1]
        if target in plan.tensors:
            tensors[target] = plan.tensors[target][: int(values[bs])]
    for name, values in plan.tensors.items():
        if name not in _INDPTRS and name not in flat and values.dim() >= 1 and values.shape[0] == n:
            tensors[name] = values[:bs]  # one entry (or row) per request: num_kv_splits, page_table, ...
    return Plan(backend=plan.backend, tensors=tensors, scalars=dict(plan.scalars))


def out_of_bounds(trace: Trace, plan: Plan) -> str | None:
    """None when the plan's indptrs are well formed, cover no more requests and query rows than the
    step has, and the indices they cover are inside the cache."""
    n, bs, tokens = _request_count(plan), trace.batch.batch_size, trace.batch.num_tokens
    if n is not None and n > bs:
        padded = trace.graph is not None and trace.graph.is_graph_replay and n == trace.graph.capture_bs
        return f"recorded plan covers {n} requests, the step has {bs}" + (" (it is padded to the graph's capture size)" if padded else "")
    for name in _QUERY_INDPTRS:
        values = plan.tensors.get(name)
        if values is not None and values.numel() and int(values[-1]) > tokens:
            return f"recorded plan {name}[-1] = {int(values[-1])} reads query rows past the step's {tokens}"
    for name, values in plan.tensors.items():
        if not name.endswith("indptr") or values.numel() == 0:
            continue
        values = values.to(torch.int64)
        if int(values[0]) != 0 or bool((values[1:] < values[:-1]).any()):
            return f"recorded plan {name} does not start at 0 or decreases: {values[:8].tolist()}"
        target = name.replace("indptr", "indices")
        if target in plan.tensors and int(values[-1]) > plan.tensors[target].numel():
            return f"recorded plan {name}[-1] = {int(values[-1])} exceeds {target}'s length {plan.tensors[target].numel()}"
    indices = plan.tensors.get("kv_indices")
    indptr = plan.tensors.get("kv_indptr")
    if indices is not None and indptr is not None and indptr.numel():
        # Page ids when the backend pages its indices (FlashInfer with page_size > 1), else slots.
        limit = trace.batch.kv_cache_size // int(plan.scalars.get("page_size", 1))
        used = indices[: int(indptr[-1])].to(torch.int64)
        bad = torch.nonzero((used < 0) | (used >= limit)).flatten()
        if bad.numel():
            i = int(bad[0])
            return f"recorded plan kv_indices[{i}] = {int(used[i])} is outside the KV cache [0, {limit})"
    return None
