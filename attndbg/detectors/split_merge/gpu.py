"""split-merge, GPU only: FlashInfer's cascade against one paged pass, flashinfer.cascade.merge_state
on empty states, and graph replay against eager on paths with a merge (a merge launched off the
capture stream).
"""

from __future__ import annotations

import functools

import torch

from attndbg import machine
from attndbg.backends import registry
from attndbg.backends.base import PartialStates
from attndbg.backends.engine_names import merge_path
# FlashInfer's cascade is what this module runs (its module imports FlashInfer only when a kernel runs).
from attndbg.backends.flashinfer import FlashInferBackend, FlashInferOptions
from attndbg.backends.options import BackendOptions
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding
from attndbg.detectors.split_merge.base import KIND, _location
from attndbg.replay import runner
from attndbg.replay.runner import RunStatus
from attndbg.replay.variants import Graph
from attndbg.trace.schema import DTYPES, ForwardMode, Trace


def _flashinfer_ready(ctx: CheckContext) -> bool:
    return FlashInferBackend.name in ctx.backends()


def forced_runs(trace: Trace) -> list[tuple[str, FlashInferOptions]]:
    """The FlashInfer runs `cascade_vs_single_pass` makes of this step when FlashInfer is among the
    check's backends, each with the options it forces (the compile phase builds their kernels)."""
    batch = trace.batch
    if (
        batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED)
        or batch.selective
        or trace.model.sliding_window >= 0
        or not bool((batch.prefix_lens > 0).any())
    ):
        return []
    return [(FlashInferBackend.name, FlashInferOptions(extend_path=path)) for path in ("cascade", "paged")]


def cascade_vs_single_pass(ctx: CheckContext) -> list[Finding]:
    """FlashInfer's cascade (ragged + paged prefix merged) against one paged pass, both against the reference."""
    trace, batch = ctx.trace, ctx.trace.batch
    forced_paths = forced_runs(trace)
    if not forced_paths or not _flashinfer_ready(ctx):
        return []
    runs = {}
    for name, options in forced_paths:
        path = options.extend_path.value
        runs[path] = ctx.run_derived(name, BackendOptions(((name, options),)), what=f"extend_path={path}").comparison
    cascade, paged = runs["cascade"], runs["paged"]
    # No comparison: the path did not run (the kernels raised, or it cannot take this step).
    if cascade is None or cascade.passed or paged is None or not paged.passed:
        return []
    worst = cascade.worst
    # The empty-prefix mechanism is named only where merge_state itself is shown to mishandle it
    # (the probe's standalone call); a failure elsewhere names no mechanism it has not reproduced.
    empty_prefix = (
        worst is not None
        and int(batch.prefix_lens[worst.request]) == 0
        and merge_state_probe(_probe_dtype(trace))["state + empty state (-inf)"] is not None
    )
    return [
        Finding(
            KIND,
            "cascade-vs-single-pass",
            _location(ctx, worst),
            f"FlashInfer cascade: {cascade.failing_rows}/{cascade.total_rows} rows fail the reference (max abs "
            f"{cascade.max_abs:.3e}, worst {worst}); one paged pass over the same KV passes (max abs {paged.max_abs:.3e})"
            + (f"; request {worst.request} has an empty prefix" if empty_prefix else ""),
            (
                "The merge of the ragged and paged partial states is wrong: the empty prefix state (-inf LSE) is not neutral "
                "in merge_state (reproduced by a standalone merge_state call)."
                if empty_prefix
                else "The ragged pass, the prefix pass or their merge_state is wrong on this shape while one paged pass is right; "
                "bench/flashinfer_cascade_rows.py runs each pass alone against float64 to tell which."
            ),
            data={"cascade_max_abs": cascade.max_abs, "paged_max_abs": paged.max_abs},
        )
    ]


def flashinfer_merge_state(ctx: CheckContext) -> list[Finding]:
    """flashinfer.cascade.merge_state on empty states, reported where this step reaches them:
    an empty prefix in a cascade, an FA2 +inf marker in the recorded LSE."""
    trace, batch = ctx.trace, ctx.trace.batch
    if not _flashinfer_ready(ctx):
        return []
    cascade = batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and not batch.selective
    empty_prefix = cascade and bool((batch.prefix_lens > 0).any()) and bool((batch.prefix_lens == 0).any())
    plus_inf = any(t.lse is not None and bool(torch.isposinf(t.lse).any()) for t in trace.tensors.values())
    if not (empty_prefix or plus_inf):
        return []
    problems = merge_state_probe(_probe_dtype(trace))
    reached = {"state + empty state (-inf)": empty_prefix, "FA2 empty state (+inf) + state": plus_inf}
    findings = []
    for case, problem in problems.items():
        if problem is None or not reached.get(case, False):
            continue
        findings.append(
            Finding(
                KIND,
                "merge-state-empty",
                _location(ctx),
                f"flashinfer.cascade.merge_state, case '{case}': {problem}",
                "merge_state does not treat this empty-state convention as neutral: "
                + ("an empty prefix in the cascade corrupts the row." if case.startswith("state +") else "FA2's +inf marker must become -inf before merging."),
                data={"case": case, "all_cases": problems},
            )
        )
    return findings


def _probe_dtype(trace: Trace) -> torch.dtype:
    """The dtype merge_state is probed in: the step's query dtype (half precision for float32 steps,
    which FlashInfer's merge_state does not take)."""
    return DTYPES[trace.model.q_dtype] if trace.model.q_dtype != "float32" else torch.float16


@functools.cache
def merge_state_probe(dtype: torch.dtype) -> dict[str, str | None]:
    """FlashInfer's merge_state (base-2 LSEs) on crafted states; None per case when right."""
    g = torch.Generator().manual_seed(0)
    heads, dim = 2, 128
    v = torch.randn(3, heads, dim, generator=g).to(dtype)
    s = torch.randn(3, heads, generator=g) + 3.0
    v_a, s_a, v_b, s_b = v.clone(), s.clone(), v.flip(0).clone(), s.flip(0).clone()
    s_b[0] = float("-inf")  # row 0: state + empty
    s_a[1], s_b[1] = float("-inf"), float("-inf")  # row 1: empty + empty
    s_a[2] = float("inf")  # row 2: FA2's empty marker + state
    states = PartialStates(torch.stack((v_a, v_b), dim=2), torch.stack((s_a, s_b), dim=2))
    # The probe is per process (cached), not per step: its adapter comes from the registry itself.
    merged = runner.merge(registry.create(FlashInferBackend.name), states, what="cascade.merge_state on crafted states")
    out, lse = merged.output.float(), merged.lse.float()
    cases = {}
    err = float(torch.nan_to_num((out[0] - v_a[0].float()).abs(), nan=float("inf")).max())
    cases["state + empty state (-inf)"] = None if err <= 1e-2 and torch.allclose(lse[0], s_a[0], atol=1e-3) else f"output off by {err:.3e}, LSE {lse[0].tolist()}"
    cases["empty state + empty state"] = None if bool(torch.isfinite(out[1]).all()) else f"output {out[1, 0, :4].tolist()}... (NaN), LSE {lse[1].tolist()}"
    err = float(torch.nan_to_num((out[2] - v_b[2].float()).abs(), nan=float("inf")).max())
    cases["FA2 empty state (+inf) + state"] = None if err <= 1e-2 else f"output off by {err:.3e} (NaN or the empty state's garbage)"
    return cases


def merge_in_capture(ctx: CheckContext) -> list[Finding]:
    """Graph replay against eager for steps whose path merges partial states (GPU, --cuda-graph)."""
    trace = ctx.trace
    if not (machine.cuda_available() and ctx.options.cuda_graph) or merge_path(trace) is None:
        return []
    findings = []
    for run in ctx.replay(ctx.graph_options()).runs:
        if not isinstance(run.variant, Graph) or run.status is not RunStatus.FAILED:
            continue
        if run.graph is None or run.graph.eager_bitwise_equal:
            continue
        stale = [f"graph replay differs from the same step run eagerly (max abs {run.graph.eager_max_abs:.3e})"]
        findings.append(
            Finding(
                KIND,
                "merge-off-capture-stream",
                _location(ctx, run.comparison.worst if run.comparison else None),
                f"{run.name} {run.variant.label}: {stale[0]}",
                f"The graph's output differs from the same plan and buffers run eagerly on a path with a merge ({merge_path(trace)}): "
                "a kernel of it (typically the merge) ran outside the captured stream, so replays return its stale result (SGLang #5404).",
                data={"backend": run.name},
            )
        )
    return findings
