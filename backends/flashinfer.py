"""`flashinfer`: the real FlashInfer kernels, driven the way SGLang's FlashInfer backend drives them.

The plan speaks SGLang's FlashInferAttnBackend vocabulary (see ../shared/reference/engines.md, A4.1):
`kv_indptr` (pages, int32), `kv_indices` (page ids; at page size 1 the slot ids themselves),
`kv_last_page_len`, `qo_indptr`, and for verify a bool `custom_mask` in the FULL layout (per request a
row-major [n, prefix + n] block) that FlashInfer's `plan` packs little-endian itself. Which wrapper
runs is the plan's `path` scalar:

    decode   BatchDecodeWithPagedKVCacheWrapper (tensor cores on or off)
    ragged   BatchPrefillWithRaggedKVCacheWrapper over this step's tokens (extend without any prefix)
    cascade  ragged over this step's tokens (causal) + paged over the cached prefix (non-causal),
             merged with flashinfer.cascade.merge_state: SGLang's default extend with a prefix
    paged    BatchPrefillWithPagedKVCacheWrapper over the whole visible row: causal extend, or a
             custom mask (verify trees, selective recompute)

Plan scalars: `path`, `page_size`, `window_left` and `logits_soft_cap` as the kernels take them,
`causal` (the mask of the pass over the paged KV; False for the cascade's prefix pass and wherever a
custom mask rules), `use_tensor_cores` (decode). A trace's KV cache [N, Hkv, D] is handed over as
NHD pages [N / page, page, Hkv, D]; a request's pages are `row[::page] // page`.

Facts this relies on (measured on an H200, FlashInfer 0.7.2): the kernels write base-2 LSEs (converted
here: natural = base2 * ln 2); decode `plan` needs `q_data_type` unless q is fp16. flashinfer is
imported only when a kernel runs, so this module imports on a machine without it.
"""

from __future__ import annotations

import enum
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
    KernelUnsupported,
    LibraryRelease,
    Padding,
    PartialStates,
    ScriptLibrary,
    coerce_option,
)
from attndbg.backends.host_hints import HostHint, Measures, Rows, Sizes
from attndbg.backends.capabilities import ENGINE_GRAPH_MODES, HALF_DTYPES, MHA_ALL_MODES, Capabilities, HeadDims
from attndbg.backends import flashinfer_modules as fm
from attndbg.backends import flashinfer_plan_info as fpi
from attndbg.backends import script_calls
from attndbg.backends.flashinfer_runtime import KERNEL_ERRORS, SCRIPT_INSTALL, SCRIPT_VERSION, WORKSPACE_BYTES, FlashInferGraphState, compiling_note, library_error, wait_for_pending_plans
from attndbg.backends import plan_declaration as pd
from attndbg.backends import plan_layout as pl
from attndbg.backends import plan_view as pv
from attndbg.trace import tree
from attndbg.trace.schema import DTYPES, ForwardMode, LseBase, Model, Plan, Trace, indptr
from attndbg.trace.visibility import visibility

INSTALL_HINT = "flashinfer is not installed: `pip install 'attndbg[flashinfer]'`"
# FlashInfer's FA2 prefill kernels (bf16, tensor-core decode) need Ampere or newer.
MIN_CAPABILITY = (8, 0)
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Group size above which SGLang's should_use_tensor_core picks tensor-core decode for fp16/bf16 KV.
SGLANG_TENSOR_CORE_MIN_GROUP = 4


# Head dims FlashInfer's split-KV merge (cascade.cuh VariableLengthMergeStates) is compiled for.
MERGE_HEAD_DIMS = (64, 128, 256, 512)


class ExtendPath(enum.Enum):
    """How EXTEND/MIXED steps are run. AUTO is SGLang's choice (see `FlashInferBackend.extend_path`)."""

    AUTO = "auto"
    PAGED = "paged"
    RAGGED = "ragged"
    CASCADE = "cascade"


# The name SGLang's FlashInfer backend carries in a trace's source.backend.
SGLANG_NAME = "flashinfer"


# A plan recorded from a live wrapper holds its mask as FlashInfer packed it (SGLang's recorder:
# `_custom_mask_buf` / `_mask_indptr_buf`); a derived plan holds the bool custom_mask.
PACKED_MASK = pl.PackedMask("packed_custom_mask", "packed_mask_indptr")
# Per request: a last page length; offsets over the indices, the query rows and the mask (either form).
PLAN_ROWS = (
    pv.RequestRows(
        1,
        ("kv_last_page_len",),
        (("kv_indptr", "kv_indices"), ("qo_indptr", None), ("mask_indptr", "custom_mask"), (PACKED_MASK.indptr, PACKED_MASK.tensor)),
    ),
)


class PlanPath(enum.Enum):
    """The wrapper(s) a plan is for; stored by value in `plan.scalars["path"]`."""

    DECODE = "decode"
    PAGED = "paged"
    RAGGED = "ragged"
    CASCADE = "cascade"


@dataclass(frozen=True)
class FlashInferOptions:
    # None: SGLang's should_use_tensor_core (fp8 KV, or fp16/bf16 KV with GQA group > 4).
    decode_tensor_cores: bool | None = None
    extend_path: ExtendPath | str = ExtendPath.AUTO

    def __post_init__(self) -> None:
        coerce_option(self, "extend_path", ExtendPath)


def sglang_uses_tensor_cores(kv_dtype: str, num_qo_heads: int, num_kv_heads: int) -> bool:
    """SGLang's `should_use_tensor_core` (flashinfer_backend.py) without its env override.

    fp8 KV always; fp16/bf16 KV when the GQA group exceeds 4 ("a group of at least 4 is needed to
    use tensor cores efficiently"; SGLang's test is `>`); anything else never.
    """
    if kv_dtype in FP8_DTYPES:
        return True
    if kv_dtype in ("float16", "bfloat16"):
        return num_qo_heads // num_kv_heads > SGLANG_TENSOR_CORE_MIN_GROUP
    return False


# FlashInfer releases whose batch decode is wrong at head dims that are not powers of two, measured
# on an H100 by bench/flashinfer_head_dims.py (docs/benchmarks.md, bs 2,
# 4:4 heads, bf16, page 1, against float64): the CUDA-core path returns wrong outputs at 40, 72, 80,
# 96, 104, 112, 160 and 192 (max abs 0.3-1.3); the tensor-core path ends in an illegal memory access
# at 80, 96, 104, 112 and 160, is refused at 40 and wrong at 72; only 192 on tensor cores is right.
# No error is raised at plan(). Declared as a known defect (Backend.known_defect): `check` runs the
# step in its crash-contained workers and its kernels detector confirms the prediction or contradicts
# it (the table was measured at 4:4 heads only); `replay` refuses it (an illegal memory access would
# poison its process). Every head dim measured is a multiple of 8; one
# that is not (13, say) fails FlashInfer's own JIT build, and that compiler message is the truer
# reason, so the declaration stops at multiples of 8.
DECODE_HEAD_DIM_DEFECT_RELEASES = ("0.7.2",)
DECODE_HEAD_DIM_DEFECT_MULTIPLE = 8
DECODE_HEAD_DIMS_RIGHT_ON_TENSOR_CORES = (192,)


def _measured_release() -> str | None:
    """The installed FlashInfer's version when it is a release the defect tables were measured on."""
    version = str(getattr(_flashinfer(), "__version__", "")) if machine.module_available("flashinfer") else ""
    return version if version.startswith(DECODE_HEAD_DIM_DEFECT_RELEASES) else None


def decode_head_dim_defect(head_dim: int, tensor_cores: bool) -> str | None:
    """The known library defect a decode at `head_dim` would hit with the installed FlashInfer, if any."""
    if head_dim & (head_dim - 1) == 0 or (tensor_cores and head_dim in DECODE_HEAD_DIMS_RIGHT_ON_TENSOR_CORES):
        return None
    if head_dim % DECODE_HEAD_DIM_DEFECT_MULTIPLE:
        return None  # never builds: the JIT's own error names it (KernelUnsupported)
    version = _measured_release()
    if version is None:
        return None  # a release we have not measured: run it (check's workers contain a crash)
    path = "tensor-core path: illegal memory access or wrong outputs" if tensor_cores else "CUDA-core path: wrong outputs, max abs 0.3-1.0"
    return (
        f"known FlashInfer {version} defect: batch decode at head_dim {head_dim} (not a power of two) is wrong "
        f"({path}; measured, docs/benchmarks.md); standalone reproduction: "
        f"python bench/flashinfer_head_dims.py --one {head_dim}{' --tensor-cores' if tensor_cores else ''}"
    )


# FlashInfer 0.7.2's paged prefill (BatchPrefillWithPagedKVCache, the extend path SGLang picks) ends
# in an illegal memory access at head_dim 80 and 96, measured on an H100 by bench/flashinfer_sweep.py
# (docs/benchmarks.md: 16:4 heads, bf16, pages 1 and 16; each reproduced by its `attndbg repro`
# script). Declared like the decode defect: `check` runs it in a worker, `replay` refuses it.
PREFILL_HEAD_DIMS_FAULTING = (80, 96)


def prefill_head_dim_defect(head_dim: int) -> str | None:
    """The known library defect an extend at `head_dim` would hit with the installed FlashInfer, if any."""
    if head_dim not in PREFILL_HEAD_DIMS_FAULTING:
        return None
    version = _measured_release()
    if version is None:
        return None  # a release we have not measured: run it (check's workers contain a crash)
    return (
        f"known FlashInfer {version} defect: paged prefill at head_dim {head_dim} ends in an illegal memory access "
        "(measured, docs/benchmarks.md); standalone reproduction: python bench/flashinfer_sweep.py OUT --part prefill"
    )


def _flashinfer():
    return script_calls.flashinfer_module()


class FlashInferBackend(Backend):
    name = "flashinfer"
    options_class = FlashInferOptions
    fill_requirement = FillRequirement(
        1,
        "FlashInfer's decode kernels need seq_len >= 1 in every row: seq_len 0 gave NaN padded rows (SGLang #1571, "
        "FlashInfer #2883, vLLM #38436), so SGLang fills 1 (#1779, which undid #1469's fill of 0)",
        stale_positions=(
            "The runner left stale positions in padded verify tokens; FlashInfer's verify plan reads them and hit an "
            "illegal memory access (SGLang #24361, why the newer runner zeroes positions)."
        ),
    )
    # SGLang's and vLLM's FlashInfer backends (vLLM pads with seq_len 0: its #38436 above).
    engine_names = {SGLANG_NAME: None, "FLASHINFER": None}
    # vLLM's FLASHINFER builder hands FlashInfer's trtllm-gen / XQA kernels host maxima beside their
    # block tables (vLLM 0.33 FlashInferTrtllmAPIDecode and TRTLLMPrefill, whose presence in the
    # metadata says those kernels ran): trtllm_batch_decode_with_kv_cache(max_seq_len) and
    # trtllm_batch_context_with_kv_cache(max_q_len, max_kv_len) size their work by them, and a
    # max_seq_len past the block table makes the walk read past its valid entries (vLLM #43991).
    # FlashInfer's own wrappers plan from the indptrs and read no such hint.
    host_hints = {
        "FLASHINFER": (
            HostHint(
                "decode.max_seq_len", Measures.KV_LEN, Sizes.TABLE_WALK, "FlashInfer's trtllm-gen / XQA decode (trtllm_batch_decode_with_kv_cache's max_seq_len)",
                rows=Rows.DECODES, table="decode.block_tables", present=("decode.block_tables",),
            ),
            HostHint(
                "prefill.max_seq_len", Measures.KV_LEN, Sizes.TABLE_WALK, "FlashInfer's trtllm-gen prefill (trtllm_batch_context_with_kv_cache's max_kv_len)",
                rows=Rows.PREFILLS, table="prefill.block_tables", present=("prefill.block_tables",),
            ),
            HostHint(
                "prefill.max_q_len", Measures.QUERY_LEN, Sizes.ROWS, "FlashInfer's trtllm-gen prefill (trtllm_batch_context_with_kv_cache's max_q_len)",
                rows=Rows.PREFILLS, present=("prefill.block_tables",),
            ),
        ),
    }  # fmt: skip

    def __init__(self, options: FlashInferOptions | None = None):
        self.options = options or FlashInferOptions()
        self._workspace_buffer: Tensor | None = None

    # -- capabilities -------------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        if not machine.cuda_available():
            return "no CUDA GPU: FlashInfer's kernels run only on NVIDIA GPUs"
        if not machine.module_available("flashinfer"):
            return INSTALL_HINT
        info = machine.gpu_info()
        if info is not None and info.capability < MIN_CAPABILITY:
            return f"FlashInfer's prefill kernels need sm80 or newer; this GPU ({info.name}) is {info.arch}"
        return None

    def device(self) -> str:
        return "cuda"

    def first_use_note(self) -> str | None:
        return compiling_note()

    def describe(self) -> str:
        version = getattr(_flashinfer(), "__version__", "?")
        info = machine.gpu_info()
        cores = {None: "SGLang's rule: fp8 KV or GQA group > 4", True: "on", False: "off"}[self.options.decode_tensor_cores]
        return (
            f"FlashInfer {version} on {info.arch if info else 'cuda'}: decode BatchDecodeWithPagedKVCacheWrapper "
            f"(tensor cores {cores}); extend {self.options.extend_path.value} (ragged / cascade ragged+paged "
            "merged with merge_state / paged prefill); verify and selective: paged prefill with a custom mask"
        )

    def capabilities(self) -> Capabilities:
        return Capabilities(
            kernels="FlashInfer's MHA kernels",
            other_attention="use the mla backend (FlashInfer's MLA wrapper), not the MHA wrappers",
            modes=MHA_ALL_MODES,
            graph_modes=ENGINE_GRAPH_MODES,
            kv_dtypes=HALF_DTYPES | frozenset(FP8_DTYPES),
            head_dims=HeadDims(
                min_outside_decode=32,
                one_in_decode=True,
                # Measured on the H200 at head_dim 16: "Invalid configuration : NUM_MMA_Q=1 NUM_MMA_D_QK=1 ...".
                why="the prefill kernels tile head_dim in 16-wide MMAs and need at least two",
            ),
            tree_mask=True,
            column_mask=True,
            sliding_window=True,
            window_in_tree_verify=True,
            soft_cap=True,
            # plan(causal=False); BatchAttentionWithAttentionSinkWrapper (the AttentionSink variant,
            # fa2); run(k_scale=, v_scale=); cross-attention and an extend's mask through the paged
            # prefill wrapper over the KV the plan lists (causal masks aligned bottom-right).
            non_causal=True,
            sinks=True,
            kv_scales=True,
            cross=True,
            extend_mask=True,
            lse_base=LseBase.TWO,
            # flashinfer.cascade.merge_state (two states) and merge_states (any number): base-2 LSEs.
            merge_state=True,
            merge_head_dims=frozenset(MERGE_HEAD_DIMS),
            why={
                "window_right": "plan() and run() take window_left only (prefill.py, decode.py: no right window)",
                "merge_head_dims": "MergeState dispatches head_dim through DISPATCH_HEAD_DIM (include/flashinfer/attention/cascade.cuh)",
                "empty_kv": "its decode kernels need seq_len >= 1: seq_len 0 gave illegal memory accesses (SGLang #1469) and NaN rows (FlashInfer #2883)",
            },
        )

    def configuration_reason(self, trace: Trace) -> str | None:
        mode = trace.batch.forward_mode
        if trace.model.sinks is not None:
            return self._sink_problem(trace)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND) and not trace.is_tree_verify:
            return self._extend_path_problem(trace)
        return None

    def known_defect(self, trace: Trace) -> str | None:
        # (A decode with sinks runs the sink wrapper, a prefill kernel: not the decode kernels.)
        mode = trace.batch.forward_mode
        if mode is ForwardMode.DECODE and trace.model.sinks is None:
            return decode_head_dim_defect(trace.model.head_dim, self.use_tensor_cores(trace))
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND) and not trace.is_tree_verify:
            return prefill_head_dim_defect(trace.model.head_dim)
        return None

    def library(self) -> LibraryRelease:
        return LibraryRelease("FlashInfer", package_version("flashinfer") or "not installed")

    def _sink_problem(self, trace: Trace) -> str | None:
        """Sinks run through BatchAttentionWithAttentionSinkWrapper (attention/_core.py): a paged
        prefill whose AttentionSink variant (jit/attention/variants.py) declares the sink and
        sm_scale only, so no soft-cap, and no mask beyond causal and window_left."""
        model, batch = trace.model, trace.batch
        if model.logit_cap > 0:
            return "attention sinks with a logit soft-cap: FlashInfer's AttentionSink variant applies no soft-cap"
        if trace.is_tree_verify or batch.selective or batch.custom_mask is not None:
            return "attention sinks with a custom mask: FlashInfer's sink wrapper is run here with causal / window_left masks only"
        if self.options.extend_path not in (ExtendPath.AUTO, ExtendPath.PAGED) and batch.forward_mode is not ForwardMode.DECODE:
            return f"extend_path={self.options.extend_path.value} with attention sinks: the sink is one term of one softmax, so only the paged path (one pass) runs it"
        return None

    def _extend_path_problem(self, trace: Trace) -> str | None:
        requested = self.options.extend_path
        batch = trace.batch
        if requested in (ExtendPath.RAGGED, ExtendPath.CASCADE) and _one_paged_pass(trace):
            return (
                f"extend_path={requested.value}: {_one_paged_pass(trace)} is run in one pass of the paged prefill "
                "wrapper over the KV it lists (the ragged pass attends causally to the new tokens alone): use paged"
            )
        if batch.selective and requested in (ExtendPath.RAGGED, ExtendPath.CASCADE):
            return (
                f"extend_path={requested.value}: selective recompute reads its whole row from the cache with a "
                "per-column causal mask; only the paged path (custom mask) runs it"
            )
        if requested is ExtendPath.RAGGED and bool((batch.prefix_lens > 0).any()):
            b = int(torch.nonzero(batch.prefix_lens > 0)[0])
            return (
                f"extend_path=ragged attends only to this step's tokens, but request {b} has a cached prefix of "
                f"{int(batch.prefix_lens[b])}: use cascade or paged"
            )
        if requested is ExtendPath.CASCADE and trace.model.sliding_window >= 0:
            return (
                "extend_path=cascade with a sliding window: FlashInfer's window_left counts back from the end of "
                "the KV it is given, and the cascade's prefix pass holds only the prefix, so the window would be "
                "shifted by the extend length (SGLang runs window layers paged): use paged"
            )
        return None

    # -- plan ---------------------------------------------------------------------------------

    def use_tensor_cores(self, trace: Trace) -> bool:
        if self.options.decode_tensor_cores is not None:
            return self.options.decode_tensor_cores
        m = trace.model
        return sglang_uses_tensor_cores(m.kv_dtype, m.num_qo_heads, m.num_kv_heads)

    def extend_path(self, trace: Trace) -> PlanPath:
        """The path of an EXTEND/MIXED/DRAFT_EXTEND step.

        AUTO is SGLang's: ragged when no request has a prefix, cascade otherwise; paged for sliding
        windows ("window attention use paged only"), draft extend and selective recompute.
        """
        requested = self.options.extend_path
        if requested is not ExtendPath.AUTO:
            return PlanPath(requested.value)
        batch = trace.batch
        if batch.selective or trace.model.sliding_window >= 0 or batch.forward_mode is ForwardMode.DRAFT_EXTEND or _one_paged_pass(trace):
            return PlanPath.PAGED
        return PlanPath.CASCADE if bool((batch.prefix_lens > 0).any()) else PlanPath.RAGGED

    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        if padding is not None and padding.capture_bs < trace.batch.batch_size:
            raise ValueError(f"capture_bs {padding.capture_bs} < batch size {trace.batch.batch_size}")
        if trace.batch.forward_mode is ForwardMode.DECODE and trace.model.sinks is None:
            return self._decode_plan(trace, padding)
        if trace.is_tree_verify:
            return self._verify_plan(trace, padding)
        if padding is not None and trace.batch.forward_mode is not ForwardMode.DECODE:
            raise ValueError("only decode and verify steps are padded for CUDA graphs")
        problem = self.unsupported_reason(trace)
        if problem:
            raise ValueError(problem)
        return self._extend_plan(trace, padding)  # (a decode step with sinks: the sink wrapper is a prefill wrapper)

    def _scalars(self, trace: Trace, path: PlanPath, **extra) -> dict[str, int | float | bool | str]:
        return {
            "path": path.value,
            "page_size": trace.model.page_size,
            "window_left": trace.model.sliding_window,
            "logits_soft_cap": trace.model.logit_cap,
            **extra,
        }

    def _decode_plan(self, trace: Trace, padding: Padding | None) -> Plan:
        batch, ps = trace.batch, trace.model.page_size
        window = trace.model.sliding_window
        pages = []
        for b in range(batch.batch_size):
            kv = int(batch.kv_lens[b])
            # Sliding window: only the window's pages (SGLang: kv_start_idx = seq_len - (window + 1)).
            start = _window_start(kv, keep=window + 1, page_size=ps) if window >= 0 else 0
            pages.append((_page_ids(batch.request_slots(b)[start:kv], ps), kv - start))
        if padding is not None:
            pages += [_padded_pages(padding.fill_value, padding, ps)] * (padding.capture_bs - batch.batch_size)
        scalars = self._scalars(trace, PlanPath.DECODE, use_tensor_cores=self.use_tensor_cores(trace), causal=False)
        return Plan(backend=self.name, tensors=_paged_arrays(pages, ps), scalars=scalars)

    def _verify_plan(self, trace: Trace, padding: Padding | None) -> Plan:
        batch, ps = trace.batch, trace.model.page_size
        n = trace.spec.draft_token_num
        window = trace.model.sliding_window
        pages, blocks = [], []
        for b in range(batch.batch_size):
            kv = int(batch.kv_lens[b])  # prefix + draft tokens: all in the cache
            pages.append((_page_ids(batch.request_slots(b), ps), kv))
            blocks.append(_tree_block(trace.spec.parents[b], int(batch.prefix_lens[b]), window))
        if padding is not None:
            # Padded requests: `fill_value` prefix columns plus n draft tokens, all at the dummy
            # page, under a chain tree (a valid mask whatever they read).
            chain = torch.arange(-1, n - 1)
            for _ in range(padding.capture_bs - batch.batch_size):
                pages.append(_padded_pages(padding.fill_value + n, padding, ps))
                blocks.append(_tree_block(chain, padding.fill_value, window))
        tensors = _paged_arrays(pages, ps)
        tensors["qo_indptr"] = torch.arange(0, (len(pages) + 1) * n, n, dtype=torch.int32)
        tensors["custom_mask"] = torch.cat([blk.flatten() for blk in blocks])
        tensors["mask_indptr"] = indptr(torch.tensor([blk.numel() for blk in blocks])).to(torch.int32)
        # The window is folded into the mask (draft tokens sit at prefix + depth, not prefix + index,
        # which FlashInfer's window_left would assume), so the kernel gets window_left = -1.
        scalars = self._scalars(trace, PlanPath.PAGED, causal=False)
        scalars["window_left"] = -1
        return Plan(backend=self.name, tensors=tensors, scalars=scalars)

    def _extend_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        batch, ps = trace.batch, trace.model.page_size
        path = self.extend_path(trace)
        window = trace.model.sliding_window
        pad = padding.capture_bs - batch.batch_size if padding is not None else 0  # decode rows only: one query each
        tensors = {"qo_indptr": indptr(torch.cat([batch.extend_lens, torch.ones(pad, dtype=torch.int64)])).to(torch.int32)}
        pages = []
        if batch.selective or batch.custom_mask is not None:
            # The whole row is read from the cache and a custom mask says what each query sees by
            # column (selective recompute: causality by each query's column; an extend's own mask),
            # the window folded in.
            blocks = []
            for b in range(batch.batch_size):
                pages.append((_page_ids(batch.request_slots(b), ps), int(batch.kv_lens[b])))
                blocks.append(visibility(trace, b))
            tensors.update(_paged_arrays(pages, ps))
            tensors["custom_mask"] = torch.cat([blk.flatten() for blk in blocks])
            tensors["mask_indptr"] = indptr(torch.tensor([blk.numel() for blk in blocks])).to(torch.int32)
            return Plan(backend=self.name, tensors=tensors, scalars=self._scalars(trace, path, causal=False, window_left=-1))
        for b in range(batch.batch_size):
            slots = batch.request_slots(b)
            if path is PlanPath.PAGED:
                kv = int(batch.kv_lens[b])
                # SGLang's window wrapper: paged_kernel_lens = min(seq_len, window + extend_len).
                # (A cross-attention row's window counts from its bottom-right too.)
                keep = window + int(batch.extend_lens[b])
                start = _window_start(kv, keep=keep, page_size=ps) if window >= 0 else 0
                pages.append((_page_ids(slots[start:kv], ps), kv - start))
            else:  # ragged and cascade: SGLang plans the paged wrapper over the prefix only
                prefix = int(batch.prefix_lens[b])
                pages.append((_page_ids(slots[:prefix], ps), prefix))
        if padding is not None:
            pages += [_padded_pages(padding.fill_value, padding, ps)] * pad
        tensors.update(_paged_arrays(pages, ps))
        # The cascade's prefix pass is non-causal (every new token sees the whole prefix); the paged
        # pass is as the layer is (FlashInfer's causal mask is aligned bottom-right: query i of q_len
        # sees the kv_len - q_len + i first keys, a cross-attention query's column).
        causal = path is not PlanPath.CASCADE and trace.model.causal
        return Plan(backend=self.name, tensors=tensors, scalars=self._scalars(trace, path, causal=causal))

    def plan_declaration(self, trace: Trace, plan: Plan) -> pd.PlanDeclaration:
        """SGLang's FlashInferAttnBackend plan as the wrappers read it, by `path`.

        Paged KV (decode, paged, the cascade's prefix pass): page ids over kv_indptr, a request's
        tokens (pages - 1) * page + kv_last_page_len (each in [0, page]), the plan's page size that
        of the cache (the cache is handed over as pages of the model's size). Queries: qo_indptr
        over query rows (ragged: over this step's K/V rows too, and all its kernel reads). A custom
        mask: per request a [q_len, kv_len] block over exactly the KV listed, one after the other.
        An extend lists by `path`: paged the whole row, ragged and cascade the prefix (the new
        tokens go through the ragged wrapper), an unknown path either; a verify step the whole row."""
        scalar = plan.scalars.get("path")
        try:
            path: PlanPath | None = PlanPath(scalar)
        except ValueError:
            path = None
        ends = (pl.KvEnd.KV,)
        if not trace.is_tree_verify:
            ends = {PlanPath.PAGED: (pl.KvEnd.KV,), PlanPath.RAGGED: (pl.KvEnd.PREFIX,), PlanPath.CASCADE: (pl.KvEnd.PREFIX,)}.get(path, (pl.KvEnd.KV, pl.KvEnd.PREFIX))
        return pd.PlanDeclaration(
            call=pd.Call(
                pl.KvIds.PAGES_LAST_PAGE_LEN, ids="kv_indices", count="kv_indptr", length="kv_last_page_len", page_size="page_size", queries=None if path is PlanPath.DECODE else "qo_indptr"
            ),
            unknown=pd.UnknownSetting("path", scalar, tuple(p.value for p in PlanPath)) if path is None else None,
            scalars=("window_left", "logits_soft_cap", *{PlanPath.DECODE: ("use_tensor_cores",), PlanPath.PAGED: ("causal",), PlanPath.CASCADE: ("causal",)}.get(path, ())),
            queries_only=path is PlanPath.RAGGED,
            ends=ends,
            # FlashInfer's plan() ignores any recorded mask_indptr: it computes the blocks' offsets
            # as cumsum(q_len * kv_len) (prefill.py, _compute_page_mask_indptr).
            mask=pl.MaskReading.COVERED_BLOCKS if "custom_mask" in plan.tensors or PACKED_MASK.tensor in plan.tensors else pl.MaskReading.CAUSAL,
            mask_offsets=None,
            packed_mask=PACKED_MASK,
            window="window_left",
            rows=None if path is PlanPath.RAGGED else PLAN_ROWS,
        )

    def plan_schedule(self, plan: Plan, requests: int) -> fpi.Schedule | None:
        """The wrapper's schedule as plan() left it (backends/flashinfer_plan_info.py), where the
        recorder kept it."""
        if plan.plan_info is None:
            return None
        return fpi.read_schedule(plan.plan_info.vector.tolist(), plan.plan_info.workspace, requests=requests)

    @classmethod
    def merge_path(cls, trace: Trace) -> str | None:
        # SGLang's FlashInfer backend runs a cached extend as ragged new tokens + paged prefix
        # (vLLM's runs one paged prefill).
        if trace.source.backend != SGLANG_NAME:
            return None
        batch = trace.batch
        cached = bool((batch.prefix_lens > 0).any())
        if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and cached and not batch.selective and not _one_paged_pass(trace):
            return "FlashInfer cascade (ragged new tokens + paged prefix merged with merge_state)"
        return None

    # -- JIT modules --------------------------------------------------------------------------

    def jit_specs(self, trace: Trace, at: fm.Target) -> list:
        """The modules of the derived plan's wrappers (its graph replays load the same), and of
        the recorded plan's when this backend built it (its own path, tensor cores, window)."""
        if not fm.available() or self.unsupported_reason(trace) or trace.model.sinks is not None:
            return []  # (the sink wrapper's module is built on its first use)
        m = trace.model
        path = PlanPath.DECODE if trace.batch.forward_mode is ForwardMode.DECODE else PlanPath.PAGED
        masked = trace.is_tree_verify or trace.batch.selective
        if path is PlanPath.PAGED and not masked:
            path = self.extend_path(trace)
        # A mask folds the window in: those plans pass window_left = -1 (_verify_plan, _extend_plan).
        calls = {(path, self.use_tensor_cores(trace), -1 if masked else m.sliding_window, m.logit_cap, masked)}
        plan = trace.plan
        if plan is not None and plan.backend == self.name:
            try:
                s = plan.scalars
                mask = "custom_mask" in plan.tensors or PACKED_MASK.tensor in plan.tensors
                calls.add((PlanPath(s["path"]), bool(s.get("use_tensor_cores", False)), int(s["window_left"]), float(s["logits_soft_cap"]), mask))
            except (KeyError, ValueError, TypeError):
                pass  # an unreadable plan is refused before launch: it loads nothing
        specs: list = []
        for call in sorted(calls, key=repr):
            specs += _call_specs(m, at, *call)
        return specs

    # -- run ----------------------------------------------------------------------------------

    def _workspace(self) -> Tensor:
        if self._workspace_buffer is None:
            self._workspace_buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        return self._workspace_buffer

    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        fi = _flashinfer()
        path = PlanPath(plan.scalars["path"])
        try:
            if path is PlanPath.DECODE:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(), "NHD", use_tensor_cores=bool(plan.scalars["use_tensor_cores"])
                )
                _plan_decode(wrapper, trace.model, plan, q_dtype=inputs.q.dtype, kv_dtype=inputs.k_cache.dtype)
                out, lse = wrapper.run(inputs.q, _paged_kv(inputs, int(plan.scalars["page_size"])), return_lse=True, **_kv_scales(trace.model))
            elif path is PlanPath.PAGED:
                out, lse = self._paged(fi, trace, plan, inputs)
            elif path is PlanPath.RAGGED:
                out, lse = self._ragged(fi, trace, plan, inputs)
            else:
                out, lse = self._cascade(fi, trace, plan, inputs)
        except KERNEL_ERRORS as e:
            raise library_error(e, trace.model) from e
        return AttentionResult(output=out, lse=lse * numerics.LN2)

    def _paged(self, fi, trace: Trace, plan: Plan, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """One pass of the paged prefill wrapper over the KV the plan lists; with sinks, FlashInfer's
        BatchAttentionWithAttentionSinkWrapper (the same plan, the sinks handed to run())."""
        m = trace.model
        kv = _paged_kv(inputs, int(plan.scalars["page_size"]))
        if m.sinks is None:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(), "NHD", backend="fa2")
            _plan_paged(wrapper, m, plan, q_dtype=inputs.q.dtype, kv_dtype=inputs.k_cache.dtype)
            return wrapper.run(inputs.q, kv, return_lse=True, **_kv_scales(m))
        wrapper = fi.BatchAttentionWithAttentionSinkWrapper(
            self._workspace(),
            "NHD",
            backend="fa2",
            q_data_type=inputs.q.dtype,
            kv_data_type=inputs.k_cache.dtype,
            head_dim_qk=m.head_dim,
            head_dim_vo=m.v_head_dim,
            window_left=int(plan.scalars["window_left"]),
        )
        _plan_paged(wrapper, m, plan, q_dtype=inputs.q.dtype, kv_dtype=inputs.k_cache.dtype)
        # The variant's additional tensor "sink": [Hq] float32, consumed from run()'s positional args.
        return wrapper.run(inputs.q, kv, m.sinks.to(device=inputs.q.device, dtype=torch.float32), return_lse=True, **_kv_scales(m))

    def _ragged(self, fi, trace: Trace, plan: Plan, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """This step's tokens against themselves, causal; SGLang's ragged wrapper (backend auto)."""
        m = trace.model
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace(), "NHD")
        qo_indptr = plan.tensors["qo_indptr"]
        wait_for_pending_plans()
        wrapper.plan(
            qo_indptr,
            qo_indptr,  # SGLang: begin_forward(qo_indptr, qo_indptr, ...): keys are the queries' tokens
            m.num_qo_heads,
            m.num_kv_heads,
            m.head_dim,
            head_dim_vo=m.v_head_dim,
            causal=True,
            sm_scale=m.sm_scale,
            window_left=int(plan.scalars["window_left"]),
            logits_soft_cap=float(plan.scalars["logits_soft_cap"]),
            q_data_type=inputs.q.dtype,
            kv_data_type=inputs.q.dtype,
        )
        # The engine passes the new K/V before they are quantised into an fp8 cache; fp8 values are
        # exact in fp16/bf16, so the cast loses nothing.
        return wrapper.run(inputs.q, inputs.k_new.to(inputs.q.dtype), inputs.v_new.to(inputs.q.dtype), return_lse=True)

    def _cascade(self, fi, trace: Trace, plan: Plan, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """SGLang's extend with a prefix: ragged (new tokens, causal) + paged (prefix, non-causal), merged.

        merge_state works in FlashInfer's own base-2 convention, so both LSEs go in unconverted.
        A request with no prefix gives an empty paged state; merging it must leave the ragged one.
        """
        o_new, s_new = self._ragged(fi, trace, plan, inputs)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(), "NHD", backend="fa2")
        _plan_paged(wrapper, trace.model, plan, q_dtype=inputs.q.dtype, kv_dtype=inputs.k_cache.dtype)
        o_prefix, s_prefix = wrapper.run(inputs.q, _paged_kv(inputs, int(plan.scalars["page_size"])), return_lse=True, **_kv_scales(trace.model))
        return fi.cascade.merge_state(o_new, s_new, o_prefix, s_prefix)

    def merge_states(self, states: PartialStates) -> AttentionResult:
        """flashinfer.cascade.merge_state on the two states of each row, merge_states on any other
        number (base-2 LSEs in and out), merged by their LSEs alone; with a row mask,
        merge_state_in_place(mask=) on a copy of the first states (the rows left out keep them)."""
        if states.rows is not None:
            v, s = states.output[:, :, 0].clone(memory_format=torch.contiguous_format), states.lse[:, :, 0].contiguous().clone()
            v_other, s_other = states.output[:, :, 1].contiguous(), states.lse[:, :, 1].contiguous()
            _flashinfer().cascade.merge_state_in_place(v, s, v_other, s_other, mask=states.rows)
            return AttentionResult(output=v, lse=s)
        if states.output.shape[2] != 2:
            # merge_states(v [seq, num_states, heads, dim], s [seq, num_states, heads]).
            v = states.output.permute(0, 2, 1, 3).contiguous()
            s = states.lse.permute(0, 2, 1).contiguous().to(torch.float32)
            out, lse = _flashinfer().cascade.merge_states(v, s)
            return AttentionResult(output=out, lse=lse)
        v_a, v_b = (states.output[:, :, i].contiguous() for i in (0, 1))
        s_a, s_b = (states.lse[:, :, i].contiguous() for i in (0, 1))
        out, lse = _flashinfer().cascade.merge_state(v_a, s_a, v_b, s_b)
        return AttentionResult(output=out, lse=lse)

    def script_library(self) -> ScriptLibrary:
        return ScriptLibrary(label="flashinfer", imports="import flashinfer", install=SCRIPT_INSTALL, needs_gpu=True, version=SCRIPT_VERSION)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def graph_configuration_reason(self, trace: Trace) -> str | None:
        if trace.model.sinks is not None:
            return "attention sinks run through BatchAttentionWithAttentionSinkWrapper, whose CUDA-graph buffers are not wired here"
        if trace.model.v_head_dim not in MERGE_HEAD_DIMS:
            # Measured on the H200: the graph replay fails with "Unsupported head_dim: 32".
            return (
                "FlashInfer's CUDA-graph wrappers keep split-KV on and merge the partial states with "
                f"VariableLengthMergeStates, compiled only for head_dim {'/'.join(map(str, MERGE_HEAD_DIMS))}; "
                f"this trace's is {trace.model.v_head_dim}"
            )
        return None

    def graph_state(self, trace: Trace, capacity: GraphCapacity) -> GraphState:
        reason = self.graph_unsupported_reason(trace) or self.unsupported_reason(trace)
        if reason:
            raise NotImplementedError(reason)
        return _FlashInferGraphState(trace=trace, capacity=capacity, use_tensor_cores=self.use_tensor_cores(trace))


class _FlashInferGraphState(FlashInferGraphState):
    """SGLang's CUDA-graph wrappers: `use_cuda_graph=True` over plan buffers sized for the capture.

    FlashInfer fixes the batch size at construction, so every plan loaded here must have exactly
    `capture_bs` requests (derive_plan with Padding). `load_plan` re-plans the wrapper outside the
    graph; FlashInfer copies the plan into the buffers below in place and keeps split-KV on in graph
    mode, so the captured grid fits every plan. The graph owns its float workspace: nothing an eager
    run does between replays can move or reuse it.
    """

    def __init__(self, *, trace: Trace, capacity: GraphCapacity, use_tensor_cores: bool):
        fi = _flashinfer()
        m = self.model = trace.model
        super().__init__(max_tokens=capacity.max_tokens, num_heads=m.num_qo_heads, v_head_dim=m.v_head_dim, q_dtype=DTYPES[m.q_dtype])
        self.decode = trace.batch.forward_mode is ForwardMode.DECODE
        self.use_tensor_cores = use_tensor_cores
        bs = capacity.capture_bs
        cuda = "cuda"
        self.capture_bs = bs
        self.buffers: dict[str, Tensor] = {
            "kv_indptr": torch.zeros(bs + 1, dtype=torch.int32, device=cuda),
            # Page count <= slot count, so the slot capacity bounds the page indices too.
            "kv_indices": torch.zeros(max(capacity.max_kv_slots, 1), dtype=torch.int32, device=cuda),
            "kv_last_page_len": torch.zeros(bs, dtype=torch.int32, device=cuda),
        }
        if self.decode:
            self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=use_tensor_cores,
                paged_kv_indptr_buffer=self.buffers["kv_indptr"],
                paged_kv_indices_buffer=self.buffers["kv_indices"],
                paged_kv_last_page_len_buffer=self.buffers["kv_last_page_len"],
            )
        else:
            # The mask is stored packed (one bit per element, each request's segment padded to a byte).
            self.buffers["qo_indptr"] = torch.zeros(bs + 1, dtype=torch.int32, device=cuda)
            self.buffers["custom_mask"] = torch.zeros(capacity.max_mask // 8 + bs + 1, dtype=torch.uint8, device=cuda)
            self.buffers["mask_indptr"] = torch.zeros(bs + 1, dtype=torch.int32, device=cuda)
            self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=self.buffers["qo_indptr"],
                paged_kv_indptr_buf=self.buffers["kv_indptr"],
                paged_kv_indices_buf=self.buffers["kv_indices"],
                paged_kv_last_page_len_buf=self.buffers["kv_last_page_len"],
                custom_mask_buf=self.buffers["custom_mask"],
                mask_indptr_buf=self.buffers["mask_indptr"],
                backend="fa2",
            )

    def load_plan(self, plan: Plan) -> None:
        path = PlanPath(plan.scalars["path"])
        want = PlanPath.DECODE if self.decode else PlanPath.PAGED
        if path is not want:
            raise ValueError(f"plan path {path.value!r}, but this graph was built for {want.value!r}")
        if self.decode and bool(plan.scalars["use_tensor_cores"]) != self.use_tensor_cores:
            raise ValueError(f"plan use_tensor_cores={plan.scalars['use_tensor_cores']}, graph built with {self.use_tensor_cores}")
        requests = plan.tensors["kv_last_page_len"].numel()
        if requests != self.capture_bs:
            raise ValueError(f"plan has {requests} requests; FlashInfer graphs fix the batch at capture_bs={self.capture_bs}: pad it")
        if plan.tensors["kv_indices"].numel() > self.buffers["kv_indices"].numel():
            raise ValueError(f"plan kv_indices has {plan.tensors['kv_indices'].numel()} pages, the graph holds {self.buffers['kv_indices'].numel()}")
        if int(plan.scalars["page_size"]) != self.model.page_size:
            # The captured kernels read the cache in the pages it was captured with.
            raise ValueError(f"plan page_size {plan.scalars['page_size']}, but this graph reads the cache in pages of {self.model.page_size}")
        if not self.decode:
            # What plan() packs: each request's q_len x kv_len block, padded to a byte.
            packed = int(((_mask_block_sizes(plan) + 7) // 8).sum())
            if packed > self.buffers["custom_mask"].numel():
                raise ValueError(f"plan mask packs to {packed} bytes, the graph holds {self.buffers['custom_mask'].numel()}")
        q_dtype = DTYPES[self.model.q_dtype]
        kv_dtype = DTYPES[self.model.kv_dtype]
        try:
            planner = _plan_decode if self.decode else _plan_paged
            planner(self.wrapper, self.model, plan, q_dtype=q_dtype, kv_dtype=kv_dtype)
        except KERNEL_ERRORS as e:
            raise library_error(e, self.model) from e

    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        tokens = inputs.q.shape[0]
        self.wrapper.run(inputs.q, _paged_kv(inputs, self.model.page_size), out=self.out[:tokens], lse=self.lse_base2[:tokens], return_lse=True, **_kv_scales(self.model))
        return self.result(tokens)


# -- planning helpers (kernel vocabulary) -------------------------------------------------------


def _call_specs(m: Model, at: fm.Target, path: PlanPath, tensor_cores: bool, window_left: int, logits_soft_cap: float, mask: bool) -> list:
    """The JIT specs one `run` of a plan with these scalars loads (FlashInfer's choices: flashinfer_modules.py)."""
    both = {"window_left": window_left, "logits_soft_cap": logits_soft_cap}
    if path is PlanPath.DECODE:
        if not tensor_cores:
            return fm.decode(q_dtype=m.q_dtype, kv_dtype=m.kv_dtype, head_dim=m.head_dim, **both)
        family = fm.tensor_core_decode_family(at, q_dtype=m.q_dtype, kv_dtype=m.kv_dtype)
        return fm.prefill(family, q_dtype=m.q_dtype, kv_dtype=m.kv_dtype, head_dim_qk=m.head_dim, head_dim_vo=m.head_dim, **both)
    # The paged wrapper is backend="fa2"; _paged_kv hands K and V over as separate caches, whose
    # strides differ when head_dim != v_head_dim. plan() packs a bool mask with segment_packbits.
    paged = fm.prefill("fa2", q_dtype=m.q_dtype, kv_dtype=m.kv_dtype, head_dim_qk=m.head_dim, head_dim_vo=m.v_head_dim, paged_strides_differ=m.head_dim != m.v_head_dim, **both)
    paged += fm.quantization() if mask else []
    if path is PlanPath.PAGED:
        return paged
    # The ragged wrapper is backend "auto"; its K/V are this step's, in q's dtype (_ragged).
    family = fm.prefill_family(at, q_dtype=m.q_dtype, kv_dtype=m.q_dtype, head_dim_qk=m.head_dim, head_dim_vo=m.v_head_dim)
    ragged = fm.prefill(family, q_dtype=m.q_dtype, kv_dtype=m.q_dtype, head_dim_qk=m.head_dim, head_dim_vo=m.v_head_dim, **both)
    return ragged if path is PlanPath.RAGGED else ragged + paged + fm.cascade()


def _plan_decode(wrapper, m: Model, plan: Plan, *, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    t = plan.tensors
    wait_for_pending_plans()
    wrapper.plan(
        t["kv_indptr"],
        t["kv_indices"],
        t["kv_last_page_len"],
        m.num_qo_heads,
        m.num_kv_heads,
        m.head_dim,
        int(plan.scalars["page_size"]),
        window_left=int(plan.scalars["window_left"]),
        logits_soft_cap=float(plan.scalars["logits_soft_cap"]),
        # Needed whenever q is not fp16 (FlashInfer's default).
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        sm_scale=m.sm_scale,
    )


def _bool_mask(plan: Plan) -> Tensor | None:
    """The plan's custom mask as the bool blocks plan() packs: a derived plan's custom_mask, or a
    recorded plan's packed bytes unpacked (plan() cannot take those back: handed packed_custom_mask
    it keeps bit offsets, cumsum(q_len * kv_len), where the kernel reads byte offsets)."""
    t = plan.tensors
    if "custom_mask" in t or PACKED_MASK.tensor not in t:
        return t.get("custom_mask")
    return PACKED_MASK.unpack(t[PACKED_MASK.tensor], t[PACKED_MASK.indptr].to(torch.int64), _mask_block_sizes(plan))


def _mask_block_sizes(plan: Plan) -> Tensor:
    """q_len x kv_len per request: the mask block plan() expects of each (FlashInfer computes the
    blocks' offsets from the lengths itself, whatever mask_indptr a plan holds)."""
    t = plan.tensors
    ps = int(plan.scalars["page_size"])
    pages = t["kv_indptr"].to(torch.int64).diff()
    lens = torch.where(pages > 0, (pages - 1) * ps + t["kv_last_page_len"].to(torch.int64), 0)
    return t["qo_indptr"].to(torch.int64).diff() * lens


def _plan_paged(wrapper, m: Model, plan: Plan, *, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    t = plan.tensors
    mask = _bool_mask(plan)
    wait_for_pending_plans()
    wrapper.plan(
        t["qo_indptr"],
        t["kv_indptr"],
        t["kv_indices"],
        t["kv_last_page_len"],
        m.num_qo_heads,
        m.num_kv_heads,
        m.head_dim,
        int(plan.scalars["page_size"]),
        head_dim_vo=m.v_head_dim,
        # Bool, FULL layout; plan() packs it little-endian with segment_packbits on the mask's device.
        custom_mask=None if mask is None else mask.to("cuda"),
        causal=bool(plan.scalars["causal"]),
        sm_scale=m.sm_scale,
        window_left=int(plan.scalars["window_left"]),
        logits_soft_cap=float(plan.scalars["logits_soft_cap"]),
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
    )


def _kv_scales(m: Model) -> dict[str, float]:
    """run()'s k_scale / v_scale for a scaled fp8 cache (k_scale folded into sm_scale, v_scale on
    the output, prefill.py / decode.py); nothing for an unscaled one, so those calls stay as they were."""
    return {"k_scale": m.k_scale, "v_scale": m.v_scale} if (m.k_scale, m.v_scale) != (1.0, 1.0) else {}


def _one_paged_pass(trace: Trace) -> str:
    """What in this step needs one paged pass over the whole visible KV ('' when nothing does)."""
    model, batch = trace.model, trace.batch
    if not model.causal:
        return "a non-causal layer"
    if batch.cross:
        return "cross-attention"
    if batch.custom_mask is not None:
        return "an extend step's custom mask"
    if model.sinks is not None:
        return "attention sinks"
    if (model.k_scale, model.v_scale) != (1.0, 1.0):
        return "a scaled fp8 cache"
    return ""


def _paged_kv(inputs: AttentionInputs, ps: int) -> tuple[Tensor, Tensor]:
    """The cache [N, Hkv, D] as FlashInfer's NHD pages [N / page, page, Hkv, D] (views, no copy)."""
    whole = inputs.k_cache.shape[0] // ps * ps
    k = inputs.k_cache[:whole]
    v = inputs.v_cache[:whole]
    return k.view(whole // ps, ps, *k.shape[1:]), v.view(whole // ps, ps, *v.shape[1:])


def _page_ids(slots: Tensor, page_size: int) -> Tensor:
    """A page-aligned slot row -> its page ids (FA3's page_table derivation: row[::page] // page)."""
    return slots[::page_size] // page_size


def _padded_pages(kv_len: int, padding: Padding, page_size: int) -> tuple[Tensor, int]:
    """A padded request: `kv_len` columns, every page the dummy slot's page."""
    return torch.full((-(-kv_len // page_size),), padding.dummy_slot // page_size, dtype=torch.int64), kv_len


def _paged_arrays(requests: list[tuple[Tensor, int]], page_size: int) -> dict[str, Tensor]:
    """(page ids, KV length) per request -> kv_indptr, kv_indices, kv_last_page_len (int32).

    kv_last_page_len = (len - 1) % page + 1: at page size 1 SGLang's all-ones buffer; a request with
    no KV gets no pages (FlashInfer then reads length 0 whatever its last_page_len says).
    """
    counts = torch.tensor([p.numel() for p, _ in requests], dtype=torch.int64)
    lens = torch.tensor([n for _, n in requests], dtype=torch.int64)
    indices = torch.cat([p for p, _ in requests]) if requests else torch.zeros(0, dtype=torch.int64)
    return {
        "kv_indptr": indptr(counts).to(torch.int32),
        "kv_indices": indices.to(torch.int32),
        "kv_last_page_len": ((lens - 1) % page_size + 1).to(torch.int32),
    }


def _window_start(kv_len: int, *, keep: int, page_size: int) -> int:
    """First column to pass when only the last `keep` columns can be seen, rounded down to a page."""
    return max(kv_len - keep, 0) // page_size * page_size


def _tree_block(parents: Tensor, prefix: int, window: int) -> Tensor:
    """[n, prefix + n] bool, FULL layout: prefix all visible, draft columns = ancestors (and self).

    A sliding window is folded in with the tokens' real positions: a draft token sits at
    prefix + its depth.
    """
    n = parents.numel()
    block = torch.ones(n, prefix + n, dtype=torch.bool)
    block[:, prefix:] = tree.ancestor_matrix(parents)
    if window >= 0:
        depth = tree.depths(parents)
        key_pos = torch.cat([torch.arange(prefix), prefix + depth])
        query_pos = prefix + depth
        block &= (query_pos[:, None] - key_pos[None, :]) <= window
    return block
