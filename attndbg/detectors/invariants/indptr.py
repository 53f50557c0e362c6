"""invariants on a plan's offsets: every `*indptr` / `cu_seqlens_*` starts at 0, never decreases,
and ends at the length of what it indexes; `cu_seqlens_k` = cumsum(cache_seqlens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.trace.schema import Trace


def _is_indptr(name: str) -> bool:
    return name.endswith("indptr") or "cu_seqlens" in name


def _indptr_shape(trace: Trace, name: str, values: Tensor, out: list[Finding]) -> bool:
    field = f"plan.{name}"
    if values.dim() != 1 or values.numel() == 0:
        out.append(finding(KIND, "indptr-start", step=trace.source.step, field=field, evidence=f"{field} has shape {list(values.shape)}, expected [requests + 1]", cause="the engine recorded an empty or misshapen offsets tensor"))
        return False
    if int(values[0]) != 0:
        out.append(
            finding(
                KIND,
                "indptr-start",
                step=trace.source.step,
                field=f"{field}[0]",
                evidence=f"{field}[0] = {int(values[0])}, an indptr starts at 0",
                cause="the offsets were sliced from a larger buffer at the wrong start, or written without the leading 0",
                expected=0,
                found=int(values[0]),
            )
        )
        return False
    i = _first(values[1:] < values[:-1]) + 1
    if i > 0:
        out.append(
            finding(
                KIND,
                "indptr-decreases",
                step=trace.source.step,
                request=i - 1,
                field=f"{field}[{i}]",
                evidence=f"{field}[{i}] = {int(values[i])} < {field}[{i - 1}] = {int(values[i - 1])}: an indptr never decreases",
                cause="the offsets were partly overwritten by another batch's (a shared metadata buffer), or summed from lengths in the wrong order",
                expected_at_least=int(values[i - 1]),
                found=int(values[i]),
            )
        )
        return False
    return True


def _end_cause(trace: Trace, target: str, length: int) -> str:
    """Why a buffer and its offsets disagree; SGLang's Triton backend allocates an eager step's
    kv_indices `torch.empty(seq_lens_sum)`, recorded whole (`Trace.buffers`), so a wrong host sum shows here."""
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
                cause=_end_cause(trace, target, length),
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
