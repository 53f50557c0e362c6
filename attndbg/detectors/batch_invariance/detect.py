"""batch-invariance: a request's output must not change when it is replayed alone or in a sub-batch.

TensorRT-LLM's split-consistency idea, applied to one recorded step: every kernel backend the check
exercises runs the whole batch once (the eager run every detector shares), then each request alone
(a batch of one, attndbg.trace.subbatch) and, for a batch of 4 or more, its two halves. A sub-batch
keeps its requests' KV slots in the step's own KV cache, their query/new-K/V rows, positions and
draft trees, and runs the plan the backend derives for the sub-batch, as an engine would build it
for that smaller batch. Each request's rows of the two runs are compared: a difference beyond the
step's output tolerance (attndbg.compare.tolerance, the same tolerance a run gets against the
float64 reference) is a finding naming the backend, the sub-batch, the requests, the largest
difference and the tolerance, and which run agrees with the float64 reference: two runs that
differ by more than the tolerance cannot both be within half of it of the reference.

Batch dependence within tolerance is legitimate and never reported: plans are chosen from the
batch (SGLang's Triton backend picks num_kv_splits from the batch size and the longest request,
FlashInfer's split-KV scheduler balances the batch over the SMs), so the same request is reduced
in another order in another batch and rounds differently. Removing that too, bit for bit, is what
SGLang's deterministic inference (sgl-project/sglang#10278) and vLLM's VLLM_BATCH_INVARIANT mode
(vllm-project/vllm#40173, batch-invariant backends) are for; this detector looks for the larger
dependence, a batch whose plan or scratch mixes requests.

Under --cuda-graph (decode and verify steps) the same comparison is made between graph replays:
the whole batch padded to its capture size against each sub-batch padded to its own (a request
alone replays the graph of a smaller capture size, as an engine would), each through the runner's
graph variant (replay/graph.py). Outputs are compared, not LSEs (the output is what the next layer
reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, FindingClass, finding
from attndbg.replay import graph as graph_replay
from attndbg.replay.runner import BackendRun, ReplayOptions, RunStatus
from attndbg.replay.step_data import StepData
from attndbg.replay.variants import Eager, Variant, run_name
from attndbg.trace.subbatch import SubBatch, sub_batch

KIND = FindingClass.BATCH_INVARIANCE
# Halves are run from this batch size on: below it the halves are (nearly) the requests alone.
HALVES_FROM = 4


@dataclass(frozen=True)
class Part:
    label: str  # how findings name it: "request 3 alone", "the first half (requests 0-2)"
    requests: tuple[int, ...]


def parts(batch_size: int) -> list[Part]:
    """The sub-batches a step of `batch_size` requests is replayed as: each request alone, and the
    two halves from HALVES_FROM requests on; none for a batch of one."""
    if batch_size < 2:
        return []
    out = [Part(f"request {b} alone", (b,)) for b in range(batch_size)]
    if batch_size >= HALVES_FROM:
        half = batch_size // 2
        out.append(Part(f"the first half (requests 0-{half - 1})", tuple(range(half))))
        out.append(Part(f"the second half (requests {half}-{batch_size - 1})", tuple(range(half, batch_size))))
    return out


def detect(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    if trace.batch.batch_size < 2 or not ctx.backends():
        return []
    graphs = ctx.options.cuda_graph and graph_replay.supports_graph(trace)
    # With graphs each run pads to its own batch's capture size (capture_bs None); without, the
    # options of the eager run every detector shares.
    options = ctx.graph_options() if graphs else ReplayOptions(layer=ctx.options.layer)
    # The whole batch: without graphs, the eager run the other detectors share (memoized by the context).
    whole = {_key(run): run for run in ctx.replay(options).runs if run.status in (RunStatus.PASSED, RunStatus.FAILED) and run.result is not None}
    if not whole:
        return []  # nothing ran: the step's own report says why
    data = ctx.data(ctx.options.layer)
    names = tuple(sorted({name for name, _ in whole}, key=ctx.backends().index))
    findings: list[Finding] = []
    for part in parts(trace.batch.batch_size):
        sub = sub_batch(trace, part.requests)
        # Through the context, as the whole batch: its adapters and --backend-option, each launch
        # announced with the part, so a kernel that crashes on a sub-batch is that step's crash.
        for run in ctx.replay_sub_batch(sub, options, names, part=part.label).runs:
            if _key(run) in whole:
                findings += _judge(ctx, data, part, sub, whole[_key(run)], run)
    return findings


def _key(run: BackendRun) -> tuple[str, type[Variant]]:
    """Which run of the whole batch a sub-batch's run is compared with: the same backend and kind
    of run (a graph of another capture size is still the graph run)."""
    return run.name, type(run.variant)


def _judge(ctx: CheckContext, data: StepData, part: Part, sub: SubBatch, whole: BackendRun, run: BackendRun) -> list[Finding]:
    bs = ctx.trace.batch.batch_size
    if run.status is RunStatus.ERROR:
        return [
            finding(
                KIND,
                "sub-batch-error",
                step=ctx.step,
                layer=ctx.options.layer,
                request=part.requests[0],
                evidence=f"{_named(run)}: {part.label} (requests {list(part.requests)}) failed where {_whole(whole, bs)} ran: {run.reason}",
                cause=f"The backend cannot run these requests without the rest of the batch of {bs}: its plan or kernel depends on the batch's composition.",
                backend=run.name,
                variant=run.variant.label,
                sub_batch=list(part.requests),
            )
        ]
    if run.result is None or run.comparison is None or whole.comparison is None:
        return []  # not run here (unsupported, unavailable): nothing to compare
    rows = sub.rows
    tol = data.output_tolerance()[rows]  # [t, Hq]
    diff = _difference(run.result.output, whole.result.output[rows])
    over = diff / tol
    if not bool((over > 1).any()):
        return []
    # Against the float64 reference, as a multiple of the same tolerance (>1 fails), per row/head.
    in_batch, in_part = whole.comparison.row_errors[rows], run.comparison.row_errors
    starts = sub.trace.batch.qo_indptr  # request k of the sub-batch has its rows starts[k]:starts[k+1]
    affected = {}
    for k, b in enumerate(part.requests):
        lo, hi = int(starts[k]), int(starts[k + 1])
        if bool((over[lo:hi] > 1).any()):
            affected[b] = {"request": b, "batch_error": float(in_batch[lo:hi].max()), "sub_batch_error": float(in_part[lo:hi].max())}
    i, head = divmod(int(torch.argmax(over)), over.shape[1])
    b, row = part.requests[_owner(starts, i)], int(rows[i])
    agrees = _agrees(affected[b])
    errors = ", ".join(f"request {a['request']} {a['batch_error']:.2f}x in the batch, {a['sub_batch_error']:.2f}x {_where(part)}" for a in affected.values())
    # --json is strict JSON: an infinite error (a NaN in one run only) is written "inf", as diff's JSON does.
    requests = [{key: _number(value) for key, value in a.items()} for a in affected.values()]
    evidence = (
        f"{_named(run)}: {part.label} differs from {_whole(whole, bs)} in requests {list(affected)} "
        f"by up to {float(diff.max()):.3e}; worst request {b} step row {row} head {head}: {float(diff[i, head]):.3e} "
        f"against tolerance {float(tol[i, head]):.3e} ({float(over[i, head]):.1f}x); error against the float64 reference "
        f"as a multiple of the tolerance: {errors}"
    )
    return [
        finding(
            KIND,
            "output-depends-on-batch",
            step=ctx.step,
            layer=ctx.options.layer,
            request=b,
            row=row,
            head=head,
            evidence=evidence,
            cause=_cause(b, part, bs, agrees),
            backend=run.name,
            variant=run.variant.label,
            batch_variant=whole.variant.label,
            sub_batch=list(part.requests),
            batch_size=bs,
            requests=requests,
            max_diff=_number(float(diff.max())),
            tolerance=float(tol[i, head]),
            agrees_with_reference=agrees,
        )
    ]


def _number(value: float | int) -> float | int | str:
    return value if math.isfinite(value) else str(value)


def _named(run: BackendRun) -> str:
    """'triton' for an eager run, 'triton graph bs=2 fill=1' for a graph replay."""
    return run_name(run.name, run.variant)


def _whole(run: BackendRun, bs: int) -> str:
    """'the whole batch of 3', and its graph's capture size and fill where it is a graph replay."""
    return f"the whole batch of {bs}" + ("" if isinstance(run.variant, Eager) else f" ({run.variant.label})")


def _difference(a: Tensor, b: Tensor) -> Tensor:
    """[t, Hq] largest |a - b| over the head's values: 0 where both hold the same value or both NaN,
    infinite where only one is NaN (a NaN that appears in one batch is a difference)."""
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return torch.nan_to_num((a - b).abs(), nan=float("inf")).masked_fill(same, 0.0).amax(-1)


def _owner(starts: Tensor, row: int) -> int:
    """Index within the sub-batch of the request whose rows hold sub-batch row `row`."""
    return int(torch.searchsorted(starts, torch.tensor(row), right=True)) - 1


def _where(part: Part) -> str:
    return "alone" if len(part.requests) == 1 else f"in {part.label}"


def _agrees(request: dict) -> str:
    """Which run of the request is within tolerance of the float64 reference."""
    batch_ok, part_ok = request["batch_error"] <= 1, request["sub_batch_error"] <= 1
    return {(True, True): "both", (True, False): "whole batch", (False, True): "sub-batch", (False, False): "neither"}[(batch_ok, part_ok)]


def _cause(b: int, part: Part, bs: int, agrees: str) -> str:
    where = _where(part)
    start = f"Request {b}'s output depends on what it is batched with: "
    if agrees == "sub-batch":
        return start + f"{where} it matches the float64 reference, in the batch of {bs} it does not, so the whole batch's plan or scratch mixes requests (a KV row, split or workspace slot taken from a neighbour)."
    if agrees == "whole batch":
        return start + f"in the batch of {bs} it matches the float64 reference, {where} it does not, so the plan built for the smaller batch is wrong (a path, split count or buffer chosen by batch size)."
    if agrees == "neither":
        return start + f"neither {where} nor in the batch of {bs} does it match the float64 reference, and the two runs are wrong differently."
    return start + "each run is within tolerance of the float64 reference, yet they differ by more than it: batch-dependent rounding larger than a same-dtype implementation commits (a reduction order or split count chosen by batch size)."
