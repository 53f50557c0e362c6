"""invariants: the batch's own bookkeeping and the recorded plan, checked against the batch.

The batch is the ground truth (validated on load); what the engine *recorded* is evidence: its
`positions` and raw `seq_lens` (not validated on load, engines disagree) and its plan. Checks:

    positions          decode: kv_len - 1; extend/mixed: prefix + i; selective: the token's column;
                       verify: prefix + depth of the draft token
    seq-lens           the engine's raw seq_lens, per SGLang's semantics (decode/extend: kv_len;
                       verify: prefix only, the backend adds draft_token_num); vLLM: always kv_len
                       (each engine's convention: attndbg/trace/engines.py)
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
    num-kv-splits      in [1, max_kv_splits], one per request (a graph replay: also within the
                       captured scratch, capture.max_kv_splits)
    capture-batch-size, capture-num-tokens, capture-kv-indices, capture-mask, capture-block-table
                       the step fits the sizes the engine captured its graphs with (`Trace.capture`):
                       invariants/capture.py
    window-kv          SGLang's sliding-window list (window_kv_indptr / _indices / _offsets) against
                       the batch's rows and the window (invariants_window)
    mask-length        a selective step's custom_mask is as long as mask_indptr[-1]
    plan-pointer-moved (recording) plan tensors keep their data pointers across graph replays
    vLLM's CommonAttentionMetadata (query_start_loc, seq_lens, block table, slot_mapping, host
                       mirrors), kept verbatim as `common.*` plan tensors: invariants_vllm.py
    window-off         a sliding-window layer's kernel planned without its window while a request's
                       list reaches past its queries' windows: invariants/window.py
    builder-copy, builder-counts
                       what a vLLM builder handed its kernels (its copies of those fields, its
                       decode/prefill counts, its paged-KV lists) against them: vllm_builder.py
    plan-info-*        FlashInfer's own schedule of the plan (plan.plan_info: request_indices,
                       kv_tile_indices, padded_batch_size, block_valid_mask, o_indptr, merge_indptr)
                       against the plan's batch: invariants/schedule.py
    host-hint          a host-side hint a kernel sizes its grid or block-table walk by (max_seq_len,
                       max_query_len, max_seqlen_q, max_extend_len; which reach which kernel: the
                       adapters' declarations) against the batch: invariants/host_hints.py
    transformers' raw token-row indices (read_index, write_index), kept when one is outside its
                       token view: invariants/token_indices.py

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

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.invariants.base import KIND
from attndbg.detectors.invariants.batch import _check_positions, _check_seq_lens
from attndbg.detectors.invariants.capture import check_capture
from attndbg.detectors.invariants.host_hints import check_host_hints
from attndbg.detectors.invariants.plan import _check_plan
from attndbg.detectors.invariants.schedule import check_schedule
from attndbg.detectors.invariants.token_indices import check_token_indices
from attndbg.detectors.invariants.vllm import check_vllm
from attndbg.detectors.invariants.vllm_builder import check_builder
from attndbg.detectors.invariants.window import check_kernel_window, check_window_list
from attndbg.plans.reading import PlanReading, read
from attndbg.trace.schema import Trace


POINTER_SUFFIX = "_data_ptr"


CAUSE_POINTER = (
    "the engine allocated this metadata tensor afresh at replay instead of copying into the captured buffer, so the "
    "graph reads the capture-time (freed) memory (SGLang PR #26019 review)"
)


def detect(ctx: CheckContext) -> list[Finding]:
    return check_trace(ctx.trace, ctx.plan())


def check_trace(trace: Trace, reading: PlanReading | None = None) -> list[Finding]:
    """Every single-step invariant of `trace` (pure: no kernels run); `reading`: the step's plan
    reading (default: read here)."""
    out: list[Finding] = []
    _check_positions(trace, out)
    _check_seq_lens(trace, out)
    if trace.plan is not None:
        reading = reading if reading is not None else read(trace)
        _check_plan(trace, reading, out)
        check_window_list(trace, reading.layout, out)
        check_kernel_window(trace, reading, out)
        check_schedule(trace, reading.schedule, out)
    check_vllm(trace, out)
    if trace.plan is not None:
        check_builder(trace, reading, out)
        check_host_hints(trace, reading, out)
    check_token_indices(trace, out)
    check_capture(trace, out)  # last: it defers to block-table-short and replaces indptr-end on a captured buffer
    return out


@dataclass(frozen=True)
class PointerDigest:
    """What plan-pointer-moved keeps of a graph-replayed step: which graph, and its plan's pointers."""

    step: int
    path: str
    graph_key: tuple  # (tp_rank, mode, capture_bs, plan backend): one captured graph
    description: str  # "the decode graph captured at bs=8"
    pointers: dict[str, int]  # plan tensor name -> data pointer


def recording_digest(ctx: CheckContext) -> PointerDigest | None:
    trace = ctx.trace
    if trace.plan is None or trace.graph is None or not trace.graph.is_graph_replay:
        return None
    pointers = {
        key[: -len(POINTER_SUFFIX)]: value
        for key, value in sorted(trace.plan.scalars.items())
        if key.endswith(POINTER_SUFFIX) and isinstance(value, int) and not isinstance(value, bool)
    }
    mode, capture_bs = trace.batch.forward_mode.value, trace.graph.capture_bs
    graph_key = (trace.source.tp_rank, mode, capture_bs, trace.plan.backend)
    return PointerDigest(ctx.step, ctx.path, graph_key, f"the {mode} graph captured at bs={capture_bs}", pointers)


class RecordingState:
    """plan-pointer-moved over a recording, one step at a time: the first pointer of each (graph, tensor)."""

    def __init__(self) -> None:
        self.first: dict[tuple, tuple[int, int]] = {}  # (graph key, name) -> (step, pointer)
        self.reported: set[tuple] = set()

    def observe(self, now: PointerDigest | None) -> list[Finding]:
        if now is None:
            return []
        out = []
        for name, value in now.pointers.items():
            key = (now.graph_key, name)
            seen = self.first.setdefault(key, (now.step, value))
            if seen[1] == value or key in self.reported:
                continue
            self.reported.add(key)
            out.append(
                finding(
                    KIND,
                    "plan-pointer-moved",
                    step=now.step,
                    field=f"plan.{name}",
                    evidence=f"plan.{name} is at {value:#x} in step {now.step} but was at {seen[1]:#x} in step {seen[0]}, "
                    f"both replays of {now.description}",
                    cause=CAUSE_POINTER,
                    trace=now.path,
                    name=name,
                    expected=seen[1],
                    found=value,
                    first_step=seen[0],
                )
            )
        return out


def detect_recording(contexts: list[CheckContext]) -> list[Finding]:
    """plan-pointer-moved: a plan tensor whose `NAME_data_ptr` changes between replays of one graph."""
    state = RecordingState()
    ordered = sorted(contexts, key=lambda c: (c.trace.source.tp_rank, c.step))
    return [f for ctx in ordered for f in state.observe(recording_digest(ctx))]
