"""What a vLLM metadata builder knows about its layers: Model, backend name, pool size, speculation.

Everything is read with `getattr` from the builder's `kv_cache_spec` and `vllm_config`, because
these objects gain and lose fields between vLLM versions (engines.md B2-B4): a missing field
falls back to a documented default instead of failing the hook.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from attndbg.record.vllm.convert import Speculation
from attndbg.trace.schema import DTYPES, Q_DTYPES, AttentionKind, CaptureSizes, Model

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# vLLM stores an fp8 KV cache as uint8 and names it "fp8" (= e4m3) in cache_dtype.
_STORAGE_DTYPES = {torch.uint8: "float8_e4m3fn"}
_BACKEND_NAMES: dict[type, str] = {}


def dtype_name(dtype: Any, default: str) -> str:
    if isinstance(dtype, torch.dtype):
        return _DTYPE_NAMES.get(dtype) or _STORAGE_DTYPES.get(dtype, default)
    return default


def _hf_text_config(builder: Any) -> Any:
    model_config = getattr(getattr(builder, "vllm_config", None), "model_config", None)
    return getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)


def _num_q_heads(builder: Any, default: int) -> int:
    """Query heads per TP rank: the builder's own count where it keeps one, else the model's."""
    for attr in ("num_heads_q", "num_heads"):
        value = getattr(builder, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(builder, "vllm_config", None)
    model_config = getattr(config, "model_config", None)
    if model_config is not None and hasattr(model_config, "get_num_attention_heads"):
        return int(model_config.get_num_attention_heads(config.parallel_config))
    return default


def model_from_builder(builder: Any) -> Model:
    """The layer group's shape and numerics from `builder.kv_cache_spec` and the model config.

    sm_scale is head_size**-0.5 (MHA) or (qk_nope_head_dim + qk_rope_head_dim)**-0.5 (MLA): the
    builder never sees the layer's scale, and models with a custom scale are not recorded right.
    """
    spec = builder.kv_cache_spec
    block_size = int(spec.block_size)
    head_size = int(spec.head_size)
    kv_heads = int(getattr(spec, "num_kv_heads", 1))
    model_config = getattr(getattr(builder, "vllm_config", None), "model_config", None)
    kv_dtype = dtype_name(getattr(spec, "dtype", None), "bfloat16")
    q_dtype = dtype_name(getattr(model_config, "dtype", None), kv_dtype)
    if q_dtype not in Q_DTYPES:
        q_dtype = "bfloat16"
    hf = _hf_text_config(builder)
    window = getattr(spec, "sliding_window", None)
    # vLLM's sliding_window counts the query's own token: FlashAttention runs window_size=(W-1, 0).
    window_left = int(window) - 1 if isinstance(window, int) and window > 0 else -1
    logit_cap = float(getattr(hf, "attn_logit_softcapping", None) or 0.0)
    mla = type(spec).__name__.startswith(("MLA", "SlidingWindowMLA")) or bool(getattr(model_config, "use_mla", False))
    if mla:
        rope = int(getattr(hf, "qk_rope_head_dim", 64))
        latent = int(getattr(hf, "kv_lora_rank", head_size - rope))
        nope = int(getattr(hf, "qk_nope_head_dim", 128))
        return Model(
            num_qo_heads=_num_q_heads(builder, 1),
            num_kv_heads=1,
            head_dim=latent + rope,
            v_head_dim=latent,
            attention=AttentionKind.MLA,
            kv_lora_rank=latent,
            qk_rope_head_dim=rope,
            sm_scale=(nope + rope) ** -0.5,
            logit_cap=logit_cap,
            sliding_window=window_left,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            page_size=block_size,
        )
    return Model(
        num_qo_heads=_num_q_heads(builder, kv_heads),
        num_kv_heads=kv_heads,
        head_dim=head_size,
        v_head_dim=int(getattr(spec, "head_size_v", None) or head_size),
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=head_size**-0.5,
        logit_cap=logit_cap,
        sliding_window=window_left,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        page_size=block_size,
    )


def backend_name(builder_cls: type) -> str:
    """vLLM's name of the backend that uses this builder (`AttentionBackend.get_name()`, e.g.
    "TRITON_ATTN"), found among the backends of the builder's module; else the class name."""
    if builder_cls in _BACKEND_NAMES:
        return _BACKEND_NAMES[builder_cls]
    name = builder_cls.__name__
    module = sys.modules.get(builder_cls.__module__)
    for _, candidate in inspect.getmembers(module or object(), inspect.isclass):
        get_builder = getattr(candidate, "get_builder_cls", None)
        get_name = getattr(candidate, "get_name", None)
        if get_builder is None or get_name is None or inspect.isabstract(candidate):
            continue
        try:
            if get_builder() is builder_cls:
                name = str(get_name())
                break
        except NotImplementedError:
            continue
    _BACKEND_NAMES[builder_cls] = name
    return name


def kv_cache_size(builder: Any) -> int | None:
    """Slots in the KV pool (num_gpu_blocks * block_size) when the config carries it.

    The engine process sets `cache_config.num_gpu_blocks` after profiling; a worker process may
    not, and then the converter uses the blocks the step references as a lower bound."""
    cache_config = getattr(getattr(builder, "vllm_config", None), "cache_config", None)
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    block_size = getattr(cache_config, "block_size", None)
    if isinstance(blocks, int) and blocks > 0 and isinstance(block_size, int) and block_size > 0:
        return blocks * block_size
    return None


def speculation(builder: Any) -> Speculation | None:
    config = getattr(getattr(builder, "vllm_config", None), "speculative_config", None)
    tokens = getattr(config, "num_speculative_tokens", None)
    if not isinstance(tokens, int) or tokens < 1:
        return None
    return Speculation(method=str(getattr(config, "method", None) or "unknown"), num_speculative_tokens=tokens)


def adaptive_verification(builder: Any) -> bool:
    """`speculative_config.enable_adaptive_verification` (vLLM's V2 runner, opt-in): the draft
    budget is reallocated among the verify requests on the device only, so query_start_loc and its
    host mirror differ per request while their totals agree."""
    config = getattr(getattr(builder, "vllm_config", None), "speculative_config", None)
    return getattr(config, "enable_adaptive_verification", False) is True


def tp_rank() -> int:
    """This worker's tensor-parallel rank; 0 when vLLM's process groups are not initialised."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    group = getattr(state, "_TP", None) if state is not None else None
    rank = getattr(group, "rank_in_group", 0) if group is not None else 0
    return int(rank) if isinstance(rank, int) else 0


def _positive(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def capture_sizes(builder: Any, block_table: Any) -> CaptureSizes:
    """What this vLLM sized once for its CUDA graphs and persistent buffers, from the config and the
    step's block table (its shape only: no device sync).

    max_bs: `scheduler_config.max_num_seqs`, the rows of the persistent query_start_loc / seq_lens /
    block table (`InputBatch(max_num_reqs=...)`). max_num_tokens: the largest captured graph
    (`compilation_config.cudagraph_capture_sizes` are token counts), None when no graph is captured
    (no sizes: CPU, enforce_eager). block_table_width: the persistent table's columns
    (cdiv(max_model_len, block_size)), read from the untrimmed table the builder got.
    workspace_bytes: FlashInfer's float workspace once the builder allocated it. vLLM exposes no
    split-KV scratch width, custom-mask or flat kv_indices buffer of its own: those stay None.
    """
    config = getattr(builder, "vllm_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    compilation = getattr(config, "compilation_config", None)
    sizes = getattr(compilation, "cudagraph_capture_sizes", None)
    listed = [v for v in sizes if _positive(v)] if isinstance(sizes, (list, tuple)) else []
    max_tokens = max(listed) if listed else None
    if max_tokens is None and isinstance(sizes, (list, tuple)):
        # vLLM sets the list and its maximum together; without a list no graph is captured.
        max_tokens = _positive(getattr(compilation, "max_cudagraph_capture_size", None))
    shape = getattr(block_table, "shape", None)
    width = _positive(int(shape[1])) if shape is not None and len(shape) == 2 else None
    workspace = getattr(builder, "_workspace_buffer", None)
    return CaptureSizes(
        max_bs=_positive(getattr(scheduler, "max_num_seqs", None)),
        max_num_tokens=max_tokens,
        block_table_width=width,
        workspace_bytes=int(workspace.nbytes) if isinstance(workspace, torch.Tensor) else None,
    )
