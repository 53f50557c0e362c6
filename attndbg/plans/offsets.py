"""The offsets rule (attndbg/trace/offsets.py) applied to a recorded plan's offsets (`*indptr`,
`cu_seqlens_*`): one dimension, a leading 0, never decreasing. Read by the per-request KV reading (kv.py) and judged by the
invariants detector (detectors/invariants/indptr.py also checks where each list ends; vllm.py
judges vLLM's query_start_loc by the same rule, in its own words); a broken list is reported as
the invariants detector's finding.
"""

from __future__ import annotations

from torch import Tensor

from attndbg.detector_api.findings import Finding, FindingClass, finding
from attndbg.trace.offsets import OffsetsFault, broken
from attndbg.trace.schema import Trace

KIND = FindingClass.INVARIANT  # what a broken offsets list is: the invariants detector's finding


def is_indptr(name: str) -> bool:
    """Whether a plan tensor of this name is a CSR offsets list (`*indptr`, `cu_seqlens_*`)."""
    return name.endswith("indptr") or "cu_seqlens" in name


def indptr_shape(trace: Trace, name: str, values: Tensor, out: list[Finding]) -> bool:
    """Whether plan.<name> is a 1-D offsets list that starts at 0 and never decreases; when not,
    the invariants detector's finding naming the first bad element goes to `out`."""
    field = f"plan.{name}"
    bad = broken(values)
    if bad is None:
        return True
    if bad.fault is OffsetsFault.SHAPE:
        out.append(finding(KIND, "indptr-start", step=trace.source.step, field=field, evidence=f"{field} has shape {list(values.shape)}, expected [requests + 1]", cause="the engine recorded an empty or misshapen offsets tensor"))
    elif bad.fault is OffsetsFault.START:
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
    else:
        i = bad.at
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
