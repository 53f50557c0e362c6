"""A sub-batch of a step: some of its requests, as the engine would have batched them alone.

`sub_batch(trace, requests)` keeps, for each chosen request in the order given, everything the
step says about it: its lengths, its KV row (the same slot ids: the KV pool, `kv_cache_size`, is
the step's, so a request run alone reads the very same keys), its query tokens' columns,
`out_cache_loc` and positions, its raw `seq_lens` entry, its draft tree and its block of the
engine's tree mask, and the per-token rows of recorded layer tensors (the recorded KV rows are
kept whole: they are the pool's contents, not the batch's).

What it drops, and why:
  plan     the engine's plan indexes the whole batch (indptrs, offsets into flat tensors);
           a backend derives the sub-batch's own plan from the sub-batch, as an engine would
  graph    the step's CUDA-graph padding is the whole batch's; a sub-batch runs eagerly
  buffers  they describe the whole batch's engine buffers
  a recorded tree mask whose length does not match its layout for the whole batch (evidence for
           the tree-mask detector): no block of it can be said to be one request's

`rows` are the step's query rows the sub-batch's rows are, in order, so a caller can take the
same rows of the step's inputs and outputs. The sub-batch of a seeded trace, replayed on its own,
would draw other data (its seed draws for its own rows and slots): to run it on the step's data,
take `rows` of the step's queries and new K/V and keep the step's KV cache
(attndbg.replay.step_data.StepData.sub_batch does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg.trace.mask_geometry import MaskGeometry
from attndbg.trace.schema import LayerTensors, Spec, Trace, indptr


@dataclass(frozen=True)
class SubBatch:
    trace: Trace  # the chosen requests as a step of their own
    requests: tuple[int, ...]  # their indices in the step, in the sub-batch's order
    rows: Tensor  # [num_tokens of the sub-batch] int64: the step's query rows, in order


def sub_batch(trace: Trace, requests: Sequence[int]) -> SubBatch:
    """The step's `requests` (indices into its batch, distinct, in the order wanted) as a batch of
    their own; ValueError for an index outside the batch or one given twice."""
    batch = trace.batch
    chosen = tuple(int(b) for b in requests)
    if not chosen or len(set(chosen)) != len(chosen) or not all(0 <= b < batch.batch_size for b in chosen):
        raise ValueError(f"a sub-batch is distinct requests of the batch of {batch.batch_size}, got {list(chosen)}")
    index = torch.tensor(chosen, dtype=torch.int64)
    qo = batch.qo_indptr
    rows = torch.cat([torch.arange(int(qo[b]), int(qo[b + 1])) for b in chosen])
    slots = [batch.request_slots(b) for b in chosen]
    sub = replace(
        batch,  # what is not per request or per token (mode, kv_cache_size, selective) is the step's
        prefix_lens=batch.prefix_lens[index],
        extend_lens=batch.extend_lens[index],
        kv_lens=batch.kv_lens[index],
        slot_indptr=indptr(torch.tensor([s.numel() for s in slots], dtype=torch.int64)),
        slot_ids=torch.cat(slots),
        query_cols=batch.query_cols[rows],
        out_cache_loc=batch.out_cache_loc[rows],
        positions=batch.positions[rows],
        seq_lens_raw=batch.seq_lens_raw[index],
        custom_mask=None if batch.custom_mask is None else torch.cat([batch.mask_block(b).flatten() for b in chosen]),
    )
    part = replace(
        trace,
        batch=sub,
        spec=_spec(trace, chosen),
        graph=None,
        plan=None,
        tensors={layer: layer_rows(t, rows) for layer, t in trace.tensors.items()},
        buffers={},
    )
    return SubBatch(trace=part, requests=chosen, rows=rows)


def _spec(trace: Trace, chosen: tuple[int, ...]) -> Spec | None:
    spec = trace.spec
    if spec is None:
        return None
    mask = spec.custom_mask
    if mask is not None:
        geometry = MaskGeometry.of_spec(spec, trace.batch.prefix_lens)
        if mask.numel() == geometry.length:
            mask = torch.cat([mask[slice(*geometry.span(b))] for b in chosen])
        else:
            mask = None  # malformed for the whole batch: not one request's block can be located
    return replace(spec, parents=spec.parents[list(chosen)], custom_mask=mask)


def layer_rows(t: LayerTensors, rows: Tensor) -> LayerTensors:
    """Query rows `rows` of one layer's recorded per-token tensors (the KV rows stay whole)."""
    return replace(
        t,
        q=t.q[rows],
        k_new=t.k_new[rows],
        v_new=t.v_new[rows],
        output=None if t.output is None else t.output[rows],
        lse=None if t.lse is None else t.lse[rows],
    )
