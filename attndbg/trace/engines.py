"""What an engine's recorded fields mean, declared as data per engine, and the one lookup from a
trace's `source.engine` to them. No detector compares an engine's name: each asks
`engine_conventions(trace)`.

The trace keeps what engines disagree on as recorded (DESIGN.md "The trace": the raw `seq_lens`,
the padded rows as the runner filled them, the engine's own metadata in the plan); how to read it
is declared here, the way backends/capabilities.py declares what a backend's kernels take. Only
what a checker reads today is declared. Sources: ../shared/reference/engines.md (SGLang A2, A3:
verify seq_lens exclude the drafts; vLLM B2, B5) and attndbg/record/vllm/fields.py (the plan names
the vLLM recorder writes).

An engine not in the table (synth, the importers' engines) is read with SGLang's conventions: the trace's fields are named after SGLang's (DESIGN.md "The trace").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from attndbg.trace.schema import ForwardMode, Trace


@dataclass(frozen=True)
class VerifySeqLens:
    """What a tree-verify step's raw `seq_lens` (`batch.seq_lens_raw`) count."""

    includes_drafts: bool  # prefix + draft tokens; False: the prefix only
    rule: str  # the convention as a seq-lens finding states it
    # Why a verify step's seq_lens follow the other convention (drafts counted, or not, wrongly).
    mixup_cause: str


@dataclass(frozen=True)
class BuilderTensor:
    """A tensor an engine's metadata builder hands its kernels that copies one of the engine's own
    metadata fields for some of the requests: the two must agree on the real requests."""

    name: str  # plan.tensors: the builder's name for it (nested parts dotted: "decode.seq_lens")
    meaning: str  # the MetadataFields field it copies: "query_start_loc", "seq_lens", "block_table", "slot_mapping"
    # Which requests its rows are: "all" from request 0, "decodes" the first num_decodes (the
    # builder's count), "prefills" the rest (MLA's decode and prefill parts, vLLM: decodes first).
    rows: str = "all"


@dataclass(frozen=True)
class MetadataFields:
    """Where an engine that records its own attention metadata keeps it in the plan. Each field
    lists the names to read, first present wins: the verbatim evidence, then the names a backend's
    builder passes the same tensor through under (recordings made before the evidence was kept)."""

    query_start_loc: tuple[str, ...]  # plan.tensors: [rows + 1] query offsets, the padded tail included
    seq_lens: tuple[str, ...]  # plan.tensors: [rows] KV lengths, padded rows included
    block_table: tuple[str, ...]  # plan.tensors: [rows, width] block ids
    slot_mapping: tuple[str, ...]  # plan.tensors: [num_actual_tokens] the KV slot each token writes
    # Host mirrors the builder plans from (plan.tensors), each with what it must hold.
    query_start_loc_cpu: str  # == query_start_loc
    seq_lens_cpu: str  # == seq_lens (real rows)
    num_computed_tokens_cpu: str  # == seq_lens - query lengths (real rows)
    seq_lens_cpu_upper_bound: str  # >= seq_lens (real rows)
    num_actual_tokens: tuple[str, ...]  # plan.scalars: the step's query tokens
    max_seq_len: tuple[str, ...]  # plan.scalars: the longest seq_len kernels are sized for
    num_blocks: tuple[str, ...]  # plan.scalars: blocks in the KV pool (from the engine's config)
    # plan.scalars: true where the engine moves request boundaries of query_start_loc on the device
    # only (vLLM V2's adaptive verification): its host mirror then keeps the total and row count.
    device_only_boundaries: tuple[str, ...] = ()
    # plan.tensors: the seq_lens the builder hands its kernels ([rows], padded rows included),
    # first present wins. A builder may hand its kernel other padded rows than the runner's
    # (vLLM's FlashMLA FP8 path clamps them to >= 1, #35969): what the kernel gets is judged.
    kernel_seq_lens: tuple[str, ...] = ()
    # The builder's copies of these fields (plan.tensors), each judged against the field it copies.
    builder_tensors: tuple[BuilderTensor, ...] = ()
    # Builders that hand their kernels a batch of their own making (chunked local attention's
    # virtual batches), whose tensors copy nothing: by the builder's class name (plan.scalars).
    builder_name: str = ""
    transforming_builders: tuple[str, ...] = ()
    # plan.scalars: the builder's request and token counts (decodes first), and its paged-KV lists'
    # prefixes ("" top level, "decode." an MLA decode part): paged_kv_indptr, paged_kv_last_page_len.
    counts: tuple[str, ...] = ()
    paged_kv_prefixes: tuple[str, ...] = ()
    # A split-KV kernel scheduled ahead of time outside the graph: plan.tensors holding the
    # schedule (present: scheduled at each step) and plan.scalars holding the bound on its split
    # count that the graph's capture sized its split buffers for (0: no bound).
    split_schedule: tuple[str, ...] = ()
    split_bound: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenIndices:
    """An engine that addresses its KV cache by token row (transformers' paged cache): the plan
    tensors holding its raw indices and the plan scalar bounding them (rows of its token view).
    Recorded as evidence only when an index is outside (attndbg/record/transformers/trace.py)."""

    fields: tuple[str, ...]  # plan.tensors: raw index tensors, [0, bound) each
    bound: str  # plan.scalars: rows of the engine's token view


@dataclass(frozen=True)
class EngineConventions:
    """One engine's conventions, as data."""

    verify_seq_lens: VerifySeqLens
    # Padded rows carry request-pool rows (graph.padded_req_pool_indices, SGLang's req_to_token)
    # worth judging. False: the engine has no request pool; what a trace holds there is made up.
    request_pool: bool
    # The runner leaves padded rows' positions stale by design (not a finding).
    stale_padded_positions: bool
    # Its own attention metadata kept in the plan (None: it keeps none).
    metadata: MetadataFields | None = None
    token_indices: TokenIndices | None = None


SGLANG = EngineConventions(
    verify_seq_lens=VerifySeqLens(
        includes_drafts=False,
        rule="SGLang verify: the prefix only",
        mixup_cause="the engine's verify seq_lens include the draft tokens; SGLang backends add draft_token_num themselves, so the drafts are counted twice",
    ),
    request_pool=True,
    stale_padded_positions=False,
)

# vLLM v1: no request pool (a request's KV row is its block-table row), padded positions left stale
# (engines.md B5), seq_lens count the speculative tokens; its CommonAttentionMetadata is recorded
# verbatim as `common.*` (record/vllm/fields.py), and the builders' outputs pass some of it through.
VLLM = EngineConventions(
    verify_seq_lens=VerifySeqLens(
        includes_drafts=True,
        rule="vLLM: prefix + draft tokens",
        mixup_cause="vLLM's seq_lens count the speculative tokens; these exclude them",
    ),
    request_pool=False,
    stale_padded_positions=True,
    metadata=MetadataFields(
        query_start_loc=("common.query_start_loc", "query_start_loc"),
        seq_lens=("common.seq_lens", "seq_lens"),
        block_table=("common.block_table_tensor", "block_table_tensor", "block_table"),
        slot_mapping=("common.slot_mapping", "slot_mapping"),
        query_start_loc_cpu="common.query_start_loc_cpu",
        seq_lens_cpu="common.seq_lens_cpu",
        num_computed_tokens_cpu="common.num_computed_tokens_cpu",
        seq_lens_cpu_upper_bound="common.seq_lens_cpu_upper_bound",
        num_actual_tokens=("common.num_actual_tokens", "vllm.num_actual_tokens"),
        max_seq_len=("common.max_seq_len", "vllm.max_seq_len"),
        num_blocks=("vllm.num_gpu_blocks",),
        device_only_boundaries=("vllm.adaptive_verification",),
        kernel_seq_lens=("decode.seq_lens", "seq_lens"),
        # Names from vLLM 0.33's metadata classes (engines.md B3): FlashAttention's, Triton's and
        # FlashInfer's pass the step's tensors through; MLACommonMetadata splits decodes and prefills.
        builder_tensors=(
            BuilderTensor("query_start_loc", "query_start_loc"),
            BuilderTensor("seq_lens", "seq_lens"),
            BuilderTensor("block_table", "block_table"),
            BuilderTensor("block_table_tensor", "block_table"),
            BuilderTensor("slot_mapping", "slot_mapping"),
            BuilderTensor("decode.seq_lens", "seq_lens", rows="decodes"),
            BuilderTensor("decode.block_table", "block_table", rows="decodes"),
            BuilderTensor("prefill.block_table", "block_table", rows="prefills"),
        ),
        builder_name="vllm.builder",
        transforming_builders=("ChunkedLocalAttentionBuilder", "ChunkedLocalAttentionMetadataBuilder"),
        counts=("num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens", "num_actual_tokens"),
        paged_kv_prefixes=("", "decode."),
        # FlashAttentionMetadata (FA3's ahead-of-time scheduler, vLLM #20301).
        split_schedule=("scheduler_metadata",),
        split_bound=("max_num_splits",),
    ),
)

# transformers' continuous batching: no request pool, no padded requests (it pads tokens), no
# verify steps; its raw cache indices are kept in the plan when one is outside its token view.
TRANSFORMERS = EngineConventions(
    verify_seq_lens=SGLANG.verify_seq_lens,
    request_pool=False,
    stale_padded_positions=False,
    token_indices=TokenIndices(fields=("read_index", "write_index"), bound="token_rows"),
)

ENGINES: Mapping[str, EngineConventions] = MappingProxyType({"sglang": SGLANG, "vllm": VLLM, "transformers": TRANSFORMERS})
DEFAULT = SGLANG  # an engine not in ENGINES


def engine_conventions(trace: Trace) -> EngineConventions:
    """The conventions of the engine that recorded `trace` (DEFAULT for one not in ENGINES)."""
    return ENGINES.get(trace.source.engine, DEFAULT)


def draft_decode(trace: Trace) -> tuple[int, int] | None:
    """(topk, step) of a draft decode step, as the SGLang recorder keeps its multi-step draft
    backend's host facts (plan.scalars draft_topk, draft_step; record/sglang/draft.py), else None."""
    scalars = trace.plan.scalars if trace.plan is not None and trace.batch.forward_mode is ForwardMode.DECODE else {}
    topk, step = scalars.get("draft_topk"), scalars.get("draft_step")
    if isinstance(topk, int) and isinstance(step, int) and not isinstance(topk, bool) and not isinstance(step, bool) and topk >= 1 and step >= 0:
        return topk, step
    return None
