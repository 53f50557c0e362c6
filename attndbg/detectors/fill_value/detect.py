"""fill-value: how the batch was padded for a CUDA graph, and what the padding does to the kernels.

Two halves (DESIGN.md "The detectors"):

  recorded padding  the trace's `graph` section (the runner's static buffers) and recorded plan,
                    read without running anything: padded seq_lens a backend cannot take, padded
                    tokens writing KV outside the dummy slot, `seq_lens_sum` that ignores padding,
                    indptrs whose padded entries decrease, stale padded req_pool_indices/positions.
  padded replays    the step replayed in a graph (captured where a GPU is present, else the same
                    sequence run eagerly on the static buffers) at the recorded capture size with
                    the engine's recorded fill value and with each backend's own; without a
                    recorded graph, at the next SGLang capture size with each backend's fill value.
                    Findings: padded rows that are not finite, KV writes outside the dummy slot,
                    a replay that raises, and real rows that are right eagerly but wrong padded.

When stale padded values are harmless, and so are not reported: a padded req_pool_index whose
padded seq_len is 0 (nothing is read through it), or that is the row of a live request of this
batch at least as long as the padded seq_len (the backend reads that row's first slot ids, which
are valid); any padded req_pool_index or position of a vLLM step (vLLM has no request pool and
leaves positions stale by design, engines.md B5; each engine's conventions:
attndbg/trace/engines.py). Zero is what SGLang's newer runner writes. Other non-zero values are
hazards: a row that no live request holds may never have been written (req_to_token allocated
with torch.empty, SGLang #1779), and stale positions broke FlashInfer's
verify plan (SGLang #24361: a defect on a FlashInfer verify step, whose plan reads them). A row id
outside any plausible request pool is a defect when it is read (padded seq_len >= 1):
req_to_token is read out of bounds. A step that records no padded req_pool_indices (None: the
engine has no request pool) has none of these judged: nothing stands in for them.

Severity (detector_api/findings.py `Severity`): padded rows are independent of real ones in every
attention kernel here, so what only the padded rows get wrong is a hazard: a padded seq_len the
kernel cannot take (0 for FlashInfer: NaN padded rows, FlashInfer #2883; vLLM pads with 0 by its
own convention), stale padded seq_lens, row ids and positions nothing reads, NaN/Inf in padded
rows. Each says when it would hurt: a later op that mixes rows, a stale row id that stops holding
valid slot ids. What makes this step wrong is a defect: KV written outside the dummy slot,
offsets or sums that make a kernel read past its buffers, a padded replay that raises, real rows
that the padding changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attndbg.backends import engine_names
from attndbg.backends.base import FillRequirement
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, FindingClass, Severity, finding
from attndbg.detectors.fill_value import requirements
from attndbg.plans.reading import PlanReading, read
from attndbg.replay import graph as graph_replay
from attndbg.replay.runner import BackendRun, RunStatus
from attndbg.replay.variants import Eager, Graph
from attndbg.trace.engines import draft_decode, engine_conventions
from attndbg.trace.offsets import first_decrease
from attndbg.trace.schema import ForwardMode, Trace

KIND = FindingClass.FILL_VALUE
DEFECT, HAZARD = Severity.DEFECT, Severity.HAZARD
# What a padded token's out_cache_loc may hold: SGLang zeroes it (slot 0 is reserved "for writing
# dummy outputs from padded tokens"), vLLM sets -1 (the KV write is skipped).
DUMMY_SLOTS = (0, -1)
# No engine keeps a request pool of a million rows (SGLang's is max_running_requests, thousands at
# most; a req_to_token of 2^20 rows x 4096 int32 columns is 16 GiB): a padded row id at or above
# this is garbage, wherever the pool ends.
IMPLAUSIBLE_POOL_ROWS = 1 << 20


def requirement(backend: str, kv_dtype: str | None = None) -> FillRequirement | None:
    """What the engine backend `backend` (trace.source.backend) needs of padded rows, with a KV
    cache of `kv_dtype`: the capability its adapter declares, or backends/engine_names.py's table
    for one without an adapter."""
    return engine_names.fill_requirement(backend, kv_dtype)


def requirements_summary(trace: Trace) -> str:
    """'flashinfer >= 1, fa3 >= 0, triton >= 0': what attndbg's backends that can run this step
    need of padded rows (engine_names.step_requirements), by attndbg's names."""
    return ", ".join(f"{name} >= {r.min_seq_len}" for name, r in engine_names.step_requirements(trace).items()) or "no attndbg backend runs this step"


def detect(ctx: CheckContext) -> list[Finding]:
    replayed, outcomes, needs = padded_replays(ctx)
    engine = engine_names.adapter_for(ctx.trace.source.backend)
    engine_name = engine.name if engine is not None else None
    recorded = [requirements.confirmed(f, outcomes, engine_name) for f in recorded_padding(ctx.trace, ctx.plan())]
    return recorded + replayed + requirements.contradictions(ctx.trace, outcomes, needs)


# -- recorded padding -------------------------------------------------------------------------


def recorded_padding(trace: Trace, reading: PlanReading | None = None) -> list[Finding]:
    """Findings from the recorded graph section and plan alone (no kernel runs); `reading`: the
    step's plan reading (default: read here)."""
    graph, batch = trace.graph, trace.batch
    if graph is None or not graph.is_graph_replay:
        return []
    bs, cap = batch.batch_size, graph.capture_bs
    if cap <= bs:
        # No padded request (a capture size below the batch is the invariants detector's), but vLLM's
        # uniform decode pads tokens past query_start_loc[-1] without padded rows: their slots are
        # still written.
        return _padded_out_cache_loc(trace) if graph.padded_out_cache_loc.numel() > batch.num_tokens else []
    reading = reading if reading is not None else read(trace)
    return (
        _padded_seq_lens(trace, reading)
        + _padded_out_cache_loc(trace)
        + _seq_lens_sum(trace)
        + _padded_indptrs(trace, reading)
        + _padded_req_pool_indices(trace)
        + _padded_positions(trace)
    )


def _graded(trace: Trace, check: str, evidence: str, cause: str, *, severity: Severity = DEFECT, data: dict | None = None, **where) -> Finding:
    """A fill-value finding of `severity` (a hazard's cause states when it would hurt)."""
    return finding(KIND, check, step=trace.source.step, evidence=evidence, cause=cause, severity=severity, **where, **(data or {}))


def _padded_seq_lens(trace: Trace, reading: PlanReading) -> list[Finding]:
    graph, bs = trace.graph, trace.batch.batch_size
    padded = graph.padded_seq_lens[bs : graph.capture_bs].tolist()
    backend = trace.source.backend
    need = requirement(backend, trace.model.kv_dtype)
    findings = []
    # What the kernel gets: the builder's own seq_lens where the engine records them (it may clamp
    # the runner's padding), else the runner's static buffer.
    given, field = padded, "graph.padded_seq_lens"
    kernel = reading.kernel_seq_lens
    if kernel is not None and kernel[1].numel() >= graph.capture_bs:
        given, field = kernel[1][bs : graph.capture_bs].tolist(), f"plan.{kernel[0]}"
    if need is not None:
        bad = [(bs + i, n) for i, n in enumerate(given) if n < need.min_seq_len]
        if bad:
            row, value = bad[0]
            # A negative length makes the kernel's offsets decrease (reads before a request's KV),
            # and a kernel declared to read out of bounds below its minimum does (FlashMLA's FP8
            # decode at seq_len 0): defects. Otherwise a short length (0) reads nothing: only the
            # padded rows' own output is at stake.
            negative = any(n < 0 for _, n in bad) or need.out_of_bounds
            findings.append(
                _graded(
                    trace,
                    "padded-seq-len-unsupported",
                    f"{len(bad)} of {len(padded)} padded requests have seq_len < {need.min_seq_len} "
                    f"(first: {field}[{row}] = {value}; graph.fill_value = {graph.fill_value}); "
                    f"the step ran on {backend}, which needs >= {need.min_seq_len}. attndbg's backends for this step need: {requirements_summary(trace)}",
                    f"The graph runner padded with a fill value {backend} cannot take: {need.why}."
                    + (
                        ""
                        if negative
                        else " The real rows do not read the padded ones; this hurts where a later op mixes padded rows into real"
                        " ones (a per-batch reduction), or where the kernel faults on it, which this detector's padded replay at the"
                        " recorded fill shows wherever the backend runs."
                    ),
                    severity=DEFECT if negative else HAZARD,
                    request=row,
                    field=f"{field}[{row}]",
                    data={"backend": backend, "min_seq_len": need.min_seq_len, "padded_seq_lens": given, "fill_value": graph.fill_value},
                )
            )
            return findings
    stale = [(bs + i, n) for i, n in enumerate(padded) if n != graph.fill_value]
    if stale:
        row, value = stale[0]
        findings.append(
            _graded(
                trace,
                "padded-seq-len-stale",
                f"{len(stale)} padded requests hold a seq_len other than the fill value {graph.fill_value} "
                f"(first: graph.padded_seq_lens[{row}] = {value})",
                "The runner did not reset the padded seq_lens to its fill value, so padded requests read as many "
                "KV slots of their (stale) req_to_token rows as an earlier batch had; harmless only while those rows hold valid slot ids.",
                severity=HAZARD,
                request=row,
                field=f"graph.padded_seq_lens[{row}]",
                data={"padded_seq_lens": padded, "fill_value": graph.fill_value},
            )
        )
    return findings


def _padded_out_cache_loc(trace: Trace) -> list[Finding]:
    graph, batch = trace.graph, trace.batch
    tokens = batch.num_tokens
    per_req = max(tokens // max(batch.batch_size, 1), 1)
    tail = graph.padded_out_cache_loc[tokens:]
    bad = torch.nonzero(~torch.isin(tail, torch.tensor(DUMMY_SLOTS))).flatten()
    if not bad.numel():
        return []
    i = int(bad[0])
    row, slot = tokens + i, int(tail[i])
    owner = batch.slot_owner(slot)
    where = f"request {owner[0]}'s column {owner[1]}, live KV of this batch" if owner else "a slot no request of this batch reads"
    return [
        _graded(
            trace,
            "padded-kv-write",
            f"{bad.numel()} padded tokens write K/V outside the dummy slot (first: graph.padded_out_cache_loc[{row}] = {slot}, "
            f"{where}); padded tokens may write only slot 0 (SGLang) or -1 (vLLM, skipped)",
            "The graph runner did not reset out_cache_loc past the real tokens (SGLang zeroes it every replay), so padded "
            "tokens overwrite the KV that stale values point at" + (", corrupting a live request's cache." if owner else "."),
            # A token padded without a padded request (vLLM, past query_start_loc[-1]) belongs to none.
            request=batch.batch_size + i // per_req if graph.capture_bs > batch.batch_size else None,
            row=row,
            field=f"graph.padded_out_cache_loc[{row}]",
            data={"slots": tail[bad].tolist()[:16], "owner": list(owner) if owner else None},
        )
    ]


def _seq_lens_sum(trace: Trace) -> list[Finding]:
    graph, plan, batch = trace.graph, trace.plan, trace.batch
    if plan is None or "seq_lens_sum" not in plan.scalars:
        return []
    recorded = int(plan.scalars["seq_lens_sum"])
    # A draft decode step's rows are its requests' topk branches (each with its request's seq_len);
    # the engine's sum is over the requests.
    draft = draft_decode(trace)
    per_request = draft[0] if draft else 1
    padded = int(graph.padded_seq_lens[: graph.capture_bs].sum()) // per_request
    raw = int(batch.seq_lens_raw.sum()) // per_request
    if recorded == padded:
        return []
    pad = (graph.capture_bs - batch.batch_size) // per_request
    if recorded == raw:
        return [
            _graded(
                trace,
                "seq-lens-sum-ignores-padding",
                f"plan.seq_lens_sum = {recorded} = the {batch.batch_size // per_request} real requests' sum, but the padded batch's "
                f"seq_lens sum to {padded} ({pad} padded requests x fill {graph.fill_value})",
                "The runner passed the raw batch's seq_lens_sum instead of seq_lens_sum + padded requests x fill_value "
                "(SGLang's replay adds it): buffers sized from it (kv_indices) miss the padded requests' entries.",
                field="plan.seq_lens_sum",
                data={"recorded": recorded, "padded": padded, "raw": raw},
            )
        ]
    return [
        _graded(
            trace,
            "seq-lens-sum-mismatch",
            f"plan.seq_lens_sum = {recorded}, but the padded batch's seq_lens sum to {padded} (real requests alone: {raw})",
            "seq_lens_sum was computed from other seq_lens than the ones the graph ran (stale or double-counted padding).",
            field="plan.seq_lens_sum",
            data={"recorded": recorded, "padded": padded, "raw": raw},
        )
    ]


def _padded_indptrs(trace: Trace, reading: PlanReading) -> list[Finding]:
    """Each per-request offsets list over the padded batch (PlanReading.padded_offsets)."""
    plan, bs = trace.plan, trace.batch.batch_size
    if plan is None:
        return []
    findings = []
    for name, per_request in reading.padded_offsets.items():
        values = plan.tensors.get(name)
        real = bs * per_request  # entries [0, real] are the real requests'
        if values is None or values.numel() <= real + 1:
            continue  # the plan covers only the real requests: nothing padded was recorded
        values = values.to(torch.int64)
        drop = first_decrease(values[real:])  # the offsets rule over the padded tail (trace/offsets.py)
        if drop < 0:
            continue
        i = real + drop
        request = (i - 1) // per_request
        findings.append(
            _graded(
                trace,
                "padded-indptr-decreases",
                f"plan.{name}[{i}] = {int(values[i])} < plan.{name}[{i - 1}] = {int(values[i - 1])} "
                f"(entry of padded request {request}; the real requests end at {name}[{real}] = {int(values[real])})",
                f"The padded entries of {name} were left at the static buffer's initial or stale values instead of "
                "continuing the cumulative sum (each padded request adds its fill_value columns): a kernel reading them "
                "gets a negative length for a padded request.",
                request=request,
                field=f"plan.{name}[{i}]",
                data={"name": name, "values": values.tolist()[: 2 * (real + 2)]},
            )
        )
    return findings


def _padded_req_pool_indices(trace: Trace) -> list[Finding]:
    graph, batch = trace.graph, trace.batch
    # Not recorded (an engine without a request pool: vLLM, graph.padded_req_pool_indices None)
    # means not judged. vLLM traces written before that field could be None hold made-up indices.
    if graph.padded_req_pool_indices is None or not engine_conventions(trace).request_pool:
        return []
    bs, cap = batch.batch_size, graph.capture_bs
    live = graph.padded_req_pool_indices[:bs].tolist()
    live_len = {row: int(batch.kv_lens[b]) for b, row in enumerate(live)}
    seq_lens = graph.padded_seq_lens[:cap].tolist()
    out, stale = [], []
    for r in range(bs, min(cap, graph.padded_req_pool_indices.numel())):
        index, reads = int(graph.padded_req_pool_indices[r]), int(seq_lens[r]) if r < len(seq_lens) else 0
        if index == 0:
            continue
        if index < 0 or index >= IMPLAUSIBLE_POOL_ROWS:
            out.append((r, index, reads))
        elif reads > 0 and live_len.get(index, 0) < reads:
            stale.append((r, index, reads))
    findings = []
    if out:
        r, index, reads = out[0]
        findings.append(
            _graded(
                trace,
                "padded-req-pool-index-out-of-pool",
                f"{len(out)} padded requests carry a request-pool row outside any pool (first: "
                f"graph.padded_req_pool_indices[{r}] = {index}, padded seq_len {reads})",
                "The runner never reset the padded req_pool_indices (an uninitialised buffer, SGLang #1779): the backend "
                "reads req_to_token at that row out of bounds" + (" (illegal memory access)." if reads else " once the padded seq_len is >= 1."),
                severity=DEFECT if reads else HAZARD,
                request=r,
                field=f"graph.padded_req_pool_indices[{r}]",
                data={"rows": [i for _, i, _ in out][:16]},
            )
        )
    if stale:
        r, index, reads = stale[0]
        findings.append(
            _graded(
                trace,
                "stale-padded-req-pool-index",
                f"{len(stale)} padded requests point at request-pool rows no live request of this batch holds (first: "
                f"graph.padded_req_pool_indices[{r}] = {index}, read for {reads} slot ids; live rows: {live[:8]}); "
                "SGLang's newer runner zeroes them",
                "The classic SGLang runner leaves padded req_pool_indices stale: harmless while that row still holds valid "
                "slot ids from an earlier request, garbage if it was never written (req_to_token allocated with torch.empty, SGLang #1779).",
                severity=HAZARD,
                request=r,
                field=f"graph.padded_req_pool_indices[{r}]",
                data={"rows": [i for _, i, _ in stale][:16], "live_rows": live},
            )
        )
    return findings


def _padded_positions(trace: Trace) -> list[Finding]:
    graph, batch = trace.graph, trace.batch
    if engine_conventions(trace).stale_padded_positions:
        return []  # stale by design (vLLM, engines.md B5)
    tokens = batch.num_tokens
    per_req = max(tokens // max(batch.batch_size, 1), 1)
    tail = graph.padded_positions[tokens:]
    bad = torch.nonzero(tail != 0).flatten()
    if not bad.numel():
        return []
    i = int(bad[0])
    need = requirement(trace.source.backend, trace.model.kv_dtype)
    read_by_verify_plan = batch.forward_mode is ForwardMode.TARGET_VERIFY and need is not None and need.stale_positions is not None
    if read_by_verify_plan:
        cause = need.stale_positions
    else:
        cause = (
            "The classic SGLang runner leaves padded positions stale: harmless for this attention step (only the padded "
            "rows' rotary embedding uses them), but a verify plan that reads positions crashed on them (SGLang #24361)."
        )
    return [
        _graded(
            trace,
            "stale-padded-positions",
            f"{bad.numel()} padded tokens have non-zero positions (first: graph.padded_positions[{tokens + i}] = {int(tail[i])}); "
            "SGLang's newer runner zeroes them",
            cause,
            severity=DEFECT if read_by_verify_plan else HAZARD,
            request=batch.batch_size + i // per_req,
            row=tokens + i,
            field=f"graph.padded_positions[{tokens + i}]",
            data={"positions": tail[bad].tolist()[:16]},
        )
    ]


# -- padded replays -----------------------------------------------------------------------------



@dataclass(frozen=True)
class _Padded:
    fill: int
    eager: BackendRun | None
    graph: BackendRun | None


def replay_fills(trace: Trace, backend_fill: int) -> list[int]:
    """Fill values to replay with: the backend's own, the engine's recorded one, and the smallest
    seq_len actually found in the recorded padded rows (when the runner did not apply its fill)."""
    fills = [backend_fill]
    graph = trace.graph
    if graph is not None and graph.is_graph_replay and graph.capture_bs > trace.batch.batch_size:
        padded = graph.padded_seq_lens[trace.batch.batch_size : graph.capture_bs]
        fills += [graph.fill_value] + ([int(padded.min())] if padded.numel() else [])
    return sorted(set(f for f in fills if f >= 0), key=fills.index)


def padded_replays(ctx: CheckContext) -> tuple[list[Finding], list[requirements.PaddedOutcome], dict[str, FillRequirement]]:
    """The step replayed padded by each backend: findings, each replay's outcome, and what each
    backend declares it needs of padded rows (the prediction its outcomes are held to)."""
    trace = ctx.trace
    if not graph_replay.supports_graph(trace):
        return [], [], {}
    graph, bs = trace.graph, trace.batch.batch_size
    recorded = graph is not None and graph.is_graph_replay and graph.capture_bs >= bs
    capture_bs = graph_replay.step_capture_bs(trace)
    findings: list[Finding] = []
    outcomes: list[requirements.PaddedOutcome] = []
    needs: dict[str, FillRequirement] = {}
    engine_adapter = engine_names.adapter_for(trace.source.backend)
    for name in ctx.backends():
        backend = ctx.adapter(name)
        if backend.graph_unsupported_reason(trace) is not None:
            continue
        # The engine's adapter is held to what is declared for the engine backend that ran the
        # step (Backend.engine_names: an engine's name may carry its own requirement); any other
        # adapter, to what it declares under its own name.
        need = requirement(trace.source.backend if engine_adapter is type(backend) else name, trace.model.kv_dtype)
        if need is not None:
            needs[name] = need
        runs = []
        fills = replay_fills(trace, backend.cuda_graph_fill_value)
        if engine_adapter is not type(backend):
            # The engine ran another backend: this one never receives the engine's padding, only
            # its own (what its engine pads with for it). Its kernels under a padding they are never
            # given (FlashInfer under vLLM's seq_len 0 on a step vLLM ran on TRITON_ATTN) say
            # nothing about this step: replayed only with its own fill.
            fills = [f for f in fills if f == backend.cuda_graph_fill_value]
        for fill in fills:
            # Captured only under --cuda-graph on a GPU; else the same padded sequence runs eagerly
            # on the static buffers, which judges the fill values all the same (ctx.graph_options).
            result = ctx.replay(ctx.graph_options(capture_bs=capture_bs, fill_value=fill), (name,))
            eager = next((r for r in result.runs if isinstance(r.variant, Eager)), None)
            graphed = next((r for r in result.runs if isinstance(r.variant, Graph)), None)
            runs.append(_Padded(fill, eager, graphed))
            seen = requirements.outcome(name, fill, capture_bs, eager=eager, graph=graphed)
            outcomes += [seen] if seen is not None else []
        findings += _replay_findings(trace, name=name, capture_bs=capture_bs, runs=runs, recorded=recorded)
    return findings, outcomes, needs


def _fill_note(trace: Trace, backend: str, fill: int) -> str:
    need = requirement(backend, trace.model.kv_dtype)
    if need is not None and fill < need.min_seq_len:
        return f" seq_len {fill} is below what {backend} takes: {need.why}."
    return ""


def _replay_findings(trace: Trace, *, name: str, capture_bs: int, runs: list[_Padded], recorded: bool) -> list[Finding]:
    findings = []
    where = "the recorded capture size" if recorded else "the next SGLang capture size"
    passing = [p.fill for p in runs if p.graph is not None and p.graph.status is RunStatus.PASSED]
    for p in runs:
        run = p.graph
        if run is None or run.status in (RunStatus.UNSUPPORTED, RunStatus.UNAVAILABLE, RunStatus.PASSED):
            continue
        label = f"{name} graph replay at capture_bs={capture_bs} ({where}), padded seq_len {p.fill}"
        data = {"backend": name, "capture_bs": capture_bs, "fill_value": p.fill}
        if run.status is RunStatus.ERROR:
            findings.append(
                _graded(
                    trace,
                    "padded-replay-error",
                    f"{label}: {run.reason}",
                    "The kernel failed on the padded batch although the real rows are the same as eagerly."
                    + _fill_note(trace, name, p.fill),
                    field="graph",
                    data=data,
                )
            )
            continue
        outcome = run.graph
        if outcome is not None and outcome.padded_nonfinite:
            findings.append(
                _graded(
                    trace,
                    "padded-rows-nonfinite",
                    f"{label}: {outcome.padded_nonfinite} NaN/Inf values in the padded rows' output/LSE",
                    "The kernel writes NaN/Inf into padded rows; any per-batch reduction downstream (a quantisation "
                    "scale shared by a 128-row tile, FlashInfer #2883) spreads them into real tokens." + _fill_note(trace, name, p.fill),
                    # Only while this replay's real rows are right (else they are wrong: a defect).
                    severity=HAZARD if run.comparison is not None and run.comparison.passed else DEFECT,
                    request=trace.batch.batch_size,
                    data={**data, "nonfinite": outcome.padded_nonfinite},
                )
            )
        if outcome is not None and outcome.stray_kv_slots:
            slots = ", ".join(map(str, outcome.stray_kv_slots))
            findings.append(
                _graded(
                    trace,
                    "padded-kv-write",
                    f"{label}: the replay changed KV slots [{slots}], which no token of the step writes",
                    "Padded tokens wrote K/V outside the dummy slot 0, overwriting KV that other requests read.",
                    field="graph.padded_out_cache_loc",
                    data=data,
                )
            )
        eager_ok = p.eager is not None and p.eager.status is RunStatus.PASSED
        cmp = run.comparison
        if eager_ok and cmp is not None and not cmp.passed:
            worst = cmp.worst
            others = f"; at padded seq_len {', '.join(map(str, passing))} the same rows pass" if passing else ""
            findings.append(
                _graded(
                    trace,
                    "padding-leaks-into-real-rows",
                    f"{label}: {cmp.failing_rows}/{cmp.total_rows} real rows fail the reference (max abs {cmp.max_abs:.3e}, "
                    f"{cmp.nonfinite} non-finite; worst {worst}) while the eager run passes{others}",
                    "Real rows are right eagerly but wrong when the batch is padded: the kernel lets padded rows (their "
                    "garbage queries, fill-value KV or shared per-batch state) reach real ones." + _fill_note(trace, name, p.fill),
                    request=worst.request if worst else None,
                    row=worst.row if worst else None,
                    head=worst.head if worst else None,
                    data={**data, "failing_rows": cmp.failing_rows, "max_abs": cmp.max_abs},
                )
            )
    return findings
