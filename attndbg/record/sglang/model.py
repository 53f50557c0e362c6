"""The attention layer's shape and numerics from SGLang's own objects.

SGLang keeps them on each `RadixAttention` layer (tp_q_head_num, tp_k_head_num, qk_head_dim,
v_head_dim, scaling, logit_cap, sliding_window_size); dtypes on the KV pool and the backend; the
page size on the backend or the pool. MLA layers (DeepSeek absorbed attention) have one KV head
whose key is [latent | rope] and whose value is the latent: head_dim = kv_lora_rank + rope dim.
"""

from __future__ import annotations

from typing import Any

import torch

from attndbg.trace.schema import DTYPES, AttentionKind, Model

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{what} dtype {dtype} is not one attndbg records ({', '.join(DTYPES)})")
    return _DTYPE_NAMES[dtype]


def model_from_layer(layer: Any, *, q_dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int = 1, mla: bool = False) -> Model:
    """A Model from a RadixAttention layer. `mla`: the layer is DeepSeek's absorbed MLA (the
    backend knows: `backend.use_mla`); then v_head_dim is the latent width, the rest is rope."""
    head_dim = int(getattr(layer, "qk_head_dim", layer.head_dim))
    v_head_dim = int(layer.v_head_dim)
    window = int(layer.sliding_window_size) if layer.sliding_window_size is not None else -1
    return Model(
        num_qo_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num),
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        attention=AttentionKind.MLA if mla else AttentionKind.MHA,
        kv_lora_rank=v_head_dim if mla else 0,
        qk_rope_head_dim=head_dim - v_head_dim if mla else 0,
        sm_scale=float(layer.scaling),
        logit_cap=float(layer.logit_cap or 0.0),
        # SGLang's window: a key is visible iff pos(q) - pos(k) <= sliding_window_size (window_left).
        sliding_window=window if window > 0 else -1,
        q_dtype=dtype_name(q_dtype, "query"),
        kv_dtype=dtype_name(kv_dtype, "KV cache"),
        page_size=int(page_size),
    )


def backend_page_size(backend: Any) -> int:
    for owner in (backend, getattr(backend, "token_to_kv_pool", None)):
        value = getattr(owner, "page_size", None)
        if isinstance(value, int) and value >= 1:
            return value
    return 1


def kv_cache_size(backend: Any) -> int:
    """Slots in the KV pool: SGLang allocates `size + page_size` rows (page 0 is the dummy page)."""
    pool = backend.token_to_kv_pool
    return int(pool.size) + backend_page_size(backend)


def model_from_backend(backend: Any, layer: Any) -> Model:
    pool = backend.token_to_kv_pool
    kv_dtype = getattr(pool, "dtype", None) or torch.bfloat16
    q_dtype = getattr(backend, "data_type", None) or getattr(pool, "dtype", None) or torch.bfloat16
    if q_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        q_dtype = torch.bfloat16  # an fp8 KV pool with activations in bf16, SGLang's default
    return model_from_layer(layer, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=backend_page_size(backend), mla=bool(getattr(backend, "use_mla", False)))
