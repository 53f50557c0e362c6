"""invariants over vLLM's own metadata: the `CommonAttentionMetadata` the recorder keeps verbatim
(`plan.tensors["common.*"]`, see attndbg/record/vllm/fields.py) against the batch built from it.
Checked for a step whose engine keeps its metadata in the plan; where each field lies is the
engine's convention (attndbg/trace/engines.py `MetadataFields`).

    indptr-start, indptr-decreases, indptr-end
                        query_start_loc starts at 0, never decreases, padded tail included (vLLM
                        repeats the last entry: FA3 and the Triton kernels need it non-decreasing),
                        and ends within the step's num_actual_tokens
    query-start-loc-shape  num_reqs + 1 entries for num_reqs seq_lens
    unowned-tokens      num_actual_tokens past query_start_loc[-1] only where a CUDA graph padded
                        the step: its padded rows are zero-length, or its rows are max_num_seqs
                        (capture.max_bs; silent where the recording lacks it)
    vllm-empty-request  no row without query tokens before a real request (vLLM pads only after)
    host-mirror         query_start_loc_cpu == query_start_loc, seq_lens_cpu == seq_lens,
                        seq_lens_cpu_upper_bound >= seq_lens (builders plan from the host copies);
                        under vLLM V2's adaptive verification (recorded as vllm.adaptive_verification)
                        query_start_loc_cpu keeps only the total and the row count
    seq-lens-max        no seq_len past max_seq_len (vLLM sizes launches and the block table by it)
    block-table-short   each row has a column for every block its seq_len reads
    index-outside-cache every block id a row reads (a padded row too: it reads its seq_len) is in
                        [0, num_gpu_blocks) (the pool, when the engine's config gave it)
    null-block-read     no real request reads NULL_BLOCK_ID 0 in a column a query can see (with a
                        sliding window vLLM nulls the blocks before the window: those are skipped)
    slot-mapping        each real token's slot is block_table[b, col // bs] * bs + col % bs of its
                        KV column (-1 would skip its K/V write)

The engine's raw seq_lens against the batch, positions against columns, and padded rows' fills and
slots are checked by the generic invariants (`seq-lens`, `positions`) and by fill-value.
Recordings made before the evidence was kept read the same fields from the builder's output where
it passes them through (TritonAttentionMetadata, FlashAttentionMetadata): the conventions list
those names after the evidence's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND, _first
from attndbg.plural import counted
from attndbg.trace.offsets import first_decrease
from attndbg.trace.engines import MetadataFields, engine_conventions
from attndbg.trace.schema import Trace

NULL_BLOCK = 0  # vLLM's NULL_BLOCK_ID
SKIPPED_SLOT = -1  # vLLM's slot for a token whose K/V write is skipped (padding)


@dataclass(frozen=True)
class _Common:
    """The engine's fields (int64), each with the plan name findings cite."""

    names: MetadataFields  # where the engine keeps them, its host mirrors and scalars
    qsl: Tensor
    qsl_name: str
    seq: Tensor
    seq_name: str
    table: Tensor | None  # [rows, columns]
    table_name: str
    slots: Tensor | None
    slots_name: str


def _field(trace: Trace, keys: tuple[str, ...]) -> tuple[Tensor, str] | None:
    plan = trace.plan
    assert plan is not None
    for key in keys:
        value = plan.tensors.get(key)
        if value is not None and not value.is_floating_point() and value.dtype is not torch.bool:
            return value.to(torch.int64), f"plan.{key}"
    return None


def _named_scalar(trace: Trace, *names: str) -> tuple[int, str] | None:
    """The first of `names` the plan keeps as an int scalar, with its name."""
    assert trace.plan is not None
    for name in names:
        value = trace.plan.scalars.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, name
    return None


def _scalar(trace: Trace, *names: str) -> int | None:
    found = _named_scalar(trace, *names)
    return found[0] if found is not None else None


def check_vllm(trace: Trace, out: list[Finding]) -> None:
    """Every invariant of the engine's own metadata, for a step of an engine that keeps it in the
    plan (vLLM; nothing without a plan)."""
    names = engine_conventions(trace).metadata
    if names is None or trace.plan is None:
        return
    qsl, seq = _field(trace, names.query_start_loc), _field(trace, names.seq_lens)
    if qsl is None or seq is None:
        return
    table, slots = _field(trace, names.block_table), _field(trace, names.slot_mapping)
    if table is not None and table[0].dim() != 2:
        table = None
    common = _Common(
        names=names,
        qsl=qsl[0].reshape(-1),
        qsl_name=qsl[1],
        seq=seq[0].reshape(-1),
        seq_name=seq[1],
        table=table[0] if table else None,
        table_name=table[1] if table else "",
        slots=slots[0].reshape(-1) if slots else None,
        slots_name=slots[1] if slots else "",
    )
    _query_start_loc(trace, common, out)
    _unowned_tokens(trace, common, out)
    _host_mirrors(trace, common, out)
    _max_seq_len(trace, common, out)
    if common.table is not None:
        _block_table(trace, common, out)
        if common.slots is not None:
            _slot_mapping(trace, common, out)


def _query_start_loc(trace: Trace, c: _Common, out: list[Finding]) -> None:
    qsl, name, rows, bs = c.qsl, c.qsl_name, c.seq.numel(), trace.batch.batch_size
    if qsl.numel() != rows + 1:
        out.append(
            finding(
                KIND,
                "query-start-loc-shape",
                step=trace.source.step,
                field=name,
                evidence=f"{name} has {qsl.numel()} entries for {rows} seq_lens, expected {rows + 1}",
                cause="query_start_loc and seq_lens were sliced to different batch sizes (num_reqs vs num_reqs_padded)",
                expected=rows + 1,
                found=qsl.numel(),
            )
        )
    if qsl.numel() == 0:
        return
    if int(qsl[0]) != 0:
        out.append(
            finding(
                KIND,
                "indptr-start",
                step=trace.source.step,
                field=f"{name}[0]",
                evidence=f"{name}[0] = {int(qsl[0])}, query_start_loc starts at 0",
                cause="query_start_loc was sliced from the persistent buffer at the wrong offset",
                expected=0,
                found=int(qsl[0]),
            )
        )
    i = first_decrease(qsl)
    if i > 0:
        padded = i - 1 >= bs
        out.append(
            finding(
                KIND,
                "indptr-decreases",
                step=trace.source.step,
                request=i - 1,
                field=f"{name}[{i}]",
                evidence=f"{name}[{i}] = {int(qsl[i])} < {name}[{i - 1}] = {int(qsl[i - 1])} "
                + (f"(row {i - 1} is CUDA-graph padding; the {bs} real requests end at {name}[{bs}] = {int(qsl[bs])})" if padded else f"(request {i - 1})"),
                cause=(
                    "the padded tail of query_start_loc was left stale or zeroed instead of repeating the last real entry "
                    "(vLLM's runner fills it with cu_num_tokens[-1]): a kernel reading it sees a negative query length"
                    if padded
                    else "the real requests' offsets were overwritten by another batch's or summed in the wrong order"
                ),
                expected_at_least=int(qsl[i - 1]),
                found=int(qsl[i]),
            )
        )
    tokens = c.slots.numel() if c.slots is not None else _scalar(trace, *c.names.num_actual_tokens)
    end = int(qsl.max())
    if tokens is not None and end > tokens:
        at = int(torch.nonzero(qsl == end)[0])
        out.append(
            finding(
                KIND,
                "indptr-end",
                step=trace.source.step,
                request=max(at - 1, 0),
                field=f"{name}[{at}]",
                evidence=f"{name}[{at}] = {end} but the step has {tokens} tokens (num_actual_tokens): the kernel reads query rows that do not exist",
                cause="query_start_loc was computed for a larger batch than the one the runner prepared (stale entries)",
                expected_at_most=tokens,
                found=end,
            )
        )
    lens = qsl[1 : bs + 1] - qsl[:bs] if qsl.numel() > bs else torch.zeros(0, dtype=torch.int64)
    b = _first(lens == 0)
    if b >= 0:
        out.append(
            finding(
                KIND,
                "vllm-empty-request",
                step=trace.source.step,
                request=b,
                field=f"{name}[{b + 1}]",
                evidence=f"row {b} has no query tokens ({name}[{b}] = {name}[{b + 1}] = {int(qsl[b])}) but row {bs - 1} after it is a real request",
                cause="a padded (or finished) row sits before live requests: vLLM pads only after the real rows, so the batch was condensed wrongly",
                found=0,
            )
        )


def _unowned_tokens(trace: Trace, c: _Common, out: list[Finding]) -> None:
    """num_actual_tokens may exceed query_start_loc[-1] only by a FULL graph's padding (vLLM 0.33:
    the V1 dispatcher and V2's runner pad the rows with the tokens, zero-length rows whose
    query_start_loc repeats the real total, up to max_num_seqs rows). The recording keeps no graph
    mode, so the rows tell: excess tokens with every row owning tokens and fewer rows than
    max_num_seqs belong to no request and to no graph (docs/checking.md, "vLLM: num_actual_tokens
    against query_start_loc"). Builders that plan from query_start_loc_cpu and run
    num_actual_tokens rows (FlashInfer's prefill and native decode) get rows nobody wrote."""
    assert trace.plan is not None
    top = trace.capture.max_bs if trace.capture is not None else None
    found = _named_scalar(trace, *c.names.num_actual_tokens)
    if top is None or found is None or c.qsl.numel() < 2:
        return
    tokens, tokens_name = found
    # The end the builders see: the host mirror where recorded (FlashInfer plans from it), else
    # the device tensor; a mirror that differs is host-mirror's finding, so the larger end is taken.
    ends = [(int(c.qsl.max()), c.qsl_name)]
    host = trace.plan.tensors.get(c.names.query_start_loc_cpu)
    if host is not None and host.numel() and not host.is_floating_point():
        ends.append((int(host.max()), f"plan.{c.names.query_start_loc_cpu}"))
    end, end_name = max(ends, key=lambda e: e[0])
    rows = c.qsl.numel() - 1
    last = int(c.qsl[-1] - c.qsl[-2])
    if tokens <= end or last <= 0 or rows >= top:
        return
    out.append(
        finding(
            KIND,
            "unowned-tokens",
            step=trace.source.step,
            field=f"plan.scalars.{tokens_name}",
            evidence=f"num_actual_tokens = {tokens} but {end_name}[-1] = {end}: {counted(tokens - end, 'token')} past the last request's, "
            f"with no zero-length row among the {counted(rows, 'row')} and {rows} < max_num_seqs = {top} (capture.max_bs)",
            cause=f"num_actual_tokens ({tokens}) counts {counted(tokens - end, 'token')} that no request owns (query_start_loc[-1] = {end}, "
            f"num_reqs = {rows}) and no CUDA graph padded: a FULL graph pads num_reqs with the tokens (zero-length rows) up to "
            f"max_num_seqs = {top}. The metadata was built with a padded token count (a DP-synced or capture size) outside a FULL "
            "graph: builders that plan from query_start_loc_cpu and run num_actual_tokens query rows (FlashInfer's prefill, its "
            "native decode) get rows past the plan",
            expected=end,
            found=tokens,
            num_reqs=rows,
            max_num_seqs=top,
        )
    )


def _host_mirrors(trace: Trace, c: _Common, out: list[Finding]) -> None:
    assert trace.plan is not None
    # query_start_loc's padded tail is read by the kernels; padded rows' lengths are fill-value's.
    real = trace.batch.batch_size
    names = c.names
    pairs = (
        (names.query_start_loc_cpu, c.qsl, c.qsl_name, "=="),
        (names.seq_lens_cpu, c.seq[:real], c.seq_name, "=="),
        (names.num_computed_tokens_cpu, (c.seq - _query_lens(c))[:real], c.seq_name + " - query lengths", "=="),
        (names.seq_lens_cpu_upper_bound, c.seq[:real], c.seq_name, ">="),
    )
    totals_only = any(trace.plan.scalars.get(k) is True for k in names.device_only_boundaries)
    for mirror, device, device_name, rule in pairs:
        host = trace.plan.tensors.get(mirror)
        if host is None or host.is_floating_point():
            continue
        host = host.to(torch.int64).reshape(-1)
        if totals_only and mirror == names.query_start_loc_cpu:
            _boundaries_on_device(trace, host, c, mirror, out)
            continue
        n = min(host.numel(), device.numel())
        bad = host[:n] < device[:n] if rule == ">=" else host[:n] != device[:n]
        i = _first(bad)
        if i < 0:
            continue
        out.append(
            finding(
                KIND,
                "host-mirror",
                step=trace.source.step,
                request=i,
                field=f"plan.{mirror}[{i}]",
                evidence=f"plan.{mirror}[{i}] = {int(host[i])}, expected {rule} {device_name}[{i}] = {int(device[i])}",
                cause="the host copy the builder plans from (split_decodes_and_prefills, max lengths) was not updated with the device tensor the kernel reads",
                expected=int(device[i]),
                found=int(host[i]),
            )
        )


def _boundaries_on_device(trace: Trace, host: Tensor, c: _Common, mirror: str, out: list[Finding]) -> None:
    """vLLM V2's adaptive verification admits each verify request's drafts on the device and
    rewrites query_start_loc there (vllm/v1/worker/gpu/spec_decode/adaptive_verification.py:462-468
    in 0.33, `reallocate_drafts`), while the host copy spreads the same draft budget evenly over the
    verify requests (`compact_batch`, 409-413): per-request boundaries differ by design, the total
    and the row count do not (v1/attention/backend.py:216-229, backends opt in). Those two are held."""
    device, name = c.qsl, c.qsl_name
    if host.numel() == device.numel() and (host.numel() == 0 or int(host[-1]) == int(device[-1])):
        return
    i = min(host.numel(), device.numel()) - 1
    if host.numel() != device.numel():
        evidence = f"plan.{mirror} has {host.numel()} entries, {name} {device.numel()}"
        expected, found = device.numel(), host.numel()
    else:
        evidence = f"plan.{mirror}[{i}] = {int(host[i])}, expected == {name}[{i}] = {int(device[i])} (the total)"
        expected, found = int(device[i]), int(host[i])
    out.append(
        finding(
            KIND,
            "host-mirror",
            step=trace.source.step,
            request=max(i, 0),
            field=f"plan.{mirror}",
            evidence=evidence + "; adaptive verification is on, so only the per-request boundaries may differ",
            cause="the host copy the builder plans from was not updated with the device tensor: adaptive verification moves "
            "drafts between verify requests on the device, but the host copy must keep the step's total and its requests "
            "(the decode/prefill split and the token count builders take from it)",
            expected=expected,
            found=found,
        )
    )


def _query_lens(c: _Common) -> Tensor:
    rows = c.seq.numel()
    qsl = c.qsl[: rows + 1]
    lens = qsl[1:] - qsl[:-1]
    return torch.nn.functional.pad(lens, (0, rows - lens.numel()))


def _max_seq_len(trace: Trace, c: _Common, out: list[Finding]) -> None:
    bound = _scalar(trace, *c.names.max_seq_len)
    if bound is None:
        return
    b = _first(c.seq > bound)
    if b < 0:
        return
    out.append(
        finding(
            KIND,
            "seq-lens-max",
            step=trace.source.step,
            request=b,
            field=f"{c.seq_name}[{b}]",
            evidence=f"{c.seq_name}[{b}] = {int(c.seq[b])} > max_seq_len = {bound}",
            cause="max_seq_len was computed from other lengths than seq_lens (a stale host-side maximum): kernels sized by it skip the request's last KV blocks",
            expected_at_most=bound,
            found=int(c.seq[b]),
        )
    )


def _read_columns(trace: Trace, c: _Common, b: int) -> tuple[int, int]:
    """Block columns [first, stop) row b's kernel reads: its seq_len's blocks, from the first one a
    query can see (a sliding window starts past the prefix's head)."""
    page = trace.model.page_size
    stop = -(-max(int(c.seq[b]), 0) // page)
    window, batch = trace.model.sliding_window, trace.batch
    first = 0
    if window >= 0 and b < batch.batch_size:
        first = max(int(batch.prefix_lens[b]) - window, 0) // page
    return first, stop


def _block_table(trace: Trace, c: _Common, out: list[Finding]) -> None:
    table, name = c.table, c.table_name
    assert table is not None
    bound = _scalar(trace, *c.names.max_seq_len)
    pool = _scalar(trace, *c.names.num_blocks)
    page = trace.model.page_size
    outside: list[tuple[int, int]] = []
    null: list[tuple[int, int]] = []
    for b in range(c.seq.numel()):
        first, stop = _read_columns(trace, c, b)
        width = int(table.shape[1]) if b < table.shape[0] else 0
        if stop > width and (bound is None or int(c.seq[b]) <= bound):
            out.append(
                finding(
                    KIND,
                    "block-table-short",
                    step=trace.source.step,
                    request=b,
                    field=f"{name}[{b}]",
                    evidence=f"row {b} reads {stop} blocks (seq_len {int(c.seq[b])}, block size {page}) but {name} has {width} columns for it",
                    cause="the block table was sliced narrower (or to fewer rows) than the lengths the kernel reads",
                    expected_at_least=stop,
                    found=width,
                )
            )
        ids = table[b, first : min(stop, width)] if b < table.shape[0] else torch.zeros(0, dtype=torch.int64)
        bad = (ids < 0) | (ids >= pool) if pool is not None else ids < 0
        outside += [(b, first + int(j)) for j in torch.nonzero(bad).flatten()]
        if b < trace.batch.batch_size:
            null += [(b, first + int(j)) for j in torch.nonzero(ids == NULL_BLOCK).flatten()]
    real = trace.batch.batch_size
    if outside:
        b, col = outside[0]
        value = int(table[b, col])
        where = f"request {b}" if b < real else f"padded row {b} (seq_len {int(c.seq[b])})"
        out.append(
            finding(
                KIND,
                "index-outside-cache",
                step=trace.source.step,
                request=b,
                column=col * page,
                field=f"{name}[{b}, {col}]",
                evidence=f"{name}[{b}, {col}] = {value}, read by {where} for KV columns {col * page}..{col * page + page - 1}, is outside the pool"
                + (f" [0, {pool})" if pool is not None else "")
                + f"; {len(outside)} such entries",
                cause=(
                    "the row was read before its blocks were allocated (-1 marks an unassigned entry): the kernel reads memory outside the KV cache"
                    if value < 0
                    else "the block id comes from another pool or a freed, stale table row"
                ),
                found=value,
                count=len(outside),
            )
        )
    if null:
        b, col = null[0]
        out.append(
            finding(
                KIND,
                "null-block-read",
                step=trace.source.step,
                request=b,
                column=col * page,
                field=f"{name}[{b}, {col}]",
                evidence=f"{name}[{b}, {col}] = {NULL_BLOCK} (NULL_BLOCK_ID), read by request {b} for KV columns {col * page}..{col * page + page - 1}; {len(null)} such entries",
                cause="a live request's block-table row holds the null block vLLM fills into padded rows: the row was overwritten by padding or never written, so attention reads padding instead of the request's KV",
                found=NULL_BLOCK,
                count=len(null),
            )
        )


def _slot_mapping(trace: Trace, c: _Common, out: list[Finding]) -> None:
    table, slots, batch = c.table, c.slots, trace.batch
    assert table is not None and slots is not None
    page, pool = trace.model.page_size, _scalar(trace, *c.names.num_blocks)
    rows = c.seq.numel()
    qsl = c.qsl[: rows + 1]
    t = 0
    for b in range(batch.batch_size):
        for i in range(int(batch.extend_lens[b])):
            col, engine = int(batch.query_cols[t]), int(qsl[b]) + i
            t += 1
            block = int(table[b, col // page]) if b < table.shape[0] and col // page < table.shape[1] else None
            if block is None or block <= NULL_BLOCK or (pool is not None and block >= pool):
                continue  # the block-table entry itself is the finding
            expected = block * page + col % page
            found = int(slots[engine]) if 0 <= engine < slots.numel() else None
            if found == expected:
                continue
            out.append(_slot_finding(trace, c, b=b, t=t - 1, col=col, engine=engine, expected=expected, found=found))
            return


def _block_size_of_slots(trace: Trace, c: _Common, page: int) -> int | None:
    """A block size smaller than `page` (dividing it) under which every real token's slot is its
    KV column in the block table, where the table holds that column (it is cut to the columns
    `page` needs): the table and slots are in smaller blocks than the step's page size says."""
    table, slots, batch = c.table, c.slots, trace.batch
    assert table is not None and slots is not None
    qsl = c.qsl
    for block in range(page // 2, 0, -1):
        if page % block:
            continue
        seen, t = 0, 0
        agrees = True
        for b in range(min(batch.batch_size, table.shape[0])):
            for i in range(int(batch.extend_lens[b])):
                col, engine = int(batch.query_cols[t]), int(qsl[b]) + i
                t += 1
                if col // block >= table.shape[1] or not 0 <= engine < slots.numel():
                    continue
                seen += 1
                agrees = agrees and int(slots[engine]) == int(table[b, col // block]) * block + col % block
        if agrees and seen:
            return block
    return None


def _slot_finding(trace: Trace, c: _Common, *, b: int, t: int, col: int, engine: int, expected: int, found: int | None) -> Finding:
    table, name, page = c.table, c.slots_name, trace.model.page_size
    assert table is not None
    pool = _scalar(trace, *c.names.num_blocks)
    position = int(trace.batch.positions[t])
    if found is None:
        cause = f"slot_mapping has {c.slots.numel() if c.slots is not None else 0} entries: it was sliced to fewer tokens than the batch has"
    elif found == SKIPPED_SLOT:
        cause = "a real token got the padded-token slot -1, so its K/V is never written and attention reads the slot's stale contents"
    elif found < 0 or (pool is not None and found >= pool * page):
        cause = "the slot is outside the KV pool: the write lands outside the cache"
    elif position != col and 0 <= position // page < table.shape[1] and found == int(table[b, position // page]) * page + position % page:
        cause = f"slot_mapping was computed from the token's position {position} instead of its KV column {col}"
    elif (block := _block_size_of_slots(trace, c, page)) is not None:
        cause = (
            f"slot_mapping and the block table are in blocks of {block} tokens, while the step's page size is {page}: the "
            f"builder was given another block size than the cache's pages (vLLM's hybrid models handed the KV manager's "
            f"block size instead of the kernel's, #27753), so the lists it derives at page size {page} (pages per request, "
            "last-page lengths) do not match the pages the kernel reads"
        )
    elif (owner := trace.batch.slot_owner(found, other_than=b)) is not None:
        cause = f"the slot is request {owner[0]}'s KV column {owner[1]}: this token overwrites another request's cache (slot_mapping computed from another request's block-table row, or rows out of order)"
    else:
        cause = "slot_mapping was not computed from this step's block table (a stale buffer from an earlier step)"
    return finding(
        KIND,
        "slot-mapping",
        step=trace.source.step,
        request=b,
        row=t,
        column=col,
        field=f"{name}[{engine}]",
        evidence=f"{name}[{engine}] = {found if found is not None else 'missing'} for request {b}'s token at KV column {col}, expected block_table[{b}, {col // page}] * {page} + {col % page} = {expected}",
        cause=cause,
        expected=expected,
        found=found,
    )
