"""Wrong slot maps for recorded steps: what the output check must catch."""

from __future__ import annotations

from dataclasses import replace

import torch

from attndbg.trace.schema import Trace


def foreign_first_key(trace: Trace) -> tuple[Trace, int]:
    """Point the longest request's first column at the next request's first slot; returns the
    trace and that request. Attention is a set operation over keys, so a wrong map only matters
    when it brings in a foreign key: the engine's output no longer matches attention over what
    the trace says that request reads, and the other requests still do."""
    batch = trace.batch
    b = int(torch.argmax(batch.kv_lens))
    other = (b + 1) % batch.batch_size
    slots = batch.slot_ids.clone()
    slots[int(batch.slot_indptr[b])] = slots[int(batch.slot_indptr[other])]
    return replace(trace, batch=replace(batch, slot_ids=slots)), b
