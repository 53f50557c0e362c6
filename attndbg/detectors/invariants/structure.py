"""invariants on the recorded plan's structure, as the plan reading found it (attndbg/plans): index
tensors of a wrong dtype or rank (plan-dtype, plan-shape), offsets lists that break the offsets rule
(indptr-start, indptr-decreases), and a per-request KV its kernel cannot read (a page table and
lengths of different batches: plan-batch-size; a length past its table row: kv-length; a last page
length outside the page: kv-last-page-len). Each problem worded as this detector's finding.
"""

from __future__ import annotations

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND
from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.trace.schema import Trace


def worded(trace: Trace, problem: PlanProblem) -> Finding:
    """The finding that names `problem` (one the reading met in the plan's tensors, offsets or KV)."""
    step, name, detail = trace.source.step, problem.field, problem.detail
    field = f"plan.{name}"
    kind = problem.kind
    if kind is ProblemKind.INDEX_DTYPE:
        return finding(
            KIND,
            "plan-dtype",
            step=step,
            field=field,
            evidence=f"{field} has dtype {detail['dtype']}, expected an integer index type",
            cause="the engine passed a float or bool tensor where the kernel takes indices",
        )
    if kind is ProblemKind.INDEX_RANK:
        return finding(
            KIND,
            "plan-shape",
            step=step,
            field=field,
            evidence=f"{field} has shape {detail['shape']}, expected {detail['dims']} dimension(s)",
            cause="the engine passed a tensor of the wrong rank where the kernel takes this plan field",
        )
    if kind is ProblemKind.OFFSETS_SHAPE:
        return finding(KIND, "indptr-start", step=step, field=field, evidence=f"{field} has shape {detail['shape']}, expected [requests + 1]", cause="the engine recorded an empty or misshapen offsets tensor")
    if kind is ProblemKind.OFFSETS_START:
        return finding(
            KIND,
            "indptr-start",
            step=step,
            field=f"{field}[0]",
            evidence=f"{field}[0] = {problem.found}, an indptr starts at 0",
            cause="the offsets were sliced from a larger buffer at the wrong start, or written without the leading 0",
            expected=0,
            found=problem.found,
        )
    if kind is ProblemKind.OFFSETS_DECREASE:
        i = problem.index
        return finding(
            KIND,
            "indptr-decreases",
            step=step,
            request=problem.request,
            field=f"{field}[{i}]",
            evidence=f"{field}[{i}] = {problem.found} < {field}[{i - 1}] = {problem.expected}: an indptr never decreases",
            cause="the offsets were partly overwritten by another batch's (a shared metadata buffer), or summed from lengths in the wrong order",
            expected_at_least=problem.expected,
            found=problem.found,
        )
    if kind is ProblemKind.TABLE_ROWS:
        return finding(
            KIND,
            "plan-batch-size",
            step=step,
            field=field,
            evidence=f"{field} has {detail['rows']} rows, {detail['lengths']} has {detail['requests']} requests",
            cause="the page table and the lengths were built for different batches",
        )
    if kind is ProblemKind.TABLE_SHORT:
        b = problem.request
        cause = f"{name} is longer than the page table row built for this request (lengths and table from different steps)"
        if trace.graph is not None and trace.graph.is_graph_replay:
            # A replay reads the table the graph captured: its width is fixed at capture (SGLang's FA3
            # sized it from the context length while verify lengths add the draft tokens, #35985).
            cause = (
                f"{name} needs more pages than the {detail['columns']} columns of the page table this CUDA graph replay reads: the "
                "table is the buffer made for the capture, so either its width was sized short of the longest length a replay "
                "publishes (from the model's context length, say, while a verify step's lengths add its draft tokens) or the "
                "lengths come from another step; the kernel reads past the row"
            )
        return finding(
            KIND,
            "kv-length",
            step=step,
            request=b,
            field=f"{field}[{b}]",
            evidence=f"{field}[{b}] = {problem.found} needs {detail['pages']} pages, plan.{detail['table']} has {detail['columns']} columns",
            cause=cause,
        )
    if kind is ProblemKind.LAST_PAGE_LEN:
        b, ps = problem.request, detail["page_size"]
        return finding(
            KIND,
            "kv-last-page-len",
            step=step,
            request=b,
            field=f"{field}[{b}]",
            evidence=f"{field}[{b}] = {problem.found}, expected a value in [1, {ps}] (page_size {ps})",
            cause=f"{name} was computed as seq_len % page_size without mapping 0 to a full page, or from a stale length",
            found=problem.found,
        )
    raise ValueError(f"not a KV structure problem: {kind}")
