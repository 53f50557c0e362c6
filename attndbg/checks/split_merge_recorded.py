"""split-merge on the engine's recorded tensors: output and LSE against the reference, LSE base
confusion (log2 e / ln 2), FA2's +inf empty marker, NaN rows of requests with empty splits, and a
merge mis-weighted by one partial's LSE.

An engine output that fails the reference on a path without any merge is still reported (as
`recorded-output-mismatch` / `-nonfinite`): the recorded tensors are the engine's own result, and a
user must never get a clean report for a step whose output is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.backends.triton import DEFAULT_MAX_KV_SPLITS
from attndbg.checks.context import CheckContext
from attndbg.checks.findings import Finding, Location
from attndbg.checks.split_merge_base import KIND, LN2, LOG2E, _request_of, empty_splits, merge_path, split_length
from attndbg.compare.tolerance import ERROR_FACTOR, LSE_FLOOR, compare_to_reference, output_tolerance
from attndbg.trace.schema import DTYPES, ForwardMode, LseBase, Trace


_NO_MERGE_CAUSE = (
    "No partial states are merged on this path, so the engine's kernel, or the lengths, KV slots or mask "
    "it was given, disagree with the batch; `attndbg replay --plan recorded` shows whether the recorded "
    "plan reproduces it."
)


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
        data = ctx.data(layer)
        truth = _Truth(data.on("cpu"), data.reference, data.lowp)
        skip_rows = torch.zeros(trace.batch.num_tokens, dtype=torch.bool)
        if recorded.output is not None:
            out_findings, skip_rows = _output_findings(ctx, layer=layer, output=recorded.output, truth=truth)
            findings += out_findings
        if recorded.lse is not None:
            findings += _lse_findings(ctx, layer=layer, lse=recorded.lse, base=recorded.lse_base, truth=truth, skip_rows=skip_rows)
    return findings


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
    cmp = compare_to_reference(trace, AttentionResult(output, truth.ref.lse), truth.ref, truth.lowp)
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
        if not explained:
            findings.append(
                Finding(
                    KIND,
                    "recorded-output-nonfinite",
                    first,
                    f"the engine's output has NaN/Inf in {len(rows)} rows of requests {requests} where the reference is finite",
                    f"A non-finite partial state reached the merge of this path ({path})." if path else _NO_MERGE_CAUSE,
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
        else:
            requests = sorted({_request_of(trace, r) for r in rows})
            findings.append(
                Finding(
                    KIND,
                    "recorded-output-mismatch",
                    spot,
                    f"the engine's output fails the reference in {len(rows)} rows of requests {requests} (max abs {cmp.max_abs:.3e}, worst {cmp.worst})",
                    f"This step's path merges partial states ({path}); no single LSE rescaling explains the error." if path else _NO_MERGE_CAUSE,
                    data={"rows": rows[:32], "requests": requests, "max_abs": cmp.max_abs},
                )
            )
    return findings, nonfinite_rows


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
    ref = truth.ref.output.double()
    tol = output_tolerance(ref, truth.lowp.output, DTYPES[trace.model.q_dtype])
    # Each request's prefix partial (columns before its prefix) and new-token partial, float64,
    # from the reference's own partial states.
    zeros, prefix, kv = torch.zeros_like(batch.prefix_lens), batch.prefix_lens, batch.kv_lens
    prefix_part = reference.attention(trace, truth.inputs, torch.float64, columns=torch.stack([zeros, prefix], 1))
    new_part = reference.attention(trace, truth.inputs, torch.float64, columns=torch.stack([prefix, kv], 1))
    p = (prefix_part.output.cpu(), prefix_part.lse.cpu(), new_part.output.cpu(), new_part.lse.cpu())
    qo = batch.qo_indptr
    out = output.double()
    for part, index in (("prefix", 1), ("new-token", 3)):
        for factor in (LOG2E, LN2):
            candidate = ref.clone()
            scaled = list(p)
            scaled[index] = p[index] * factor
            merged = _merge(*scaled)
            for b in cached:
                candidate[int(qo[b]) : int(qo[b + 1])] = merged[int(qo[b]) : int(qo[b + 1])]
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
