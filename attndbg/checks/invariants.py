"""invariants: the batch's own bookkeeping and the recorded plan, checked against the batch.

The batch is the ground truth (validated on load); what the engine *recorded* is evidence: its
`positions` and raw `seq_lens` (not validated on load, engines disagree) and its plan. Checks:

    positions          decode: kv_len - 1; extend/mixed: prefix + i; selective: the token's column;
                       verify: prefix + depth of the draft token
    seq-lens           the engine's raw seq_lens, per SGLang's semantics (decode/extend: kv_len;
                       verify: prefix only, the backend adds draft_token_num); vLLM: always kv_len
    seq-lens-sum       a `seq_lens_sum` plan scalar equals the sum of those seq_lens (with graph
                       padding, sum + pad * fill_value; one that ignores padding is fill-value's)
    plan-dtype         index tensors of the plan are integers
    indptr-start, indptr-decreases, indptr-end
                       every `*indptr` / `cu_seqlens_*` starts at 0, never decreases, and ends at
                       the length of what it indexes (`X_indptr` -> `X_indices`; `cu_seqlens_k` ->
                       sum(cache_seqlens); `mask_indptr` -> `custom_mask` outside tree verify)
    plan-batch-size    the plan covers the batch's requests (or capture_bs of a graph replay)
    qo-lens            qo_indptr / cu_seqlens_q against the extend lengths
    cu-seqlens-k       cu_seqlens_k = cumsum(cache_seqlens)
    index-outside-cache  used indices inside the pool: slot ids < kv_cache_size, page ids <
                       kv_cache_size // page_size
    kv-length          each request's KV length in the plan (indptr, kv_last_page_len,
                       cache_seqlens, kv_len_arr) against the batch
    kv-last-page-len   kv_last_page_len in [1, page_size]
    kv-index           each request's indices equal its req_to_token row (slots, or page ids
                       row[::page] // page): the first wrong column, expected and found
    num-kv-splits      in [1, max_kv_splits], one per request
    mask-length        a selective step's custom_mask is as long as mask_indptr[-1]
    plan-pointer-moved (recording) plan tensors keep their data pointers across graph replays

Vocabulary, by `plan.backend` (and the `impl` scalar of `mla` plans): `triton` (SGLang's Triton
ForwardMetadata: kv_indptr/kv_indices over slot ids; extend and verify cover the prefix only),
`flashinfer` (page ids, kv_last_page_len; decode, verify and the paged path cover the whole row,
the ragged/cascade paths the prefix), `fa3` (page_table rows + cache_seqlens; the two-call tree
verify covers the prefix in its main call), `mla` with impl flashinfer (kv_len_arr) or flashmla
(block_table). With a sliding window a plan may hold only the window's tail of a row (SGLang's
window_kv_indices), as long as it keeps every column a query can see. Other backends get only the
generic indptr checks.

Division of labour: verify-step masks (`custom_mask`, `mask_indptr`, fa3's expand_* tables) belong
to tree-mask; padded requests of a CUDA-graph plan (their lengths, fills and slots) to fill-value:
here they are checked only for well-formed indptrs and in-cache indices.

Recorder conventions this module defines:
- plan tensors are recorded trimmed to their used length (not a graph's [max] static buffer), so
  `indptr[-1] == len(indices)` holds for a correct engine;
- the data pointer of a plan tensor NAME is recorded as the int scalar `NAME_data_ptr` (e.g.
  `plan.scalars["kv_indices_data_ptr"]`); across graph replays of one captured graph (same
  tp_rank, mode, capture_bs, backend) each must stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.checks.context import CheckContext
from attndbg.checks.findings import Finding, FindingClass, Location
from attndbg.trace import tree
from attndbg.trace.schema import ForwardMode, Plan, Trace

POINTER_SUFFIX = "_data_ptr"

CAUSE_WRONG_ROW = "the engine built request {b}'s kv_indices from request {c}'s req_to_token row (a wrong req_pool_indices entry)"
CAUSE_SHIFTED = "the engine's indices for request {b} start {k} column(s) too {direction} (a wrong kv_start_idx or window offset)"
CAUSE_STALE_ROW = "the engine built request {b}'s indices from a stale or overwritten req_to_token row"
CAUSE_GARBAGE = (
    "the engine read a req_to_token entry that was never written (garbage from a torch.empty pool, SGLang #1469) "
    "or read past the row's used length"
)
CAUSE_POINTER = (
    "the engine allocated this metadata tensor afresh at replay instead of copying into the captured buffer, so the "
    "graph reads the capture-time (freed) memory (SGLang PR #26019 review)"
)


def detect(ctx: CheckContext) -> list[Finding]:
    return check_trace(ctx.trace)


def check_trace(trace: Trace) -> list[Finding]:
    """Every single-step invariant of `trace` (pure: no kernels run)."""
    out: list[Finding] = []
    _check_positions(trace, out)
    _check_seq_lens(trace, out)
    if trace.plan is not None:
        _check_plan(trace, trace.plan, out)
    return out


def detect_recording(contexts: list[CheckContext]) -> list[Finding]:
    """plan-pointer-moved: a plan tensor whose `NAME_data_ptr` changes between replays of one graph."""
    out: list[Finding] = []
    first: dict[tuple, tuple[int, int]] = {}  # (graph key, name) -> (step, pointer)
    reported: set[tuple] = set()
    for ctx in sorted(contexts, key=lambda c: (c.trace.source.tp_rank, c.step)):
        trace = ctx.trace
        if trace.plan is None or trace.graph is None or not trace.graph.is_graph_replay:
            continue
        graph_key = (trace.source.tp_rank, trace.batch.forward_mode.value, trace.graph.capture_bs, trace.plan.backend)
        for key, value in sorted(trace.plan.scalars.items()):
            if not key.endswith(POINTER_SUFFIX) or isinstance(value, bool) or not isinstance(value, int):
                continue
            name = key[: -len(POINTER_SUFFIX)]
            seen = first.setdefault((graph_key, name), (ctx.step, value))
            if seen[1] == value or (graph_key, name) in reported:
                continue
            reported.add((graph_key, name))
            out.append(
                _finding(
                    trace,
                    "plan-pointer-moved",
                    field=f"plan.{name}",
                    evidence=(
                        f"plan.{name} is at {value:#x} in step {ctx.step} but was at {seen[1]:#x} in step {seen[0]}, "
                        f"both replays of the {trace.batch.forward_mode.value} graph captured at bs={trace.graph.capture_bs}"
                    ),
                    cause=CAUSE_POINTER,
                    trace_path=ctx.path,
                    name=name,
                    expected=seen[1],
                    found=value,
                    first_step=seen[0],
                )
            )
    return out


# -- findings ---------------------------------------------------------------------------------------


def _finding(trace: Trace, check: str, *, evidence: str, cause: str, request=None, row=None, column=None, field=None, trace_path: str = "", **data) -> Finding:
    location = Location(step=trace.source.step, request=request, row=row, column=column, field=field)
    return Finding(FindingClass.INVARIANT, check, location, evidence, cause, trace=trace_path, data=data)


def _request_of(qo_indptr: Tensor, t: int) -> int:
    return int(torch.searchsorted(qo_indptr, torch.tensor(t), right=True)) - 1


def _first(mask: Tensor) -> int:
    return int(torch.nonzero(mask.flatten())[0]) if bool(mask.any()) else -1


# -- batch bookkeeping --------------------------------------------------------------------------------


def expected_positions(trace: Trace) -> Tensor:
    """[T] the rope position of every query token: its column, or prefix + depth for a draft token."""
    batch = trace.batch
    if not trace.is_tree_verify:
        return batch.query_cols.clone()
    depth = torch.cat([tree.depths(p) for p in trace.spec.parents]) if batch.batch_size else torch.zeros(0, dtype=torch.int64)
    return torch.repeat_interleave(batch.prefix_lens, batch.extend_lens) + depth


def _check_positions(trace: Trace, out: list[Finding]) -> None:
    batch = trace.batch
    expected = expected_positions(trace)
    found = batch.positions
    t = _first(found != expected)
    if t < 0:
        return
    qo = batch.qo_indptr
    b = _request_of(qo, t)
    i = t - int(qo[b])
    rows = slice(int(qo[b]), int(qo[b + 1]))
    diff = (found[rows] - expected[rows]).unique()
    prefix = int(batch.prefix_lens[b])
    if trace.is_tree_verify:
        rule = f"prefix + depth = {prefix} + {int(expected[t]) - prefix}"
        by_index = prefix + torch.arange(rows.stop - rows.start)
        if torch.equal(found[rows], by_index):
            cause = "the engine computed draft positions as prefix + token index; a draft token sits at prefix + its tree depth (EAGLE's spec_info.positions)"
        else:
            cause = None
    else:
        rule = "kv_len - 1" if batch.forward_mode is ForwardMode.DECODE else ("its KV column" if batch.selective else f"prefix + {i}")
        cause = None
    if cause is None:
        if diff.numel() == 1 and int(diff) == -1:
            cause = "the positions are one step stale: computed before this step's seq_lens update"
        elif diff.numel() == 1 and int(diff) == 1:
            cause = "the positions are one ahead: computed from seq_lens that already count the current token (position = seq_len - 1)"
        elif diff.numel() == 1:
            cause = f"the positions are off by {int(diff)}: computed from another request's or another step's lengths"
        else:
            cause = "the engine's positions were not computed from this batch's lengths (a stale buffer or rows out of order)"
    count = int((found != expected).sum())
    out.append(
        _finding(
            trace,
            "positions",
            request=b,
            row=t,
            field=f"batch.positions[{t}]",
            evidence=f"batch.positions[{t}] = {int(found[t])} (request {b}, token {i}), expected {int(expected[t])} ({rule}); {count} of {found.numel()} positions differ",
            cause=cause,
            expected=int(expected[t]),
            found=int(found[t]),
            differing=count,
        )
    )


def expected_seq_lens(trace: Trace) -> Tensor:
    """The raw seq_lens a correct engine records: SGLang verify = prefix, else (and vLLM) kv_len."""
    batch = trace.batch
    if trace.is_tree_verify and trace.source.engine != "vllm":
        return batch.prefix_lens.clone()
    return batch.kv_lens.clone()


def _check_seq_lens(trace: Trace, out: list[Finding]) -> None:
    batch = trace.batch
    expected = expected_seq_lens(trace)
    found = batch.seq_lens_raw
    b = _first(found != expected)
    if b >= 0:
        kv, prefix = int(batch.kv_lens[b]), int(batch.prefix_lens[b])
        if trace.is_tree_verify:
            rule = "SGLang verify: the prefix only" if trace.source.engine != "vllm" else "vLLM: prefix + draft tokens"
        else:
            rule = f"{batch.forward_mode.value}: prefix + extend = {kv}"
        if trace.is_tree_verify and int(found[b]) == kv and trace.source.engine != "vllm":
            cause = "the engine's verify seq_lens include the draft tokens; SGLang backends add draft_token_num themselves, so the drafts are counted twice"
        elif batch.forward_mode is ForwardMode.DECODE and int(found[b]) == kv - 1:
            cause = "seq_lens were taken before the decode step's seq_lens += 1 (the current token is missing)"
        elif trace.is_tree_verify and int(found[b]) == prefix and trace.source.engine == "vllm":
            cause = "vLLM's seq_lens count the speculative tokens; these exclude them"
        else:
            cause = "the engine's seq_lens buffer holds another step's or another request's lengths"
        out.append(
            _finding(
                trace,
                "seq-lens",
                request=b,
                field=f"batch.seq_lens_raw[{b}]",
                evidence=f"batch.seq_lens_raw[{b}] = {int(found[b])}, expected {int(expected[b])} ({rule})",
                cause=cause,
                expected=int(expected[b]),
                found=int(found[b]),
            )
        )
    plan = trace.plan
    value = plan.scalars.get("seq_lens_sum") if plan is not None else None
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    want = int(expected.sum())
    accepted = {want}
    graph = trace.graph
    if graph is not None and graph.is_graph_replay and graph.capture_bs > batch.batch_size:
        padded = want + (graph.capture_bs - batch.batch_size) * graph.fill_value
        accepted = {padded, want}  # `want` alone under padding is fill-value's finding
        want = padded
    if int(value) in accepted:
        return
    bs = batch.batch_size
    if batch.forward_mode is ForwardMode.DECODE and int(value) == want - bs:
        cause = "seq_lens_sum was computed before the decode step's seq_lens += 1"
    elif trace.is_tree_verify and int(value) == want + bs * trace.spec.draft_token_num:
        cause = "seq_lens_sum counts the draft tokens, which SGLang's verify seq_lens exclude"
    else:
        cause = "seq_lens_sum was not updated with this batch's seq_lens (a stale host-side sum)"
    out.append(
        _finding(
            trace,
            "seq-lens-sum",
            field="plan.scalars.seq_lens_sum",
            evidence=f"plan.scalars.seq_lens_sum = {int(value)}, expected sum(seq_lens) = {want}",
            cause=cause,
            expected=want,
            found=int(value),
        )
    )


# -- the plan: generic structure ------------------------------------------------------------------------


def _is_indptr(name: str) -> bool:
    return name.endswith("indptr") or "cu_seqlens" in name


_INDEX_WORDS = ("indptr", "indices", "cu_seqlens", "page_table", "block_table", "cache_seqlens", "kv_len", "last_page_len", "num_kv_splits")


def _check_plan(trace: Trace, plan: Plan, out: list[Finding]) -> None:
    tensors: dict[str, Tensor] = {}
    for name, value in plan.tensors.items():
        if any(w in name for w in _INDEX_WORDS) and (value.is_floating_point() or value.is_complex() or value.dtype is torch.bool):
            out.append(
                _finding(
                    trace,
                    "plan-dtype",
                    field=f"plan.{name}",
                    evidence=f"plan.{name} has dtype {str(value.dtype).replace('torch.', '')}, expected an integer index type",
                    cause="the engine passed a float or bool tensor where the kernel takes indices",
                )
            )
            continue
        tensors[name] = value.to(torch.int64) if any(w in name for w in _INDEX_WORDS) else value
    sane = {name for name in tensors if not _is_indptr(name) or _indptr_shape(trace, name, tensors[name], out)}
    _indptr_ends(trace, tensors, sane, out)
    view = _kv_view(trace, plan, tensors, sane, out)
    if view is None:
        return
    bs = trace.batch.batch_size
    graph = trace.graph
    allowed = {bs} | ({graph.capture_bs} if graph is not None and graph.is_graph_replay else set())
    if view.requests not in allowed:
        out.append(
            _finding(
                trace,
                "plan-batch-size",
                field=f"plan.{view.count_field}",
                evidence=f"plan.{view.count_field} describes {view.requests} requests, the batch has {bs}"
                + (f" (graph capture_bs {graph.capture_bs})" if graph is not None and graph.is_graph_replay else ""),
                cause="the plan was built for another batch (stale metadata, or padded to the wrong capture size)",
                expected=bs,
                found=view.requests,
            )
        )
        return
    outside = _check_in_cache(trace, view, out)
    _check_requests(trace, view, outside, out)
    _check_qo(trace, tensors, sane, view.requests, out)
    _check_splits(trace, plan, tensors, view.requests, out)


def _indptr_shape(trace: Trace, name: str, values: Tensor, out: list[Finding]) -> bool:
    field = f"plan.{name}"
    if values.dim() != 1 or values.numel() == 0:
        out.append(_finding(trace, "indptr-start", field=field, evidence=f"{field} has shape {list(values.shape)}, expected [requests + 1]", cause="the engine recorded an empty or misshapen offsets tensor"))
        return False
    if int(values[0]) != 0:
        out.append(
            _finding(
                trace,
                "indptr-start",
                field=f"{field}[0]",
                evidence=f"{field}[0] = {int(values[0])}, an indptr starts at 0",
                cause="the offsets were sliced from a larger buffer at the wrong start, or written without the leading 0",
                expected=0,
                found=int(values[0]),
            )
        )
        return False
    i = _first(values[1:] < values[:-1]) + 1
    if i > 0:
        out.append(
            _finding(
                trace,
                "indptr-decreases",
                request=i - 1,
                field=f"{field}[{i}]",
                evidence=f"{field}[{i}] = {int(values[i])} < {field}[{i - 1}] = {int(values[i - 1])}: an indptr never decreases",
                cause="the offsets were partly overwritten by another batch's (a shared metadata buffer), or summed from lengths in the wrong order",
                expected_at_least=int(values[i - 1]),
                found=int(values[i]),
            )
        )
        return False
    return True


def _indptr_ends(trace: Trace, tensors: dict[str, Tensor], sane: set[str], out: list[Finding]) -> None:
    pairs = []
    for name in sane:
        if name.endswith("_indptr") and name != "mask_indptr" and name.replace("indptr", "indices") in tensors:
            pairs.append((name, name.replace("indptr", "indices")))
    if trace.batch.selective and "mask_indptr" in sane and "custom_mask" in tensors:
        pairs.append(("mask_indptr", "custom_mask"))
    for indptr, target in sorted(pairs):
        end, length = int(tensors[indptr][-1]), tensors[target].numel()
        if end == length:
            continue
        check = "mask-length" if target == "custom_mask" else "indptr-end"
        out.append(
            _finding(
                trace,
                check,
                field=f"plan.{indptr}[-1]",
                evidence=f"plan.{indptr}[-1] = {end} but plan.{target} has {length} elements ("
                + ("the kernel reads past its end" if end > length else f"{length - end} trailing entries no request owns")
                + ")",
                cause="the offsets and the buffer they index were built for different batches, or the buffer was recorded untrimmed",
                expected=length,
                found=end,
            )
        )
        sane.discard(indptr)
    for prefix in ("", "expand_"):
        cu, lens = f"{prefix}cu_seqlens_k", f"{prefix}cache_seqlens"
        if cu not in sane or lens not in tensors:
            continue
        expected = torch.nn.functional.pad(torch.cumsum(tensors[lens], 0), (1, 0))
        found = tensors[cu]
        if found.numel() == expected.numel() and torch.equal(found, expected):
            continue
        i = _first(found[: expected.numel()] != expected[: found.numel()]) if found.numel() and expected.numel() else -1
        where = f"[{i}]" if i >= 0 else ""
        out.append(
            _finding(
                trace,
                "cu-seqlens-k",
                field=f"plan.{cu}{where}",
                evidence=(
                    f"plan.{cu}{where} = {int(found[i])}, expected cumsum({lens}) = {int(expected[i])}"
                    if i >= 0
                    else f"plan.{cu} has {found.numel()} entries, {lens} has {expected.numel() - 1} requests"
                ),
                cause="cu_seqlens_k and cache_seqlens were computed from different lengths (one of them missed an update)",
            )
        )


# -- the plan: per-request KV ---------------------------------------------------------------------------


@dataclass
class _Segment:
    units: Tensor  # [u] int64: recorded slot or page ids the kernel reads for this request
    length: int | None  # tokens the plan says the kernel reads; None when the plan gives only units
    field: str  # the tensor holding them, e.g. "plan.kv_indices"
    offset: int  # flat index of units[0] in it
    row: int | None = None  # page-table row (then units are row[:u])

    def name(self, j: int) -> str:
        return f"{self.field}[{self.row}, {j}]" if self.row is not None else f"{self.field}[{self.offset + j}]"


@dataclass
class _KvView:
    vocabulary: str  # "triton" | "flashinfer" | "flashinfer-mla" | "page-table"
    page_size: int  # 1 for slot ids
    segments: list[_Segment]
    ends: tuple[str, ...]  # where each request's covered columns end: "prefix" and/or "kv"
    count_field: str
    length_field: str

    @property
    def requests(self) -> int:
        return len(self.segments)


def _vocabulary(plan: Plan) -> str | None:
    impl = plan.scalars.get("impl")
    if plan.backend == "triton" or (plan.backend == "mla" and impl == "triton"):
        return "triton"
    if plan.backend == "flashinfer":
        return "flashinfer"
    if plan.backend == "mla" and impl == "flashinfer":
        return "flashinfer-mla"
    if plan.backend == "fa3" or (plan.backend == "mla" and impl == "flashmla"):
        return "page-table"
    return None


def _ends(trace: Trace, plan: Plan, vocabulary: str) -> tuple[str, ...]:
    batch = trace.batch
    if batch.forward_mode is ForwardMode.DECODE or batch.selective:
        return ("kv",)
    if vocabulary == "triton":
        return ("prefix",)
    if vocabulary == "flashinfer" and not trace.is_tree_verify:
        path = plan.scalars.get("path")
        return {"paged": ("kv",), "ragged": ("prefix",), "cascade": ("prefix",)}.get(str(path), ("kv", "prefix"))
    if vocabulary == "page-table" and trace.is_tree_verify and plan.scalars.get("verify_path") == "two-call":
        return ("prefix",)
    return ("kv",)


def _kv_view(trace: Trace, plan: Plan, t: dict[str, Tensor], sane: set[str], out: list[Finding]) -> _KvView | None:
    vocabulary = _vocabulary(plan)
    if vocabulary is None:
        return None
    ends = _ends(trace, plan, vocabulary)
    if vocabulary == "page-table":
        table_name = "block_table" if "block_table" in t else "page_table"
        if table_name not in t or "cache_seqlens" not in t or t[table_name].dim() != 2:
            return None
        table, lens = t[table_name], t["cache_seqlens"]
        ps = int(plan.scalars.get("page_size", trace.model.page_size))
        if table.shape[0] != lens.numel():
            out.append(
                _finding(trace, "plan-batch-size", field=f"plan.{table_name}", evidence=f"plan.{table_name} has {table.shape[0]} rows, cache_seqlens has {lens.numel()} requests", cause="the page table and the lengths were built for different batches")
            )
            return None
        segments = []
        for b in range(lens.numel()):
            pages = max(-(-int(lens[b]) // ps), 0)
            if pages > table.shape[1]:
                out.append(
                    _finding(
                        trace,
                        "kv-length",
                        request=b,
                        field=f"plan.cache_seqlens[{b}]",
                        evidence=f"plan.cache_seqlens[{b}] = {int(lens[b])} needs {pages} pages, plan.{table_name} has {table.shape[1]} columns",
                        cause="cache_seqlens is longer than the page table row built for this request (lengths and table from different steps)",
                    )
                )
                return None
            segments.append(_Segment(table[b, :pages], int(lens[b]), f"plan.{table_name}", 0, row=b))
        return _KvView(vocabulary, ps, segments, ends, "cache_seqlens", "cache_seqlens")
    if "kv_indptr" not in sane or "kv_indices" not in t:
        return None
    indptr, indices = t["kv_indptr"], t["kv_indices"]
    if int(indptr[-1]) > indices.numel():
        return None  # indptr-end already says it; segments would run off the buffer
    ps = 1 if vocabulary == "triton" else int(plan.scalars.get("page_size", trace.model.page_size))
    last = t.get("kv_last_page_len") if vocabulary == "flashinfer" else None
    kv_len_arr = t.get("kv_len_arr") if vocabulary == "flashinfer-mla" else None
    segments = []
    for b in range(indptr.numel() - 1):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        count = hi - lo
        if vocabulary == "triton":
            length = count
        elif kv_len_arr is not None and b < kv_len_arr.numel():
            length = int(kv_len_arr[b])
        elif last is not None and b < last.numel():
            page_len = int(last[b])
            if count and not 1 <= page_len <= ps:
                out.append(
                    _finding(
                        trace,
                        "kv-last-page-len",
                        request=b,
                        field=f"plan.kv_last_page_len[{b}]",
                        evidence=f"plan.kv_last_page_len[{b}] = {page_len}, expected a value in [1, {ps}] (page_size {ps})",
                        cause="kv_last_page_len was computed as seq_len % page_size without mapping 0 to a full page, or from a stale length",
                        found=page_len,
                    )
                )
                return None
            length = (count - 1) * ps + page_len if count else 0
        else:
            length = None
        segments.append(_Segment(indices[lo:hi], length, "plan.kv_indices", lo))
    length_field = {"triton": "kv_indptr", "flashinfer": "kv_indptr/kv_last_page_len", "flashinfer-mla": "kv_len_arr"}[vocabulary]
    return _KvView(vocabulary, ps, segments, ends, "kv_indptr", length_field)


def _check_in_cache(trace: Trace, view: _KvView, out: list[Finding]) -> set[int]:
    """index-outside-cache over every request (padded ones too); returns the requests it names."""
    limit = trace.batch.kv_cache_size // view.page_size
    unit = "slot" if view.page_size == 1 else "page"
    for b, seg in enumerate(view.segments):
        j = _first((seg.units < 0) | (seg.units >= limit))
        if j < 0:
            continue
        padded = b >= trace.batch.batch_size
        span = None if padded else _coverage(trace, view, b)
        column = (span[0] if span else 0) + j * view.page_size
        where = f"KV column {column}" if span or padded else f"entry {j}"
        out.append(
            _finding(
                trace,
                "index-outside-cache",
                request=b,
                column=column if span or padded else None,
                field=seg.name(j),
                evidence=f"{seg.name(j)} = {int(seg.units[j])} ({'padded ' if padded else ''}request {b}, {where}) is outside the KV cache: {unit} ids are in [0, {limit})",
                cause=CAUSE_GARBAGE,
                found=int(seg.units[j]),
                limit=limit,
            )
        )
        return {b}
    return set()


def kv_coverage(trace: Trace) -> list[tuple[int, int] | None] | None:
    """Per real request, the columns [start, end) of its KV row that the recorded plan reads, by
    this module's rules; None per request whose plan length fits no rule, and None overall when
    the plan is absent, of an unknown vocabulary, or malformed (the checks above say how)."""
    plan = trace.plan
    if plan is None:
        return None
    scratch: list[Finding] = []
    tensors = {name: v.to(torch.int64) for name, v in plan.tensors.items() if not (v.is_floating_point() or v.is_complex())}
    sane = {name for name in tensors if not _is_indptr(name) or _indptr_shape(trace, name, tensors[name], scratch)}
    view = _kv_view(trace, plan, tensors, sane, scratch)
    if view is None or view.requests < trace.batch.batch_size:
        return None
    return [_coverage(trace, view, b) for b in range(trace.batch.batch_size)]


def _coverage(trace: Trace, view: _KvView, b: int) -> tuple[int, int] | None:
    """(start, end) of request b's columns that the plan covers, or None when its length fits no rule.

    The covered columns end at the prefix or at the whole row (by vocabulary and mode); with a
    sliding window they may start later, page-aligned, but no later than the first column a query
    of the request can see."""
    batch = trace.batch
    seg = view.segments[b]
    ends = {"prefix": int(batch.prefix_lens[b]), "kv": int(batch.kv_lens[b])}
    length = seg.length if seg.length is not None else seg.units.numel() * view.page_size
    for kind in view.ends:
        start = ends[kind] - length
        if 0 <= start <= _needed_start(trace, b) and start % view.page_size == 0:
            return start, ends[kind]
    return None


def _needed_start(trace: Trace, b: int) -> int:
    """The first column of request b's row that any of its queries may see."""
    batch, window = trace.batch, trace.model.sliding_window
    if window < 0:
        return 0
    if trace.is_tree_verify:
        first_query = int(batch.prefix_lens[b])  # the root, at depth 0
    elif int(batch.extend_lens[b]) > 0:
        first_query = int(batch.query_cols[int(batch.qo_indptr[b])])
    else:
        first_query = int(batch.kv_lens[b])
    return max(first_query - window, 0)


def _check_requests(trace: Trace, view: _KvView, skip: set[int], out: list[Finding]) -> None:
    batch = trace.batch
    ps = view.page_size
    rows = [batch.request_slots(b) for b in range(batch.batch_size)]
    for b in range(batch.batch_size):
        if b in skip:
            continue
        seg = view.segments[b]
        ends = {k: {"prefix": int(batch.prefix_lens[b]), "kv": int(batch.kv_lens[b])}[k] for k in view.ends}
        span = _coverage(trace, view, b)
        if span is None:
            length = seg.length if seg.length is not None else seg.units.numel() * ps
            out.append(_length_finding(trace, view, b, length, ends, _needed_start(trace, b)))
            continue
        start, end = span
        expected = rows[b][start:end][::ps] // ps
        found = seg.units
        if found.numel() != expected.numel():
            out.append(_length_finding(trace, view, b, found.numel() * ps, ends, _needed_start(trace, b)))
            continue
        j = _first(found != expected)
        if j < 0:
            continue
        count = int((found != expected).sum())
        unit = "slot" if ps == 1 else "page"
        out.append(
            _finding(
                trace,
                "kv-index",
                request=b,
                column=start + j * ps,
                field=seg.name(j),
                evidence=f"{seg.name(j)} = {int(found[j])} (request {b}, KV column {start + j * ps}), expected {unit} {int(expected[j])} from its req_to_token row; {count} of {found.numel()} entries differ",
                cause=_index_cause(b, found, rows, start, end, ps),
                expected=int(expected[j]),
                found=int(found[j]),
                differing=count,
            )
        )


def _index_cause(b: int, found: Tensor, rows: list[Tensor], start: int, end: int, ps: int) -> str:
    for c, row in enumerate(rows):
        if c == b:
            continue
        for other in (row[start:end][::ps] // ps, row[::ps] // ps):
            k = min(other.numel(), found.numel())
            # Past the other row's used length, a req_to_token row holds zeros.
            if k and torch.equal(found[:k], other[:k]) and not bool(found[k:].any()):
                return CAUSE_WRONG_ROW.format(b=b, c=c)
    own = rows[b][::ps] // ps
    first = start // ps
    for shift in (-2, -1, 1, 2):
        lo = first + shift
        if lo < 0 or lo + found.numel() > own.numel():
            continue
        if torch.equal(found, own[lo : lo + found.numel()]):
            return CAUSE_SHIFTED.format(b=b, k=abs(shift) * ps, direction="late" if shift > 0 else "early")
    return CAUSE_STALE_ROW.format(b=b)


def _length_finding(trace: Trace, view: _KvView, b: int, found: int, ends: dict[str, int], needed: int) -> Finding:
    batch = trace.batch
    window = trace.model.sliding_window
    main = next(iter(ends.values()))
    if window >= 0 and needed > 0:
        expected_text = " or ".join(f"between {e - needed} and {e}" for e in ends.values()) + f" (sliding window {window})"
    else:
        expected_text = " or ".join(f"{k} = {e}" for k, e in ends.items())
    n = trace.spec.draft_token_num if trace.spec is not None else 0
    if trace.is_tree_verify and found == main - n:
        cause = "the draft tokens were not added: SGLang's verify seq_lens exclude them and the backend must add draft_token_num"
    elif trace.is_tree_verify and found == main + n:
        cause = "the draft tokens were counted twice (the seq_lens given to the backend already included them)"
    elif batch.forward_mode is ForwardMode.DECODE and found == main - 1:
        cause = "the length was taken before the decode step's seq_lens += 1, so the current token is missing"
    elif found == main + 1:
        cause = "one column too many: the current token was counted twice"
    elif any(found == int(v) for v in batch.kv_lens) or any(found == int(v) for v in batch.prefix_lens):
        cause = "the length belongs to another request (lengths in the wrong order, or a wrong req_pool_indices entry)"
    else:
        cause = "the plan's lengths were not computed from this batch's seq_lens (a stale or partially updated buffer)"
    return _finding(
        trace,
        "kv-length",
        request=b,
        field=f"plan.{view.length_field}",
        evidence=f"the plan gives request {b} {found} KV columns ({view.length_field}), expected {expected_text}",
        cause=cause,
        expected=main,
        found=found,
    )


def _check_qo(trace: Trace, t: dict[str, Tensor], sane: set[str], requests: int, out: list[Finding]) -> None:
    batch = trace.batch
    for name in ("qo_indptr", "cu_seqlens_q"):
        if name not in sane:
            continue
        values = t[name]
        if values.numel() != requests + 1:
            out.append(_finding(trace, "qo-lens", field=f"plan.{name}", evidence=f"plan.{name} has {values.numel()} entries, expected {requests + 1}", cause="the query offsets were built for another batch size"))
            continue
        lens = values.diff()[: batch.batch_size]
        b = _first(lens != batch.extend_lens)
        if b < 0:
            continue
        if batch.forward_mode is ForwardMode.DECODE or trace.is_tree_verify:
            cause = "the query offsets assume another number of tokens per request (decode 1, verify draft_token_num)"
        else:
            cause = "the query offsets were computed from stale extend lengths (or prefix lengths taken as extend lengths)"
        out.append(
            _finding(
                trace,
                "qo-lens",
                request=b,
                field=f"plan.{name}[{b + 1}]",
                evidence=f"plan.{name} gives request {b} {int(lens[b])} query tokens ({name}[{b + 1}] - {name}[{b}]), the batch has extend_lens[{b}] = {int(batch.extend_lens[b])}",
                cause=cause,
                expected=int(batch.extend_lens[b]),
                found=int(lens[b]),
            )
        )


def _check_splits(trace: Trace, plan: Plan, t: dict[str, Tensor], requests: int, out: list[Finding]) -> None:
    splits = t.get("num_kv_splits")
    if splits is None:
        return
    if splits.numel() != requests:
        out.append(_finding(trace, "num-kv-splits", field="plan.num_kv_splits", evidence=f"plan.num_kv_splits has {splits.numel()} entries for {requests} requests", cause="the split counts were sized for another batch"))
        return
    top = plan.scalars.get("max_kv_splits")
    top = int(top) if isinstance(top, int) and not isinstance(top, bool) else None
    bad = (splits < 1) | ((splits > top) if top is not None else torch.zeros_like(splits, dtype=torch.bool))
    b = _first(bad)
    if b < 0:
        return
    value = int(splits[b])
    if value < 1:
        cause = "a request with no KV split is skipped by stage 1 and merged from nothing in stage 2 (NaN or stale output)"
    else:
        cause = "the stage-1 scratch holds max_kv_splits partials per request; more splits write past it"
    out.append(
        _finding(
            trace,
            "num-kv-splits",
            request=b,
            field=f"plan.num_kv_splits[{b}]",
            evidence=f"plan.num_kv_splits[{b}] = {value}, expected a value in [1, {top if top is not None else 'max_kv_splits'}]",
            cause=cause,
            found=value,
            maximum=top,
        )
    )
