"""tree-mask on verify outputs: rows that fail against the reference with plans derived from the
tree (verify-output) or with the recorded plan (recorded-verify-output), with the mask columns
that differ from the true mask at those rows, and the mask mistake that reproduces the kernel's
output (attndbg/diagnose's mask models: the mask ignored, read transposed or in the other bit
order, ignored past the causal tile, the recorded plan's mask, the window by index), if one does.
"""

from __future__ import annotations

import torch

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.tree_mask.base import KIND
from attndbg.diagnose import MASK_MODELS, Reproduction, diagnose
from attndbg.plans.reading import PlanReading
from attndbg.plans.visibility import PlanVisibility
from attndbg.replay.runner import BackendRun, PlanSource, ReplayOptions, RunStatus
from attndbg.replay.step_data import StepData
from attndbg.replay.variants import Eager, Recorded
from attndbg.trace.schema import Trace
from attndbg.trace.visibility import visibility


# Shown per failing row in the output findings.
MAX_ROWS_SHOWN = 4
MAX_COLUMNS_SHOWN = 8


def _output_findings(ctx: CheckContext, *, run_recorded: bool) -> list[Finding]:
    trace = ctx.trace
    out: list[Finding] = []
    backends = ctx.backends()
    if not backends:
        return out
    data = ctx.data(ctx.options.layer)
    for run in ctx.replay().runs:
        if isinstance(run.variant, Eager):
            _report_run(trace, run, None, "verify-output", out, data, ctx.plan())
    plan = trace.plan
    if run_recorded and plan is not None and plan.backend in backends:
        view = ctx.plan().visibility
        recorded = ctx.replay(ReplayOptions(layer=ctx.options.layer, plan=PlanSource.RECORDED))
        for run in recorded.runs:
            if isinstance(run.variant, Recorded):
                _report_run(trace, run, view, "recorded-verify-output", out, data, ctx.plan())
    return out


def _report_run(trace: Trace, run: BackendRun, view: PlanVisibility | None, check: str, out: list[Finding], data: StepData, plan: PlanReading) -> None:
    recorded = check == "recorded-verify-output"
    if run.status is RunStatus.ERROR:
        if recorded and run.refused is not None:
            return  # an out-of-cache plan: invariants explains it
        out.append(
            finding(
                KIND,
                check,
                step=trace.source.step,
                evidence=f"{run.name} ({run.variant.label}) raised on this verify step: {run.reason}",
                cause="the kernel rejected the verify plan" + (" the engine recorded" if recorded else " derived from the draft tree"),
                backend=run.name,
                variant=run.variant.label,
            )
        )
        return
    if run.status is not RunStatus.FAILED or run.comparison is None:
        return
    ratio = torch.maximum(run.comparison.row_errors, run.comparison.lse_errors)  # [T, Hq]
    failing = torch.nonzero((ratio > 1).any(-1)).flatten().tolist()
    if not failing:
        return
    batch = trace.batch
    qo = batch.qo_indptr
    parts, columns_of_first = [], []
    for t in failing[:MAX_ROWS_SHOWN]:
        b = int(torch.searchsorted(qo, torch.tensor(t), right=True)) - 1
        r = t - int(qo[b])
        text = f"row {t} (request {b}, draft token {r}, {float(ratio[t].max()):.3g}x tolerance)"
        if recorded:
            wrong = _wrong_columns(trace, view, b, r)
            if t == failing[0]:
                columns_of_first = wrong
            if wrong is None:
                text += ": the plan's mask for this row could not be read"
            elif wrong:
                shown = ", ".join(f"{c} ({'should be visible' if e else 'should be hidden'})" for c, e in wrong[:MAX_COLUMNS_SHOWN])
                text += f": its recorded mask differs from the true mask at columns {shown}" + (" ..." if len(wrong) > MAX_COLUMNS_SHOWN else "")
            else:
                text += ": its recorded mask row matches the true mask"
        parts.append(text)
    t0 = failing[0]
    b0 = int(torch.searchsorted(qo, torch.tensor(t0), right=True)) - 1
    head = int(torch.argmax(ratio[t0]))
    if not recorded:
        cause = "the kernel applies a correct tree mask wrongly: the plan was derived from the draft tree, so the kernel (or its mask packing) is at fault"
    elif columns_of_first:
        cause = "the recorded plan's tree mask shows or hides the listed columns at the failing rows, so those rows attend to the wrong keys"
    else:
        cause = "the failing rows' masks are right: the recorded plan's indices, offsets or lengths make them wrong (see the invariants findings)"
    found = _reproduced(data, run, failing, plan)
    if found:
        parts.append("reproduced: the kernel's output equals " + "; ".join(r.describe() for r in found[:2]))
        cause = f"{cause}. {found[0].cause}"
    out.append(
        finding(
            KIND,
            check,
            step=trace.source.step,
            request=b0,
            row=t0,
            column=columns_of_first[0][0] if columns_of_first else None,
            head=head,
            evidence=f"{run.name} ({run.variant.label}): {len(failing)} of {batch.num_tokens} rows fail against the reference; " + "; ".join(parts),
            cause=cause,
            backend=run.name,
            variant=run.variant.label,
            failing_rows=failing[:32],
            columns=[c for c, _ in columns_of_first] if columns_of_first else [],
            reproductions=[r.to_json() for r in found],
        )
    )


def _reproduced(data: StepData, run: BackendRun, failing: list[int], plan: PlanReading) -> list[Reproduction]:
    """The mask mistakes whose output equals the run's on its failing rows (none when the run has
    no output or non-finite rows, which no mask mistake makes)."""
    if run.result is None or not bool(torch.isfinite(run.result.output).all()):
        return []
    found = diagnose(data, run.result.output, models=MASK_MODELS, plan=plan)
    return [r for r in found if set(r.rows) & set(failing)]


def _wrong_columns(trace: Trace, view: PlanVisibility | None, b: int, r: int) -> list[tuple[int, bool]] | None:
    """Columns where the plan's visibility at (request b, draft row r) differs from the truth: (column, should see)."""
    if view is None or b not in view.blocks:
        return None
    truth = visibility(trace, b)[r]
    seen = view.blocks[b][r]
    return [(int(c), bool(truth[c])) for c in torch.nonzero(seen != truth).flatten()]
