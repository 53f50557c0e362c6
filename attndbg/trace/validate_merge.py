"""Validation of a trace's `merge` section (schema.MergeStates): a standalone merge of given
partial states. Called by `validate.from_dict` with its section reader; one `TraceError` naming the
field and its first bad element, like every other section.

What a kernel would read outside of is refused here, before any launch: states and LSEs of other
shapes (a [heads, tokens] LSE given where [tokens, heads] is read), an LSE that is NaN or +inf (no
merge convention weighs it; FA2's +inf empty marker is stored as the -inf it means), and a step
that also claims attention of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attndbg.trace.errors import TraceError
from attndbg.trace.schema import DTYPES, Batch, ForwardMode, LseBase, MergeStates, Model

# More states than any engine merges per row (SGLang's chunked prefix merges one state per chunk).
MAX_STATES = 4096


def _first_bad(mask: Tensor) -> int:
    return int(torch.nonzero(mask.flatten())[0, 0]) if bool(mask.any()) else -1


def _index_of(flat: int, shape: tuple[int, ...]) -> str:
    """'[i, j, k]' of flat element `flat` in a tensor of `shape`."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return "[" + ", ".join(str(i) for i in reversed(index)) + "]"


def read_merge(r: Any, model: Model, batch: Batch) -> MergeStates:
    """`r`: validate's reader of the `merge` section (its tensor/enum accessors, prefix "merge")."""
    if batch.forward_mode is not ForwardMode.IDLE or batch.batch_size:
        raise TraceError("batch.forward_mode", f"= {batch.forward_mode.value} with {batch.batch_size} requests, but the step is a merge of given states: its batch is IDLE with no requests (it runs no attention of its own)")
    dtype = DTYPES[model.q_dtype]
    v = r.tensor("v", ndim=4)
    if v.dtype != dtype:
        raise TraceError(r.name("v"), f"dtype {str(v.dtype).replace('torch.', '')}, expected model.q_dtype {model.q_dtype}")
    states, tokens, heads, width = v.shape
    if not 1 <= states <= MAX_STATES:
        raise TraceError(r.name("v"), f"holds {states} states per row, expected 1 to {MAX_STATES}")
    if heads != model.num_qo_heads or width != model.v_head_dim:
        raise TraceError(r.name("v"), f"shape {list(v.shape)}, expected [states, tokens, num_qo_heads = {model.num_qo_heads}, v_head_dim = {model.v_head_dim}]")
    s = r.tensor("s", dtypes=(torch.float32,), ndim=3)
    if tuple(s.shape) != (states, tokens, heads):
        raise TraceError(r.name("s"), f"shape {list(s.shape)}, expected [states, tokens, heads] = {[states, tokens, heads]}: one LSE per state of v")
    bad = _first_bad(torch.isnan(s) | (s == float("inf")))
    if bad >= 0:
        value = float(s.flatten()[bad])
        raise TraceError(f"{r.name('s')}{_index_of(bad, tuple(s.shape))}", f"= {value}, expected a finite LSE or -inf (an empty state)")
    output = r.tensor("output", optional=True)
    if output is not None and (output.dtype != dtype or tuple(output.shape) != (tokens, heads, width)):
        raise TraceError(r.name("output"), f"{str(output.dtype).replace('torch.', '')} {list(output.shape)}, expected {model.q_dtype} {[tokens, heads, width]} (the merged output)")
    lse = r.tensor("lse", dtypes=(torch.float32,), optional=True)
    if lse is not None and tuple(lse.shape) != (tokens, heads):
        raise TraceError(r.name("lse"), f"shape {list(lse.shape)}, expected [tokens, heads] = {[tokens, heads]}")
    mask = r.tensor("mask", dtypes=(torch.bool,), ndim=1, optional=True)
    if mask is not None and (states != 2 or mask.numel() != tokens):
        raise TraceError(r.name("mask"), f"has {mask.numel()} rows for {states} states of {tokens} tokens, expected one per token with two states (merge_state_in_place merges v_other into v)")
    return MergeStates(v=v, s=s, lse_base=r.enum("lse_base", LseBase), output=output, lse=lse, mask=mask)
