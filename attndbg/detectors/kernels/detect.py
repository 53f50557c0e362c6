"""kernels: each backend's own kernels on the step, against the float64 reference.

What runs: every backend of the check that can take the step (`CheckContext.backends`), on the
plan it derives from the batch, on every forward mode (decode, extend, mixed, verify, draft extend,
selective); under --cuda-graph, on the steps engines capture (decode, tree verify), also as a graph
replay padded to the step's capture size with the backend's own fill value. These are the check's
memoised replays: where another detector already ran a backend on the step (fill-value's padded
replays run its eager twin, tree-mask replays verify steps) nothing runs again; an extend or mixed
step costs one kernel run per backend, on the step's shared data and reference.

What a run shows, as a claim about a library (DESIGN.md "Findings"):

  kernel-fails-reference  rows beyond tolerance, or NaN/Inf where the reference is finite  (defect)
  kernel-raised           the library raised on a step its capabilities claim              (defect)
  known-defect-not-reproduced
                          the backend declares a library defect at this shape
                          (Backend.known_defect), and the run matched the reference        (hazard)

A defect names the library and its release, the shape as the kernels took it, and the `attndbg
repro` command whose script makes only the library's calls and exits 1 when it reproduces. It says
which other backends pass the same step: then the data and the reference are right, and what is
left is the library or the adapter's calls to it, which the script tells apart (it makes the
adapter's calls, captured, and nothing else). A crash that kills the worker is the check engine's
`backend-crash` finding, named the same way (checks/crashes.py).

Left to the detector that explains it: a graph replay wrong where the same backend's eager run is
right is what the padding does (fill-value: padding-leaks-into-real-rows, padded-replay-error);
here a graph replay is judged only beside a failing eager run, whose finding says whether the
graph fails too.
"""

from __future__ import annotations

from attndbg.backends.base import Backend
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, FindingClass, Severity, finding
from attndbg.detector_api.library_defect import LibraryDefect, library_defect
from attndbg.replay import graph as graph_replay
from attndbg.replay.runner import BackendRun, RunStatus
from attndbg.replay.variants import Eager, Graph

KIND = FindingClass.KERNELS
JUDGED = (RunStatus.PASSED, RunStatus.FAILED, RunStatus.ERROR)


def detect(ctx: CheckContext) -> list[Finding]:
    runs = kernel_runs(ctx)
    passing = [name for name, own in runs.items() if own and own[0].status is RunStatus.PASSED]
    findings: list[Finding] = []
    for name, own in runs.items():
        eager = next((r for r in own if isinstance(r.variant, Eager)), None)
        if eager is None or eager.status not in JUDGED:
            continue
        graph = next((r for r in own if isinstance(r.variant, Graph)), None)
        backend = ctx.adapter(name)
        predicted = backend.known_defect(ctx.trace)
        if eager.status is RunStatus.PASSED:
            if predicted is not None:
                findings.append(_not_reproduced(ctx, backend, eager, predicted))
            continue
        others = [p for p in passing if p != name]
        defect = library_defect(ctx.trace, ctx.path, backend, variant=eager.variant, plan=eager.plan, options=ctx.options.backend_options)
        findings.append(_defect(ctx, eager, graph, defect=defect, others=others, predicted=predicted))
    return findings


def kernel_runs(ctx: CheckContext) -> dict[str, list[BackendRun]]:
    """Each backend's runs of the step: its eager run first, then (--cuda-graph, a step engines
    capture) its graph replay."""
    trace = ctx.trace
    runs: dict[str, list[BackendRun]] = {}
    if not ctx.backends():
        return runs  # nothing can run the step here: no reference to build either
    for run in ctx.replay().runs:
        runs.setdefault(run.name, []).append(run)
    if ctx.options.cuda_graph and graph_replay.supports_graph(trace):
        options = ctx.graph_options(capture_bs=graph_replay.step_capture_bs(trace))
        for name in ctx.backends():
            if ctx.adapter(name).graph_unsupported_reason(trace) is None:
                runs[name] += [r for r in ctx.replay(options, (name,)).runs if isinstance(r.variant, Graph)]
    return runs


def _defect(ctx: CheckContext, eager: BackendRun, graph: BackendRun | None, *, defect: LibraryDefect, others: list[str], predicted: str | None) -> Finding:
    name, library = eager.name, defect.library
    if eager.status is RunStatus.ERROR:
        check = "kernel-raised"
        what = f"raised on this step: {eager.reason}"
        where: dict = {}
        numbers: dict = {}
    else:
        cmp = eager.comparison
        assert cmp is not None  # a FAILED run was compared
        check = "kernel-fails-reference"
        what = (
            f"{cmp.failing_rows}/{cmp.total_rows} rows fail the float64 reference (max abs {cmp.max_abs:.3e}, "
            f"{cmp.nonfinite} NaN/Inf where the reference is finite; worst {cmp.worst})"
        )
        worst = cmp.worst
        where = {} if worst is None else {"request": worst.request, "row": worst.row, "head": worst.head}
        numbers = {"failing_rows": cmp.failing_rows, "total_rows": cmp.total_rows, "max_abs": cmp.max_abs, "nonfinite": cmp.nonfinite}
    graph_words = _graph_words(graph)
    evidence = f"{library} ({name}, {eager.variant.label}) {what}; shape: {defect.shape}" + (f"; {graph_words}" if graph_words else "")
    evidence += f"; the same step passes on {', '.join(others)}" if others else "; no other backend ran this step"
    if others:
        cause = (
            f"A defect of {library} at this shape: {', '.join(others)} pass the same step on the same data and reference, "
            f"so what is left is {library.name}'s kernels or the {name} adapter's calls to them; "
        )
    else:
        cause = f"{library} computes this step wrongly, or the {name} adapter calls it wrongly (no other backend ran the step to rule the adapter out); "
    if ctx.trace.merge is not None:
        cause += f"`{defect.repro}` merges the step's states on {name} again and exits 1 when it reproduces."
    else:
        cause += f"`{defect.repro}` makes only the library's calls on this step's data and exits 1 when it reproduces."
    if predicted is not None:
        cause += f" Predicted: {predicted}."
    return finding(
        KIND,
        check,
        step=ctx.step,
        evidence=evidence,
        cause=cause,
        layer=ctx.options.layer,
        **where,
        **defect.data(),
        variant=eager.variant.label,
        passing=others,
        graph=None if graph is None else graph.status.value,
        predicted=predicted,
        **numbers,
    )


def _graph_words(graph: BackendRun | None) -> str:
    if graph is None:
        return ""
    if graph.status is RunStatus.PASSED:
        return f"its {graph.variant.label} replay passes"
    if graph.status is RunStatus.ERROR:
        return f"its {graph.variant.label} replay raised too ({graph.reason})"
    if graph.comparison is not None and not graph.comparison.passed:
        n = graph.comparison.failing_rows
        return f"its {graph.variant.label} replay fails too ({n} row{'s' if n != 1 else ''})"
    return ""


def _not_reproduced(ctx: CheckContext, backend: Backend, run: BackendRun, predicted: str) -> Finding:
    return finding(
        KIND,
        "known-defect-not-reproduced",
        step=ctx.step,
        evidence=f"{backend.library()} ({run.name}, {run.variant.label}) matches the float64 reference on this step, where the {run.name} adapter declares: {predicted}",
        cause=(
            f"The declared defect (the {run.name} adapter's known_defect) is wider than what this step shows: it may hold "
            "only at the shapes it was measured on (heads, lengths, device). Correct here; the declaration makes replay "
            "refuse such steps, and a narrower one would let them run."
        ),
        severity=Severity.HAZARD,
        layer=ctx.options.layer,
        backend=run.name,
        library=backend.library().name,
        version=backend.library().version,
        predicted=predicted,
    )
