"""The shape rule of a recorded plan's offsets (`*indptr`, `cu_seqlens_*`): one dimension, a
leading 0, never decreasing. Read by the per-request KV reading (kv.py) and judged by the
invariants detector (detectors/invariants/indptr.py also checks where each list ends; vllm.py
judges vLLM's query_start_loc by the same rule, in its own words); a broken list is reported as
the invariants detector's finding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, FindingClass, finding
from attndbg.trace.schema import Trace

KIND = FindingClass.INVARIANT  # what a broken offsets list is: the invariants detector's finding


def first_true(mask: Tensor) -> int:
    """The flat index of the first True in `mask`, -1 when there is none."""
    return int(torch.nonzero(mask.flatten())[0]) if bool(mask.any()) else -1


def first_decrease(values: Tensor) -> int:
    """The first index i with values[i] < values[i - 1] (an offsets list that decreases there), -1
    when there is none."""
    i = first_true(values[1:] < values[:-1])
    return i + 1 if i >= 0 else -1


def is_indptr(name: str) -> bool:
    """Whether a plan tensor of this name is a CSR offsets list (`*indptr`, `cu_seqlens_*`)."""
    return name.endswith("indptr") or "cu_seqlens" in name


def indptr_shape(trace: Trace, name: str, values: Tensor, out: list[Finding]) -> bool:
    """Whether plan.<name> is a 1-D offsets list that starts at 0 and never decreases; when not,
    the invariants detector's finding naming the first bad element goes to `out`."""
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
    i = first_decrease(values)
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
