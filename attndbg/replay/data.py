"""The step's data: KV cache and queries, from recorded tensors or drawn from the trace's seed.

Data is drawn on the CPU with a generator seeded from the trace, then moved, so the same trace
gives the same inputs on every machine. The cache is returned as it is *after* this step's K/V
writes (engines write before attending).
"""

from __future__ import annotations

import torch

from attndbg.backends.base import AttentionInputs
from attndbg.trace.schema import DTYPES, AttentionKind, Trace


def build_inputs(trace: Trace, *, layer: int | None = None) -> AttentionInputs:
    """CPU inputs for one layer (recorded tensors of `layer` when the trace has them)."""
    model, batch = trace.model, trace.batch
    q_dtype, kv_dtype = DTYPES[model.q_dtype], DTYPES[model.kv_dtype]
    g = torch.Generator().manual_seed(trace.seed)
    n, t = batch.kv_cache_size, batch.num_tokens
    hkv, dk = model.num_kv_heads, model.head_dim
    mla = model.attention is AttentionKind.MLA
    dv = 0 if mla else model.v_head_dim

    # Draw in float32 and round once, so each dtype sees the same underlying values.
    k_cache = torch.randn(n, hkv, dk, generator=g)
    v_cache = torch.randn(n, hkv, dv, generator=g)
    q = torch.randn(t, model.num_qo_heads, dk, generator=g)
    k_new = torch.randn(t, hkv, dk, generator=g)
    v_new = torch.randn(t, hkv, dv, generator=g)

    recorded = trace.tensors.get(layer) if layer is not None else None
    if recorded is not None:
        slots = recorded.kv_slots
        k_cache[slots] = recorded.k_rows.float()
        v_cache[slots] = recorded.v_rows.float()
        q, k_new, v_new = recorded.q.float(), recorded.k_new.float(), recorded.v_new.float()

    k_cache = k_cache.to(kv_dtype)
    v_cache = v_cache.to(kv_dtype)
    k_new = k_new.to(kv_dtype)
    v_new = v_new.to(kv_dtype)
    # This step's K/V land in their slots before attention reads the cache.
    k_cache[batch.out_cache_loc] = k_new
    v_cache[batch.out_cache_loc] = v_new
    if mla:
        # MLA values are the latent part of the keys: views, exactly as the engine's cache.
        v_cache = k_cache[..., : model.kv_lora_rank]
        v_new = k_new[..., : model.kv_lora_rank]
    return AttentionInputs(q=q.to(q_dtype), k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)


def to_device(inputs: AttentionInputs, device: str) -> AttentionInputs:
    """Move to `device`, keeping MLA's values a view of the keys."""
    k_cache = inputs.k_cache.to(device)
    k_new = inputs.k_new.to(device)
    shared = inputs.v_cache.data_ptr() == inputs.k_cache.data_ptr()
    v_cache = k_cache[..., : inputs.v_cache.shape[-1]] if shared else inputs.v_cache.to(device)
    v_new = k_new[..., : inputs.v_new.shape[-1]] if shared else inputs.v_new.to(device)
    return AttentionInputs(q=inputs.q.to(device), k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
