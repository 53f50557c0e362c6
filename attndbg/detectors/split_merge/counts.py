"""split-merge, split counts: decode steps through our Triton split-KV kernels with num_kv_splits
forced to 1, 2, SGLang's heuristic, the recorded plan's and the maximum, plus vLLM PagedAttention
v2's scheme (its own kernel through the runner's `vllm_paged` backend where it runs, else its
partition counts on our kernels), each against the float64 reference and the single-split run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

# This detector studies num_kv_splits, which our Triton split-KV kernels take as an option: it
# drives them by their options, the one backend whose splits it can set.
from attndbg.backends.options import BackendOptions
from attndbg.backends.triton import DEFAULT_MAX_KV_SPLITS, TritonBackend, TritonOptions
from attndbg.backends.triton_kernels.split_rule import MIN_BLOCK_KV, empty_splits
from attndbg.backends.vllm_paged import PARTITION_TOKENS as V2_PARTITION_TOKENS
from attndbg.compare.tolerance import Comparison
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding
from attndbg.detectors.split_merge.base import KIND, _location, _request_of
from attndbg.detectors.split_merge.vllm import _vllm_v2_available, _vllm_v2_run
from attndbg.replay import runner
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus
from attndbg.trace.schema import ForwardMode, Plan


MAX_KV_SPLITS = 16
FORCED_SPLITS = (1, 2)


@dataclass(frozen=True)
class SplitConfig:
    label: str
    splits: tuple[int, ...]  # per request
    forced: int | None = None  # a uniform count the runner can force; else the vector is planted in a plan
    vllm_v2: bool = False


def _heuristic_plan(ctx: CheckContext) -> Plan:
    """The plan our Triton adapter derives with its default options: SGLang's split heuristic."""
    return ctx.adapter(TritonBackend.name, BackendOptions()).derive_plan(ctx.trace)


def split_configs(ctx: CheckContext) -> tuple[list[SplitConfig], list[int]]:
    """Distinct split configurations to run (first label wins for equal vectors), and the KV length
    each request's split kernel sees (the window's slots only, under a sliding window)."""
    trace = ctx.trace
    heuristic = _heuristic_plan(ctx)
    lengths = heuristic.tensors["kv_indptr"].to(torch.int64).diff().tolist()
    bs = len(lengths)
    candidates = [SplitConfig(f"num_kv_splits={k}", (k,) * bs, forced=k) for k in FORCED_SPLITS]
    candidates.append(SplitConfig("SGLang's heuristic (the engine's)", tuple(heuristic.tensors["num_kv_splits"].tolist())))
    plan = trace.plan
    if plan is not None and plan.backend == TritonBackend.name and "num_kv_splits" in plan.tensors:
        recorded = plan.tensors["num_kv_splits"][:bs].tolist()
        if len(recorded) == bs and min(recorded) >= 1:
            candidates.append(SplitConfig("the recorded plan's num_kv_splits", tuple(recorded)))
    candidates.append(SplitConfig(f"num_kv_splits={MAX_KV_SPLITS} (max)", (MAX_KV_SPLITS,) * bs, forced=MAX_KV_SPLITS))
    v2 = tuple(max(1, -(-n // V2_PARTITION_TOKENS)) for n in lengths)
    candidates.append(SplitConfig(f"vLLM PagedAttention v2 ({V2_PARTITION_TOKENS}-token partitions)", v2, vllm_v2=True))
    configs, seen = [], set()
    for c in candidates:
        # vLLM's own kernel is a different computation even where its split vector repeats one of ours.
        key = ("vllm", c.splits) if c.vllm_v2 and _vllm_v2_available(ctx) else c.splits
        if key not in seen:
            seen.add(key)
            configs.append(c)
    return configs, lengths


def split_counts(ctx: CheckContext) -> list[Finding]:
    """Every split configuration against the reference. A single split merges nothing: when it
    fails too, the reference says nothing about the merge, and a configuration is reported only
    where its output moves away from the single-split output beyond the reference tolerance."""
    trace = ctx.trace
    if trace.batch.forward_mode is not ForwardMode.DECODE or TritonBackend.name not in ctx.backends():
        return []
    configs, lengths = split_configs(ctx)
    results = [_run_config(ctx, c) for c in configs]
    base = next((r for c, r in results if c.forced == 1 and isinstance(r, runner.BackendRun)), None)
    base_passes = base is not None and base.comparison is not None and base.comparison.passed
    tolerance = None if base is None or base_passes else ctx.data(ctx.options.layer).output_tolerance()
    findings = []
    for config, run in results:
        if run is None or config.forced == 1:
            continue  # not runnable here (never a finding), or the baseline itself
        if isinstance(run, str):
            findings.append(
                Finding(KIND, "split-count-error", _location(ctx), f"{config.label}: {run}", "The split-KV kernels raised for this split configuration.")
            )
            continue
        cmp = run.comparison
        if cmp is None or cmp.passed:
            continue
        if base is not None and not base_passes:
            finding = _drift_finding(ctx, config=config, run=run, base=base, tolerance=tolerance)
            findings += [finding] if finding else []
            continue
        findings.append(_split_finding(ctx, config=config, run=run, base=base, lengths=lengths))
    return findings


def _drift_finding(ctx: CheckContext, *, config: SplitConfig, run, base, tolerance: Tensor) -> Finding | None:
    diff = torch.nan_to_num((run.result.output.double() - base.result.output.double()).abs().amax(-1), nan=float("inf"))
    over = diff / tolerance
    if not bool((over > 1).any()):
        return None
    row, head = divmod(int(torch.argmax(over)), over.shape[1])
    request = _request_of(ctx.trace, row)
    return Finding(
        KIND,
        "split-count-changes-output",
        _location(ctx, request=request, row=row, head=head),
        f"{config.label}: differs from the single-split output by up to {float(diff.max()):.3e} "
        f"({int((over > 1).any(1).sum())} rows beyond the reference tolerance; worst row {row} head {head}); "
        f"the single-split run fails the reference too ({base.comparison.failing_rows} rows)",
        "The step is wrong even without splitting (outside the merge), and this split configuration adds an error of its own in the merge.",
        data={"splits": list(config.splits), "max_diff": float(diff.max())},
    )


def _run_config(ctx: CheckContext, config: SplitConfig) -> tuple[SplitConfig, runner.BackendRun | str | None]:
    """The eager run of one configuration: a failure message when the kernels raised, None when
    the backend could not run the step at all."""
    if config.vllm_v2 and _vllm_v2_available(ctx):
        run = _vllm_v2_run(ctx)
        if not isinstance(run, str):
            return config, run
        # vLLM's op did not take our call (its signature moves between versions): our kernels run
        # v2's partition count instead, and a finding on this configuration says so.
        config = replace(config, label=f"{config.label} on our kernels ({run})")
    return config, _run_triton(ctx, config)


def _run_triton(ctx: CheckContext, config: SplitConfig) -> runner.BackendRun | str | None:
    trace = ctx.trace
    if config.forced is not None:
        opts = TritonOptions(num_kv_splits=config.forced, max_kv_splits=max(DEFAULT_MAX_KV_SPLITS, config.forced))
        forced = BackendOptions(((TritonBackend.name, opts),))
        result = ctx.replay(ReplayOptions(layer=ctx.options.layer, backend_options=forced), (TritonBackend.name,))
    else:
        # A per-request vector: planted in the plan derived from the batch, run as a recorded plan
        # (so the runner's plan guard judges it before launch).
        plan = _heuristic_plan(ctx)
        plan = replace(
            plan,
            tensors={**plan.tensors, "num_kv_splits": torch.tensor(config.splits, dtype=torch.int32)},
            scalars={**plan.scalars, "max_kv_splits": max(DEFAULT_MAX_KV_SPLITS, *config.splits)},
        )
        options = ReplayOptions(layer=ctx.options.layer, plan=PlanSource.RECORDED)
        result = ctx.replay(options, (TritonBackend.name,), trace=replace(trace, plan=plan))
    run = result.runs[0] if result.runs else None
    if run is None or run.status in (RunStatus.UNSUPPORTED, RunStatus.UNAVAILABLE):
        return None
    if run.status is RunStatus.ERROR:
        return run.reason or "kernel error"
    return run


def _split_finding(ctx: CheckContext, *, config: SplitConfig, run, base, lengths: list[int]) -> Finding:
    cmp: Comparison = run.comparison
    worst = cmp.worst
    b = worst.request if worst else 0
    n, s = lengths[b], config.splits[b]
    empty = empty_splits(n, s)
    evidence = (
        f"{config.label}: {cmp.failing_rows}/{cmp.total_rows} rows fail the reference (max abs {cmp.max_abs:.3e}, "
        f"{cmp.nonfinite} non-finite; worst {worst}); request {b}: kv {n}, {s} splits, {empty} empty"
    )
    if base is not None and base.result is not None and run.result is not None:
        diff = torch.nan_to_num((run.result.output.double() - base.result.output.double()).abs().amax(-1), nan=float("inf"))
        row, head = divmod(int(torch.argmax(diff)), diff.shape[1])
        evidence += f"; against 1 split: max abs {float(diff.max()):.3e} at row {row} head {head} (1 split passes)"
    if cmp.nonfinite and empty:
        cause = (
            f"Request {b} has {empty} empty splits (kv {n} < {MIN_BLOCK_KV} x {s} splits): merging empty states "
            "(-inf LSE) computes exp(-inf - -inf) = NaN instead of skipping them (FlashInfer #4051)."
        )
    else:
        cause = "The partial states of the splits are merged wrongly (split boundaries, LSE weights or the final normalisation)."
    data = {"splits": list(config.splits), "lengths": lengths, "failing_rows": cmp.failing_rows, "max_abs": cmp.max_abs}
    return Finding(KIND, "split-count-fails-reference", _location(ctx, worst), evidence, cause, data=data)
