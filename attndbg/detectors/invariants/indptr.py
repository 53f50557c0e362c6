"""invariants on a plan's offsets: every `*indptr` / `cu_seqlens_*` ends at the length of what it
indexes; `cu_seqlens_k` = cumsum(cache_seqlens). That each starts at 0 and never decreases is the
shape rule the plan readers share (attndbg/plans/offsets.py), checked by plan.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.trace.engines import draft_decode
from attndbg.trace.schema import Trace


def _end_cause(trace: Trace, target: str, length: int, end: int) -> str:
    """Why a buffer and its offsets disagree; SGLang's Triton backend allocates an eager step's
    kv_indices `torch.empty(seq_lens_sum)`, recorded whole (`Trace.buffers`), so a wrong host sum shows here."""
    draft = draft_decode(trace)
    if draft is not None and target == "kv_indices" and draft[0] > 1 and length * draft[0] == end:
        topk, step = draft
        return (
            f"plan.kv_indices holds 1/topk of the ids its offsets index: a draft decode's kv_indices sized without the topk factor "
            f"(each request has {topk} branch rows: seq_lens_sum x topk + bs x topk x (step + 1) = {end} at step {step}; SGLang #27338, #27460)"
        )
    buffer = trace.buffers.get(f"plan.{target}")
    sized = buffer is not None and not buffer.capacity
    total = trace.plan.scalars.get("seq_lens_sum")
    if sized and isinstance(total, int) and not isinstance(total, bool) and total == length:
        return f"the engine sized plan.{target} from its seq_lens_sum = {total}, which disagrees with the lengths its offsets sum (a stale or wrong host-side seq_lens_sum)"
    if sized:
        return f"the engine sized plan.{target} for this step from other lengths than the ones its offsets were built from"
    return "the offsets and the buffer they index were built for different batches, or the buffer was recorded untrimmed"


def _indptr_ends(trace: Trace, tensors: dict[str, Tensor], sane: set[str], out: list[Finding]) -> None:
    pairs = []
    for name in sane:
        if name.endswith("_indptr") and name != "mask_indptr" and name.replace("indptr", "indices") in tensors:
            pairs.append((name, name.replace("indptr", "indices")))
    if trace.batch.selective and "mask_indptr" in sane and "custom_mask" in tensors:
        pairs.append(("mask_indptr", "custom_mask"))
    for indptr, target in sorted(pairs):
        end, length = int(tensors[indptr][-1]), tensors[target].numel()
        if end == length:
            continue
        check = "mask-length" if target == "custom_mask" else "indptr-end"
        out.append(
            finding(
                KIND,
                check,
                step=trace.source.step,
                field=f"plan.{indptr}[-1]",
                evidence=f"plan.{indptr}[-1] = {end} but plan.{target} has {length} elements ("
                + ("the kernel reads past its end" if end > length else f"{length - end} trailing entries no request owns")
                + ")",
                cause=_end_cause(trace, target, length, end),
                expected=length,
                found=end,
            )
        )
        sane.discard(indptr)
    for prefix in ("", "expand_"):
        cu, lens = f"{prefix}cu_seqlens_k", f"{prefix}cache_seqlens"
        if cu not in sane or lens not in tensors:
            continue
        expected = torch.nn.functional.pad(torch.cumsum(tensors[lens], 0), (1, 0))
        found = tensors[cu]
        if found.numel() == expected.numel() and torch.equal(found, expected):
            continue
        i = _first(found[: expected.numel()] != expected[: found.numel()]) if found.numel() and expected.numel() else -1
        where = f"[{i}]" if i >= 0 else ""
        out.append(
            finding(
                KIND,
                "cu-seqlens-k",
                step=trace.source.step,
                field=f"plan.{cu}{where}",
                evidence=(
                    f"plan.{cu}{where} = {int(found[i])}, expected cumsum({lens}) = {int(expected[i])}"
                    if i >= 0
                    else f"plan.{cu} has {found.numel()} entries, {lens} has {expected.numel() - 1} requests"
                ),
                cause="cu_seqlens_k and cache_seqlens were computed from different lengths (one of them missed an update)",
            )
        )
