"""split-merge: partial attention states (KV splits, cascade parts) and how they are merged.

What it runs (DESIGN.md "The detectors"):

  split counts      decode steps through our Triton split-KV kernels with num_kv_splits forced to
                    1, 2, SGLang's heuristic (the engine's), the recorded plan's, and the maximum
                    (16), plus vLLM PagedAttention v2's scheme (below); any configuration that
                    fails the float64 reference is reported with the request/row/head, its empty
                    splits, and how it differs from the single-split run.
  empty states      our stage 2 driven directly with crafted partials: empty splits whose scratch
                    holds -inf (an empty state) or +inf (FlashAttention-2 marks empty rows +inf)
                    must be skipped, and a row whose every split is empty must give 0 / -inf, not
                    NaN (FlashInfer #4051); reported where the trace reaches that case.
  recorded tensors  the engine's own output/LSE (Trace.tensors) against the reference: LSE base
                    confusion named by its ratio (log2 e: a base-2 LSE read as natural log; ln 2:
                    the reverse; FlashInfer #2113, SGLang #40903), FA2's +inf empty marker
                    recognised, NaN rows of requests with empty splits, and a merged output that
                    matches the reference only with one partial's LSE rescaled by log2 e or ln 2.
  GPU only          FlashInfer's cascade (ragged + paged merged) against one paged pass, with empty
                    prefixes; `flashinfer.cascade.merge_state` on empty states; graph replay
                    against eager for paths with a merge (a merge launched off the capture stream
                    is missing from the graph, SGLang #5404).

vLLM PagedAttention v2 splits every sequence into fixed 512-token partitions and merges them
through exp_sums/max_logits. With vLLM importable on a GPU its kernel runs; otherwise our kernels
run with num_kv_splits = cdiv(len, 512) per request: the same number of partitions as v2, but our
split length is cdiv(cdiv(len, s), 32) * 32 tokens (SGLang's rule, computed in the kernel from the
length and the split count), which equals 512 only when cdiv(len, s) > 480 (e.g. len 1000, not
1025: 352 + 352 + 321 instead of 512 + 512 + 1). Exact 512-token partitions would need a fixed
partition size inside the kernel, which ours (like SGLang's) does not have.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg import machine
from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs, AttentionResult, KernelError
from attndbg.backends.triton import DEFAULT_MAX_KV_SPLITS, TritonBackend, TritonOptions
from attndbg.checks.context import CheckContext
from attndbg.checks.findings import Finding, FindingClass, Location
from attndbg.compare.tolerance import ERROR_FACTOR, LSE_FLOOR, OUTPUT_FLOOR, Comparison, compare
from attndbg.replay import runner
from attndbg.replay.data import build_inputs, to_device
from attndbg.replay.runner import PlanSource, ReplayOptions, RunStatus
from attndbg.trace.schema import DTYPES, AttentionKind, ForwardMode, LseBase, Trace
from attndbg.trace.visibility import visibility

KIND = FindingClass.SPLIT_MERGE
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
MAX_KV_SPLITS = 16
FORCED_SPLITS = (1, 2)
# SGLang's and our kernels' split tile (MIN_BLOCK_KV in backends/triton_kernels/decode.py).
SPLIT_TILE = 32
V2_PARTITION_TOKENS = 512  # vLLM's _PARTITION_SIZE for paged_attention_v2
V2_BLOCK_SIZE = 16  # a KV block size vLLM's v1/v2 kernels are instantiated for
# Crafted stage-2 probe: 40 tokens in 4 splits are two splits (32 + 8) and two empty ones.
PROBE_LEN, PROBE_SPLITS = 40, 4


def detect(ctx: CheckContext) -> list[Finding]:
    return (
        split_counts(ctx)
        + empty_split_merge(ctx)
        + recorded_tensors(ctx)
        + cascade_vs_single_pass(ctx)
        + flashinfer_merge_state(ctx)
        + merge_in_capture(ctx)
    )


def split_length(length: int, splits: int) -> int:
    """Tokens per split, the kernels' rule: cdiv(cdiv(length, splits), 32) * 32."""
    if splits <= 0:
        return 0
    chunk = -(-length // splits)
    return -(-chunk // SPLIT_TILE) * SPLIT_TILE


def empty_splits(length: int, splits: int) -> int:
    """Splits of a request that get no KV under that rule."""
    per_split = split_length(length, splits)
    return splits - (-(-length // per_split) if per_split else 0) if splits > 0 else 0


def merge_path(trace: Trace) -> str | None:
    """The merge of partial states in the path the recording backend runs for this step, if any."""
    batch, backend = trace.batch, trace.source.backend
    if batch.forward_mode is ForwardMode.DECODE:
        return "split-KV decode (partial states of KV splits merged by their LSEs)"
    cached = bool((batch.prefix_lens > 0).any())
    if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and backend == "flashinfer" and cached and not batch.selective:
        return "FlashInfer cascade (ragged new tokens + paged prefix merged with merge_state)"
    if trace.is_tree_verify and backend == "fa3" and trace.spec.topk > 1:
        return "FA3 two-call verify (prefix and draft partials merged with merge_state_v2)"
    return None


def _location(ctx: CheckContext, worst=None, **extra) -> Location:
    if worst is not None:
        extra = {"request": worst.request, "row": worst.row, "head": worst.head, **extra}
    return Location(step=ctx.step, layer=ctx.options.layer, **extra)


# -- split counts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitConfig:
    label: str
    splits: tuple[int, ...]  # per request
    forced: int | None = None  # a uniform count the runner can force; else the vector is planted in a plan
    vllm_v2: bool = False


def split_configs(trace: Trace) -> tuple[list[SplitConfig], list[int]]:
    """Distinct split configurations to run (first label wins for equal vectors), and the KV length
    each request's split kernel sees (the window's slots only, under a sliding window)."""
    heuristic = TritonBackend(TritonOptions()).derive_plan(trace)
    lengths = heuristic.tensors["kv_indptr"].to(torch.int64).diff().tolist()
    bs = len(lengths)
    candidates = [SplitConfig(f"num_kv_splits={k}", (k,) * bs, forced=k) for k in FORCED_SPLITS]
    candidates.append(SplitConfig("SGLang's heuristic (the engine's)", tuple(heuristic.tensors["num_kv_splits"].tolist())))
    plan = trace.plan
    if plan is not None and plan.backend == "triton" and "num_kv_splits" in plan.tensors:
        recorded = plan.tensors["num_kv_splits"][:bs].tolist()
        if len(recorded) == bs and min(recorded) >= 1:
            candidates.append(SplitConfig("the recorded plan's num_kv_splits", tuple(recorded)))
    candidates.append(SplitConfig(f"num_kv_splits={MAX_KV_SPLITS} (max)", (MAX_KV_SPLITS,) * bs, forced=MAX_KV_SPLITS))
    v2 = tuple(max(1, -(-n // V2_PARTITION_TOKENS)) for n in lengths)
    candidates.append(SplitConfig(f"vLLM PagedAttention v2 ({V2_PARTITION_TOKENS}-token partitions)", v2, vllm_v2=True))
    configs, seen = [], set()
    for c in candidates:
        # vLLM's own kernel is a different computation even where its split vector repeats one of ours.
        key = ("vllm", c.splits) if c.vllm_v2 and _vllm_v2_available(trace) else c.splits
        if key not in seen:
            seen.add(key)
            configs.append(c)
    return configs, lengths


def split_counts(ctx: CheckContext) -> list[Finding]:
    """Every split configuration against the reference. A single split merges nothing: when it
    fails too, the reference says nothing about the merge, and a configuration is reported only
    where its output moves away from the single-split output beyond the reference tolerance."""
    trace = ctx.trace
    if trace.batch.forward_mode is not ForwardMode.DECODE or "triton" not in ctx.backends():
        return []
    configs, lengths = split_configs(trace)
    results = [_run_config(ctx, c) for c in configs]
    base = next((r for c, r in results if c.forced == 1 and isinstance(r, runner.BackendRun)), None)
    base_passes = base is not None and base.comparison is not None and base.comparison.passed
    tolerance = None if base is None or base_passes else _tolerance(trace, ctx.options.layer)
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


def _tolerance(trace: Trace, layer: int | None) -> Tensor:
    """[T, Hq]: the reference comparison's per-row tolerance (tolerance.py's model)."""
    inputs = build_inputs(trace, layer=layer)
    ref = reference.attention(trace, inputs, torch.float64).output
    lowp = reference.attention(trace, inputs, DTYPES[trace.model.q_dtype]).output.double()
    floor = OUTPUT_FLOOR.get(DTYPES[trace.model.q_dtype], OUTPUT_FLOOR[torch.bfloat16])
    return ERROR_FACTOR * (lowp - ref).abs().amax(-1) + floor * ref.abs().amax(-1).clamp_min(1.0)


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
    trace = ctx.trace
    if config.vllm_v2 and _vllm_v2_available(trace):
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
        result = ctx.replay(ReplayOptions(layer=ctx.options.layer, triton=opts), ("triton",))
    else:
        # A per-request vector: planted in the plan derived from the batch, run as a recorded plan.
        plan = TritonBackend(TritonOptions()).derive_plan(trace)
        plan = replace(
            plan,
            tensors={**plan.tensors, "num_kv_splits": torch.tensor(config.splits, dtype=torch.int32)},
            scalars={**plan.scalars, "max_kv_splits": max(DEFAULT_MAX_KV_SPLITS, *config.splits)},
        )
        options = ReplayOptions(layer=ctx.options.layer, plan=PlanSource.RECORDED)
        result = runner.replay(replace(trace, plan=plan), ctx.path, ["triton"], options)
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
            f"Request {b} has {empty} empty splits (kv {n} < {SPLIT_TILE} x {s} splits): merging empty states "
            "(-inf LSE) computes exp(-inf - -inf) = NaN instead of skipping them (FlashInfer #4051)."
        )
    else:
        cause = "The partial states of the splits are merged wrongly (split boundaries, LSE weights or the final normalisation)."
    data = {"splits": list(config.splits), "lengths": lengths, "failing_rows": cmp.failing_rows, "max_abs": cmp.max_abs}
    return Finding(KIND, "split-count-fails-reference", _location(ctx, worst), evidence, cause, data=data)


# -- vLLM PagedAttention v2 (GPU with vLLM) ------------------------------------------------------


def _vllm_v2_available(trace: Trace) -> bool:
    m = trace.model
    return (
        machine.cuda_available()
        and machine.module_available("vllm")
        and m.attention is AttentionKind.MHA
        and m.head_dim == m.v_head_dim
        and m.sliding_window < 0
        and m.logit_cap == 0
        and m.q_dtype == m.kv_dtype
    )


def _vllm_v2_run(ctx: CheckContext) -> runner.BackendRun | str:
    """vLLM's paged_attention_v2 on the step: each request's K/V gathered into 16-token blocks in
    vLLM's v1/v2 cache layout; the LSE is rebuilt from the kernel's per-partition exp_sums/max_logits."""
    from vllm import _custom_ops as ops

    trace = ctx.trace
    m, batch = trace.model, trace.batch
    inputs = build_inputs(trace, layer=ctx.options.layer)
    dtype = DTYPES[m.q_dtype]
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    lens = batch.kv_lens.tolist()
    blocks_per = [-(-n // V2_BLOCK_SIZE) for n in lens]
    total = sum(blocks_per) + 1
    k_cache = torch.zeros(total, V2_BLOCK_SIZE, m.num_kv_heads, m.head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    nxt = 1  # block 0 stays vLLM's null block
    for b, n in enumerate(lens):
        slots = batch.request_slots(b)
        ids = torch.arange(nxt, nxt + blocks_per[b])
        table[b, : blocks_per[b]] = ids.to(torch.int32)
        k_cache.view(-1, m.num_kv_heads, m.head_dim)[nxt * V2_BLOCK_SIZE : nxt * V2_BLOCK_SIZE + n] = inputs.k_cache[slots]
        v_cache.view(-1, m.num_kv_heads, m.head_dim)[nxt * V2_BLOCK_SIZE : nxt * V2_BLOCK_SIZE + n] = inputs.v_cache[slots]
        nxt += blocks_per[b]
    # vLLM's v1/v2 layout: key [blocks, Hkv, D/x, block, x], value [blocks, Hkv, D, block].
    key = k_cache.view(total, V2_BLOCK_SIZE, m.num_kv_heads, m.head_dim // x, x).permute(0, 2, 3, 1, 4).contiguous().cuda()
    value = v_cache.permute(0, 2, 3, 1).contiguous().cuda()
    max_len = max(lens)
    parts = -(-max_len // V2_PARTITION_TOKENS)
    bs, hq = len(lens), m.num_qo_heads
    out = torch.empty(bs, hq, m.head_dim, dtype=dtype, device="cuda")
    exp_sums = torch.full((bs, hq, parts), float("nan"), dtype=torch.float32, device="cuda")
    max_logits = torch.full_like(exp_sums, float("nan"))
    tmp_out = torch.empty(bs, hq, parts, m.head_dim, dtype=dtype, device="cuda")
    args = (out, exp_sums, max_logits, tmp_out, inputs.q.cuda(), key, value, m.num_kv_heads, m.sm_scale,
            table.cuda(), batch.kv_lens.to(torch.int32).cuda(), V2_BLOCK_SIZE, max_len, None, "auto")  # fmt: skip
    # k_scale/v_scale are tensors in newer vLLM, floats in older: try both before giving up.
    one = torch.ones((), dtype=torch.float32, device="cuda")
    error = None
    for scale in (one, 1.0):
        try:
            ops.paged_attention_v2(*args, scale, scale)
            error = None
            break
        except (RuntimeError, TypeError) as e:
            error = f"vLLM paged_attention_v2 raised: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
    if error:
        return error
    # Partitions past a request's end hold no state; the LSE merges the rest in float64.
    used = torch.arange(parts)[None, :] < torch.tensor([-(-n // V2_PARTITION_TOKENS) for n in lens])[:, None]
    logits, sums = max_logits.double().cpu(), exp_sums.double().cpu()
    part_lse = torch.where(used[:, None, :], logits + torch.log(sums), torch.full_like(logits, float("-inf")))
    lse = torch.logsumexp(part_lse, dim=-1)
    result = AttentionResult(output=out.cpu(), lse=lse.float())
    lowp = reference.attention(trace, inputs, dtype)
    ref = reference.attention(trace, inputs, torch.float64)
    cmp = _compare(trace, result, ref, lowp)
    status = RunStatus.PASSED if cmp.passed else RunStatus.FAILED
    return runner.BackendRun("vllm", status, f"vLLM {getattr(ops, '__name__', '')} paged_attention_v2", comparison=cmp, result=result)


# -- empty states through our stage 2 -----------------------------------------------------------


CONTROL = "control: two non-empty splits"


@functools.cache
def stage2_probe(dv: int) -> dict[str, str | None]:
    """Our stage 2 on crafted partials; for each case None (right) or what went wrong.

    Rows: (0) 40 tokens in 4 splits, the two empty splits' scratch holding NaN outputs and -inf
    LSEs; (1) the same states with +inf LSEs in the empty splits (FA2's empty marker); (2) 0 tokens
    in 2 splits (every state empty); (3) the control, 64 tokens in 2 non-empty splits. Rows 0, 1
    and 3 must equal the float64 merge of their non-empty splits, row 2 must be 0 with LSE -inf.
    A failing control means the merge is wrong with or without empty states.
    """
    machine.select_triton_mode()
    from attndbg.backends.triton_kernels import decode

    device = machine.kernel_device()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1, PROBE_SPLITS, dv, generator=g)
    lse = torch.randn(4, 1, PROBE_SPLITS, generator=g) + 3.0
    used = PROBE_SPLITS - empty_splits(PROBE_LEN, PROBE_SPLITS)
    logits[1], lse[1] = logits[0], lse[0]  # the same states; only the empty splits' marker differs
    logits[:2, :, used:] = float("nan")
    lse[0, :, used:] = float("-inf")
    lse[1, :, used:] = float("inf")
    logits[2], lse[2] = float("nan"), float("-inf")
    lengths = [PROBE_LEN, PROBE_LEN, 0, 2 * SPLIT_TILE]
    splits = [PROBE_SPLITS, PROBE_SPLITS, 2, 2]
    o = torch.full((4, 1, dv), float("nan"), device=device)
    out_lse = torch.full((4, 1), float("nan"), device=device)
    decode.decode_stage2(
        attn_logits=logits.to(device),
        attn_lse=lse.to(device),
        o=o,
        lse=out_lse,
        kv_indptr=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        num_kv_splits=torch.tensor(splits, dtype=torch.int32, device=device),
        max_kv_splits=PROBE_SPLITS,
    )
    o, out_lse = o.cpu().double(), out_lse.cpu().double()
    cases = {}
    for row, name in ((3, CONTROL), (0, "empty splits marked -inf"), (1, "empty splits marked +inf (FA2's convention)")):
        n = splits[row] - empty_splits(lengths[row], splits[row])
        w = torch.softmax(lse[row, 0, :n].double(), dim=0)
        expected = (w[:, None] * logits[row, 0, :n].double()).sum(0)
        expected_lse = torch.logsumexp(lse[row, 0, :n].double(), dim=0)
        err = float(torch.nan_to_num((o[row, 0] - expected).abs(), nan=float("inf")).max())
        lse_err = float(torch.nan_to_num((out_lse[row, 0] - expected_lse).abs(), nan=float("inf")))
        ok = err <= 1e-5 and lse_err <= 1e-5
        cases[name] = None if ok else f"output off by {err:.3e}, LSE {float(out_lse[row, 0]):.4f} (expected {float(expected_lse):.4f})"
    zero_ok = bool((o[2] == 0).all()) and bool(torch.isneginf(out_lse[2]).all())
    cases["every split empty (no KV)"] = None if zero_ok else f"output {o[2, 0, :4].tolist()}..., LSE {out_lse[2].tolist()} (expected 0 and -inf)"
    return cases


def empty_split_merge(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    if trace.batch.forward_mode is not ForwardMode.DECODE or "triton" not in ctx.backends():
        return []
    configs, lengths = split_configs(trace)
    short = [(b, c) for c in configs for b, n in enumerate(lengths) if empty_splits(n, c.splits[b]) > 0]
    graph = trace.graph
    no_kv = [b for b, n in enumerate(lengths) if n == 0]
    if graph is not None and graph.is_graph_replay:
        padded = graph.padded_seq_lens[trace.batch.batch_size : graph.capture_bs]
        no_kv += [trace.batch.batch_size + i for i in torch.nonzero(padded == 0).flatten().tolist()]
    if not short and not no_kv:
        return []
    cases = stage2_probe(trace.model.v_head_dim)
    if cases[CONTROL] is not None:
        return []  # the merge is wrong without any empty state: the split-count runs report that
    findings = []
    for case, problem in cases.items():
        if problem is None:
            continue
        reached = no_kv[:1] if case.startswith("every split") else [b for b, _ in short[:1]]
        if not reached:
            continue
        b = reached[0]
        how = "a padded or empty request" if case.startswith("every split") else f"request {b} (kv {lengths[b]}) under {short[0][1].label}"
        findings.append(
            Finding(
                KIND,
                "empty-split-merge",
                _location(ctx, request=b),
                f"our stage 2 on crafted partials, case '{case}': {problem}; this step reaches the case at {how}",
                "The split merge does not skip empty states: exp(-inf - -inf) (or an FA2 +inf marker) enters the "
                "weights and the merged row becomes NaN (FlashInfer #4051).",
                data={"case": case, "problem": problem},
            )
        )
    return findings


# -- the engine's recorded tensors ---------------------------------------------------------------


@dataclass(frozen=True)
class _Truth:
    inputs: AttentionInputs
    ref: AttentionResult
    lowp: AttentionResult


def recorded_tensors(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    layers = [ctx.options.layer] if ctx.options.layer is not None else sorted(trace.tensors)
    findings = []
    for layer in layers:
        recorded = trace.tensors.get(layer)
        if recorded is None or (recorded.output is None and recorded.lse is None):
            continue
        inputs = build_inputs(trace, layer=layer)
        truth = _Truth(inputs, reference.attention(trace, inputs, torch.float64), reference.attention(trace, inputs, DTYPES[trace.model.q_dtype]))
        skip_rows = torch.zeros(trace.batch.num_tokens, dtype=torch.bool)
        if recorded.output is not None:
            out_findings, skip_rows = _output_findings(ctx, layer=layer, output=recorded.output, truth=truth)
            findings += out_findings
        if recorded.lse is not None:
            findings += _lse_findings(ctx, layer=layer, lse=recorded.lse, base=recorded.lse_base, truth=truth, skip_rows=skip_rows)
    return findings


def _compare(trace: Trace, result: AttentionResult, ref: AttentionResult, lowp: AttentionResult) -> Comparison:
    return compare(
        output=result.output,
        lse=result.lse,
        reference_output=ref.output,
        reference_lse=ref.lse,
        lowp_output=lowp.output,
        lowp_lse=lowp.lse,
        dtype=DTYPES[trace.model.q_dtype],
        qo_indptr=trace.batch.qo_indptr,
    )


def _request_of(trace: Trace, row: int) -> int:
    return int(torch.searchsorted(trace.batch.qo_indptr, torch.tensor(row), right=True)) - 1


def engine_splits(trace: Trace) -> tuple[list[int], list[int], str]:
    """Per request: KV length and num_kv_splits the engine's split kernel used, and the source."""
    plan, bs = trace.plan, trace.batch.batch_size
    if plan is not None and "num_kv_splits" in plan.tensors and "kv_indptr" in plan.tensors:
        lengths = plan.tensors["kv_indptr"].to(torch.int64).diff()[:bs].tolist()
        return lengths, plan.tensors["num_kv_splits"][:bs].tolist(), "the recorded plan's num_kv_splits"
    window = trace.model.sliding_window
    lengths = [min(int(n), window + 1) if window >= 0 else int(n) for n in trace.batch.kv_lens]
    return lengths, [DEFAULT_MAX_KV_SPLITS] * bs, f"no recorded split plan: SGLang's graph default of {DEFAULT_MAX_KV_SPLITS}"


def _output_findings(ctx: CheckContext, *, layer: int, output: Tensor, truth: _Truth) -> tuple[list[Finding], Tensor]:
    trace = ctx.trace
    cmp = _compare(trace, AttentionResult(output, truth.ref.lse), truth.ref, truth.lowp)
    nonfinite_rows = (~torch.isfinite(output.double())).flatten(1).any(1) & torch.isfinite(truth.ref.output).flatten(1).all(1)
    if cmp.passed:
        return [], nonfinite_rows
    findings = []
    path = merge_path(trace)
    where = Location(step=ctx.step, layer=layer)
    if bool(nonfinite_rows.any()):
        rows = torch.nonzero(nonfinite_rows).flatten().tolist()
        requests = sorted({_request_of(trace, r) for r in rows})
        first = replace(where, request=requests[0], row=rows[0])
        explained = False
        if trace.batch.forward_mode is ForwardMode.DECODE:
            lengths, splits, source = engine_splits(trace)
            hit = [b for b in requests if empty_splits(lengths[b], splits[b]) > 0]
            if hit:
                b = hit[0]
                explained = True
                findings.append(
                    Finding(
                        KIND,
                        "empty-split-nan",
                        replace(where, request=b, row=int(trace.batch.qo_indptr[b])),
                        f"the engine's output has NaN/Inf in {len(rows)} rows of requests {requests} where the reference is "
                        f"finite; request {b}: kv {lengths[b]}, {splits[b]} splits ({source}) of "
                        f"{split_length(lengths[b], splits[b])} tokens, {empty_splits(lengths[b], splits[b])} of them empty",
                        "Requests shorter than the split tile x num_kv_splits have empty splits, and the engine's merge "
                        "combined their -inf LSEs as exp(-inf - -inf) = NaN instead of skipping them (FlashInfer #4051).",
                        data={"rows": rows[:32], "requests": requests, "lengths": lengths, "splits": splits},
                    )
                )
        if not explained and path:
            findings.append(
                Finding(
                    KIND,
                    "recorded-output-nonfinite",
                    first,
                    f"the engine's output has NaN/Inf in {len(rows)} rows of requests {requests} where the reference is finite",
                    f"A non-finite partial state reached the merge of this path ({path}).",
                    data={"rows": rows[:32], "requests": requests},
                )
            )
    failing = (cmp.row_errors > 1).any(1) & ~nonfinite_rows
    if bool(failing.any()):
        confusion = _merge_confusion(trace, output=output, truth=truth, rows=~nonfinite_rows)
        rows = torch.nonzero(failing).flatten().tolist()
        worst_row = rows[int(torch.argmax(cmp.row_errors[failing].amax(1)))]
        spot = replace(where, request=_request_of(trace, worst_row), row=worst_row)
        if confusion is not None:
            part, factor = confusion
            ratio = "log2 e" if factor == LOG2E else "ln 2"
            reading = "a base-2 LSE read as natural log" if factor == LOG2E else "a natural-log LSE read as base 2"
            findings.append(
                Finding(
                    KIND,
                    "merge-lse-base-confusion",
                    spot,
                    f"the engine's output fails the reference in {len(rows)} rows (max abs {cmp.max_abs:.3e}) but matches, "
                    f"within tolerance, the merge of the prefix and new-token partials with the {part} partial's LSE x {ratio}",
                    f"The {part} partial's LSE entered the merge as {reading} (FlashInfer writes base-2 LSEs, merge code "
                    "expected natural log: FlashInfer #2113, SGLang #40903), mis-weighting the two parts.",
                    data={"part": part, "factor": factor, "rows": rows[:32]},
                )
            )
        elif path:
            findings.append(
                Finding(
                    KIND,
                    "recorded-output-mismatch",
                    spot,
                    f"the engine's output fails the reference in {len(rows)} rows (max abs {cmp.max_abs:.3e}, worst {cmp.worst})",
                    f"This step's path merges partial states ({path}); no single LSE rescaling explains the error.",
                    data={"rows": rows[:32], "max_abs": cmp.max_abs},
                )
            )
    return findings, nonfinite_rows


def _partials(trace: Trace, inputs: AttentionInputs, b: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Request b's prefix partial (columns before its prefix length) and new-token partial, float64:
    outputs [e, Hq, Dv] and natural-log LSEs [e, Hq] (-inf where a part has no visible key)."""
    model, batch = trace.model, trace.batch
    qo = batch.qo_indptr
    rows = slice(int(qo[b]), int(qo[b + 1]))
    slots = batch.request_slots(b)
    group = model.gqa_group
    q = inputs.q[rows].double()
    k = inputs.k_cache[slots].double().repeat_interleave(group, dim=1)
    v = inputs.v_cache[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * model.sm_scale
    if model.logit_cap > 0:
        scores = model.logit_cap * torch.tanh(scores / model.logit_cap)
    visible = visibility(trace, b)
    prefix = int(batch.prefix_lens[b])
    cols = torch.arange(visible.shape[1])
    parts = []
    for part in (cols < prefix, cols >= prefix):
        masked = scores.masked_fill(~(visible & part[None, :])[None], float("-inf"))
        lse = torch.logsumexp(masked, dim=-1)
        probs = torch.nan_to_num(torch.exp(masked - lse[..., None]), nan=0.0)
        parts += [torch.einsum("hqk,khd->qhd", probs, v), lse.T]
    return tuple(parts)


def _merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tensor:
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b).clamp_min(1e-300)[..., None]


def _merge_confusion(trace: Trace, *, output: Tensor, truth: _Truth, rows: Tensor) -> tuple[str, float] | None:
    """('prefix'|'new-token', factor) when rescaling that partial's LSE by the factor before the
    merge reproduces the engine's output on every one of `rows` (called where the correct merge
    does not)."""
    batch = trace.batch
    if batch.forward_mode is ForwardMode.DECODE or batch.selective:
        return None
    cached = [b for b in range(batch.batch_size) if int(batch.prefix_lens[b]) > 0 and int(batch.extend_lens[b]) > 0]
    if not cached:
        return None
    ref, lowp = truth.ref.output.double(), truth.lowp.output.double()
    magnitude = ref.abs().amax(-1)
    floor = OUTPUT_FLOOR.get(DTYPES[trace.model.q_dtype], OUTPUT_FLOOR[torch.bfloat16])
    tol = ERROR_FACTOR * (lowp - ref).abs().amax(-1) + floor * magnitude.clamp_min(1.0)
    partials = {b: _partials(trace, truth.inputs, b) for b in cached}
    qo = batch.qo_indptr
    out = output.double()
    for part, index in (("prefix", 1), ("new-token", 3)):
        for factor in (LOG2E, LN2):
            candidate = ref.clone()
            for b, p in partials.items():
                scaled = list(p)
                scaled[index] = p[index] * factor
                candidate[int(qo[b]) : int(qo[b + 1])] = _merge(*scaled)
            err = torch.nan_to_num((out - candidate).abs().amax(-1), nan=float("inf"))
            if bool((err <= tol)[rows].all()):
                return part, factor
    return None


def _lse_findings(ctx: CheckContext, *, layer: int, lse: Tensor, base: LseBase, truth: _Truth, skip_rows: Tensor) -> list[Finding]:
    trace = ctx.trace
    ref = truth.ref.lse.double()
    natural = lse.double() * (LN2 if base is LseBase.TWO else 1.0)
    empty = torch.isneginf(ref)
    # FlashAttention-2 marks a row without keys with +inf: the same empty state, spelled differently.
    fa2_empty = empty & torch.isposinf(natural)
    natural = torch.where(fa2_empty, torch.full_like(natural, float("-inf")), natural)
    low = truth.lowp.lse.double()
    floor = LSE_FLOOR.get(DTYPES[trace.model.q_dtype], LSE_FLOOR[torch.bfloat16])
    tol = ERROR_FACTOR * torch.where(torch.isfinite(low), (low - ref).abs(), torch.zeros_like(ref)) + floor
    considered = ~skip_rows[:, None].expand_as(ref)
    finite = torch.isfinite(ref) & torch.isfinite(natural) & considered

    def explained(factor: float) -> Tensor:
        return (empty & torch.isneginf(natural)) | (finite & ((natural - factor * ref).abs() <= tol * factor))

    bad = considered & ~explained(1.0)
    if not bool(bad.any()):
        return []
    where = Location(step=ctx.step, layer=layer)
    row, head = (int(i) for i in torch.nonzero(bad)[0])
    spot = replace(where, request=_request_of(trace, row), row=row, head=head)
    label = "base 2" if base is LseBase.TWO else "natural log"
    data = {"lse_base": base.value, "fa2_empty_rows": int(fa2_empty.any(1).sum()), "bad": int(bad.sum())}
    for factor, name, reading, cause in (
        (LOG2E, "log2 e", "LSE in base 2 treated as natural", "the LSE is a base-2 value (FlashInfer's kernels write base 2) recorded or merged as natural log"),
        (LN2, "ln 2", "natural LSE treated as base 2", "a natural-log LSE was converted as if it were base 2 (x ln 2 once too often, or labelled base 2)"),
    ):
        if not bool((considered & ~explained(factor)).any()):
            fitted = float((natural[finite] * ref[finite]).sum() / (ref[finite] ** 2).sum().clamp_min(1e-300))
            return [
                Finding(
                    KIND,
                    "lse-base-confusion",
                    spot,
                    f"the engine's LSE (labelled {label}) / the reference LSE = {fitted:.4f} over {int(finite.sum())} "
                    f"row-heads, = {name} ({factor:.4f}) within tolerance: {reading}",
                    f"{reading[0].upper() + reading[1:]}: {cause}; merges weighted by it mix partial states wrongly "
                    "(FlashInfer #2113, SGLang #40903).",
                    data={**data, "ratio": fitted, "factor": factor},
                )
            ]
    ref_v, got = float(ref[row, head]), float(natural[row, head])
    return [
        Finding(
            KIND,
            "recorded-lse-mismatch",
            spot,
            f"the engine's LSE (labelled {label}) differs from the reference in {int(bad.sum())} row-heads "
            f"(first row {row} head {head}: {got:.4f} natural vs {ref_v:.4f}); no base factor explains it",
            "The LSE the engine produced (the weight of its partial states in any merge) is wrong for these rows.",
            data={**data, "recorded": got, "reference": ref_v},
        )
    ]


# -- GPU: FlashInfer cascade and merge_state, merges under graph capture ---------------------------


def _flashinfer_ready(ctx: CheckContext) -> bool:
    return "flashinfer" in ctx.backends()


def cascade_vs_single_pass(ctx: CheckContext) -> list[Finding]:
    """FlashInfer's cascade (ragged + paged prefix merged) against one paged pass, both against the reference."""
    trace, batch = ctx.trace, ctx.trace.batch
    if (
        batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED)
        or batch.selective
        or trace.model.sliding_window >= 0
        or not bool((batch.prefix_lens > 0).any())
        or not _flashinfer_ready(ctx)
    ):
        return []
    from attndbg.backends.flashinfer import FlashInferBackend, FlashInferOptions

    inputs = build_inputs(trace, layer=ctx.options.layer)
    ref = reference.attention(trace, inputs, torch.float64)
    lowp = reference.attention(trace, inputs, DTYPES[trace.model.q_dtype])
    runs = {}
    for path in ("cascade", "paged"):
        backend = FlashInferBackend(FlashInferOptions(extend_path=path))
        try:
            result = backend.run(trace, to_device(inputs, "cuda"), backend.derive_plan(trace))
        except KernelError as e:
            runs[path] = str(e)
            continue
        runs[path] = _compare(trace, AttentionResult(result.output.cpu(), result.lse.cpu()), ref, lowp)
    cascade, paged = runs["cascade"], runs["paged"]
    if isinstance(cascade, str) or cascade.passed or isinstance(paged, str) or not paged.passed:
        return []
    worst = cascade.worst
    empty_prefix = worst is not None and int(batch.prefix_lens[worst.request]) == 0
    return [
        Finding(
            KIND,
            "cascade-vs-single-pass",
            _location(ctx, worst),
            f"FlashInfer cascade: {cascade.failing_rows}/{cascade.total_rows} rows fail the reference (max abs "
            f"{cascade.max_abs:.3e}, worst {worst}); one paged pass over the same KV passes (max abs {paged.max_abs:.3e})"
            + (f"; request {worst.request} has an empty prefix" if empty_prefix else ""),
            "The merge of the ragged and paged partial states is wrong"
            + (": the empty prefix state (-inf LSE) is not neutral in merge_state." if empty_prefix else "."),
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
    problems = merge_state_probe(DTYPES[trace.model.q_dtype] if trace.model.q_dtype != "float32" else torch.float16)
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


@functools.cache
def merge_state_probe(dtype: torch.dtype) -> dict[str, str | None]:
    """FlashInfer's merge_state (base-2 LSEs) on crafted states; None per case when right."""
    import flashinfer

    g = torch.Generator().manual_seed(0)
    heads, dim = 2, 128
    v = torch.randn(3, heads, dim, generator=g).to(dtype)
    s = torch.randn(3, heads, generator=g) + 3.0
    v_a, s_a, v_b, s_b = v.clone(), s.clone(), v.flip(0).clone(), s.flip(0).clone()
    s_b[0] = float("-inf")  # row 0: state + empty
    s_a[1], s_b[1] = float("-inf"), float("-inf")  # row 1: empty + empty
    s_a[2] = float("inf")  # row 2: FA2's empty marker + state
    out, lse = flashinfer.cascade.merge_state(v_a.cuda(), s_a.cuda(), v_b.cuda(), s_b.cuda())
    out, lse = out.float().cpu(), lse.float().cpu()
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
    options = ReplayOptions(layer=ctx.options.layer, cuda_graph=True, graph_capture=True)
    findings = []
    for run in ctx.replay(options).runs:
        if not run.variant.startswith("graph") or run.status is not RunStatus.FAILED:
            continue
        if run.graph is None or run.graph.eager_bitwise_equal:
            continue
        stale = [f"graph replay differs from the same step run eagerly (max abs {run.graph.eager_max_abs:.3e})"]
        findings.append(
            Finding(
                KIND,
                "merge-off-capture-stream",
                _location(ctx, run.comparison.worst if run.comparison else None),
                f"{run.name} {run.variant}: {stale[0]}",
                f"The graph's output differs from the same plan and buffers run eagerly on a path with a merge ({merge_path(trace)}): "
                "a kernel of it (typically the merge) ran outside the captured stream, so replays return its stale result (SGLang #5404).",
                data={"backend": run.name},
            )
        )
    return findings
