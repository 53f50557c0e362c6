"""Trace format v1: one engine forward step, engine-neutral, named after SGLang where a name exists.

A trace is stored as a plain dict of str/int/float/bool/None/list/dict and torch tensors, so that
`torch.load(weights_only=True)` can read it without executing code. In memory it is the frozen
dataclasses below. `attndbg.trace.validate` checks every field on load; objects built here by
synth or recorders are validated the same way before they are written.

Lengths are stored unambiguously (prefix / extend / kv) because engines disagree on what
`seq_lens` means: SGLang's decode seq_lens include the current token, its verify seq_lens exclude
the draft tokens. The engine's raw `seq_lens` is kept alongside, as recorded.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

FORMAT_NAME = "attndbg.trace"
FORMAT_VERSION = 1  # `buffers`, `capture`, graph.padded_qo_indptr / padded_block_table / captured, source.inferred, source.crash, model.causal / window_right / sinks / k_scale / v_scale, batch.cross / custom_mask and `merge` (optional, absent in older files) were added within version 1


class ForwardMode(enum.Enum):
    """SGLang's ForwardMode, stored by name (its int values differ between SGLang versions)."""

    DECODE = "DECODE"
    EXTEND = "EXTEND"
    MIXED = "MIXED"
    TARGET_VERIFY = "TARGET_VERIFY"
    DRAFT_EXTEND = "DRAFT_EXTEND"
    IDLE = "IDLE"


class AttentionKind(enum.Enum):
    MHA = "mha"  # includes GQA / MQA
    MLA = "mla"  # not a backend name: DeepSeek absorbed MLA: keys = [latent | rope], values = latent


class MaskLayout(enum.Enum):
    """How an engine lays out a speculative tree mask (SGLang's TreeMaskMode)."""

    FULL = "full"  # per request a row-major [n, prefix + n] bool block
    QLEN_ONLY = "qlen_only"  # per request [n, n] bool
    QLEN_ONLY_BITPACKED = "qlen_only_bitpacked"  # one little-endian word per row, bit 0 = root


class GraphCapture(enum.Enum):
    """Which steps the engine's runner captured in CUDA graphs (what a replayed graph may hold)."""

    DECODE = "decode"  # uniform decode / verify batches only: SGLang's runner, vLLM FULL_DECODE_ONLY and FULL_AND_PIECEWISE's full graphs
    MIXED = "mixed"  # also batches mixing prefill chunks with decode rows (vLLM FULL with a backend that captures them)
    FULL = "full"  # every batch, pure extend / prefill included (vLLM FULL, AttentionCGSupport.ALWAYS)


class LseBase(enum.Enum):
    E = "e"  # natural log (Triton, FA3)
    TWO = "2"  # base 2 (FlashInfer kernels)


DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
Q_DTYPES = ("float16", "bfloat16", "float32")


def indptr(lengths: Tensor) -> Tensor:
    """[n] lengths -> [n+1] int64 offsets starting at 0 (the CSR "indptr" every plan uses)."""
    return torch.nn.functional.pad(torch.cumsum(lengths.to(torch.int64), 0), (1, 0))


@dataclass(frozen=True)
class Source:
    """Where the step came from."""

    engine: str  # "synth", "sglang", "vllm", "transformers", ...
    engine_version: str
    backend: str  # the attention backend the engine ran ("triton", "flashinfer", ...)
    device: str  # "cpu" or "cuda:<name>"
    tp_rank: int
    step: int
    attndbg_version: str
    # Added within version 1 (absent in older files: empty). What the step's source format did not
    # carry and the importer filled in (`attndbg import`): trace field -> how it was inferred, e.g.
    # "model.sm_scale": "1/sqrt(head_dim): the plan gave none". Recorders leave it empty.
    inferred: dict[str, str] = field(default_factory=dict)
    # Added within version 1 (absent in older files: None). The call did not return where it ran
    # (an imported call whose kernel crashed: its inputs were dumped, its outputs never were): the
    # error its source logged, "" when none was. `check` and `replay` run it again in an isolated
    # worker; `repro` writes a script that crashes the same way.
    crash: str | None = None


@dataclass(frozen=True)
class Model:
    """The attention layer's shape and numerics."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int  # query/key width (576 for DeepSeek MLA: kv_lora_rank + qk_rope_head_dim)
    v_head_dim: int  # value/output width (512 for MLA)
    attention: AttentionKind
    kv_lora_rank: int  # MLA only, else 0
    qk_rope_head_dim: int  # MLA only, else 0
    sm_scale: float
    logit_cap: float  # tanh soft-cap on scaled logits; 0 = off
    sliding_window: int  # window_left: key k visible from query q iff pos(q) - pos(k) <= window; -1 = off
    q_dtype: str  # a key of DTYPES
    kv_dtype: str
    page_size: int
    # Added within version 1 (absent in older files: these defaults, and left out when they hold).
    causal: bool = True  # False: a query also sees the keys after its own column (encoder / bidirectional layers)
    window_right: int = -1  # non-causal only: key k visible from query q iff pos(k) - pos(q) <= window_right; -1 = no bound
    sinks: Tensor | None = None  # [num_qo_heads] float32: learned sink logit per query head (gpt-oss): one more softmax term with no value
    k_scale: float = 1.0  # dequantisation scale of the (fp8) KV cache: a key is its stored value * k_scale
    v_scale: float = 1.0  # a value is its stored value * v_scale

    @property
    def gqa_group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True)
class Batch:
    """What attention must compute this step, from the engine's point of view.

    Request b owns columns 0..kv_lens[b]-1 of its KV row; column j lives in KV slot
    `slot_ids[slot_indptr[b] + j]` (its req_to_token row, used part). Query token t of
    request b sits at column `query_cols[t]` of that row and its new K/V are written to
    `out_cache_loc[t]` == that column's slot before attention runs. Non-tree queries attend
    causally: to columns <= their own. Verify queries attend to the prefix and to their draft
    ancestors (see `Spec`).
    """

    forward_mode: ForwardMode
    prefix_lens: Tensor  # [bs] int64: KV already cached before this step
    extend_lens: Tensor  # [bs] int64: query tokens this step
    kv_lens: Tensor  # [bs] int64: KV columns visible this step = prefix + extend
    slot_indptr: Tensor  # [bs+1] int64: request b's slot ids are slot_ids[slot_indptr[b]:slot_indptr[b+1]]
    slot_ids: Tensor  # [sum(kv_lens)] int64: req_to_token rows, used part
    query_cols: Tensor  # [num_tokens] int64: column of each query token in its request's row
    out_cache_loc: Tensor  # [num_tokens] int64: slot each new token's K/V is written to
    positions: Tensor  # [num_tokens] int64: rope positions, as the engine computed them
    seq_lens_raw: Tensor  # [bs] int64: the engine's own seq_lens, as recorded
    kv_cache_size: int  # slots in the KV pool; slot 0 (page 0) is the engine's dummy slot
    selective: bool = False  # CacheBlend-style: query_cols is a subset of the row, not its tail
    # Added within version 1 (absent in older files: False / None, and left out when so).
    # Cross-attention (vLLM's ENCODER_DECODER layers): a request's KV row is the encoder's tokens,
    # all cached before this step (prefix_lens == kv_lens, independent of extend_lens); its queries
    # sit at no column of that row and write nothing (out_cache_loc -1). query_cols then hold the
    # bottom-right alignment FlashAttention and FlashInfer use for a causal mask over q_len != kv_len,
    # kv_len - q_len + i, negative for the rows of a request with more queries than keys.
    cross: bool = False
    # A custom mask on a non-verify step (an extend with bidirectional spans, say): per request a
    # row-major [extend_len, kv_len] bool block over its KV row, blocks back to back; it replaces
    # causality (a sliding window still applies).
    custom_mask: Tensor | None = None  # [sum(extend_lens * kv_lens)] bool

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.query_cols.numel())

    @property
    def qo_indptr(self) -> Tensor:
        """[bs+1] int64: request b's query tokens are rows qo_indptr[b]:qo_indptr[b+1]."""
        return indptr(self.extend_lens)

    def request_slots(self, b: int) -> Tensor:
        return self._request_rows[b]

    def mask_block(self, b: int) -> Tensor:
        """[extend_lens[b], kv_lens[b]] bool: request b's block of `custom_mask` (a view)."""
        assert self.custom_mask is not None, "mask_block needs a custom_mask"
        return self._mask_blocks[b].view(int(self.extend_lens[b]), int(self.kv_lens[b]))

    def slot_owner(self, slot: int, *, other_than: int | None = None) -> tuple[int, int] | None:
        """(request, column) of the first request, in batch order, whose KV row holds `slot`
        (leaving out request `other_than`); None when no such request reads it."""
        hits = torch.nonzero(self.slot_ids == slot).flatten()
        owners = torch.searchsorted(self.slot_indptr, hits, right=True) - 1
        if other_than is not None:
            keep = owners != other_than
            hits, owners = hits[keep], owners[keep]
        if not hits.numel():
            return None
        b = int(owners[0])
        return b, int(hits[0]) - int(self.slot_indptr[b])

    @functools.cached_property
    def _request_rows(self) -> list[Tensor]:
        # One split for every request's row (views): replay, plans and the reference ask per request
        # hundreds of times a step, and indexing the indptr tensor each time costs more than the work.
        return list(torch.split(self.slot_ids, self.slot_indptr.diff().tolist()))

    @functools.cached_property
    def _mask_blocks(self) -> list[Tensor]:
        return list(torch.split(self.custom_mask, (self.extend_lens * self.kv_lens).tolist()))


@dataclass(frozen=True)
class Spec:
    """Speculative decoding info of a verify (or draft) step."""

    algorithm: str  # "EAGLE", "EAGLE3", "NGRAM", ...
    draft_token_num: int  # n: tokens verified per request (root + n-1 drafts)
    topk: int
    steps: int  # draft depth
    parents: Tensor  # [bs, n] int64: parent draft index per token, -1 for the root (index 0)
    custom_mask: Tensor | None  # the engine's mask exactly as recorded (flat), or None
    mask_layout: MaskLayout


@dataclass(frozen=True)
class Graph:
    """CUDA-graph padding of this step, as the engine's runner filled it (real rows first).

    Engine-neutral: what an engine does not have is None, never made up. SGLang pads a request
    pool index per row and keeps no query offsets or block table among its runner's static
    buffers (its backends' graph buffers are the plan's); vLLM has no request pool (a request's KV
    row is its block-table row) but pads query_start_loc and the block table itself.
    """

    is_graph_replay: bool
    capture_bs: int
    fill_value: int  # seq_len fill of padded rows
    padded_seq_lens: Tensor  # [capture_bs] int64: the static seq_lens buffer, real rows first
    padded_req_pool_indices: Tensor | None  # [capture_bs] int64; None: the engine has no request pool (vLLM)
    padded_out_cache_loc: Tensor  # [capture_bs * tokens_per_req] int64
    padded_positions: Tensor  # [capture_bs * tokens_per_req] int64
    # Added within version 1; absent from older files (None). Stored as the engine filled them:
    # [capture_bs+1] query offsets (vLLM query_start_loc), the padded rows' tail included.
    padded_qo_indptr: Tensor | None = None
    # [capture_bs, width] block/page ids per row (vLLM block_table_tensor), padded rows included
    # (vLLM fills them with NULL_BLOCK_ID 0; a -1 fill shows as recorded).
    padded_block_table: Tensor | None = None
    # Which steps the runner captured (None: decode and verify only, what every engine did before).
    captured: GraphCapture | None = None


# Fields added within version 1, with the value that means "absent": left out of the stored dict
# when they hold it, so a file without them stays byte-identical to one written before they existed.
GRAPH_OPTIONAL = ("padded_qo_indptr", "padded_block_table", "captured")
MODEL_DEFAULTS: dict[str, Any] = {"causal": True, "window_right": -1, "sinks": None, "k_scale": 1.0, "v_scale": 1.0}
BATCH_DEFAULTS: dict[str, Any] = {"cross": False, "custom_mask": None}


@dataclass(frozen=True)
class CaptureSizes:
    """What the engine sized once, when it captured its CUDA graphs: the limits every graph replay
    must fit in. Each is None when the engine exposes no such size or the adapter could not read
    it; a recorder never guesses one.

    Where they come from: SGLang's graph runner (`max_bs`, `max_num_token`, or the replay view's
    static buffers) and attention backend (`cuda_graph_attn_logits` [max_num_tokens, H,
    max_kv_splits, Dv], `cuda_graph_kv_indices`, the verify mask buffer, FlashInfer's workspace);
    vLLM's config (`scheduler_config.max_num_seqs`, `compilation_config.cudagraph_capture_sizes`)
    and the step's own persistent block table (its width).
    """

    max_bs: int | None = None  # requests the static buffers hold (SGLang max_bs; vLLM max_num_seqs)
    max_num_tokens: int | None = None  # tokens the largest captured graph holds
    max_kv_splits: int | None = None  # split-KV partials per request the stage-1 scratch holds
    mask_capacity: int | None = None  # elements of the custom-mask buffer graphs read
    kv_indices_capacity: int | None = None  # elements of the kv_indices buffer graphs read
    block_table_width: int | None = None  # block/page ids per request row
    workspace_bytes: int | None = None  # FlashInfer's float workspace (recorded, not judged)

    def known(self) -> dict[str, int]:
        """The sizes the engine gave, by field name."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if getattr(self, name) is not None}


@dataclass(frozen=True)
class PlanInfo:
    """A kernel library's own schedule of the plan, as its plan() left it on the host: the library
    reads it, never the engine. FlashInfer: the wrapper's `_plan_info` vector and the head of its
    pinned int workspace (`_pin_memory_int_workspace_buffer`), whose arrays the vector's offsets
    place (request_indices, kv_tile_indices, block_valid_mask, ...). What the entries mean is the
    backend's (backends/flashinfer_plan_info.py); read in attndbg/plans/schedule.py."""

    vector: Tensor  # [n] int64: the plan-info vector, as plan() returned it
    workspace: Tensor  # [bytes] uint8: the host int workspace from its start, as far as the vector's arrays reach


@dataclass(frozen=True)
class Plan:
    """What the live backend built, by the backend's own names. Evidence: loaded, never fixed."""

    backend: str
    tensors: dict[str, Tensor]
    scalars: dict[str, int | float | bool | str]
    # The library's own schedule of this plan (added; absent in older files and where not recorded).
    plan_info: PlanInfo | None = None


@dataclass(frozen=True)
class EngineBuffer:
    """The engine buffer behind a recorded tensor (`Trace.buffers[field]`): evidence kept beside the
    engine-neutral fields, so a detector can judge a buffer that is too long or holds a stale tail.

    The tensor at `field` ("spec.custom_mask", "plan.custom_mask", "plan.kv_indices", ...) is the
    buffer's head, untrimmed: all of it for a buffer the engine sized for this step (then a wrong
    length is the engine's); for a `capacity` buffer, its first max(read, this step's need)
    elements, because no kernel of this step reads further and the rest can be hundreds of MB.
    """

    length: int  # elements the engine's buffer really has (>= the recorded tensor's numel)
    read: int  # elements the step's kernel reads from its start, by the engine's own offsets (mask_indptr[-1], kv_indptr[-1] of the launched batch); -1: the engine gives none
    capacity: bool  # allocated once at a fixed size (a CUDA-graph buffer, SGLang's VerifyMask, an over-allocation by design): its length says nothing about this step


@dataclass(frozen=True)
class LayerTensors:
    """Real tensors of one layer (optional). KV rows are compacted: cache row i is slot kv_slots[i]."""

    q: Tensor  # [num_tokens, Hq, head_dim]
    k_new: Tensor  # [num_tokens, Hkv, head_dim]
    v_new: Tensor  # [num_tokens, Hkv, v_head_dim] (for MLA: empty, values are the key latent part)
    kv_slots: Tensor  # [R] int64: slot ids of the rows below
    k_rows: Tensor  # [R, Hkv, head_dim]: cache contents before this step's writes
    v_rows: Tensor  # [R, Hkv, v_head_dim]
    output: Tensor | None  # [num_tokens, Hq, v_head_dim]: the engine's output
    lse: Tensor | None  # [num_tokens, Hq]
    lse_base: LseBase


@dataclass(frozen=True)
class MergeStates:
    """A standalone merge of given partial attention states: what FlashInfer's
    `merge_state(v_a, s_a, v_b, s_b)` / `merge_state_in_place` / `merge_states(v, s)` and vLLM's
    `merge_attn_states` compute (SGLang's cascade and chunked-prefix paths, vLLM's MLA chunked
    prefill). State i of a row is a normalised output v[i] with its LSE s[i]; the merge weighs each
    by exp(s[i]) (2**s[i] in base 2). A state with LSE -inf attended to no key (an empty chunk): it
    weighs 0 and its output is never read.

    Layouts are FlashInfer's, states first: vLLM's LSEs are [heads, tokens] and its natural-log base,
    an adapter's to map. The step that holds one runs no attention of its own (an IDLE batch of no
    requests); its model gives the heads (num_qo_heads), width (v_head_dim) and dtype (q_dtype)."""

    v: Tensor  # [num_states, tokens, heads, v_head_dim] in the model's q_dtype
    s: Tensor  # [num_states, tokens, heads] float32: finite or -inf
    lse_base: LseBase  # of `s` and of the recorded `lse`
    output: Tensor | None = None  # [tokens, heads, v_head_dim]: the engine's merged output, as recorded
    lse: Tensor | None = None  # [tokens, heads] float32: its merged LSE, in lse_base
    # [tokens] bool: merge_state_in_place's row mask: rows where it is false are not merged and keep
    # state 0 (v_a, s_a) as they were. Two states only.
    mask: Tensor | None = None

    @property
    def num_states(self) -> int:
        return int(self.v.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.v.shape[1])

    def words(self) -> str:
        """'merge of 2 states x 48 tokens x 8 heads, width 128 bfloat16, LSE base 2' (what a reader is told)."""
        states, tokens, heads, width = self.v.shape
        recorded = ", output recorded" if self.output is not None else ""
        masked = f", {int(self.mask.sum())} of {tokens} rows merged (row mask)" if self.mask is not None else ""
        return f"merge of {states} states x {tokens} tokens x {heads} heads, width {width} {str(self.v.dtype).replace('torch.', '')}, LSE base {self.lse_base.value}{masked}{recorded}"


@dataclass(frozen=True)
class Trace:
    source: Source
    model: Model
    batch: Batch
    seed: int  # replay draws q/k/v from this seed when tensors are absent
    spec: Spec | None = None
    graph: Graph | None = None
    plan: Plan | None = None
    tensors: dict[int, LayerTensors] = field(default_factory=dict)  # by layer id
    # Recorded tensor field -> the engine buffer behind it (absent: the tensor is the whole buffer
    # and nothing says how much the kernel reads; traces written before buffers existed load so).
    buffers: dict[str, EngineBuffer] = field(default_factory=dict)
    # What the engine sized at graph capture (absent in older files and for engines that expose none).
    capture: CaptureSizes | None = None
    # Added within version 1 (absent in older files: None, and then not stored): the step is a
    # standalone merge of these given partial states, not an attention step.
    merge: MergeStates | None = None

    @property
    def is_tree_verify(self) -> bool:
        return self.spec is not None and self.batch.forward_mode is ForwardMode.TARGET_VERIFY


def to_dict(trace: Trace) -> dict[str, Any]:
    """The storage form: plain containers and tensors only (weights_only-loadable)."""

    def plain(obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return obj.value
        if isinstance(obj, Tensor):
            return obj.detach().cpu().contiguous()
        if isinstance(obj, dict):
            return {str(k): plain(v) for k, v in obj.items()}
        if hasattr(obj, "__dataclass_fields__"):
            return {name: plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
        return obj

    out = plain(trace)
    # Sections and fields added within version 1 are left out when empty: files without them stay
    # byte-identical to those written before they existed.
    if not out["buffers"]:
        del out["buffers"]
    if out["plan"] is not None and out["plan"]["plan_info"] is None:
        del out["plan"]["plan_info"]
    if out["capture"] is None:
        del out["capture"]
    if out["merge"] is None:
        del out["merge"]
    else:
        for name in ("output", "lse", "mask"):
            if out["merge"][name] is None:
                del out["merge"][name]
    if not out["source"]["inferred"]:
        del out["source"]["inferred"]
    if out["source"]["crash"] is None:
        del out["source"]["crash"]
    if out["graph"] is not None:
        for name in GRAPH_OPTIONAL:
            if out["graph"][name] is None:
                del out["graph"][name]
    for section, defaults in (("model", MODEL_DEFAULTS), ("batch", BATCH_DEFAULTS)):
        for name, absent in defaults.items():
            value = out[section][name]
            if value is absent or (absent is not None and type(value) is type(absent) and value == absent):
                del out[section][name]
    out["format"] = FORMAT_NAME
    out["version"] = FORMAT_VERSION
    return out
