"""What a backend's kernels can run, declared as data, and the one derivation of "why not".

vLLM's `AttentionBackend` is the model: an adapter states what it takes (attention kinds, forward
modes, q/KV dtypes, head dims, page sizes, custom masks, sliding window and how many keys it keeps,
soft-cap, the LSE base its kernels write, what it captures in CUDA graphs) and `gap` turns that into
the first reason a trace cannot run, worded the same way for every backend. What data cannot say
stays in the adapter: an option that picks a path in its `configuration_reason`, a defect of the
installed library release at a shape these claim in its `known_defect` (a prediction `check` runs).

`attndbg backends --capabilities` prints these declarations, so what a user reads there is what
the replay and the detectors act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attndbg.trace.schema import AttentionKind, ForwardMode, GraphCapture, LseBase, Trace
from attndbg.trace.tree import is_chain

ALL_MODES = frozenset(ForwardMode) - {ForwardMode.IDLE}
MHA_ALL_MODES = {AttentionKind.MHA: ALL_MODES}
# What engines capture in CUDA graphs by default (SGLang's runner, vLLM's decode-only full graphs):
# decode and verify. A trace's graph.captured says when its runner captured more (vLLM FULL graphs).
ENGINE_GRAPH_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY})
CAPTURED_MODES = {
    GraphCapture.DECODE: ENGINE_GRAPH_MODES,
    GraphCapture.MIXED: ENGINE_GRAPH_MODES | {ForwardMode.MIXED},
    GraphCapture.FULL: ENGINE_GRAPH_MODES | {ForwardMode.MIXED, ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND},
}
HALF_DTYPES = frozenset({"float16", "bfloat16"})
# Every layer kind and batch form added within trace version 1, for kernels that take them all
# (Capabilities(**EVERY_LAYER_KIND)).
EVERY_LAYER_KIND = {"non_causal": True, "window_right": True, "sinks": True, "kv_scales": True, "cross": True, "extend_mask": True, "empty_kv": True}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8 e4m3", "float8_e5m2": "fp8 e5m2"}


def dtype_words(values) -> str:
    """'fp16 or bf16': dtype names as a reader says them, in a fixed order."""
    order = list(_SHORT)  # dtypes in a reader's order (fp16 before bf16), others by value
    ranked = sorted(values, key=lambda v: (order.index(v) if v in order else len(order), v))
    names = [_SHORT.get(v, str(v)) for v in ranked]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _mode_words(mode: ForwardMode) -> str:
    return mode.value.lower().replace("_", " ")


@dataclass(frozen=True)
class HeadDims:
    """Which head dims the kernels take. Empty fields take anything."""

    pairs: frozenset[tuple[int, int]] = frozenset()  # exactly these (qk, vo) pairs
    min_outside_decode: int = 0  # prefill-style kernels tile head_dim: at least this, both qk and vo
    one_in_decode: bool = False  # decode takes one head_dim for q/k and v
    why: str = ""  # where the rule comes from


@dataclass(frozen=True)
class LatentDims:
    """MLA: which (kv_lora_rank, qk_rope_head_dim) the kernels take. Empty fields take anything."""

    pairs: frozenset[tuple[int, int]] = frozenset()
    multiples: tuple[int, int] | None = None


@dataclass(frozen=True)
class Capabilities:
    """One backend's kernels, as data. `kernels` names them in every derived reason."""

    kernels: str
    # Defaults claim nothing beyond the plainest MHA decode in fp16/bf16: an adapter that declares
    # nothing is never asked to run what it cannot (and `attndbg backends --capabilities` says so).
    attention: frozenset[AttentionKind] = frozenset({AttentionKind.MHA})
    other_attention: str = ""  # where a trace of another attention kind should go
    # Forward modes per attention kind (IDLE: no attention at all).
    modes: Mapping[AttentionKind, frozenset[ForwardMode]] = field(
        default_factory=lambda: {AttentionKind.MHA: frozenset({ForwardMode.DECODE})}
    )
    graph_modes: frozenset[ForwardMode] = frozenset()  # what its CUDA-graph replay captures
    q_dtypes: frozenset[str] = HALF_DTYPES
    kv_dtypes: frozenset[str] = HALF_DTYPES
    kv_dtype_is_q_dtype: bool = False
    head_dims: HeadDims = HeadDims()
    latent_dims: LatentDims = LatentDims()
    page_sizes: frozenset[int] = frozenset()  # empty: any
    tree_mask: bool = False  # a custom mask for tree verify (topk > 1)
    column_mask: bool = False  # selective recompute: a mask by column
    sliding_window: bool = False
    window_in_tree_verify: bool = False
    # Keys a query sees under window W: W + window_extra_keys (SGLang's convention and FlashInfer's
    # window_left: the query's own key and the W before it).
    window_extra_keys: int = 1
    soft_cap: bool = False
    # What the trace model added for the layers engines run today (schema.Model / Batch):
    non_causal: bool = False  # model.causal false: queries also see later keys (encoder, bidirectional layers)
    window_right: bool = False  # model.window_right: a two-sided sliding window
    sinks: bool = False  # model.sinks: a learned per-head sink logit in the softmax (gpt-oss)
    kv_scales: bool = False  # model.k_scale / v_scale other than 1 (a scaled fp8 KV cache)
    cross: bool = False  # batch.cross: cross-attention over cached encoder KV (KV lengths independent of the queries)
    extend_mask: bool = False  # batch.custom_mask: a custom mask on a step that is not a verify
    empty_kv: bool = False  # a request with no key at all (kv_len 0), whose rows are fully masked
    lse_base: LseBase = LseBase.E  # what its kernels write (adapters always return natural log)
    # A standalone merge of given partial states (trace.merge) through a merge kernel of the library,
    # and the widths it is compiled for (empty: any).
    merge_state: bool = False
    merge_head_dims: frozenset[int] = frozenset()
    # Why a capability is missing, keyed by field name: appended to the derived reason.
    why: Mapping[str, str] = field(default_factory=dict)

    def _because(self, key: str) -> str:
        return f" ({self.why[key]})" if key in self.why else ""

    def gap(self, trace: Trace) -> str | None:
        """The first thing in `trace` these kernels cannot run, worded for a reader; None: none."""
        model, batch = trace.model, trace.batch
        if trace.merge is not None:
            return self._merge_gap(trace)
        mode, kind = batch.forward_mode, model.attention
        if kind not in self.attention:
            if kind is AttentionKind.MLA:
                return f"an MLA model: {self.other_attention or f'{self.kernels} run MHA/GQA only'}"
            return f"not an MLA model (attention={kind.value}): {self.other_attention or f'{self.kernels} run MLA only'}"
        modes = self.modes.get(kind, frozenset())
        if mode not in modes:
            if mode is ForwardMode.IDLE:
                return "an IDLE step has no attention to run"
            only = "/".join(sorted(_mode_words(m) for m in modes)) or "nothing"
            return f"{kind.name} {_mode_words(mode)}: {self.kernels} run {kind.name} {only} only{self._because('modes')}"
        if model.q_dtype not in self.q_dtypes:
            return f"{self.kernels} take {dtype_words(self.q_dtypes)} queries; this trace's are {model.q_dtype}"
        if model.kv_dtype not in self.kv_dtypes:
            return f"{self.kernels} take {dtype_words(self.kv_dtypes)} KV; this trace's is {model.kv_dtype}{self._because('kv_dtypes')}"
        if self.kv_dtype_is_q_dtype and model.kv_dtype != model.q_dtype:
            return f"{self.kernels} take q and KV of one dtype; this trace has q {model.q_dtype}, KV {model.kv_dtype}{self._because('kv_dtype_is_q_dtype')}"
        if batch.selective and not self.column_mask:
            return f"selective recompute attends by column (a custom mask), and {self.kernels} take no custom mask{self._because('column_mask')}"
        if trace.is_tree_verify:
            if not self.tree_mask and not is_chain(trace.spec.parents):
                return f"tree verify (topk={trace.spec.topk}) needs a custom mask, and {self.kernels} take no custom mask{self._because('tree_mask')}"
            if model.sliding_window >= 0 and not self.window_in_tree_verify:
                return f"tree verify with a sliding window is not run by {self.kernels}{self._because('window_in_tree_verify')}"
        if model.logit_cap > 0 and not self.soft_cap:
            return f"{self.kernels} have no logit soft-cap"
        if model.sliding_window >= 0 and not self.sliding_window:
            return f"{self.kernels} have no sliding window"
        return self._model_gap(trace) or self._dims_gap(trace)

    def _merge_gap(self, trace: Trace) -> str | None:
        """A merge step (trace.merge): it has no attention of its own, only states to merge."""
        model = trace.model
        if not self.merge_state:
            return f"a standalone merge of given partial states (trace.merge): {self.kernels} have no merge of given states{self._because('merge_state')}"
        if model.q_dtype not in self.q_dtypes:
            return f"{self.kernels} merge {dtype_words(self.q_dtypes)} states; this merge's are {model.q_dtype}"
        if self.merge_head_dims and model.v_head_dim not in self.merge_head_dims:
            widths = "/".join(map(str, sorted(self.merge_head_dims)))
            return f"states of width {model.v_head_dim}: {self.kernels} merge widths {widths} only{self._because('merge_head_dims')}"
        return None

    def _model_gap(self, trace: Trace) -> str | None:
        """The layer kinds and batch forms added within trace version 1 (schema.Model, Batch)."""
        model, batch = trace.model, trace.batch
        if not model.causal and not self.non_causal and batch.forward_mode is not ForwardMode.DECODE:
            # A decode query is its row's last column: causal or not, it sees the same keys.
            return f"a non-causal layer (model.causal = false): {self.kernels} run causal attention only{self._because('non_causal')}"
        if model.window_right >= 0 and not self.window_right and batch.forward_mode is not ForwardMode.DECODE:
            return f"a right sliding window (model.window_right = {model.window_right}): {self.kernels} take a left window only{self._because('window_right')}"
        if model.sinks is not None and not self.sinks:
            return f"attention sinks (model.sinks): {self.kernels} have no sink term{self._because('sinks')}"
        if (model.k_scale != 1.0 or model.v_scale != 1.0) and not self.kv_scales:
            return f"a scaled KV cache (k_scale {model.k_scale}, v_scale {model.v_scale}): {self.kernels} take no KV scales{self._because('kv_scales')}"
        if batch.cross and not self.cross:
            return f"cross-attention (batch.cross): {self.kernels} run self-attention only{self._because('cross')}"
        if batch.custom_mask is not None and not self.extend_mask:
            return f"a custom mask on this {_mode_words(batch.forward_mode)} step (batch.custom_mask): {self.kernels} take none there{self._because('extend_mask')}"
        if not self.empty_kv and bool((batch.kv_lens == 0).any()):
            b = int(torch.nonzero(batch.kv_lens == 0)[0])
            return f"request {b} has no KV (kv_len 0): {self.kernels} need at least one key per request{self._because('empty_kv')}"
        return None

    def _dims_gap(self, trace: Trace) -> str | None:
        model, mode = trace.model, trace.batch.forward_mode
        dims, because = self.head_dims, f" ({self.head_dims.why})" if self.head_dims.why else ""
        shown = str(model.head_dim) if model.head_dim == model.v_head_dim else f"{model.head_dim}/{model.v_head_dim}"
        if model.attention is AttentionKind.MHA:
            if dims.pairs and (model.head_dim, model.v_head_dim) not in dims.pairs:
                return f"head dims {shown}: {self.kernels} take {', '.join(f'{a}/{b}' for a, b in sorted(dims.pairs))}{because}"
            if mode is not ForwardMode.DECODE and min(model.head_dim, model.v_head_dim) < dims.min_outside_decode:
                return f"head_dim {shown}: {self.kernels} need head_dim >= {dims.min_outside_decode} outside decode{because}"
            if mode is ForwardMode.DECODE and dims.one_in_decode and model.head_dim != model.v_head_dim:
                return f"head dims {shown}: {self.kernels} decode with one head_dim for q/k and v"
        latent = self.latent_dims
        if model.attention is AttentionKind.MLA:
            shape = (model.kv_lora_rank, model.qk_rope_head_dim)
            if latent.pairs and shape not in latent.pairs:
                return f"kv_lora_rank {shape[0]} / rope {shape[1]}: {self.kernels} take {', '.join(f'{a}/{b}' for a, b in sorted(latent.pairs))}"
            if latent.multiples and (shape[0] % latent.multiples[0] or shape[1] % latent.multiples[1]):
                return f"kv_lora_rank {shape[0]} / rope {shape[1]}: {self.kernels} need multiples of {latent.multiples[0]} / {latent.multiples[1]}"
        if self.page_sizes and model.page_size not in self.page_sizes:
            return f"page_size {model.page_size}: {self.kernels} read {dtype_words(self.page_sizes)}-token blocks{self._because('page_sizes')}"
        return None

    def graph_gap(self, trace: Trace) -> str | None:
        """Beyond `gap`: why this trace's step is not replayed under a CUDA graph by these kernels."""
        mode = trace.batch.forward_mode
        captured = trace.graph.captured if trace.graph is not None and trace.graph.captured is not None else GraphCapture.DECODE
        if mode not in CAPTURED_MODES[captured] or (mode is ForwardMode.TARGET_VERIFY and not trace.is_tree_verify):
            if captured is GraphCapture.DECODE:
                return f"engines capture only decode and verify steps in CUDA graphs, not {mode.value}"
            return f"a runner capturing {captured.value} graphs does not capture {mode.value} steps"
        if mode not in self.graph_modes:
            return f"{self.kernels}: no CUDA-graph replay of {mode.value} here{self._because('graph_modes')}"
        return None

    def keys_in_window(self, window: int) -> int:
        """How many keys (at most) a query sees under sliding window `window` with these kernels."""
        return window + self.window_extra_keys
