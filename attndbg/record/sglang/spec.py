"""SGLang's EagleVerifyInput -> the trace's Spec: the draft tree as parents, the mask as recorded.

SGLang does not keep the tree's parents; it keeps, per request, each token's first child
(`retrive_next_token`, SGL-new `retrieve_next_token`) and next sibling (`retrive_next_sibling` /
`retrieve_next_sibling`), local indices, -1 for none (engines.md A3). The parents are rebuilt from
those links, not from the mask, so the tree-mask detector can check the engine's mask against a
tree it did not come from.

The mask layout (SGLang's TreeMaskMode) is the backend's `VerifyMask.mode` when it has one, else
told apart by dtype and size: bit-packed words are integers, one per row; QLEN_ONLY is `bs*n*n`
bools; FULL is `n*sum(prefix) + bs*n*n` bools, and any other length is taken as FULL (SGLang's GPU
default), so a wrong length is recorded and judged, never refused.

The mask is evidence and is recorded as the engine holds it (`Trace.buffers["spec.custom_mask"]`):
- a mask the engine allocated for this step (`build_tree_kernel_efficient` sizes it
  `seq_lens_sum*n + bs*n*n`) is recorded whole, so a mask sized from a wrong `seq_lens_sum`, or one
  reused from an earlier larger step with its tail left over, keeps its real length and tail;
- a capacity buffer (SGL-new's `VerifyMask.buffer`, allocated once for max_bs x max_context_len;
  `spec_info.custom_mask` is that tensor) is recorded up to this step's layout length: its kernel
  reads no further (the offsets over it are the plan's mask_indptr, judged there), and the rest can
  be hundreds of MB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.mask_geometry import mask_length
from attndbg.trace.schema import EngineBuffer, MaskLayout, Spec

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


def mask_layout(mask: Tensor, *, batch_size: int, draft_token_num: int, prefix_sum: int | None, hint: MaskLayout | None = None) -> MaskLayout:
    """Which TreeMaskMode laid out `mask` (see the module docstring); never raises: a length that
    fits no layout is FULL's, judged by the detectors."""
    if not mask.dtype.is_floating_point and mask.dtype is not torch.bool:
        return MaskLayout.QLEN_ONLY_BITPACKED
    if hint is not None:
        return hint
    bs, n = batch_size, draft_token_num
    if prefix_sum is not None and mask.numel() == mask_length(MaskLayout.FULL, batch_size=bs, draft_token_num=n, prefix_sum=prefix_sum):
        return MaskLayout.FULL  # also when every prefix is empty: then FULL and QLEN_ONLY coincide
    if mask.numel() == mask_length(MaskLayout.QLEN_ONLY, batch_size=bs, draft_token_num=n, prefix_sum=0):
        return MaskLayout.QLEN_ONLY
    return MaskLayout.FULL


@dataclass(frozen=True)
class SpecInfo:
    """Host facts of a verify step's spec input."""

    algorithm: str
    draft_token_num: int
    topk: int
    steps: int
    layout: MaskLayout | None  # None: the step has no custom mask
    mask_length: int = 0  # elements of the engine's mask buffer
    capacity: bool = False  # the mask is a buffer allocated once at a fixed size (VerifyMask)


def capture_spec(
    spec_info: Any, *, batch_size: int, prefix_sum: int | None, algorithm: str = "EAGLE", layout: MaskLayout | None = None, capacity: bool = False
) -> tuple[SpecInfo, dict[str, Tensor | None]]:
    """Device tensors and host facts of an EagleVerifyInput; never syncs.

    `prefix_sum`: the real requests' prefix lengths summed on the host (None when the engine keeps
    none); it cuts a `capacity` buffer to this step's layout length before the copy. A mask the engine
    sized for this step is taken whole (module docstring).
    """
    from attndbg.record.sglang.batch import draft_token_num

    n = draft_token_num(spec_info)
    mask = spec_info.custom_mask
    found = None if mask is None else mask_layout(mask, batch_size=batch_size, draft_token_num=n, prefix_sum=prefix_sum, hint=layout)
    length = 0
    if mask is not None:
        mask = mask.reshape(-1)
        length = mask.numel()
        if capacity and prefix_sum is not None:
            mask = mask[: mask_length(found, batch_size=batch_size, draft_token_num=n, prefix_sum=prefix_sum)]
    info = SpecInfo(algorithm=algorithm, draft_token_num=n, topk=int(spec_info.topk), steps=int(spec_info.spec_steps), layout=found, mask_length=length, capacity=capacity)
    tensors = {
        "next_token": _field(spec_info, "next_token")[:batch_size],
        "next_sibling": _field(spec_info, "next_sibling")[:batch_size],
        "custom_mask": mask,
    }
    return info, tensors


def spec_from_host(info: SpecInfo, host: dict[str, Tensor | None], prefix_lens: Tensor | None = None) -> tuple[Spec, EngineBuffer | None]:
    """The Spec and, when it has a mask, the engine buffer behind it. `prefix_lens` (the batch's)
    cuts a capacity buffer that could not be cut on the device."""
    parents = parents_from_links(host["next_token"].to(torch.int64), host["next_sibling"].to(torch.int64))
    if parents.shape[1] != info.draft_token_num:
        raise ValueError(f"the tree links have {parents.shape[1]} tokens per request, draft_token_num is {info.draft_token_num}")
    layout = info.layout or MaskLayout.FULL
    mask = host["custom_mask"]
    buffer = None
    if mask is not None:
        if info.capacity and prefix_lens is not None:
            mask = mask[: mask_length(layout, batch_size=parents.shape[0], draft_token_num=info.draft_token_num, prefix_sum=int(prefix_lens.sum()))]
        # The kernel's reads of this mask go through the plan's mask_indptr (judged there): none of its own.
        buffer = EngineBuffer(length=info.mask_length, read=-1, capacity=info.capacity)
    spec = Spec(
        algorithm=info.algorithm,
        draft_token_num=info.draft_token_num,
        topk=info.topk,
        steps=info.steps,
        parents=parents,
        custom_mask=mask,
        mask_layout=layout,
    )
    return spec, buffer


def spec_from_verify_input(spec_info: Any, seq_lens: Tensor, layout: MaskLayout | None = None, *, algorithm: str = "EAGLE", capacity: bool = False) -> Spec:
    """The trace's Spec of an EagleVerifyInput whose requests have prefix lengths `seq_lens`
    (SGLang's verify seq_lens). `layout` forces the TreeMaskMode when the caller knows it;
    `capacity`: the mask is a buffer allocated once at a fixed size (VerifyMask)."""
    bs = int(seq_lens.numel())
    info, tensors = capture_spec(spec_info, batch_size=bs, prefix_sum=int(seq_lens.sum()), algorithm=algorithm, layout=layout, capacity=capacity)
    return spec_from_host(info, {k: None if v is None else v.detach().cpu() for k, v in tensors.items()})[0]


def algorithm_name(fb: Any) -> str:
    """SGLang's SpeculativeAlgorithm member name (EAGLE, EAGLE3, NGRAM, ...), EAGLE when absent."""
    algorithm = getattr(fb, "spec_algorithm", None)
    name = getattr(algorithm, "name", None)
    return name if isinstance(name, str) and name not in ("NONE", "") else "EAGLE"
