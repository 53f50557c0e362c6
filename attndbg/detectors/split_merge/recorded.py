"""split-merge on the engine's recorded tensors: output and LSE against the reference, LSE base
confusion (log2 e / ln 2), FA2's +inf empty marker, NaN rows of requests with empty splits, and
finite wrong outputs attributed by reproduction (attndbg/diagnose): the mistake models whose
float64 output equals the engine's are named with their parameters (a merge of the prefix and
new-token partials with their LSEs (one or both) in the wrong base keeps its own check,
merge-lse-base-confusion).

An engine output that fails the reference on a path without any merge is still reported (as
`recorded-output-mismatch` / `-nonfinite`): the recorded tensors are the engine's own result, and a
user must never get a clean report for a step whose output is wrong. When no model reproduces it,
the finding says so and names the models tried: no guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.backends.engine_names import merge_path
from attndbg.backends.triton_kernels.split_rule import empty_splits, split_length
from attndbg.compare.tolerance import ERROR_FACTOR, LSE_FLOOR, compare_to_reference
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, Location
from attndbg.detectors.split_merge.base import KIND, _request_of
from attndbg.diagnose import Reproduction, applicable, diagnose
from attndbg.diagnose.split_models import PrefixMergeLseBase, engine_splits, merged_lses
from attndbg.numerics import LN2, LOG2E
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import DTYPES, ForwardMode, LayerTensors, LseBase, Trace


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
        if recorded is None or (recorded.output is None and recorded.lse is None) or not kv_rows_cover(trace, recorded):
            continue
        data = ctx.data(layer)
        truth = _Truth(data.on("cpu"), data.reference, data.lowp)
        skip_rows = torch.zeros(trace.batch.num_tokens, dtype=torch.bool)
        if recorded.output is not None:
            out_findings, skip_rows = _output_findings(ctx, layer=layer, output=recorded.output, truth=truth, data=data)
            findings += out_findings
        if recorded.lse is not None:
            findings += _lse_findings(ctx, layer=layer, lse=recorded.lse, base=recorded.lse_base, truth=truth, skip_rows=skip_rows)
    return findings


def kv_rows_cover(trace: Trace, recorded: LayerTensors) -> bool:
    """The recorded KV rows hold every slot the step reads besides its own new tokens. A layer
    recorded by in-graph probes (a CUDA-graph replay: q, new k/v and output, no KV rows; see
    attndbg/record/probes.py) does not: the reference would attend over drawn values, not the
    engine's, so its output is not compared."""
    batch = trace.batch
    prefix = batch.slot_ids[~torch.isin(batch.slot_ids, batch.out_cache_loc)]
    return bool(torch.isin(prefix, recorded.kv_slots).all())


def _output_findings(ctx: CheckContext, *, layer: int, output: Tensor, truth: _Truth, data: StepData) -> tuple[list[Finding], Tensor]:
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
        rows = torch.nonzero(failing).flatten().tolist()
        worst_row = rows[int(torch.argmax(cmp.row_errors[failing].amax(1)))]
        spot = replace(where, request=_request_of(trace, worst_row), row=worst_row)
        findings.append(_mismatch(ctx, data, output=output, judged=~nonfinite_rows, rows=rows, spot=spot, max_abs=cmp.max_abs, worst=str(cmp.worst)))
    return findings, nonfinite_rows


def _mismatch(ctx: CheckContext, data: StepData, *, output: Tensor, judged: Tensor, rows: list[int], spot: Location, max_abs: float, worst: str) -> Finding:
    """The engine's output fails the reference on finite rows: attributed to the mistake models that
    reproduce it (attndbg/diagnose), or said to be reproduced by none."""
    trace = ctx.trace
    path = merge_path(trace)
    found = diagnose(data, output, rows=judged, plan=ctx.plan())
    requests = sorted({_request_of(trace, r) for r in rows})
    data_out = {"rows": rows[:32], "requests": requests, "max_abs": max_abs, "reproductions": [r.to_json() for r in found]}
    merged = _prefix_merge_base(found, rows)
    if merged is not None:
        part, factor = merged.params[0]["part"], merged.params[0]["factor"]
        ratio = "log2 e" if factor == LOG2E else "ln 2"
        reading = "base-2 LSEs read as natural log" if factor == LOG2E else "natural-log LSEs read as base 2"
        lses = merged_lses(part)
        return Finding(
            KIND,
            "merge-lse-base-confusion",
            spot,
            f"the engine's output fails the reference in {len(rows)} rows (max abs {max_abs:.3e}) but matches, "
            f"within tolerance, the merge of the prefix and new-token partials with {lses} x {ratio}",
            f"{lses[0].upper() + lses[1:]} entered the merge as {reading} (FlashInfer writes base-2 LSEs, merge code "
            "expected natural log: FlashInfer #2113, SGLang #40903), mis-weighting the two parts.",
            data={**data_out, "part": part, "factor": factor},
        )
    evidence = f"the engine's output fails the reference in {len(rows)} rows of requests {requests} (max abs {max_abs:.3e}, worst {worst})"
    if found:
        explained = {r for rep in found for r in rep.rows}
        reproduced = "; ".join(f"the engine's output equals {rep.describe()}" for rep in found[:3])
        rest = f" ({len(rows) - len(explained & set(rows))} failing rows not reproduced)" if not set(rows) <= explained else ""
        return Finding(KIND, "recorded-output-mismatch", spot, f"{evidence}; reproduced: {reproduced}{rest}", found[0].cause, data=data_out)
    tried = [m.name for m in applicable(trace)]
    cause = f"This step's path merges partial states ({path}); none of the known merge or metadata mistakes reproduces the error." if path else _NO_MERGE_CAUSE
    data_out["models_tried"] = tried
    return Finding(
        KIND,
        "recorded-output-mismatch",
        spot,
        f"{evidence}; no known mistake model reproduces it (tried: {', '.join(tried) or 'none applies to this step'})",
        cause,
        data=data_out,
    )


def _prefix_merge_base(found: list[Reproduction], rows: list[int]) -> Reproduction | None:
    """The one prefix-merge LSE-base reproduction that explains every failing row alone (the
    detector's named merge-lse-base-confusion finding), if that is what was found."""
    hits = [r for r in found if r.mechanism == PrefixMergeLseBase.name and set(rows) <= set(r.rows)]
    return hits[0] if hits else None


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
