"""One transformers continuous-batching step, as host copies, read into a Trace.

Cache indices: transformers addresses a token as a row of a per-layer "shifted" token view in which
block `b` starts at row `b * block_physical_stride` and holds `page_size` tokens. We store dense
slot ids, `slot = (index // stride) * page_size + index % stride`, so `Model.page_size` means what
it says and slot 0 stays the engine's trash (the first two sectors are never handed to requests).

An index outside the token view (`[0, rows)`) is what makes the engine's gather or scatter fault (a
device-side assert or an illegal memory access). It is kept as evidence, never refused: the page
run of the request's row holding it reads a spare page of its own past the pool (so the trace
loads and no other request's KV aliases it), and the engine's raw `read_index` / `write_index`
go to the plan verbatim with the view's row count (`token_rows`), where the invariants detector
names the entry (trace/engines.py, transformers' `token_indices`).

Padding: under CUDA graphs transformers pads every step's query tokens (and KV reads) to an
interval; per-token tensors are cut to the step's real tokens, KV rows to the real reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.trace.build import batch_from_rows, mode_from_lengths, source
from attndbg.trace.schema import AttentionKind, LayerTensors, LseBase, Model, Plan, Trace

ENGINE = "transformers"
FULL_ATTENTION = "full_attention"
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
LAYER_TENSORS = ("q", "k_new", "v_new", "output")  # a layer is in the trace only with all four
# plan.tensors / plan.scalars names of the evidence kept when an index is outside the token view
EVIDENCE_INDICES = ("read_index", "write_index")
TOKEN_ROWS = "token_rows"


@dataclass(frozen=True)
class CacheGeometry:
    """How transformers' cache indices map to dense slots, for the full-attention allocator."""

    allocator_index: int
    stride: int  # rows between consecutive blocks in the token view
    page_size: int  # tokens per page
    num_slots: int  # dense slots covering the whole view
    rows: int = 0  # rows of the token view: valid indices are [0, rows)

    def to_slots(self, index: Tensor) -> Tensor:
        index = index.to(torch.int64)
        return torch.div(index, self.stride, rounding_mode="floor") * self.page_size + index % self.stride

    def outside(self, index: Tensor) -> Tensor:
        """[n] bool: indices the engine's cache has no row for."""
        index = index.to(torch.int64)
        return (index < 0) | (index >= self.rows)


def cache_geometry(cache: Any) -> CacheGeometry:
    """Read the full-attention allocator's layout from a live `PagedAttentionCache`."""
    full = [a for a in cache.cache_allocators.values() if type(a).__name__.startswith("FullAttention")] if isinstance(cache.cache_allocators, dict) else []
    if not full:
        allocators = cache.cache_allocators.values() if isinstance(cache.cache_allocators, dict) else cache.cache_allocators
        kinds = sorted({type(a).__name__ for a in allocators})
        raise NotImplementedError(f"only full-attention layers are recorded; this cache has {kinds}")
    allocator = full[0]
    k_view, _ = allocator._kv_token_views[allocator.layer_indices[0]]
    stride = int(allocator.block_physical_stride)
    page = int(allocator.tokens_per_page)
    rows = int(k_view.shape[0])
    return CacheGeometry(allocator_index=int(allocator.index), stride=stride, page_size=page, num_slots=(rows // stride + 1) * page, rows=rows)


def model_from_config(config: Any, dtype: torch.dtype, page_size: int) -> Model:
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if dtype not in DTYPE_NAMES:
        raise NotImplementedError(f"cache dtype {dtype} is not recorded (fp16/bf16/fp32 are)")
    if getattr(config, "sliding_window", None) and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise NotImplementedError("sliding-window layers keep a separate ring cache; only full-attention models are recorded")
    return Model(
        num_qo_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        attention=AttentionKind.MHA,
        kv_lora_rank=0,
        qk_rope_head_dim=0,
        sm_scale=float(getattr(config, "attention_multiplier", None) or head_dim**-0.5),
        logit_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        sliding_window=-1,
        q_dtype=DTYPE_NAMES[dtype],
        kv_dtype=DTYPE_NAMES[dtype],
        page_size=page_size,
    )


def per_allocator(value: Any, index: int) -> Any:
    """batch_data holds per-allocator lists (read/write index) and per-type dicts (cu_seq_lens_k)."""
    if isinstance(value, dict):
        return value.get(FULL_ATTENTION)
    if isinstance(value, (list, tuple)):
        return value[index] if len(value) > index else None
    return value


def recorded_layers(host: dict[str, Tensor | None]) -> list[int]:
    """Layers whose four tensors all arrived (a ring step written before its forward ended, or a
    probe overwritten before it was read, has fewer)."""
    layers = {int(name.split(".")[0][len("layer") :]) for name in host if name.startswith("layer") and "." in name}
    return sorted(layer for layer in layers if all(host.get(f"layer{layer}.{t}") is not None for t in LAYER_TENSORS))


def _rows_with_spares(rows: list[Tensor], bad: list[Tensor], geometry: CacheGeometry) -> tuple[list[Tensor], int]:
    """Each page run (columns c with the same c // page_size) of a row that holds a bad index
    reads a spare page past the pool instead: slot = spare_page * page_size + c % page_size, so the
    row keeps its page structure. Returns the rows and the slots the cache then needs."""
    page = geometry.page_size
    next_spare = geometry.num_slots // page
    out = []
    for row, wrong in zip(rows, bad):
        row = row.clone()
        cols = torch.arange(row.numel())
        for run in torch.unique(cols[wrong] // page).tolist():
            in_run = cols // page == run
            row[in_run] = next_spare * page + cols[in_run] % page
            next_spare += 1
        out.append(row)
    return out, next_spare * page


def trace_from_step(host: dict[str, Tensor | None], *, model: Model, geometry: CacheGeometry, step: int, backend: str, device: torch.device | str) -> Trace:
    """One recorded step (host tensors) -> Trace."""
    cu_q = host["cu_seq_lens_q"].to(torch.int64)
    cu_k = host["cu_seq_lens_k"].to(torch.int64)
    extend = cu_q.diff()
    kv = cu_k.diff()
    prefix = kv - extend
    total_tokens = int(cu_q[-1])
    write_index = host["write_index"][:total_tokens].to(torch.int64)
    read = host["read_index"]
    reads = read is not None and read.numel() > 0
    read_index = read[: int(cu_k[-1])].to(torch.int64) if reads else None
    raw_rows, bad_rows = [], []
    for b in range(extend.numel()):
        index = read_index[int(cu_k[b]) : int(cu_k[b + 1])] if read_index is not None else write_index[int(cu_q[b]) : int(cu_q[b + 1])]
        raw_rows.append(index)
        bad_rows.append(geometry.outside(index))
    rows = [geometry.to_slots(index) for index in raw_rows]
    bad_write = geometry.outside(write_index)
    evidence = bool(bad_write.any()) or any(bool(bad.any()) for bad in bad_rows)
    cache_size = geometry.num_slots
    if evidence:
        # A bad write index makes its column's page run spare too (its slot is the row's).
        for b in range(extend.numel()):
            cols = int(prefix[b]) + torch.arange(int(extend[b]))
            bad_rows[b] = bad_rows[b].clone()
            bad_rows[b][cols] |= bad_write[int(cu_q[b]) : int(cu_q[b + 1])]
        rows, cache_size = _rows_with_spares(rows, bad_rows, geometry)
        write = torch.cat([row[int(p) :] for row, p in zip(rows, prefix.tolist())]) if rows else torch.zeros(0, dtype=torch.int64)
    else:
        write = geometry.to_slots(write_index)
    batch = batch_from_rows(
        forward_mode=mode_from_lengths(extend, prefix),
        prefix_lens=prefix,
        extend_lens=extend,
        rows=rows,
        out_cache_loc=write,
        positions=host["position_ids"][:total_tokens],
        seq_lens_raw=kv,
        kv_cache_size=cache_size,
    )
    plan = None
    if evidence:
        tensors = {"write_index": write_index} | ({"read_index": read_index} if read_index is not None else {})
        plan = Plan(backend=ENGINE, tensors=tensors, scalars={TOKEN_ROWS: geometry.rows, "page_size": geometry.page_size, "block_physical_stride": geometry.stride})
    return Trace(
        source=source(engine=ENGINE, backend=backend, device=device, step=step),
        model=model,
        batch=batch,
        seed=step,
        plan=plan,
        tensors={layer: _layer(host, layer, geometry, total_tokens) for layer in recorded_layers(host)},
    )


def _layer(host: dict[str, Tensor | None], layer: int, geometry: CacheGeometry, total_tokens: int) -> LayerTensors:
    """A layer's tensors, cut to the step's real tokens and reads (graph padding past them). Graph
    replays' probes carry no KV rows (probes.py): the layer then reads none (kv_slots empty)."""
    q = host[f"layer{layer}.q"]
    k_rows = host.get(f"layer{layer}.k_rows")
    read_rows = host.get(f"layer{layer}.read_index")
    if k_rows is None or read_rows is None:
        empty = q.new_zeros((0, *host[f"layer{layer}.k_new"].shape[1:]))
        kv_slots, k_rows, v_rows = torch.zeros(0, dtype=torch.int64), empty, empty.clone()
    else:
        reads = int(host["cu_seq_lens_k"][-1]) if read_rows.numel() else 0
        keep = ~geometry.outside(read_rows[:reads])  # a row the engine could not have read is not evidence of KV
        kv_slots = geometry.to_slots(read_rows[:reads][keep])
        k_rows, v_rows = k_rows[:reads][keep], host[f"layer{layer}.v_rows"][:reads][keep]
    return LayerTensors(
        q=q[:total_tokens],
        k_new=host[f"layer{layer}.k_new"][:total_tokens],
        v_new=host[f"layer{layer}.v_new"][:total_tokens],
        kv_slots=kv_slots,
        k_rows=k_rows,
        v_rows=v_rows,
        output=host[f"layer{layer}.output"][:total_tokens],
        lse=None,
        lse_base=LseBase.E,
    )
