"""Which keys each query of a request sees: decided from the batch alone.

This is the ground truth every comparison rests on (the reference backend, the detectors, the
injections): a query attends causally to the columns at or before its own (a non-causal layer: to
every column of its row); a step's custom mask replaces that rule; a draft token of a verify step
attends to the prefix, the root, itself and its ancestors; the sliding windows (left, and right
for a non-causal layer) and rope positions (a draft token sits at prefix + its depth) cut what is
left. A cross-attention query's column is its bottom-right alignment (schema.Batch.cross), so a causal
request with more queries than keys has rows that see nothing: they are fully masked, and the
reference gives them output 0 and LSE -inf (or the sink's logit, model.sinks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.trace import tree
from attndbg.trace.schema import Trace


def visibility(trace: Trace, b: int, rows: slice = slice(None), *, tree_mask: Tensor | None = None) -> Tensor:
    """[extend_len, kv_len] bool: which columns of request b's row each of its queries sees
    (only the request's query rows `rows`, counted within the request, when given).

    `tree_mask` [n, kv_len] (verify): the mask a kernel applied in place of the tree's (prefix
    columns visible, then the ancestor matrix), the window still cut by rope positions: what a
    kernel that read the right mask wrongly sees (attndbg/diagnose's mask mistakes)."""
    batch = trace.batch
    prefix = int(batch.prefix_lens[b])
    kv = int(batch.kv_lens[b])
    qo = batch.qo_indptr
    query_cols = batch.query_cols[int(qo[b]) : int(qo[b + 1])][rows]
    cols = torch.arange(kv)
    if trace.is_tree_verify:
        parents = trace.spec.parents[b]
        if tree_mask is None:
            visible = torch.ones(query_cols.numel(), kv, dtype=torch.bool)
            visible[:, prefix:] = tree.ancestor_matrix(parents)[rows]
        else:
            visible = tree_mask[rows].clone()
        # Window distances use rope positions: a draft token sits at prefix + its depth.
        key_pos = torch.cat([cols[:prefix], prefix + tree.depths(parents)])
        query_pos = (prefix + tree.depths(parents))[rows]
    else:
        model = trace.model
        if batch.custom_mask is not None:
            visible = batch.mask_block(b)[rows].clone()
        elif model.causal:
            visible = cols[None, :] <= query_cols[:, None]
        else:
            visible = torch.ones(query_cols.numel(), kv, dtype=torch.bool)
        key_pos, query_pos = cols, query_cols
        if model.window_right >= 0:
            visible &= (key_pos[None, :] - query_pos[:, None]) <= model.window_right
    window = trace.model.sliding_window
    if window >= 0:
        visible &= (query_pos[:, None] - key_pos[None, :]) <= window
    return visible
