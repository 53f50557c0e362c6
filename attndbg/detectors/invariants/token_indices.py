"""invariants over an engine's raw token-row cache indices (transformers' paged cache), kept in the
plan when one is outside the engine's token view (attndbg/record/transformers/trace.py):

    index-outside-cache  every index of each field (`read_index`, `write_index`) is in
                         [0, token_rows): the rows of the engine's KV token view

Where they lie is the engine's convention (attndbg/trace/engines.py `TokenIndices`). The batch of
such a step reads a spare page for each page run that held a bad index (so it loads); this check
names the engine's own entry.
"""

from __future__ import annotations

import torch

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.trace.engines import engine_conventions
from attndbg.trace.schema import Trace

CAUSE = (
    "the engine handed its KV cache a token index past its token view: the gather (read_index) or scatter "
    "(write_index) that uses it reads or writes outside the cache (a device-side assert or an illegal memory access)"
)


def check_token_indices(trace: Trace, out: list[Finding]) -> None:
    names = engine_conventions(trace).token_indices
    plan = trace.plan
    if names is None or plan is None:
        return
    bound = plan.scalars.get(names.bound)
    if not isinstance(bound, int) or isinstance(bound, bool):
        return
    for field in names.fields:
        index = plan.tensors.get(field)
        if index is None or index.is_floating_point() or index.dtype is torch.bool:
            continue
        index = index.to(torch.int64).reshape(-1)
        i = _first((index < 0) | (index >= bound))
        if i < 0:
            continue
        count = int(((index < 0) | (index >= bound)).sum())
        out.append(
            finding(
                KIND,
                "index-outside-cache",
                step=trace.source.step,
                field=f"plan.{field}[{i}]",
                evidence=f"plan.{field}[{i}] = {int(index[i])} is outside the token view [0, {bound}) ({count} such entr{'y' if count == 1 else 'ies'})",
                cause=CAUSE,
                expected_at_most=bound - 1,
                found=int(index[i]),
            )
        )
