"""invariants: host-side hints against the batch (`host-hint`).

A kernel launched with a host maximum (`max_seq_len`, `max_seqlen_q`, `max_query_len`,
`max_extend_len`) sizes its grid or its walk over a block table by it, whatever its tensors say.
Which hints reach which kernel is the adapter's declaration (backends/host_hints.py, by the engine
backend name the step carries); each present hint is judged against the requests its kernel runs:

    below the batch's longest (query tokens or KV columns): the kernel leaves rows or keys unread,
        a defect. A vLLM max_seq_len equal to its CommonAttentionMetadata's is seq-lens-max's;
    a table walk past the block table's width (ceil(hint / page_size) entries of a row with fewer
        columns): the kernel reads outside the tensor it was given, a defect (vLLM #43991).

A hint above the batch's longest within the table is the engines' own practice (SGLang's
trtllm_mha passes max_context_len, vLLM captures its graphs with max_model_len): no finding.
"""

from __future__ import annotations

from attndbg.backends.engine_names import host_hints
from attndbg.backends.host_hints import HostHint, Measures, Rows, Sizes
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND
from attndbg.plans.reading import PlanReading
from attndbg.trace.engines import engine_conventions
from attndbg.trace.schema import Trace

CHECK = "host-hint"


def check_host_hints(trace: Trace, reading: PlanReading, out: list[Finding]) -> None:
    """Every hint the recording backend's kernels read, where the plan holds it."""
    plan = trace.plan
    assert plan is not None
    for hint in host_hints(trace.source.backend):
        value = plan.scalars.get(hint.scalar)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if any(name not in plan.scalars and name not in plan.tensors for name in hint.present):
            continue  # another kernel ran this part
        rows = _rows(trace, reading, hint.rows)
        if not rows:
            continue
        lens = trace.batch.extend_lens if hint.measures is Measures.QUERY_LEN else trace.batch.kv_lens
        b = max(rows, key=lambda r: int(lens[r]))
        longest = int(lens[b])
        if value < longest and not _judged_as_metadata(trace, hint, value):
            out.append(_below(trace, hint, value, longest, b))
        elif hint.sizes is Sizes.TABLE_WALK:
            _walk(trace, hint, value, longest, out)


def _rows(trace: Trace, reading: PlanReading, which: Rows) -> range:
    real = trace.batch.batch_size
    if which is Rows.ALL:
        return range(real)
    decodes = min(reading.builder_counts.get("num_decodes", real), real)
    return range(decodes) if which is Rows.DECODES else range(decodes, real)


def _judged_as_metadata(trace: Trace, hint: HostHint, value: int) -> bool:
    """A KV hint equal to the engine's own max_seq_len field: seq-lens-max reports it once."""
    fields = engine_conventions(trace).metadata
    if fields is None or hint.measures is not Measures.KV_LEN:
        return False
    assert trace.plan is not None
    return any(trace.plan.scalars.get(name) == value for name in fields.max_seq_len)


def _below(trace: Trace, hint: HostHint, value: int, longest: int, b: int) -> Finding:
    what = "query tokens" if hint.measures is Measures.QUERY_LEN else "KV columns"
    return finding(
        KIND,
        CHECK,
        step=trace.source.step,
        request=b,
        field=f"plan.scalars.{hint.scalar}",
        evidence=f"plan.scalars.{hint.scalar} = {value} but request {b} has {longest} {what} ({hint.measures.value} of the requests its kernel runs)",
        cause=f"{hint.kernel} sizes {hint.sizes.value} by this host-side hint, in blocks of its own size: request {b}'s {what} "
        f"past the last block the hint launches are never read (up to its last {longest - value}, all of them where the block "
        "size divides the hint). The hint was computed from other lengths than the batch's (a stale or partial host maximum)"
        + (". `attndbg replay --plan both` runs the kernel with the hint as recorded and as the batch implies" if hint.replayed else ""),
        expected_at_least=longest,
        found=value,
    )


def _walk(trace: Trace, hint: HostHint, value: int, longest: int, out: list[Finding]) -> None:
    assert trace.plan is not None
    table = trace.plan.tensors.get(hint.table)
    if table is None or table.dim() != 2:
        return
    page, width = trace.model.page_size, int(table.shape[1])
    walked = -(-value // page)
    if walked <= width or _maybe_cut(trace, width, page):
        return
    out.append(
        finding(
            KIND,
            CHECK,
            step=trace.source.step,
            field=f"plan.scalars.{hint.scalar}",
            evidence=f"plan.scalars.{hint.scalar} = {value}: the kernel walks ceil({value} / {page}) = {walked} entries of each "
            f"plan.{hint.table} row, which has {width} columns; the longest request reads {longest} KV columns "
            f"({-(-longest // page)} entries)",
            cause=f"{hint.kernel} sizes its walk over the block table by this host-side hint, not by each row's seq_len: past the "
            f"table's {width} columns it reads outside the tensor it was given. The hint must be the batch's longest sequence "
            "(vLLM #43991, #40654: max_seq_len = max_model_len, which only a graph's capture may pass, with a table that wide)",
            expected_at_most=width * page,
            found=value,
        )
    )


def _maybe_cut(trace: Trace, width: int, page: int) -> bool:
    """Whether the recorder may have kept fewer columns than the engine's table had: vLLM's keeps
    ceil(max_seq_len / block_size) of them (attndbg/record/vllm/plan.py), so a table that wide
    says nothing of the columns past it."""
    fields = engine_conventions(trace).metadata
    if fields is None:
        return False
    assert trace.plan is not None
    kept = next((v for name in fields.max_seq_len if isinstance(v := trace.plan.scalars.get(name), int)), None)
    return kept is not None and -(-kept // page) <= width
