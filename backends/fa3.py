"""`fa3`: FlashAttention-3 semantics, run by whichever implementation is installed.

The plan speaks FA3's names, as SGLang's FlashAttentionBackend builds them: `page_table`
[bs, max_pages] (page ids of each request's KV row), `cache_seqlens`, `cu_seqlens_q`,
`cu_seqlens_k`, `max_seqlen_q`, `causal` (aligned bottom-right), `window_left`.
`select_impl` picks the implementation, in one place and in this order: `flash_attn_interface`
(FA3 proper), `sgl_kernel.flash_attn`, vLLM's `vllm.vllm_flash_attn`, then FlashInfer's paged
prefill wrapper with backend="fa3" (SM90 only). FlashInfer takes kv_indptr/kv_indices instead of
a page table: `flashinfer_paged_kv` translates, in one place.

Tree verify (topk > 1): FA3 has no custom mask. SGLang's FA3 backend runs two calls and merges
them (engines.md A4.4), and so do we ("two-call"): call 1 = every draft token over the prefix,
non-causal; call 2 ("expand_" tensors) = each draft token as its own one-token request over the
draft tokens it may see (its ancestors and itself), their slots sorted to the front of its page
table row, cache_seqlens = the mask row's sum; both with LSE, merged exactly in torch (float32,
natural log). A chain (topk == 1) is plain causal attention over prefix + drafts.

Sliding-window layers of a tree verify ("window-expand", sglang#9658): FA3 takes one window for
all the queries of a call, so the prefix call cannot give each draft token the window at its own
position. SGLang runs these layers as one causal call over `swa_spec_metadata`, recorded as the
"swa_" tensors: a row per draft token listing its request's prefix, then the draft slots it sees
(the expand call's row), cache_seqlens = prefix + that row's sum; window (W, 0) then keeps the
W + 1 keys nearest the draft token along its own path. The plan keeps the prefix call's tables
the SWA rows were built from (`page_table`, `cache_seqlens`): what the step lists per request.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg import machine, numerics
from attndbg.environment import package_version
from attndbg.backends.base import (
    AttentionInputs,
    AttentionResult,
    Backend,
    FillRequirement,
    GraphCapacity,
    GraphState,
    KernelError,
    KernelUnsupported,
    LibraryRelease,
    Padding,
    ScriptLibrary,
    ScriptMerge,
    coerce_option,
)
from attndbg.backends import flashinfer_modules as fm
from attndbg.backends import script_calls
from attndbg.backends.flashinfer_runtime import KERNEL_ERRORS, SCRIPT_INSTALL, SCRIPT_VERSION, WORKSPACE_BYTES, FlashInferGraphState, compile_failure, compiling_note, library_error, wait_for_pending_plans
from attndbg.backends import plan_declaration as pd
from attndbg.backends import plan_layout as pl
from attndbg.backends.tables import build_page_table, padded_requests
from attndbg.backends.host_hints import HostHint, Measures, Sizes
from attndbg.backends.capabilities import ENGINE_GRAPH_MODES, MHA_ALL_MODES, Capabilities, HeadDims
from attndbg.backends import plan_view as pv
from attndbg.trace import tree
from attndbg.trace.tree import is_chain
from attndbg.trace.schema import DTYPES, LseBase, Plan, Trace, indptr

# FlashInfer's SM90 prefill kernels are instantiated for these (head_dim_qk, head_dim_vo) pairs
# (flashinfer/utils.py, is_fa3_prefill_head_dim_supported).
FLASHINFER_FA3_HEAD_DIMS = {(64, 64), (128, 128), (256, 256), (192, 128)}
# Each command in backticks, whole (report/backends.py lists them one a line, to paste). FlashAttention-3's
# own flash_attn_interface is not on PyPI: it builds from the hopper/ folder of its repository.
INSTALL_HINT = (
    "install one: `pip install sgl-kernel`, `pip install vllm`, `pip install flashinfer-python` (its fa3 backend, SM90 only), "
    "or FlashAttention-3's flash_attn_interface: `git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && python setup.py install`"
)


class Impl(enum.Enum):
    FLASH_ATTN_INTERFACE = "flash_attn_interface"
    SGL_KERNEL = "sgl_kernel.flash_attn"
    VLLM = "vllm.vllm_flash_attn"
    FLASHINFER = "flashinfer"


# The top-level module whose presence means an implementation is installed (found without importing it).
_PROBE = {
    Impl.FLASH_ATTN_INTERFACE: "flash_attn_interface",
    Impl.SGL_KERNEL: "sgl_kernel",
    Impl.VLLM: "vllm",
    Impl.FLASHINFER: "flashinfer",
}
SM90 = (9, 0)


def select_impl() -> Impl | None:
    """The implementation this machine runs: the first installed in FA3's order; FlashInfer last, on
    SM90. A repro script (script_calls.py) runs FlashInfer's backend="fa3", whatever is installed here."""
    if script_calls.scripting():
        return Impl.FLASHINFER
    info = machine.gpu_info()
    return None if info is None else impl_on(info.capability)


def impl_on(capability: tuple[int, int] | None) -> Impl | None:
    """The implementation a GPU of `capability` would run with the libraries installed here."""
    if capability is None:
        return None
    for impl in (Impl.FLASH_ATTN_INTERFACE, Impl.SGL_KERNEL, Impl.VLLM):
        if machine.module_available(_PROBE[impl]):
            return impl
    if machine.module_available(_PROBE[Impl.FLASHINFER]) and capability == SM90:
        return Impl.FLASHINFER
    return None


# The name SGLang's FlashAttention backend carries in a trace's source.backend (the recorder's).
SGLANG_NAME = "fa3"
# The plan's verify_path of a sliding-window layer of a tree verify: one call over the swa_ tables
# (SGLang's swa_spec_metadata). A recorded path, not an option: SGLang chooses it by the layer.
WINDOW_EXPAND = "window-expand"


class VerifyPath(enum.Enum):
    AUTO = "auto"  # chain: one causal call; tree (topk > 1): two calls merged (SGLang's FA3 backend)
    TWO_CALL = "two-call"  # every verify step through the two calls, chains too
    MASK = "mask"  # one call with the tree as a custom mask, as FlashInfer/Triton do: FA3 cannot


@dataclass(frozen=True)
class FA3Options:
    verify_path: VerifyPath | str = VerifyPath.AUTO

    def __post_init__(self) -> None:
        coerce_option(self, "verify_path", VerifyPath)


@dataclass(frozen=True)
class FA3Call:
    """One flash_attn_with_kvcache call, in FA3's words (CPU tensors)."""

    page_table: Tensor  # [bs, max_pages] int32
    cache_seqlens: Tensor  # [bs] int32
    cu_seqlens_q: Tensor  # [bs+1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window_left: int  # -1 = off; FA3's window_size = (window_left, window_right)
    page_size: int
    window_right: int = -1  # a non-causal layer's right window; -1 = off

    def rows_without_keys(self) -> Tensor:
        """[T] bool: query rows that see no key: a request with none, or, causal (aligned
        bottom-right), row i of q_len over k keys with k - q_len + i < 0."""
        q_lens = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).to(torch.int64)
        k = self.cache_seqlens.to(torch.int64).repeat_interleave(q_lens)
        q = q_lens.repeat_interleave(q_lens)
        i = torch.arange(int(q_lens.sum())) - torch.repeat_interleave(self.cu_seqlens_q[:-1].to(torch.int64), q_lens)
        return (k == 0) | ((k - q + i < 0) if self.causal else torch.zeros_like(k, dtype=torch.bool))

    @classmethod
    def from_plan(cls, plan: Plan, prefix: str = "") -> FA3Call:
        t, s = plan.tensors, plan.scalars
        return cls(
            page_table=t[f"{prefix}page_table"],
            cache_seqlens=t[f"{prefix}cache_seqlens"],
            cu_seqlens_q=t[f"{prefix}cu_seqlens_q"],
            max_seqlen_q=int(s[f"{prefix}max_seqlen_q"]),
            max_seqlen_k=int(s[f"{prefix}max_seqlen_k"]),
            causal=bool(s[f"{prefix}causal"]),
            window_left=int(s["window_left"]),
            page_size=int(s[f"{prefix}page_size"]),
            window_right=int(s.get("window_right", -1)),
        )


class FA3Backend(Backend):
    name = "fa3"
    options_class = FA3Options
    fill_requirement = FillRequirement(0, "FlashAttention takes cache_seqlens = 0 (vLLM pads with 0); SGLang fills 1")
    # SGLang's FlashAttention backend (the recorder names it fa3) and vLLM's (engines.md B3).
    engine_names = {SGLANG_NAME: None, "FLASH_ATTN": None}
    # FlashAttention's varlen grid covers ceil(max_seqlen_q / block_m) query blocks per request:
    # SGLang passes its metadata's max_seq_len_q (engines.md A4.4, recorded as max_seqlen_q), vLLM
    # its FlashAttentionMetadata.max_query_len (v1/attention/backends/flash_attn.py forward). Its
    # max_seqlen_k (vLLM's max_seq_len) is judged as vLLM's metadata: invariants' seq-lens-max.
    host_hints = {
        SGLANG_NAME: (HostHint("max_seqlen_q", Measures.QUERY_LEN, Sizes.ROWS, "FlashAttention-3's flash_attn_with_kvcache (max_seqlen_q)", replayed=True),),
        "FLASH_ATTN": (HostHint("max_query_len", Measures.QUERY_LEN, Sizes.ROWS, "FlashAttention's flash_attn_varlen_func (max_seqlen_q = max_query_len)"),),
    }

    def __init__(self, options: FA3Options | None = None):
        self.options = options or FA3Options()
        self._workspace: Tensor | None = None
        self._wrappers: dict[str, object] = {}  # FlashInfer wrappers, by call ("main", "expand")

    # -- what runs here -----------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        info = machine.gpu_info()
        installed = [impl for impl in Impl if machine.module_available(_PROBE[impl])]
        if info is None:
            missing = "" if installed else f"; no FlashAttention-3 implementation is installed either ({INSTALL_HINT})"
            return f"fa3 needs a CUDA GPU, and none was found{missing}"
        if select_impl() is not None:
            return None
        if installed == [Impl.FLASHINFER]:
            return (
                f"FlashInfer's backend='fa3' needs SM90 (Hopper), this GPU ({info.name}) is {info.arch}; "
                f"no other FlashAttention-3 implementation is installed ({INSTALL_HINT})"
            )
        return f"no FlashAttention-3 implementation is installed: {INSTALL_HINT}"

    def device(self) -> str:
        return "cuda"

    def first_use_note(self) -> str | None:
        return compiling_note() if select_impl() is Impl.FLASHINFER else None

    def library(self) -> LibraryRelease:
        impl = select_impl()
        # The distribution that ships each implementation (attndbg.environment reads its version).
        name, package = {
            Impl.FLASH_ATTN_INTERFACE: ("FlashAttention-3 (flash_attn_interface)", "flash-attn"),
            Impl.SGL_KERNEL: ("sgl-kernel's FlashAttention-3", "sgl-kernel"),
            Impl.VLLM: ("vLLM's vllm_flash_attn (FlashAttention-3)", "vllm"),
            Impl.FLASHINFER: ("FlashInfer (backend='fa3')", "flashinfer"),
        }.get(impl, ("FlashAttention-3 (no implementation here)", ""))
        return LibraryRelease(name, (package_version(package) if package else None) or "version unknown")

    def describe(self) -> str:
        impl = select_impl()
        if impl is None:
            return "FlashAttention-3 semantics: no implementation available here"
        if impl is Impl.FLASHINFER:
            import flashinfer

            what = (
                f"FlashInfer {flashinfer.__version__} BatchPrefillWithPagedKVCacheWrapper(backend='fa3') on sm90, "
                "page_table translated to kv_indptr/kv_indices, LSE base 2 converted to natural"
            )
        else:
            what = f"{impl.value}.flash_attn_with_kvcache" if impl is not Impl.VLLM else "vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3)"
        return f"FlashAttention-3 via {what}; tree verify: {self._verify_words()}"

    def _verify_words(self) -> str:
        path = self.options.verify_path
        if path is VerifyPath.MASK:
            return "custom mask in one call (unsupported by FA3)"
        when = "every verify step" if path is VerifyPath.TWO_CALL else "topk > 1"
        return f"SGLang's two calls (prefix + draft block) for {when}, merged exactly in torch (float32)"

    # -- what this backend can take -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        # Rows of whole pages and a pool of whole pages are guaranteed by trace validation.
        on_flashinfer = select_impl() is Impl.FLASHINFER
        return Capabilities(
            kernels="FlashAttention-3 kernels",
            other_attention="use the mla backend (FlashInfer MLA, FlashMLA or our Triton MLA decode)",
            modes=MHA_ALL_MODES,
            graph_modes=ENGINE_GRAPH_MODES,
            kv_dtype_is_q_dtype=True,
            head_dims=HeadDims(
                pairs=frozenset(FLASHINFER_FA3_HEAD_DIMS) if on_flashinfer else frozenset(),
                why="FlashInfer's SM90 kernels are instantiated for these only" if on_flashinfer else "",
            ),
            tree_mask=True,  # SGLang's two-call path (verify_path='mask' is refused by configuration_reason)
            sliding_window=True,
            soft_cap=True,
            # causal=False; cross-attention as a call over the encoder's KV (FA3's causal mask is
            # aligned bottom-right); a request without keys (cache_seqlens 0, as vLLM pads).
            non_causal=True,
            cross=True,
            empty_kv=True,
            # window_size=(left, right) in flash_attn_with_kvcache / flash_attn_varlen_func;
            # FlashInfer's wrapper takes window_left only.
            window_right=not on_flashinfer,
            lse_base=LseBase.TWO if on_flashinfer else LseBase.E,
            why={
                "column_mask": "FA3 masks are causal or sliding-window only",
                "extend_mask": "FA3 masks are causal or sliding-window only",
                "window_in_tree_verify": "SGLang runs sliding-window layers of a tree verify over their own swa_spec_metadata tables (recorded as swa_*, judged by tree-mask); this adapter derives no such plan",
                "window_right": "FlashInfer's backend='fa3' wrapper takes window_left only (prefill.py plan(): no right window)",
                "sinks": "the sink term (sgl_kernel's sinks, vLLM's s_aux, FlashInfer's fa3 AttentionSink variant) is not wired into this adapter",
                "kv_dtype_is_q_dtype": "an fp8 cache with scales is not wired into this adapter",
                "kv_scales": "an fp8 cache with scales is not wired into this adapter",
                "merge_state": "FlashAttention returns a call's LSE but has no merge of given states; engines merge FA3's states with their own kernels (vLLM merge_attn_states, SGLang's sgl_kernel merge_state): replay such a step on triton or flashinfer",
            },
        )

    def configuration_reason(self, trace: Trace) -> str | None:
        if trace.is_tree_verify and self._verify_path(trace) is VerifyPath.MASK:
            return self._mask_reason(trace)
        return None

    def _verify_path(self, trace: Trace) -> VerifyPath:
        """MASK, TWO_CALL, or AUTO for a chain (one causal call)."""
        path = self.options.verify_path
        if path is VerifyPath.AUTO and not is_chain(trace.spec.parents):
            return VerifyPath.TWO_CALL
        if path is VerifyPath.MASK and is_chain(trace.spec.parents):
            return VerifyPath.AUTO  # a chain needs no mask: causal is the same thing
        return path

    def _mask_reason(self, trace: Trace) -> str:
        impl = select_impl()
        if impl is Impl.FLASHINFER:
            why = "FlashInfer's backend='fa3' rejects custom masks at run time ('operation not supported': its SM90 kernels have no MaskMode.CUSTOM)"
        else:
            why = "flash_attn_with_kvcache takes no custom mask (causal and sliding window only)"
        return (
            f"tree verify (topk={trace.spec.topk}) with verify_path='mask' needs a custom mask in one call, and {why}; "
            "use verify_path='two-call' (SGLang's FA3 path: prefix call + draft-block call, merged)"
        )

    # -- plan -----------------------------------------------------------------------------------

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        model = trace.model
        rows, q_lens = padded_requests(trace, padding)
        if trace.is_tree_verify and self._verify_path(trace) is VerifyPath.MASK:
            raise ValueError(self._mask_reason(trace))
        if trace.is_tree_verify and self._verify_path(trace) is VerifyPath.TWO_CALL:
            return self._two_call_plan(trace, rows, padding)
        tensors = _call_tensors(rows, q_lens, model.page_size)
        scalars: dict[str, int | float | bool | str] = {"window_left": model.sliding_window, "verify_path": "causal"}
        if model.window_right >= 0:
            scalars["window_right"] = model.window_right
        # A chain verify is causal whatever the layer; cross-attention: causal aligned bottom-right.
        scalars.update(_call_scalars(rows, q_lens, causal=model.causal or trace.is_tree_verify, page_size=model.page_size))
        return Plan(backend=self.name, tensors=tensors, scalars=scalars)

    def _two_call_plan(self, trace: Trace, rows: list[Tensor], padding: Padding | None) -> Plan:
        batch, model = trace.batch, trace.model
        n = trace.spec.draft_token_num
        pad = len(rows) - batch.batch_size
        prefix_lens = batch.prefix_lens.tolist() + [padding.fill_value if padding else 0] * pad
        parents = torch.cat([trace.spec.parents, torch.arange(-1, n - 1).expand(pad, n)])  # padded: chains
        prefix_rows = [r[:p] for r, p in zip(rows, prefix_lens)]
        draft_rows = [r[p:] for r, p in zip(rows, prefix_lens)]
        # Call 1: all n draft tokens of a request over its prefix, non-causal.
        tensors = _call_tensors(prefix_rows, [n] * len(rows), model.page_size)
        scalars: dict[str, int | float | bool | str] = {"window_left": model.sliding_window, "verify_path": "two-call"}
        scalars.update(_call_scalars(prefix_rows, [n] * len(rows), causal=False, page_size=model.page_size))
        # Call 2: each draft token alone over the draft tokens it may see. Draft slots need not
        # be page-aligned, so this call reads the cache as 1-token pages (page ids = slot ids).
        expand_rows = []
        for slots, p in zip(draft_rows, parents):
            allowed = tree.ancestor_matrix(p)  # [n, n]
            cols = torch.arange(n)
            # SGLang's order: allowed columns first (in column order), then the rest.
            order = torch.argsort(torch.where(allowed, cols, cols + n), dim=1)
            for i in range(n):
                expand_rows.append((slots[order[i]], int(allowed[i].sum())))
        table = torch.stack([r for r, _ in expand_rows]).to(torch.int32) if expand_rows else torch.zeros(0, n, dtype=torch.int32)
        seqlens = torch.tensor([k for _, k in expand_rows], dtype=torch.int32)
        tensors.update(
            {
                "expand_page_table": table,
                "expand_cache_seqlens": seqlens,
                "expand_cu_seqlens_q": torch.arange(len(expand_rows) + 1, dtype=torch.int32),
                "expand_cu_seqlens_k": indptr(seqlens).to(torch.int32),
            }
        )
        scalars.update(
            {
                "expand_max_seqlen_q": 1,
                "expand_max_seqlen_k": int(seqlens.max()) if seqlens.numel() else 0,
                "expand_causal": False,
                "expand_page_size": 1,
            }
        )
        return Plan(backend=self.name, tensors=tensors, scalars=scalars)

    def plan_declaration(self, trace: Trace, plan: Plan) -> pd.PlanDeclaration:
        """SGLang's FlashAttentionBackend metadata as `FA3Call`s read it: per call a page table
        whose row b is read up to ceil(cache_seqlens[b] / page) pages, cu_seqlens_q over query rows
        (cu_seqlens_k is recorded but not read by a paged call, so it is not bounded). The two-call
        tree verify's first call lists the prefix only; its expand_ call (page size 1: its table
        holds slot ids; one row per draft token) lists, per draft token, the draft slots it sees,
        and its torch merge reads every query row of both calls."""
        if plan.scalars.get("verify_path") == WINDOW_EXPAND and trace.spec is not None:
            return _window_expand_declaration(trace.spec.draft_token_num)
        two_call = plan.scalars.get("verify_path") == VerifyPath.TWO_CALL.value
        rows = [_call_layout("", 1)]
        if two_call and trace.spec is not None:
            rows.append(_call_layout("expand_", trace.spec.draft_token_num))
        return pd.PlanDeclaration(
            call=_call(""),
            scalars=("window_left", "verify_path"),
            second_call=_call("expand_") if two_call else None,
            merged_rows="the two-call merge reads every query row of the step from both calls" if two_call else None,
            ends=(pl.KvEnd.PREFIX,) if two_call and trace.is_tree_verify else (pl.KvEnd.KV,),
            mask=pl.MaskReading.EXPAND_CALL if two_call else pl.MaskReading.CAUSAL,
            window="window_left",
            expand=pl.ExpandTables("expand_page_table", "expand_cache_seqlens", "expand_cu_seqlens_k"),
            rows=tuple(rows),
        )

    @classmethod
    def merge_path(cls, trace: Trace) -> str | None:
        # SGLang's FA3 backend verifies a tree (topk > 1) in two calls merged (engines.md A4.4);
        # its sliding-window layers in one call (WINDOW_EXPAND), which merges nothing.
        if trace.plan is not None and trace.plan.scalars.get("verify_path") == WINDOW_EXPAND:
            return None
        if trace.source.backend == SGLANG_NAME and trace.is_tree_verify and trace.spec.topk > 1:
            return "FA3 two-call verify (prefix and draft partials merged with merge_state_v2)"
        return None

    # -- JIT modules ----------------------------------------------------------------------------

    def jit_specs(self, trace: Trace, at: fm.Target) -> list:
        """Where FlashInfer's backend='fa3' wrapper is the implementation on `at`: its SM90 prefill
        module, for the derived plan's window and the recorded plan's (both calls of a two-call
        verify load the same one); the head dims it is instantiated for only."""
        model = trace.model
        if impl_on(at.capability) is not Impl.FLASHINFER or (model.head_dim, model.v_head_dim) not in FLASHINFER_FA3_HEAD_DIMS:
            return []
        if self.unsupported_reason(trace):
            return []
        windows = {model.sliding_window}
        if trace.plan is not None and trace.plan.backend == self.name and "window_left" in trace.plan.scalars:
            windows.add(int(trace.plan.scalars["window_left"]))
        specs: list = []
        for window in sorted(windows):
            specs += fm.prefill(
                "fa3", q_dtype=model.q_dtype, kv_dtype=model.kv_dtype, head_dim_qk=model.head_dim, head_dim_vo=model.v_head_dim, window_left=window, logits_soft_cap=model.logit_cap
            )
        return specs

    # -- run ------------------------------------------------------------------------------------

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        impl = select_impl()
        if impl is None:
            raise KernelError(self.unavailable_reason() or "no FlashAttention-3 implementation")
        if plan.scalars["verify_path"] == WINDOW_EXPAND:
            # SGLang runs it as one call over the swa_ tables; that call has never run on a GPU here,
            # so the recorded plan is read and judged (tree-mask), never launched untested.
            raise KernelUnsupported("a sliding-window layer's tree verify (swa_spec_metadata's one call) is judged from its plan, not run by this adapter")
        main_call = FA3Call.from_plan(plan)
        try:
            main = self._call(impl, "main", trace, inputs, main_call)
            if plan.scalars["verify_path"] != "two-call":
                return main
            expand = self._call(impl, "expand", trace, inputs, FA3Call.from_plan(plan, "expand_"))
        except KERNEL_ERRORS as e:
            if compile_failure(e) is not None:  # FlashInfer's fa3 kernels are JIT-compiled too
                raise library_error(e, trace.model, library=impl.value) from e
            first = (str(e).strip().splitlines() or [""])[0]
            raise KernelError(f"{impl.value}: {type(e).__name__}: {first[:300]}") from e
        # A request with an empty prefix contributes nothing to the merge (its LSE is -inf: _call).
        return merge_states(main, expand, dtype=inputs.q.dtype)

    def _call(self, impl: Impl, key: str, trace: Trace, inputs: AttentionInputs, call: FA3Call) -> AttentionResult:
        """One FA3 call: output [T, Hq, Dv] in q's dtype, LSE [T, Hq] natural log, and -inf for the
        rows that see no key (the reference's convention: kernels write +inf there, flash-attn's
        softmax.h, or 0 with a zero output; only the LSE is mapped, the output is compared as written)."""
        result = self._launch(impl, key, trace, inputs, call)
        empty = call.rows_without_keys().to(result.lse.device)
        if not bool(empty.any()):
            return result
        return AttentionResult(output=result.output, lse=result.lse.masked_fill(empty[:, None], float("-inf")))

    def _launch(self, impl: Impl, key: str, trace: Trace, inputs: AttentionInputs, call: FA3Call) -> AttentionResult:
        model = trace.model
        device = inputs.q.device
        k_cache = inputs.k_cache.view(-1, call.page_size, model.num_kv_heads, model.head_dim)
        v_cache = inputs.v_cache.view(-1, call.page_size, model.num_kv_heads, model.v_head_dim)
        # FA3's window_size: (left, right), -1 = unbounded on that side; a causal call's right is 0.
        window = (call.window_left, call.window_right if not call.causal else 0) if call.window_left >= 0 or call.window_right >= 0 else (-1, -1)
        if impl is Impl.FLASHINFER:
            wrapper = self._wrappers.get(key)
            if wrapper is None:
                flashinfer = script_calls.flashinfer_module()
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._flashinfer_workspace(device), "NHD", backend="fa3")
                self._wrappers[key] = wrapper
            _flashinfer_plan(wrapper, model, call)
            out, lse2 = wrapper.run(inputs.q, (k_cache, v_cache), return_lse=True)
            return AttentionResult(output=out, lse=lse2 * numerics.LN2)  # FlashInfer's LSE is base 2
        # UNTESTED here (no such library on our GPU machine): written from each library's
        # documented signature. LSE comes back natural-log, [Hq, total_q].
        page_table, cache_seqlens, cu_seqlens_q = (t.to(device) for t in (call.page_table, call.cache_seqlens, call.cu_seqlens_q))
        if impl is Impl.VLLM:
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            out, lse = flash_attn_varlen_func(
                q=inputs.q,
                k=k_cache,
                v=v_cache,
                max_seqlen_q=call.max_seqlen_q,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_k=call.max_seqlen_k,
                seqused_k=cache_seqlens,
                softmax_scale=model.sm_scale,
                causal=call.causal,
                window_size=list(window),
                softcap=model.logit_cap,
                block_table=page_table,
                return_softmax_lse=True,
                fa_version=3,
            )
        else:
            if impl is Impl.FLASH_ATTN_INTERFACE:
                from flash_attn_interface import flash_attn_with_kvcache
            else:
                from sgl_kernel.flash_attn import flash_attn_with_kvcache
            out, lse, *_ = flash_attn_with_kvcache(
                q=inputs.q,
                k_cache=k_cache,
                v_cache=v_cache,
                page_table=page_table,
                cache_seqlens=cache_seqlens,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=call.max_seqlen_q,
                softmax_scale=model.sm_scale,
                causal=call.causal,
                window_size=window,
                softcap=model.logit_cap,
                return_softmax_lse=True,
            )
        return AttentionResult(output=out, lse=lse.T)

    def _flashinfer_workspace(self, device: torch.device) -> Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    # -- CUDA graphs ----------------------------------------------------------------------------

    def graph_configuration_reason(self, trace: Trace) -> str | None:
        if select_impl() is not Impl.FLASHINFER:
            return "fa3 CUDA-graph replay is wired for FlashInfer's fa3 wrapper (use_cuda_graph=True) only"
        if trace.is_tree_verify and self._verify_path(trace) is VerifyPath.TWO_CALL:
            return "the two-call tree-verify path (two wrappers and a torch merge) is not captured; replay it eagerly"
        return None

    def script_library(self) -> ScriptLibrary:
        """A script runs FlashInfer's backend="fa3" (SM90), and carries attndbg's merge of partial
        states (numerics.merge_states) for the two-call verify (script_merge)."""
        merge = inspect.getsource(numerics.merge_states)
        return ScriptLibrary(
            label="flashinfer (backend='fa3', SM90)", imports="import flashinfer", install=SCRIPT_INSTALL, needs_gpu=True, version=SCRIPT_VERSION,
            prelude=f"# attndbg's merge of partial attention states (attndbg/numerics.py), for fa3's two-call verify.\n{merge}\n",
        )  # fmt: skip

    def script_merge(self, plan: Plan, runs: list[str]) -> ScriptMerge | None:
        """The two-call tree verify: the prefix call and the draft call merged as `run` merges them
        (base-2 LSEs to natural log, a request with no prefix weighs 0 on the prefix side)."""
        if plan.scalars.get("verify_path") != VerifyPath.TWO_CALL.value or len(runs) != 2:
            return None
        main, expand = runs
        lines = (
            "# fa3's two calls merged as the adapter merges them: natural-log LSEs, an empty prefix weighs 0",
            'empty = (T["MAIN_CACHE_SEQLENS"] == 0).repeat_interleave(T["MAIN_Q_LENS"]).to(DEVICE)',
            f'main_lse = ({main}[1].float() * math.log(2.0)).masked_fill(empty[:, None], float("-inf"))',
            f"merged_output, _ = merge_states(torch.stack([{main}[0].float(), {expand}[0].float()]), torch.stack([main_lse, {expand}[1].float() * math.log(2.0)]))",
            'merged_output = merged_output.to(X["q"].dtype)',
        )
        tensors = {"MAIN_CACHE_SEQLENS": plan.tensors["cache_seqlens"].to(torch.int64), "MAIN_Q_LENS": plan.tensors["cu_seqlens_q"].diff().to(torch.int64)}
        return ScriptMerge(lines=lines, output="merged_output", tensors=tensors)

    def graph_state(self, trace: Trace, capacity: GraphCapacity) -> GraphState:
        reason = self.graph_unsupported_reason(trace)
        if reason:
            raise NotImplementedError(reason)
        return _FlashInferFA3Graph(trace, capacity)


class _FlashInferFA3Graph(FlashInferGraphState):
    """FlashInfer's fa3 wrapper with use_cuda_graph=True: indptr/indices/last-page buffers
    sized for the capture; `load_plan` re-plans the wrapper, which copies into them in place."""

    def __init__(self, trace: Trace, capacity: GraphCapacity):
        flashinfer = script_calls.flashinfer_module()
        m = self.model = trace.model
        super().__init__(max_tokens=capacity.max_tokens, num_heads=m.num_qo_heads, v_head_dim=m.v_head_dim, q_dtype=DTYPES[m.q_dtype])
        device = torch.device("cuda")
        bs = capacity.capture_bs
        self.buffers = {
            "qo_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=device),
            "kv_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=device),
            "kv_indices": torch.zeros(max(capacity.max_kv_slots, 1), dtype=torch.int32, device=device),
            "kv_last_page_len": torch.zeros(bs, dtype=torch.int32, device=device),
        }
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=self.buffers["qo_indptr"],
            paged_kv_indptr_buf=self.buffers["kv_indptr"],
            paged_kv_indices_buf=self.buffers["kv_indices"],
            paged_kv_last_page_len_buf=self.buffers["kv_last_page_len"],
            backend="fa3",
        )
        # The rows of the loaded plan that see no key, whose LSE the replay maps to -inf as an
        # eager call does (FA3Backend._call): static, rewritten in place by each load_plan.
        self.rows_without_keys = torch.zeros(capacity.max_tokens, dtype=torch.bool, device=device)

    def load_plan(self, plan: Plan) -> None:
        if plan.scalars["verify_path"] == "two-call":
            raise ValueError("a two-call plan cannot be loaded into a captured fa3 graph")
        call = FA3Call.from_plan(plan)
        _flashinfer_plan(self.wrapper, self.model, call)
        empty = call.rows_without_keys()
        self.rows_without_keys.zero_()
        self.rows_without_keys[: empty.numel()].copy_(empty, non_blocking=True)

    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        m = self.model
        tokens = inputs.q.shape[0]
        k_cache = inputs.k_cache.view(-1, self.model.page_size, m.num_kv_heads, m.head_dim)
        v_cache = inputs.v_cache.view(-1, self.model.page_size, m.num_kv_heads, m.v_head_dim)
        self.wrapper.run(inputs.q, (k_cache, v_cache), out=self.out[:tokens], lse=self.lse_base2[:tokens], return_lse=True)
        result = self.result(tokens)
        result.lse.masked_fill_(self.rows_without_keys[:tokens, None], float("-inf"))
        return result


# -- translation helpers ----------------------------------------------------------------------


def _call(prefix: str) -> pd.Call:
    """One FA3Call's KV as its kernel reads it: a page table row per request up to cache_seqlens."""
    return pd.Call(
        pl.KvIds.TABLE,
        ids=f"{prefix}page_table",
        count=f"{prefix}cache_seqlens",
        length=f"{prefix}cache_seqlens",
        page_size=f"{prefix}page_size",
        queries=f"{prefix}cu_seqlens_q",
        scalars=tuple(f"{prefix}{name}" for name in ("max_seqlen_q", "max_seqlen_k", "causal")),
    )


def _window_expand_declaration(n: int) -> pd.PlanDeclaration:
    """A sliding-window layer's tree verify (WINDOW_EXPAND): the prefix call's tables list each
    request's prefix (what the swa_ rows were built from, and what its KV is judged by); the
    kernel runs the swa_ call alone, a row per draft token (page size 1: slot ids), causal under
    the layer's window, over every query row of the step."""
    return pd.PlanDeclaration(
        call=_call(""),
        scalars=("window_left", "verify_path"),
        second_call=_call("swa_"),
        merged_rows="the sliding-window call runs every draft token of the step as its own query row",
        ends=(pl.KvEnd.PREFIX,),
        mask=pl.MaskReading.WINDOW_CALL,
        window="window_left",
        expand=pl.ExpandTables("swa_page_table", "swa_cache_seqlens", "swa_cu_seqlens_k"),
        rows=(_call_layout("", 1), _call_layout("swa_", n)),
    )


def _call_layout(prefix: str, per_request: int) -> pv.RequestRows:
    """One FA3Call's per-request tensors: `per_request` rows per request (the expand_ call: one per draft token)."""
    return pv.RequestRows(
        per_request,
        rows=(f"{prefix}page_table", f"{prefix}cache_seqlens"),
        offsets=((f"{prefix}cu_seqlens_q", None), (f"{prefix}cu_seqlens_k", None)),
    )


def flashinfer_paged_kv(page_table: Tensor, cache_seqlens: Tensor, page_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """FA3's page_table + cache_seqlens -> FlashInfer's (kv_indptr, kv_indices, kv_last_page_len), int32.

    A request with no KV has no pages and last_page_len 0 (FlashInfer's get_seq_lens clamps
    `pages - 1` at 0, so a 1 there would read one token)."""
    lens = cache_seqlens.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    kv_indices = torch.cat([page_table[b, : int(pages[b])] for b in range(lens.numel())]) if lens.numel() else page_table.new_zeros(0)
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    return indptr(pages).to(torch.int32), kv_indices.to(torch.int32), last.to(torch.int32)


def _flashinfer_plan(wrapper, model, call: FA3Call) -> None:
    kv_indptr, kv_indices, last = flashinfer_paged_kv(call.page_table, call.cache_seqlens, call.page_size)
    wait_for_pending_plans()
    dtype = DTYPES[model.q_dtype]
    wrapper.plan(
        qo_indptr=call.cu_seqlens_q,
        paged_kv_indptr=kv_indptr,
        paged_kv_indices=kv_indices,
        paged_kv_last_page_len=last,
        num_qo_heads=model.num_qo_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim_qk=model.head_dim,
        page_size=call.page_size,
        head_dim_vo=model.v_head_dim,
        causal=call.causal,
        sm_scale=model.sm_scale,
        window_left=call.window_left,
        logits_soft_cap=model.logit_cap,
        q_data_type=dtype,
        kv_data_type=DTYPES[model.kv_dtype],
    )


def merge_states(a: AttentionResult, b: AttentionResult, *, dtype: torch.dtype) -> AttentionResult:
    """Exact merge of two partial attentions over disjoint keys (natural-log LSEs), in float32,
    by numerics.merge_states (a side with LSE -inf has weight 0, whatever its output holds)."""
    output, lse = numerics.merge_states(
        torch.stack([a.output.float(), b.output.float()]), torch.stack([a.lse.float(), b.lse.float()])
    )
    return AttentionResult(output=output.to(dtype), lse=lse)


def _call_tensors(rows: list[Tensor], q_lens: list[int], page_size: int) -> dict[str, Tensor]:
    lens = torch.tensor([r.numel() for r in rows], dtype=torch.int32)
    return {
        "page_table": build_page_table(rows, page_size),
        "cache_seqlens": lens,
        "cu_seqlens_q": indptr(torch.tensor(q_lens, dtype=torch.int32)).to(torch.int32),
        "cu_seqlens_k": indptr(lens).to(torch.int32),
    }


def _call_scalars(rows: list[Tensor], q_lens: list[int], *, causal: bool, page_size: int) -> dict[str, int | bool]:
    return {
        "max_seqlen_q": max(q_lens, default=0),
        "max_seqlen_k": max((r.numel() for r in rows), default=0),
        "causal": causal,
        "page_size": page_size,
    }
