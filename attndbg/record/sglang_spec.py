"""SGLang's EagleVerifyInput -> the trace's Spec: the draft tree as parents, the mask as recorded.

SGLang does not keep the tree's parents; it keeps, per request, each token's first child
(`retrive_next_token`, SGL-new `retrieve_next_token`) and next sibling (`retrive_next_sibling` /
`retrieve_next_sibling`), local indices, -1 for none (engines.md A3). The parents are rebuilt from
those links, not from the mask, so the tree-mask detector can check the engine's mask against a
tree it did not come from.

The mask layout (SGLang's TreeMaskMode) is told apart by dtype and size: bit-packed words are
integers, one per row; QLEN_ONLY is `bs*n*n` bools; FULL is `n*sum(prefix) + bs*n*n` bools. A mask
longer than that is a preallocated CUDA-graph buffer and is cut to the layout's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.schema import MaskLayout, Spec

# SGLang's TreeMaskMode member names -> our layouts.
TREE_MASK_MODES: dict[str, MaskLayout] = {
    "FULL_MASK": MaskLayout.FULL,
    "QLEN_ONLY": MaskLayout.QLEN_ONLY,
    "QLEN_ONLY_BITPACKING": MaskLayout.QLEN_ONLY_BITPACKED,
}


def _field(spec_info: Any, name: str) -> Any:
    """`retrieve_<name>` (SGL-new) or `retrive_<name>` (SGL-classic), whichever the object has."""
    for spelling in (f"retrieve_{name}", f"retrive_{name}"):
        if hasattr(spec_info, spelling):
            return getattr(spec_info, spelling)
    raise AttributeError(f"{type(spec_info).__name__} has neither retrieve_{name} nor retrive_{name}")


def parents_from_links(next_token: Tensor, next_sibling: Tensor) -> Tensor:
    """[bs, n] first-child / next-sibling links -> [bs, n] int64 parents (-1 for the root, token 0)."""
    if next_token.shape != next_sibling.shape or next_token.dim() != 2:
        raise ValueError(f"retrieve_next_token {list(next_token.shape)} and retrieve_next_sibling {list(next_sibling.shape)} must both be [bs, n]")
    bs, n = next_token.shape
    first, sibling = next_token.tolist(), next_sibling.tolist()
    parents = torch.full((bs, n), -2, dtype=torch.int64)
    for b in range(bs):
        parents[b, 0] = -1
        stack = [0]
        while stack:
            node = stack.pop()
            child = first[b][node]
            while child != -1:
                if not 0 < child < n or int(parents[b, child]) != -2:
                    raise ValueError(f"request {b}: token {node}'s child links reach token {child} twice or out of [1, {n})")
                parents[b, child] = node
                stack.append(child)
                child = sibling[b][child]
        missing = torch.nonzero(parents[b] == -2).flatten()
        if missing.numel():
            raise ValueError(f"request {b}: draft token {int(missing[0])} is not reachable from the root through retrieve_next_token/next_sibling")
    return parents


def mask_layout(mask: Tensor, *, batch_size: int, draft_token_num: int, prefix_sum: int, hint: MaskLayout | None = None) -> MaskLayout:
    """Which TreeMaskMode laid out `mask` (see the module docstring)."""
    n, bs = draft_token_num, batch_size
    if not mask.dtype.is_floating_point and mask.dtype is not torch.bool:
        return MaskLayout.QLEN_ONLY_BITPACKED
    full, qlen = n * prefix_sum + bs * n * n, bs * n * n
    if hint is not None:
        return hint
    if mask.numel() == full:
        return MaskLayout.FULL  # also when every prefix is empty: then FULL and QLEN_ONLY coincide
    if mask.numel() == qlen:
        return MaskLayout.QLEN_ONLY
    if mask.numel() > full:
        return MaskLayout.FULL  # a graph buffer sized for the longest context (VerifyMask), FULL by default
    raise ValueError(f"custom_mask has {mask.numel()} elements: neither FULL ({full}) nor QLEN_ONLY ({qlen}) for bs={bs}, n={n}")


def mask_length(layout: MaskLayout, *, batch_size: int, draft_token_num: int, prefix_sum: int) -> int:
    n = draft_token_num
    if layout is MaskLayout.FULL:
        return n * prefix_sum + batch_size * n * n
    if layout is MaskLayout.QLEN_ONLY:
        return batch_size * n * n
    return batch_size * n


@dataclass(frozen=True)
class SpecInfo:
    """Host facts of a verify step's spec input."""

    algorithm: str
    draft_token_num: int
    topk: int
    steps: int
    layout: MaskLayout | None  # None: the step has no custom mask


def capture_spec(spec_info: Any, *, batch_size: int, prefix_sum: int, algorithm: str = "EAGLE", layout: MaskLayout | None = None) -> tuple[SpecInfo, dict[str, Tensor | None]]:
    """Device tensors and host facts of an EagleVerifyInput; never syncs.

    `prefix_sum` is the sum of the real requests' prefix lengths (SGLang's verify seq_lens_sum, a
    host int); it sizes the FULL mask so a preallocated buffer is cut before it is copied.
    """
    from attndbg.record.sglang_batch import draft_token_num

    n = draft_token_num(spec_info)
    mask = spec_info.custom_mask
    found = None if mask is None else mask_layout(mask, batch_size=batch_size, draft_token_num=n, prefix_sum=prefix_sum, hint=layout)
    if mask is not None:
        mask = mask.reshape(-1)[: mask_length(found, batch_size=batch_size, draft_token_num=n, prefix_sum=prefix_sum)]
    info = SpecInfo(algorithm=algorithm, draft_token_num=n, topk=int(spec_info.topk), steps=int(spec_info.spec_steps), layout=found)
    tensors = {
        "next_token": _field(spec_info, "next_token")[:batch_size],
        "next_sibling": _field(spec_info, "next_sibling")[:batch_size],
        "custom_mask": mask,
    }
    return info, tensors


def spec_from_host(info: SpecInfo, host: dict[str, Tensor | None]) -> Spec:
    parents = parents_from_links(host["next_token"].to(torch.int64), host["next_sibling"].to(torch.int64))
    if parents.shape[1] != info.draft_token_num:
        raise ValueError(f"the tree links have {parents.shape[1]} tokens per request, draft_token_num is {info.draft_token_num}")
    return Spec(
        algorithm=info.algorithm,
        draft_token_num=info.draft_token_num,
        topk=info.topk,
        steps=info.steps,
        parents=parents,
        custom_mask=host["custom_mask"],
        mask_layout=info.layout or MaskLayout.FULL,
    )


def spec_from_verify_input(spec_info: Any, seq_lens: Tensor, layout: MaskLayout | None = None, *, algorithm: str = "EAGLE") -> Spec:
    """The trace's Spec of an EagleVerifyInput whose requests have prefix lengths `seq_lens`
    (SGLang's verify seq_lens). `layout` forces the TreeMaskMode when the caller knows it."""
    bs = int(seq_lens.numel())
    info, tensors = capture_spec(spec_info, batch_size=bs, prefix_sum=int(seq_lens.sum()), algorithm=algorithm, layout=layout)
    return spec_from_host(info, {k: None if v is None else v.detach().cpu() for k, v in tensors.items()})


def algorithm_name(fb: Any) -> str:
    """SGLang's SpeculativeAlgorithm member name (EAGLE, EAGLE3, NGRAM, ...), EAGLE when absent."""
    algorithm = getattr(fb, "spec_algorithm", None)
    name = getattr(algorithm, "name", None)
    return name if isinstance(name, str) and name not in ("NONE", "") else "EAGLE"
