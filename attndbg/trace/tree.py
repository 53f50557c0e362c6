"""Speculative draft trees and the tree masks engines build from them.

A tree is given per request as parent indices: token 0 is the root (the last verified token,
parent -1), every other token's parent comes before it. A draft token attends to the whole
prefix, to the root, to itself and to its ancestors. The layouts are SGLang's TreeMaskMode
(see ../shared/reference/engines.md, "Tree mask construction").
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.trace.mask_geometry import MaskGeometry, pack_bits, word_dtype
from attndbg.trace.schema import MaskLayout


def eagle_tree(*, topk: int, steps: int, draft_token_num: int, generator: torch.Generator) -> Tensor:
    """Parents [n] of an EAGLE-style tree, chosen the way EAGLE's verify step chooses them.

    Drafting keeps a beam of `topk` nodes; step 0 expands the root into topk candidates, each
    later step expands the beam into topk*topk candidates and keeps the best topk. Scores are
    cumulative log-probabilities, so a child always scores below its parent. The n-1 best
    candidates overall, in candidate order (parents before children), become draft tokens 1..n-1.
    """
    n = draft_token_num
    num_candidates = topk + (steps - 1) * topk * topk
    if n - 1 > num_candidates:
        raise ValueError(
            f"draft_token_num {n} needs {n - 1} candidates, but topk {topk} x steps {steps} drafts only {num_candidates}"
        )
    scores: list[float] = []
    parent_candidate: list[int] = []  # -1 = root
    beam = [-1]
    beam_scores = [0.0]
    for step in range(steps):
        step_start = len(scores)
        for node, base in zip(beam, beam_scores):
            logp = torch.log_softmax(torch.randn(topk + 2, generator=generator), 0)[:topk]
            for lp in sorted(logp.tolist(), reverse=True):
                scores.append(base + lp)
                parent_candidate.append(node)
            if step == 0:
                break  # the root is the only node at step 0
        step_ids = list(range(step_start, len(scores)))
        best = sorted(step_ids, key=lambda i: scores[i], reverse=True)[:topk]
        beam, beam_scores = best, [scores[i] for i in best]
    chosen = sorted(sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[: n - 1])
    draft_index = {candidate: i + 1 for i, candidate in enumerate(chosen)}
    parents = [-1]
    for candidate in chosen:
        parent = parent_candidate[candidate]
        parents.append(0 if parent == -1 else draft_index[parent])
    return torch.tensor(parents, dtype=torch.int64)


def ancestor_matrix(parents: Tensor) -> Tensor:
    """[n, n] bool: entry (i, j) is True iff draft token j is token i or one of its ancestors."""
    n = parents.numel()
    visible = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        visible[i] |= visible[int(parents[i])]
    return visible


def chain_parents(n: int, requests: int) -> Tensor:
    """[requests, n] int64 parents of a chain: each draft token's parent is the one before it."""
    return torch.arange(-1, n - 1, dtype=torch.int64).expand(requests, n).clone()


def is_chain(parents: Tensor) -> bool:
    """[bs, n] parents: every draft token's parent is the one before it, so the tree mask is plain causal."""
    n = parents.shape[1]
    return bool((parents == torch.arange(-1, n - 1)).all())


def shape(parents: Tensor) -> tuple[int, int]:
    """(topk, steps) of one request's tree [n]: the most children of a node, and the deepest draft token."""
    if parents.numel() <= 1:
        return 1, 1
    children = torch.bincount(parents[1:], minlength=parents.numel())
    return int(children.max()), max(int(depths(parents).max()), 1)


def depths(parents: Tensor) -> Tensor:
    """[n] int64 depth of each draft token (root 0)."""
    out = torch.zeros(parents.numel(), dtype=torch.int64)
    for i in range(1, parents.numel()):
        out[i] = out[int(parents[i])] + 1
    return out


def full_mask(parents: Tensor, prefix_lens: Tensor) -> Tensor:
    """SGLang FULL_MASK: per request a row-major [n, prefix + n] block, prefix columns True."""
    return build_mask(MaskLayout.FULL, parents, prefix_lens)


def qlen_only_mask(parents: Tensor) -> Tensor:
    """SGLang QLEN_ONLY: per request the [n, n] draft block, flattened."""
    return build_mask(MaskLayout.QLEN_ONLY, parents, torch.zeros(parents.shape[0], dtype=torch.int64))


def qlen_only_bitpacked_mask(parents: Tensor) -> Tensor:
    """SGLang QLEN_ONLY_BITPACKING: one word per row, bit j (little-endian, bit 0 = root) = attend token j."""
    return build_mask(MaskLayout.QLEN_ONLY_BITPACKED, parents, torch.zeros(parents.shape[0], dtype=torch.int64))


def build_mask(layout: MaskLayout, parents: Tensor, prefix_lens: Tensor) -> Tensor:
    """[bs, n] parents -> the flat mask an engine builds in `layout` (trace/mask_geometry.py)."""
    n = parents.shape[1]
    geometry = MaskGeometry.verify(layout, draft_token_num=n, prefix_lens=prefix_lens)
    if layout is MaskLayout.QLEN_ONLY_BITPACKED:
        words = torch.zeros(geometry.length, dtype=torch.int64)
        for b in range(geometry.batch_size):
            geometry.block(words, b)[:] = pack_bits(ancestor_matrix(parents[b]))
        return words.to(word_dtype(n))
    # As SGLang does: fill with True (the prefix columns), then write each request's tree.
    mask = torch.ones(geometry.length, dtype=torch.bool)
    for b in range(geometry.batch_size):
        geometry.block(mask, b)[:, geometry.prefix_columns(b) :] = ancestor_matrix(parents[b])
    return mask
