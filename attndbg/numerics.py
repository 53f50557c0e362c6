"""The arithmetic of attention states that more than one part of attndbg needs, in one place.

- LSE bases: our kernels and every adapter speak natural-log LSEs; FlashInfer's kernels write base 2
  (LN2 converts); a base confusion is a factor of LN2 or LOG2E (the split-merge detector and the
  mistake models look for exactly these factors).
- Merging normalised partial states by their LSEs (split-KV stage 2, cascade / two-call merges,
  the mistake models' replays of a wrong merge), with one rule for empty states.

The split rule of the split-KV decode kernel (how long each split is, how many get no KV) is the
kernel's own, `attndbg.backends.triton_kernels.split_rule`: the adapters import this module, so it
imports nothing of theirs. The float64 reference itself is `attndbg.backends.reference` (it shares
gather/mask tables with the low-precision reference); the tolerance a comparison allows is
`attndbg.compare.tolerance`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def merge_states(outputs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised partial states [K, ..., Dv] with natural-log LSEs [K, ...], merged over K.

    Weights are exp(lse - max over the states), computed in the inputs' dtype.

    The empty-state rule: a state with LSE -inf attended to no key. It weighs 0 and its output is
    ignored whatever it holds (an empty split's scratch may hold garbage or NaN: a merge that reads
    it is the bug FlashInfer #4051 fixed). When every state is empty the merged output is 0 and its
    LSE -inf, as the reference gives for a row that sees no key.
    """
    top = lses.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)
    weighted = torch.where(weights[..., None] > 0, weights[..., None] * outputs, torch.zeros_like(outputs))
    total = weights.sum(0)
    output = weighted.sum(0) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return output, top + torch.log(total)

