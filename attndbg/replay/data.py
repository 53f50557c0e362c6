"""The step's data: KV cache and queries, from recorded tensors or drawn from the trace's seed.

Data is drawn where it will be used (a device `torch.Generator` on the GPU), and only for the KV
slots a replay can read: the batch's rows, this step's writes and the engine's dummy page (padded
rows of a CUDA graph read it). Every other slot of the pool is zero. The same trace gives the same
bits on the same device and software; CPU and GPU draw different (equally valid) values, and the
float64 reference is computed from whichever were drawn. The cache is returned as it is *after*
this step's K/V writes (engines write before attending).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.backends.base import AttentionInputs
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import DTYPES, AttentionKind, Trace


def slots_read(trace: Trace) -> Tensor:
    """[U] int64, sorted: every KV slot a replay of this step may read or write."""
    batch = trace.batch
    parts = [batch.slot_ids, batch.out_cache_loc, torch.arange(min(trace.model.page_size, batch.kv_cache_size))]
    if trace.graph is not None:
        parts.append(trace.graph.padded_out_cache_loc)
    slots = torch.unique(torch.cat([p.to(torch.int64).flatten() for p in parts]))
    return slots[(slots >= 0) & (slots < batch.kv_cache_size)]


def input_bytes(trace: Trace) -> int:
    """What `build_inputs` allocates: the KV pool in its dtype, and the float32 draws for the slots
    read and the step's tokens."""
    m, b = trace.model, trace.batch
    dv = 0 if m.attention is AttentionKind.MLA else m.v_head_dim
    kv_item = torch.empty((), dtype=DTYPES[m.kv_dtype]).element_size()
    pool = b.kv_cache_size * m.num_kv_heads * (m.head_dim + dv) * kv_item
    rows = int(b.slot_ids.numel() + b.out_cache_loc.numel()) + m.page_size
    draws = 4 * (rows * m.num_kv_heads * (m.head_dim + dv) + b.num_tokens * (m.num_qo_heads * m.head_dim + m.num_kv_heads * (m.head_dim + dv)))
    return pool + draws


def available_bytes(device: torch.device) -> int:
    """Free memory where the data will live: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_fits(trace: Trace, device: torch.device) -> None:
    """Refuse, before allocating, a step whose data could not fit: a TraceError naming the field."""
    need, free = input_bytes(trace), available_bytes(device)
    if need > free:
        raise TraceError(
            "batch.kv_cache_size",
            f"= {trace.batch.kv_cache_size} slots: replaying this step needs {need / 2**30:.1f} GiB on {device.type} "
            f"(the KV pool and the step's data), {free / 2**30:.1f} GiB are free; not replayed",
        )


def build_inputs(trace: Trace, *, layer: int | None = None, device: str | torch.device = "cpu") -> AttentionInputs:
    """Inputs for one layer on `device` (recorded tensors of `layer` when the trace has them)."""
    model, batch = trace.model, trace.batch
    device = torch.device(device)
    check_fits(trace, device)
    q_dtype, kv_dtype = DTYPES[model.q_dtype], DTYPES[model.kv_dtype]
    g = torch.Generator(device=device).manual_seed(trace.seed)
    n, t = batch.kv_cache_size, batch.num_tokens
    hkv, dk = model.num_kv_heads, model.head_dim
    mla = model.attention is AttentionKind.MLA
    dv = 0 if mla else model.v_head_dim
    slots = slots_read(trace).to(device)
    u = int(slots.numel())

    def draw(*shape: int) -> Tensor:
        # Draw in float32 and round once, so each dtype sees the same underlying values.
        return torch.randn(*shape, generator=g, device=device)

    k_rows, v_rows = draw(u, hkv, dk), draw(u, hkv, dv)
    q, k_new, v_new = draw(t, model.num_qo_heads, dk), draw(t, hkv, dk), draw(t, hkv, dv)

    recorded = trace.tensors.get(layer) if layer is not None else None
    k_cache = torch.zeros(n, hkv, dk, dtype=kv_dtype, device=device)
    v_cache = torch.zeros(n, hkv, dv, dtype=kv_dtype, device=device)
    _put_rows(k_cache, slots, k_rows.to(kv_dtype))
    _put_rows(v_cache, slots, v_rows.to(kv_dtype))
    if recorded is not None:
        _put_rows(k_cache, recorded.kv_slots.to(device), recorded.k_rows.to(device).to(kv_dtype))
        _put_rows(v_cache, recorded.kv_slots.to(device), recorded.v_rows.to(device).to(kv_dtype))
        q, k_new, v_new = recorded.q.to(device).float(), recorded.k_new.to(device).float(), recorded.v_new.to(device).float()

    k_new = k_new.to(kv_dtype)
    v_new = v_new.to(kv_dtype)
    # This step's K/V land in their slots before attention reads the cache.
    loc = batch.out_cache_loc.to(device)
    _put_rows(k_cache, loc, k_new)
    _put_rows(v_cache, loc, v_new)
    if mla:
        # MLA values are the latent part of the keys: views, exactly as the engine's cache.
        v_cache = k_cache[..., : model.kv_lora_rank]
        v_new = k_new[..., : model.kv_lora_rank]
    return AttentionInputs(q=q.to(q_dtype), k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)


def _put_rows(cache: Tensor, slots: Tensor, rows: Tensor) -> None:
    """cache[slots] = rows, also for 1-byte float dtypes (fp8), which CUDA cannot index_put."""
    if cache.shape[-1] == 0 or slots.numel() == 0:
        return
    if cache.element_size() == 1 and cache.dtype != torch.uint8:
        cache.view(torch.uint8)[slots] = rows.view(torch.uint8)
    else:
        cache[slots] = rows


def to_device(inputs: AttentionInputs, device: str) -> AttentionInputs:
    """Move to `device`, keeping MLA's values a view of the keys."""
    if inputs.q.device.type == torch.device(device).type:
        return inputs  # one GPU per process: "cuda" is the current device
    k_cache = inputs.k_cache.to(device)
    k_new = inputs.k_new.to(device)
    shared = inputs.v_cache.data_ptr() == inputs.k_cache.data_ptr()
    v_cache = k_cache[..., : inputs.v_cache.shape[-1]] if shared else inputs.v_cache.to(device)
    v_new = k_new[..., : inputs.v_new.shape[-1]] if shared else inputs.v_new.to(device)
    return AttentionInputs(q=inputs.q.to(device), k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
