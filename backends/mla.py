"""`mla`: DeepSeek-style absorbed MLA (keys = [latent 512 | rope 64], values = the latent).

Three implementations, chosen by `MLAOptions.impl` ("auto": FlashInfer when it can run here,
else our Triton kernel; `describe()` names the one used):

- `flashinfer`: `BatchMLAPagedAttentionWrapper`, on FlashInfer's own CSR plan (qo_indptr,
  kv_indptr and kv_indices over pages, kv_len_arr), any page size; decode, and causal
  extend / chain verify (q_len > 1, aligned bottom-right), as SGLang's FlashInfer-MLA backend;
- `flashmla`: `flash_mla_with_kvcache` on 64-token blocks (`block_table`, `cache_seqlens`),
  decode and chain verify, as SGLang's FlashMLA backend; UNTESTED here (not installed on our GPU);
- `triton`: our split-KV `decode_attention_fwd` with k_buffer [N, 1, 576] and v_buffer = its
  first 512 columns, through the `triton` backend (its plan, run and CUDA-graph state);
- `trtllm`: SGLang's trtllm_mla backend, FlashInfer's trtllm-gen MLA kernels
  (`trtllm_batch_decode_with_kv_cache_mla`) on a block table of the pool's pages (block_kv_indices),
  read up to seq_lens_k, the queries dense per request (decode 1, verify num_draft_tokens) or, for a
  draft extend, padded to max_seq_len_q rows from cu_seqlens_q / seq_lens_q. Those kernels run only
  on SM100 (Blackwell): a recorded plan of this form is read and judged (layout, invariants, the
  reference), never run here as another library's kernel under its name.

The query [T, H, 576] and the cache [N, 1, 576] are split into nope/rope (q_nope, q_pe, ckv,
kpe) for FlashInfer as views, never copies: its MLA kernels read every tensor's strides
(batch_mla_run.cu / batch_mla_sm90_run.cu take q_nope.stride(0), ckv_cache.stride(0), ...), and
the wrapper accepts two adjacent views of one tensor as a "split" input. FlashMLA and Triton
take the concatenated 576-wide tensors. No MLA kernel here has a custom mask: tree verify
(topk > 1) is unsupported, as in SGLang's MLA backends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

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
    coerce_option,
)
from attndbg.backends import flashinfer_modules as fm
from attndbg.backends import script_calls
from attndbg.backends.flashinfer_runtime import KERNEL_ERRORS, SCRIPT_INSTALL, SCRIPT_VERSION, WORKSPACE_BYTES, FlashInferGraphState, compile_failure, compiling_note, library_error, wait_for_pending_plans
from attndbg.backends import plan_declaration as pd
from attndbg.backends import plan_layout as pl
from attndbg.backends.capabilities import ENGINE_GRAPH_MODES, Capabilities, LatentDims
from attndbg.backends.tables import build_page_table, padded_requests
# Delegation by composition, the one adapter-to-adapter import allowed (tests/test_import_graph.py):
# impl=triton is the triton adapter itself, run on the MLA-shaped cache (its plan, plan view and
# layout, run and graph state), so it is held as `self._triton` and asked, never re-implemented.
from attndbg.backends.triton import TritonBackend
from attndbg.trace.schema import DTYPES, AttentionKind, ForwardMode, LseBase, Plan, Trace, indptr

# FlashMLA reads the cache in 64-token blocks (SGLang's flashmla_backend PAGE_SIZE).
FLASHMLA_PAGE_SIZE = 64
# FlashInfer's MLA kernels: FA3 (Hopper) on SM90, FA2 from SM80 (mla/_batch_mla/_fa_common.py).
SM80, SM90 = (8, 0), (9, 0)
# FlashInfer's trtllm-gen MLA kernels are built for SM100 (Blackwell) alone (flashinfer/mla.py
# trtllm_batch_decode_with_kv_cache_mla, SGLang's trtllm_mla backend asserts an SM100 device).
SM100 = (10, 0)
# SGLang's MLA backends run verify causally (a chain), so they support topk = 1 only.
_CAUSAL_VERIFY = "SGLang's MLA backends run verify causally, so they support topk = 1 only"
_FLASHINFER_MODES = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)


# Why the mla backend runs no merge step, whatever its implementation.
_NO_MERGE = "the mla backend runs MLA attention; a merge of given states runs on the triton or flashinfer backend"

class MLAImpl(enum.Enum):
    AUTO = "auto"
    FLASHINFER = "flashinfer"
    FLASHMLA = "flashmla"
    TRITON = "triton"
    TRTLLM = "trtllm"


@dataclass(frozen=True)
class MLAOptions:
    impl: MLAImpl | str = MLAImpl.AUTO

    def __post_init__(self) -> None:
        coerce_option(self, "impl", MLAImpl)


def _flashinfer_backend_name() -> str:
    """FlashInfer's MLA kernel family for this GPU, named explicitly: its 'auto' would fall back
    silently. A repro script picks it where it runs (its MLA_BACKEND, script_library)."""
    if script_calls.scripting():
        return script_calls.ScriptExpression("MLA_BACKEND")
    info = machine.gpu_info()
    return _flashinfer_family(info.capability if info is not None else None)


def _flashinfer_family(capability: tuple[int, int] | None) -> str:
    return "fa3" if capability == SM90 else "fa2"


class MLABackend(Backend):
    name = "mla"
    options_class = MLAOptions
    fill_requirement = FillRequirement(1, "FlashInfer MLA and FlashMLA need seq_len >= 1 (SGLang fills 1)")
    # Our own name (synth traces), and SGLang's FlashInfer MLA and FlashMLA backends.
    engine_names = {
        "mla": None,
        "flashinfer_mla": FillRequirement(1, "FlashInfer's MLA decode needs seq_len >= 1 (SGLang fills 1)"),
        "flashmla": FillRequirement(1, "FlashMLA's tile scheduler needs seq_len >= 1 (SGLang fills 1)"),
        # Its graph rows' block tables are built from the padded seq_lens (create_flashmla_kv_indices_triton)
        # and trtllm-gen reads seq_lens_k of every row the graph launches.
        "trtllm_mla": FillRequirement(1, "SGLang's trtllm_mla pads with seq_len 1 (get_cuda_graph_seq_len_fill_value): trtllm-gen reads a padded row's seq_lens_k and its block table"),
    }
    kernels_elsewhere = {"trtllm_mla": "FlashInfer's trtllm-gen MLA kernels, which run only on SM100 (Blackwell): its plans are read and judged, not run"}

    def __init__(self, options: MLAOptions | None = None):
        self.options = options or MLAOptions()
        self._triton = TritonBackend()
        self._wrapper = None  # eager FlashInfer wrapper, re-planned every run
        self._workspace: Tensor | None = None

    def impl(self) -> MLAImpl:
        """The one place that resolves "auto": FlashInfer when it can run here, else our Triton kernel."""
        if self.options.impl is not MLAImpl.AUTO:
            return self.options.impl
        if script_calls.scripting():
            return MLAImpl.FLASHINFER  # a repro script calls FlashInfer's MLA wrapper
        return MLAImpl.FLASHINFER if _library_reason(MLAImpl.FLASHINFER) is None else MLAImpl.TRITON

    # -- what runs here -----------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        impl = self.impl()
        if impl is MLAImpl.TRITON:
            return self._triton.unavailable_reason()
        if impl is MLAImpl.TRTLLM:
            return _library_reason(impl) or _TRTLLM_UNCALLED
        return _library_reason(impl)

    def device(self) -> str:
        return self._triton.device() if self.impl() is MLAImpl.TRITON else "cuda"

    def first_use_note(self) -> str | None:
        return {MLAImpl.TRITON: self._triton.first_use_note(), MLAImpl.FLASHINFER: compiling_note()}.get(self.impl())

    def library(self) -> LibraryRelease:
        impl = self.impl()
        if impl is MLAImpl.TRITON:
            return self._triton.library()
        name, package = {MLAImpl.FLASHINFER: ("FlashInfer (MLA)", "flashinfer"), MLAImpl.TRTLLM: ("FlashInfer trtllm-gen (MLA)", "flashinfer")}.get(impl, ("FlashMLA", "flash_mla"))
        return LibraryRelease(name, package_version(package) or "version unknown")

    def describe(self) -> str:
        impl = self.impl()
        if impl is MLAImpl.FLASHINFER:
            import flashinfer

            return (
                f"FlashInfer {flashinfer.__version__} BatchMLAPagedAttentionWrapper(backend='{_flashinfer_backend_name()}'), "
                "q/cache split into nope/rope views, LSE base 2 converted to natural"
            )
        if impl is MLAImpl.FLASHMLA:
            return "FlashMLA flash_mla_with_kvcache on 64-token blocks (untested adapter)"
        if impl is MLAImpl.TRTLLM:
            return "FlashInfer trtllm_batch_decode_with_kv_cache_mla (trtllm-gen, SM100 only): plans read and judged, not run"
        return f"{self._triton.describe()}; MLA decode: k_buffer [N,1,576], v_buffer = its first 512 columns"

    # -- what this backend can take -----------------------------------------------------------

    def capabilities(self) -> Capabilities:
        impl = self.impl()
        only_mla = {
            "attention": frozenset({AttentionKind.MLA}),
            "other_attention": "use the fa3, flashinfer or triton backend",
            "column_mask": False,
            # A merge of given states is no MLA kernel's: the triton and flashinfer backends run one.
            "merge_state": False,
        }
        if impl is MLAImpl.TRITON:
            triton = self._triton.capabilities()
            return replace(triton, **only_mla, why={**triton.why, "merge_state": _NO_MERGE})
        one_dtype = "fp8 KV needs scales, not wired"
        if impl is MLAImpl.FLASHINFER:
            return Capabilities(
                kernels="FlashInfer's MLA kernels",
                modes={AttentionKind.MLA: frozenset(_FLASHINFER_MODES)},
                graph_modes=ENGINE_GRAPH_MODES,
                kv_dtype_is_q_dtype=True,
                latent_dims=LatentDims(multiples=(128, 64)),
                lse_base=LseBase.TWO,
                why={"tree_mask": _CAUSAL_VERIFY, "kv_dtype_is_q_dtype": one_dtype, "merge_state": _NO_MERGE},
                **only_mla,
            )
        if impl is MLAImpl.TRTLLM:
            return Capabilities(
                kernels="FlashInfer's trtllm-gen MLA kernels (SM100 only)",
                modes={AttentionKind.MLA: frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})},
                graph_modes=ENGINE_GRAPH_MODES,
                kv_dtype_is_q_dtype=True,
                latent_dims=LatentDims(pairs=frozenset({(512, 64)})),
                why={
                    "modes": "SGLang's trtllm_mla runs extend through its ragged prefill (or FlashInfer MLA), not this form",
                    "tree_mask": _CAUSAL_VERIFY,
                    "kv_dtype_is_q_dtype": one_dtype,
                    "merge_state": _NO_MERGE,
                },
                **only_mla,
            )
        return Capabilities(
            kernels="FlashMLA's kernels",
            modes={AttentionKind.MLA: frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY})},
            graph_modes=ENGINE_GRAPH_MODES,
            kv_dtype_is_q_dtype=True,
            latent_dims=LatentDims(pairs=frozenset({(512, 64)})),
            page_sizes=frozenset({FLASHMLA_PAGE_SIZE}),
            why={
                "modes": "SGLang runs MLA extend through FlashInfer MLA (use impl=flashinfer)",
                "tree_mask": _CAUSAL_VERIFY,
                "kv_dtype_is_q_dtype": one_dtype,
                "merge_state": _NO_MERGE,
            },
            **only_mla,
        )

    def configuration_reason(self, trace: Trace) -> str | None:
        return self._triton.configuration_reason(trace) if self.impl() is MLAImpl.TRITON else None

    # -- plan -----------------------------------------------------------------------------------

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        impl = self.impl()
        if impl is MLAImpl.TRITON:
            plan = self._triton.derive_plan(trace, padding)
            return Plan(backend=self.name, tensors=plan.tensors, scalars={**plan.scalars, "impl": impl.value})
        page_size = trace.model.page_size
        rows, q_lens = padded_requests(trace, padding)
        kv_lens = torch.tensor([r.numel() for r in rows], dtype=torch.int32)
        causal = trace.batch.forward_mode is not ForwardMode.DECODE
        if impl is MLAImpl.TRTLLM:
            return _trtllm_plan(trace, rows, q_lens, kv_lens, page_size)
        if impl is MLAImpl.FLASHMLA:
            if len(set(q_lens)) > 1:
                raise ValueError(f"FlashMLA needs the same query length in every request, got {sorted(set(q_lens))}")
            return Plan(
                backend=self.name,
                tensors={"block_table": build_page_table(rows, page_size), "cache_seqlens": kv_lens},
                scalars={"impl": impl.value, "page_size": page_size, "causal": True, "q_len": q_lens[0] if q_lens else 1},
            )
        pages = [r[::page_size] // page_size for r in rows]
        return Plan(
            backend=self.name,
            tensors={
                "qo_indptr": indptr(torch.tensor(q_lens)).to(torch.int32),
                "kv_indptr": indptr(torch.tensor([p.numel() for p in pages])).to(torch.int32),
                "kv_indices": torch.cat(pages).to(torch.int32) if pages else torch.zeros(0, dtype=torch.int32),
                "kv_len_arr": kv_lens,
            },
            scalars={"impl": impl.value, "page_size": page_size, "causal": causal},
        )

    def plan_declaration(self, trace: Trace, plan: Plan) -> pd.PlanDeclaration:
        """By the plan's own `impl`: triton is the triton backend's declaration (slot ids);
        flashinfer is FlashInfer MLA's CSR (kv_indices are page ids, kv_len_arr[b] tokens of request
        b's pages, qo_indptr over query rows); flashmla a block_table of 64-token blocks read up to
        cache_seqlens. Both of the latter read whole rows and run verify steps causal, with no mask
        (SGLang: topk 1 only). An unknown impl declares no layout and cannot be read."""
        impl = plan.scalars.get("impl")
        if impl == MLAImpl.TRITON.value:
            return self._triton.plan_declaration(trace, plan)
        if impl == MLAImpl.FLASHINFER.value:
            call, scalars = pd.Call(pl.KvIds.PAGES_LENGTHS, ids="kv_indices", count="kv_indptr", length="kv_len_arr", page_size="page_size", queries="qo_indptr"), ("causal",)
        elif impl == MLAImpl.FLASHMLA.value:
            # flash_mla_with_kvcache reads the cache as 64-token blocks whatever the plan says.
            cache_page = (FLASHMLA_PAGE_SIZE, "FlashMLA reads the cache in 64-token blocks")
            call = pd.Call(pl.KvIds.TABLE, ids="block_table", count="cache_seqlens", length="cache_seqlens", page_size="page_size", cache_page=cache_page)
            scalars = ("causal", "q_len")
        elif impl == MLAImpl.TRTLLM.value:
            # A draft extend's queries are padded per request from cu_seqlens_q; decode and verify
            # run a dense q_len per request and keep no query offsets.
            queries = "cu_seqlens_q" if "cu_seqlens_q" in plan.tensors else None
            call = pd.Call(pl.KvIds.TABLE, ids="block_kv_indices", count="seq_lens_k", length="seq_lens_k", page_size="page_size", queries=queries)
            scalars = ("max_seq_len_q",) if queries else ("q_len",)
        else:
            call, scalars = None, ()
        return pd.PlanDeclaration(
            call=call,
            scalars=scalars,
            unknown=pd.UnknownSetting("impl", impl, ("triton", "flashinfer", "flashmla", "trtllm")) if call is None else None,
            ends=(pl.KvEnd.KV,),
            mask=pl.MaskReading.CAUSAL,
            window="window_left",
        )

    # -- JIT modules ----------------------------------------------------------------------------

    def jit_specs(self, trace: Trace, at: fm.Target) -> list:
        """Where FlashInfer's MLA wrapper is the implementation on `at` ("auto" picks it from SM80
        with flashinfer installed): its module for the step's dtypes and latent/rope dims, FA3's
        family on SM90, FA2's elsewhere (as `_flashinfer_backend_name` names it at run time)."""
        chosen = self.options.impl
        if chosen not in (MLAImpl.AUTO, MLAImpl.FLASHINFER) or not fm.available() or at.capability is None or at.capability < SM80:
            return []
        if MLABackend(MLAOptions(impl=MLAImpl.FLASHINFER)).unsupported_reason(trace):
            return []
        m = trace.model
        return fm.mla(_flashinfer_family(at.capability), q_dtype=m.q_dtype, kv_dtype=m.kv_dtype, head_dim_ckv=m.kv_lora_rank, head_dim_kpe=m.qk_rope_head_dim)

    # -- run ------------------------------------------------------------------------------------

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        impl = self.impl()
        if plan.scalars.get("impl") == MLAImpl.TRTLLM.value:
            raise KernelUnsupported(_trtllm_not_run())  # on any implementation, its own included
        if plan.scalars.get("impl") != impl.value:
            # A recorded plan of another implementation (FlashMLA's block table on a machine that runs
            # FlashInfer MLA): its layout is not this kernel's.
            raise KernelUnsupported(f"the plan is for mla impl={plan.scalars.get('impl')!r}; this machine runs impl={impl.value!r}")
        if impl is MLAImpl.TRITON:
            return self._triton.run(trace, inputs, _as_triton_plan(plan))
        try:
            if impl is MLAImpl.FLASHMLA:
                return _flashmla_run(trace, inputs, plan)
            return self._flashinfer_run(trace, inputs, plan)
        except KERNEL_ERRORS as e:
            if compile_failure(e) is not None:  # FlashInfer's MLA kernels are JIT-compiled
                raise library_error(e, trace.model, library=impl.value) from e
            first = (str(e).strip().splitlines() or [""])[0]
            raise KernelError(f"{impl.value}: {type(e).__name__}: {first[:300]}") from e

    def _flashinfer_run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        BatchMLAPagedAttentionWrapper = script_calls.flashinfer_module().mla.BatchMLAPagedAttentionWrapper  # noqa: N806 - the library's class
        model = trace.model
        if self._wrapper is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=inputs.q.device)
            self._wrapper = BatchMLAPagedAttentionWrapper(self._workspace, backend=_flashinfer_backend_name())
        _flashinfer_plan(self._wrapper, model, plan)
        tokens = inputs.q.shape[0]
        out = torch.empty(tokens, model.num_qo_heads, model.kv_lora_rank, dtype=inputs.q.dtype, device=inputs.q.device)
        lse2 = torch.empty(tokens, model.num_qo_heads, dtype=torch.float32, device=inputs.q.device)
        _flashinfer_run(self._wrapper, model, inputs, int(plan.scalars["page_size"]), out=out, lse=lse2)
        return AttentionResult(output=out, lse=lse2 * numerics.LN2)  # FlashInfer's LSE is base 2

    # -- CUDA graphs ----------------------------------------------------------------------------

    def graph_configuration_reason(self, trace: Trace) -> str | None:
        if self.impl() is MLAImpl.FLASHMLA:
            return "CUDA-graph replay is not wired for the (untested) FlashMLA adapter"
        if self.impl() is MLAImpl.TRTLLM:
            return _trtllm_not_run()
        return self._triton.graph_configuration_reason(trace) if self.impl() is MLAImpl.TRITON else None

    def script_library(self) -> ScriptLibrary:
        """A script calls FlashInfer's MLA wrapper, its kernel family chosen on the script's GPU as
        `_flashinfer_backend_name` chooses it here."""
        return ScriptLibrary(
            label="flashinfer (BatchMLAPagedAttentionWrapper)", imports="import flashinfer\nimport flashinfer.mla", install=SCRIPT_INSTALL, needs_gpu=True, version=SCRIPT_VERSION,
            prelude="# FlashInfer's MLA kernels for this GPU, chosen as attndbg's mla adapter chooses them.\n"
            'MLA_BACKEND = "fa3" if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else "fa2"\n',
        )  # fmt: skip

    def graph_state(self, trace: Trace, capacity: GraphCapacity) -> GraphState:
        reason = self.graph_unsupported_reason(trace)
        if reason:
            raise NotImplementedError(reason)
        if self.impl() is MLAImpl.TRITON:
            return _TritonMLAGraph(self._triton.graph_state(trace, capacity))
        return _FlashInferMLAGraph(trace, capacity)


class _TritonMLAGraph(GraphState):
    """The triton backend's graph state (static kv_indptr/kv_indices/num_kv_splits and split
    scratch, copied into in place), fed this backend's plans."""

    def __init__(self, inner: GraphState):
        self.inner = inner

    def load_plan(self, plan: Plan) -> None:
        self.inner.load_plan(_as_triton_plan(plan))

    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        return self.inner.forward(inputs)

    def poison_scratch(self) -> None:
        self.inner.poison_scratch()

    def plan_pointers(self) -> dict[str, int]:
        return self.inner.plan_pointers()


class _FlashInferMLAGraph(FlashInferGraphState):
    """BatchMLAPagedAttentionWrapper(use_cuda_graph=True) on static CSR buffers sized for the
    capture. `load_plan` re-plans the wrapper: FlashInfer copies the metadata into these buffers
    and rewrites its schedule in the same int workspace (FA2/FA3 MLA plans may be re-planned
    under a graph: supports_cuda_graph_replan)."""

    def __init__(self, trace: Trace, capacity: GraphCapacity):
        BatchMLAPagedAttentionWrapper = script_calls.flashinfer_module().mla.BatchMLAPagedAttentionWrapper  # noqa: N806 - the library's class
        self.model = m = trace.model
        super().__init__(max_tokens=capacity.max_tokens, num_heads=m.num_qo_heads, v_head_dim=m.kv_lora_rank, q_dtype=DTYPES[m.q_dtype])
        device = torch.device("cuda")
        bs = capacity.capture_bs
        self.buffers = {
            "qo_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=device),
            "kv_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=device),
            # max_kv_slots counts tokens; a request never has more pages than tokens.
            "kv_indices": torch.zeros(max(capacity.max_kv_slots, 1), dtype=torch.int32, device=device),
            "kv_len_arr": torch.zeros(bs, dtype=torch.int32, device=device),
        }
        self.wrapper = BatchMLAPagedAttentionWrapper(
            self.workspace,
            use_cuda_graph=True,
            qo_indptr=self.buffers["qo_indptr"],
            kv_indptr=self.buffers["kv_indptr"],
            kv_indices=self.buffers["kv_indices"],
            kv_len_arr=self.buffers["kv_len_arr"],
            backend=_flashinfer_backend_name(),
        )
        self.page_size = m.page_size

    def load_plan(self, plan: Plan) -> None:
        _flashinfer_plan(self.wrapper, self.model, plan)

    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        tokens = inputs.q.shape[0]
        _flashinfer_run(self.wrapper, self.model, inputs, self.page_size, out=self.out[:tokens], lse=self.lse_base2[:tokens])
        return self.result(tokens)


# -- library calls ------------------------------------------------------------------------------


_TRTLLM_UNCALLED = "attndbg does not call trtllm-gen's MLA kernels (no SM100 machine to test a call on)"


def _trtllm_not_run() -> str:
    """Why a trtllm_mla plan is not run here: its kernels are SM100's, and no other library's
    kernel is run in their name (the reference and the invariants still judge the step)."""
    reason = _library_reason(MLAImpl.TRTLLM) or _TRTLLM_UNCALLED
    return f"the plan is SGLang trtllm_mla's (FlashInfer trtllm-gen MLA, SM100 only) and is not run as another library's kernel: {reason}"


def _trtllm_plan(trace: Trace, rows: list[Tensor], q_lens: list[int], kv_lens: Tensor, page_size: int) -> Plan:
    """SGLang's TRTLLMMLADecodeMetadata for this batch: a block table of page ids read up to
    seq_lens_k; a draft extend's query offsets (cu_seqlens_q, seq_lens_q, max_seq_len_q), decode's
    and verify's dense q_len."""
    tensors = {"block_kv_indices": build_page_table(rows, page_size), "seq_lens_k": kv_lens}
    scalars: dict[str, int | float | bool | str] = {"impl": MLAImpl.TRTLLM.value, "page_size": page_size, "max_seq_len_k": int(kv_lens.max()) if kv_lens.numel() else 0}
    if trace.batch.forward_mode is ForwardMode.DRAFT_EXTEND:
        q = torch.tensor(q_lens, dtype=torch.int32)
        tensors.update({"cu_seqlens_q": indptr(q).to(torch.int32), "seq_lens_q": q})
        scalars["max_seq_len_q"] = max(q_lens, default=0)
    else:
        scalars["q_len"] = q_lens[0] if q_lens else 1
    return Plan(backend="mla", tensors=tensors, scalars=scalars)


def _library_reason(impl: MLAImpl) -> str | None:
    """Why FlashInfer's, trtllm-gen's or FlashMLA's MLA kernels cannot run on this machine, or None."""
    module, package = ("flashinfer", "flashinfer-python") if impl in (MLAImpl.FLASHINFER, MLAImpl.TRTLLM) else ("flash_mla", "FlashMLA (github.com/deepseek-ai/FlashMLA)")
    info = machine.gpu_info()
    missing = []
    if info is None:
        missing.append("an SM100 (Blackwell) GPU (none found)" if impl is MLAImpl.TRTLLM else "a CUDA GPU (none found)")
    if not machine.module_available(module):
        missing.append(f"{module} (install {package})")
    if missing:
        return f"mla impl={impl.value} needs " + " and ".join(missing)
    if impl is MLAImpl.FLASHINFER and info.capability < SM80:
        return f"FlashInfer MLA needs SM80 or newer; this GPU ({info.name}) is {info.arch}"
    if impl is MLAImpl.TRTLLM and info.capability[0] != SM100[0]:
        return f"FlashInfer's trtllm-gen MLA kernels run only on SM100 (Blackwell); this GPU ({info.name}) is {info.arch}"
    if impl is MLAImpl.FLASHMLA and info.capability != SM90:
        return f"FlashMLA needs SM90 (Hopper); this GPU ({info.name}) is {info.arch}"
    return None


def _flashinfer_plan(wrapper, model, plan: Plan) -> None:
    fi_mla = script_calls.flashinfer_module().mla

    t, s = plan.tensors, plan.scalars
    csr = {name: t[name] for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")}
    common = dict(
        num_heads=model.num_qo_heads,
        head_dim_ckv=model.kv_lora_rank,
        head_dim_kpe=model.qk_rope_head_dim,
        page_size=int(s["page_size"]),
        causal=bool(s["causal"]),
        sm_scale=model.sm_scale,
        q_data_type=DTYPES[model.q_dtype],
        kv_data_type=DTYPES[model.kv_dtype],
    )
    wait_for_pending_plans()
    if hasattr(fi_mla, "MLAPlanMetadata"):
        # Canonical form (FlashInfer 0.7.2): the run contract (split inputs, base-2 LSE) is declared here.
        wrapper.plan(
            metadata=fi_mla.MLAPlanMetadata.csr(**csr), query_layout="split", kv_cache_layout="split", lse_mode="base2", **common
        )
    else:
        # Older FlashInfer: the flat form, split inputs by default (untested here).
        wrapper.plan(**csr, **common)


def _flashinfer_run(wrapper, model, inputs: AttentionInputs, page_size: int, *, out: Tensor, lse: Tensor) -> None:
    """q [T, H, 576] and cache [N, 1, 576] as nope/rope views; writes out [T, H, 512] and base-2 lse [T, H]."""
    fi_mla = script_calls.flashinfer_module().mla

    rank = model.kv_lora_rank
    q_nope, q_pe = inputs.q[..., :rank], inputs.q[..., rank:]  # [T, H, 512], [T, H, 64]
    paged = inputs.k_cache.view(-1, page_size, model.head_dim)  # [pages, page_size, 576]
    ckv, kpe = paged[..., :rank], paged[..., rank:]  # [pages, page_size, 512], [pages, page_size, 64]
    if hasattr(fi_mla, "MLAPlanMetadata"):
        wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=out, lse=lse, return_lse=True)
    else:
        wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out, lse=lse, return_lse=True)


def _flashmla_run(trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
    """UNTESTED here (FlashMLA is not installed on our GPU machine): written from FlashMLA's
    documented interface, as SGLang's flashmla_backend calls it. Its LSE is natural log
    ([bs, H, s_q]; FlashMLA's tests compare it with torch.logsumexp)."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    model = trace.model
    device = inputs.q.device
    block_table = plan.tensors["block_table"].to(device)
    cache_seqlens = plan.tensors["cache_seqlens"].to(device)
    bs, s_q, heads = block_table.shape[0], int(plan.scalars["q_len"]), model.num_qo_heads
    # Older FlashMLA plans here (tile metadata, num_splits); newer returns (empty meta, None).
    tile_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * heads, 1)
    out, lse = flash_mla_with_kvcache(
        inputs.q.view(bs, s_q, heads, model.head_dim),
        inputs.k_cache.view(-1, FLASHMLA_PAGE_SIZE, 1, model.head_dim),
        block_table,
        cache_seqlens,
        model.kv_lora_rank,
        tile_metadata,
        num_splits,
        softmax_scale=model.sm_scale,
        causal=bool(plan.scalars["causal"]),
    )
    return AttentionResult(
        output=out.reshape(bs * s_q, heads, model.kv_lora_rank),
        lse=lse.transpose(1, 2).reshape(bs * s_q, heads),
    )


def _as_triton_plan(plan: Plan) -> Plan:
    scalars = {k: v for k, v in plan.scalars.items() if k != "impl"}
    return Plan(backend="triton", tensors=plan.tensors, scalars=scalars)
