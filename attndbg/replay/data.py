"""The step's data: KV cache and queries, from recorded tensors or drawn from the trace's seed.

Data is drawn where it will be used (a device `torch.Generator` on the GPU), and only for the KV
slots a replay can read: the batch's rows, this step's writes and the engine's dummy page (padded
rows of a CUDA graph read it). Every other slot of the pool is zero. The same trace gives the same
bits on the same device and software; CPU and GPU draw different (equally valid) values, and the
float64 reference is computed from whichever were drawn. The cache is returned as it is *after*
this step's K/V writes (engines write before attending).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.backends.base import AttentionInputs
from attndbg.backends.reference import GROUP_BYTES
from attndbg.replay import memory_share
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


def pool_bytes(trace: Trace) -> int:
    """The KV pool `build_inputs` allocates: kv_cache_size slots of K (and V, but for MLA) in the KV dtype."""
    m = trace.model
    dv = 0 if m.attention is AttentionKind.MLA else m.v_head_dim
    kv_item = torch.empty((), dtype=DTYPES[m.kv_dtype]).element_size()
    return trace.batch.kv_cache_size * m.num_kv_heads * (m.head_dim + dv) * kv_item


def draw_bytes(trace: Trace) -> int:
    """The float32 draws `build_inputs` makes: the KV rows read, and the step's q and new K/V."""
    m, b = trace.model, trace.batch
    dv = 0 if m.attention is AttentionKind.MLA else m.v_head_dim
    rows = int(b.slot_ids.numel() + b.out_cache_loc.numel()) + m.page_size
    return 4 * (rows * m.num_kv_heads * (m.head_dim + dv) + b.num_tokens * (m.num_qo_heads * m.head_dim + m.num_kv_heads * (m.head_dim + dv)))


def reference_bytes(trace: Trace, device: torch.device) -> int:
    """What the references hold on `device`: the float64 output and LSE and their low-precision twin
    (counted at float64), and the padded work of one group at a time, which backends/reference.py
    keeps under GROUP_BYTES unless a single query row of the longest request needs more."""
    m, b = trace.model, trace.batch
    results = 2 * b.num_tokens * m.num_qo_heads * (m.v_head_dim + 1) * 8
    if b.batch_size == 0:
        return results
    kv_max, rows_max = int(b.kv_lens.max()), int(b.extend_lens.max())

    def work(rows: int) -> int:  # float64 K and V gathered for kv_max keys, and ~4 copies of the scores
        return kv_max * m.num_kv_heads * (m.head_dim + m.v_head_dim) * 8 + 4 * m.num_qo_heads * rows * kv_max * 8

    budget = GROUP_BYTES.get(device.type, GROUP_BYTES["cpu"])
    return results + max(work(1), min(budget, b.batch_size * work(rows_max)))


@dataclass(frozen=True)
class Footprint:
    """What replaying one step allocates for its data on one device, by part."""

    pool: int  # the KV pool (batch.kv_cache_size)
    draws: int  # the step's queries, new K/V and the KV rows it reads (batch.extend_lens, batch.kv_lens)
    reference: int  # the float64 reference's results and working group (batch.kv_lens)
    graph: int  # --cuda-graph: the graph harness's own copy of the KV pool (batch.kv_cache_size)

    @property
    def total(self) -> int:
        return self.pool + self.draws + self.reference + self.graph


def footprint(trace: Trace, device: torch.device, *, cuda_graph: bool = False) -> Footprint:
    pool = pool_bytes(trace)
    # The graph harness (replay/graph.py) clones the cache it writes into; MLA's V is a view of K.
    return Footprint(pool=pool, draws=draw_bytes(trace), reference=reference_bytes(trace, device), graph=pool if cuda_graph else 0)


def _driving_field(trace: Trace, need: Footprint) -> tuple[str, str]:
    """The batch field behind the largest part of `need` (what makes this step big), and its value."""
    b = trace.batch
    if need.pool + need.graph >= max(need.draws, need.reference):
        return "batch.kv_cache_size", f"{b.kv_cache_size} slots"
    if need.draws >= need.reference:
        return "batch.extend_lens", f"{b.num_tokens} query tokens"
    return "batch.kv_lens", f"longest KV row {int(b.kv_lens.max())}"


def available_bytes(device: torch.device) -> int:
    """Room where the data will live: this process's room on the GPU (its share, when workers
    share the card), or the host's MemAvailable."""
    if device.type == "cuda":
        return memory_share.room(device)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_fits(trace: Trace, device: torch.device, *, max_bytes: int | None = None, cuda_graph: bool = False) -> None:
    """Refuse, before allocating, a step whose data could not fit in what `device` has free, or in
    `max_bytes` (--max-memory) when that is less: a TraceError naming the field that drives the size."""
    need, free = footprint(trace, device, cuda_graph=cuda_graph), available_bytes(device)
    by_room = max_bytes is None or max_bytes >= free
    if not by_room:
        limit, whose = max_bytes, f"--max-memory {human_bytes(max_bytes)}"
    elif device.type == "cuda" and memory_share.share() is not None:
        limit, whose = free, f"{human_bytes(free)} left in this worker's share of {device.type}"
    else:
        limit, whose = free, f"{human_bytes(free)} free on {device.type}"
    if need.total <= limit:
        return
    parts = [f"KV pool {human_bytes(need.pool)}", f"step data {human_bytes(need.draws)}", f"float64 reference {human_bytes(need.reference)}"]
    if need.graph:
        parts.append(f"CUDA-graph copy of the pool {human_bytes(need.graph)}")
    field, value = _driving_field(trace, need)
    over_share = by_room and memory_share.fits_alone(device, need.total)
    raise (memory_share.OverShare if over_share else TraceError)(
        field,
        f"= {value}: replaying this step needs {human_bytes(need.total)} on {device.type} ({', '.join(parts)}), "
        f"more than {whose}; not replayed",
    )


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def build_inputs(
    trace: Trace,
    *,
    layer: int | None = None,
    device: str | torch.device = "cpu",
    max_memory: int | None = None,  # --max-memory: refuse a step needing more (default: what `device` has free)
    cuda_graph: bool = False,  # the step will also be replayed in a CUDA graph (counted in its footprint)
) -> AttentionInputs:
    """Inputs for one layer on `device` (recorded tensors of `layer` when the trace has them)."""
    model, batch = trace.model, trace.batch
    device = torch.device(device)
    check_fits(trace, device, max_bytes=max_memory, cuda_graph=cuda_graph)
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
    # This step's K/V land in their slots before attention reads the cache (a cross-attention
    # step writes none: its out_cache_loc is -1).
    if not batch.cross:
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
