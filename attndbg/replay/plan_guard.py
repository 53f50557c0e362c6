"""Before a *recorded* plan reaches a kernel: would it read outside the KV cache?

A wrong engine plan is what users bring us to find, but handing a kernel indices past the end of
the cache turns a finding into an illegal memory access that kills the process (and on a GPU the
CUDA context). This is the minimal bounds check that keeps replay alive; the invariants detector
explains the rest.
"""

from __future__ import annotations

import torch

from attndbg.trace.schema import Plan, Trace


def out_of_bounds(trace: Trace, plan: Plan) -> str | None:
    """None when the plan's indptrs are well formed and the indices they cover are inside the cache."""
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
