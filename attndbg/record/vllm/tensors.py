"""Per-layer tensors of recorded vLLM steps (`attndbg record --layers 0,5`).

Hook: `AttentionImpl.forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)`
(vLLM 0.33: `vllm.v1.attention.backend.AttentionImpl`; engines.md B6). It runs once per layer
and step in eager and PIECEWISE-graph steps; in FULL-graph steps it runs only while the graph is
captured, so nothing is copied while `capturing()` is true and replayed FULL-graph steps stay
metadata-only. MLA layers (`MLAAttentionImpl`, another forward interface) are not hooked.

Which step a forward belongs to: the runners (V1 `_build_attention_metadata`, V2
`gpu/attn_utils.build_attn_metadata`) hand every layer of an attention group the very object its
builder's `build()` returned, so the recorded step is found by the identity of `attn_metadata`.
That holds across threads (micro-batching runs layers on other threads with per-ubatch builders).

When the step is written: the builder hook keeps a recorded step *pending* (`hold`) instead of
submitting it, and the step is submitted once its forward is surely over, which is when the same
builder builds again (the next step, or the next draft level: a builder builds once per forward)
or at `finish()` (process exit, or called by tests and in-process engines). The alternative,
wrapping the runner's model call, would need one hook per runner (V1, V2, drafters, ubatch
wrapper) and miss the ones we do not know; the builder is the one place every runner goes
through. The host copies start at build time and at each layer's forward (asynchronously, on the
engine's stream), so waiting to *submit* changes no data: the write is one step later.

Layer index: the one integer component of `layer.layer_name` ("model.layers.5.self_attn.attn"
-> 5), vLLM's own rule (`extract_layer_index` with one attention module per layer). A name with
no or several integers is not recorded.

What is copied per requested layer (one HostCopy per layer, taken after the call; q/k/v are
cloned on the device before it, so an impl that alters its inputs does not change the record):
- q [T, Hq, D], k_new / v_new [T, Hkv, D] for the step's `num_actual_tokens` T (vLLM 0.33 counts
  CUDA-graph padding in it: the writer trims to the real requests' tokens);
- the KV rows of every block the step's block table reaches (rows x used columns), gathered
  without a sync; the writer keeps exactly the slots the Batch reads. Backends that write the
  new K/V before `forward` (0.33 Triton and FlashAttention: `do_kv_cache_update` runs first) give
  rows where the new tokens' slots already hold k_new / v_new: replay writes k_new / v_new there
  before attending, so that is the same cache. When `key` is None (a layer sharing another
  layer's cache, or a fused update that bypasses it) k_new / v_new are those rows;
- the output [T, Hq, Dv] (the `output` argument, else the return value); none when the output is
  quantized (`output_scale`). LSE: None (vLLM's `forward` does not return one).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attndbg.record import session as session_module
from attndbg.record.host_copy import HostCopy, StepCopies
from attndbg.record.session import Build, RecordingSession
from attndbg.trace.schema import Batch, LayerTensors, LseBase

# Where AttentionImpl lives: vLLM 0.33 (`backend.py`), then older v1 releases.
IMPL_MODULES = ("vllm.v1.attention.backend", "vllm.attention.backends.abstract")
# Impls whose [B, H, N, C] cache view is not H = KV heads, C = K | V (b12x puts K/V on dim 1).
NON_STANDARD_LAYOUT = ("B12xPagedAttentionImpl",)
# KV cache dtypes recorded as they are: quantized caches need scales the trace does not carry.
PLAIN_KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float")
LAYER_PREFIX = "layer"

_local = threading.local()
_lock = threading.Lock()


def impl_base_class() -> type:
    """vLLM's `AttentionImpl` (ImportError naming the modules tried when absent)."""
    for name in IMPL_MODULES:
        try:
            return importlib.import_module(name).AttentionImpl
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"no AttentionImpl in {', '.join(IMPL_MODULES)}: is vLLM (v1) installed?")


def layer_index(layer_name: Any) -> int | None:
    """5 for "model.layers.5.self_attn.attn": the name's one integer component, else None."""
    if not isinstance(layer_name, str):
        return None
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def kv_views(impl: Any, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(key, value) caches as [num_blocks, block_size, Hkv, D] views of one layer's `kv_cache`.

    vLLM 0.33: a [B, H, N, C] view with C = K | V (`kv_cache.transpose(1, 2).split(head_size, -1)`,
    as TritonAttentionImpl / FlashAttentionImpl do). Older v1: (2, B, N, H, D) (FlashAttention,
    `unbind(0)`) or (B, 2, N, H, D) (FlashInfer, Triton, `unbind(1)`). Anything else raises.
    """
    head = int(impl.head_size)
    head_v = int(getattr(impl, "head_size_v", None) or head)
    kv_heads = int(getattr(impl, "num_kv_heads", 0) or 0)
    name = type(impl).__name__
    if name in NON_STANDARD_LAYOUT:
        raise NotImplementedError(f"{name} lays out its KV cache {list(kv_cache.shape)} its own way: per-layer tensors are not recorded")
    shape = tuple(kv_cache.shape)
    if kv_cache.dim() == 4 and shape[1] == kv_heads and shape[3] == head + head_v:
        packed = kv_cache.transpose(1, 2)
        return packed[..., :head], packed[..., head:]
    if kv_cache.dim() == 5 and shape[0] == 2 and shape[3] == kv_heads:
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() == 5 and shape[1] == 2 and shape[3] == kv_heads:
        return kv_cache[:, 0], kv_cache[:, 1]
    raise NotImplementedError(f"{name}: KV cache of shape {list(shape)} is not a layout attndbg reads (Hkv {kv_heads}, head sizes {head}/{head_v})")


@dataclass
class _Pending:
    """A recorded step waiting for its layers' forwards (one per builder at a time)."""

    session: RecordingSession
    builder: Any  # kept alive: its id keys _BY_BUILDER
    metadata: Any  # kept alive: its id keys _BY_METADATA
    meta_copy: HostCopy
    build: Callable[..., Any]  # build(host, layers=..., lse_bases=...) -> Trace
    tokens: int  # num_actual_tokens of the step (padded in vLLM 0.33 FULL-graph steps)
    block_size: int  # tokens per block of the block table (the builder's kv_cache_spec)
    block_table: Tensor  # the engine's [rows, used columns] block table (device view)
    layers: dict[int, HostCopy] = field(default_factory=dict)
    lse_bases: dict[int, LseBase] = field(default_factory=dict)
    flat_blocks: Tensor | None = None  # block ids the layers gather, computed once per step
    step: int | None = None  # the step's number (the flight recorder's ring names it)


_BY_METADATA: dict[int, _Pending] = {}
_BY_BUILDER: dict[int, _Pending] = {}


def hold(
    session: RecordingSession, builder: Any, metadata: Any, meta_copy: HostCopy, build: Callable[..., Any], *, tokens: int, block_size: int, block_table: Tensor, step: int | None = None
) -> None:
    """Keep a recorded step until its layers ran (the builder hook calls this instead of submit)."""
    pending = _Pending(session, builder, metadata, meta_copy, build, tokens, block_size, block_table, step=step)
    with _lock:
        _BY_METADATA[id(metadata)] = pending
        _BY_BUILDER[id(builder)] = pending


def release(builder: Any) -> None:
    """Submit the step `builder` built last: it builds again, so that step's forward is over."""
    with _lock:
        pending = _BY_BUILDER.pop(id(builder), None)
        if pending is not None:
            _BY_METADATA.pop(id(pending.metadata), None)
    if pending is not None:
        _submit(pending)


def finish() -> None:
    """Submit every pending step (process exit; tests and in-process engines before closing)."""
    with _lock:
        pendings = list(_BY_BUILDER.values())
        _BY_BUILDER.clear()
        _BY_METADATA.clear()
    for pending in pendings:
        _submit(pending)


def pending_steps() -> int:
    return len(_BY_BUILDER)


def _submit(pending: _Pending) -> None:
    session = pending.session
    with session.guard("vLLM submitting a step with layer tensors"):
        layers = sorted(pending.layers)
        parts = {"": pending.meta_copy, **{f"{LAYER_PREFIX}{n}.": pending.layers[n] for n in layers}}
        build: Build = functools.partial(pending.build, layers=tuple(layers), lse_bases=dict(pending.lse_bases))
        session.submit(StepCopies(parts), build, step=pending.step)


def wrap_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`AttentionImpl.forward` that copies the tensors of requested layers of pending steps."""

    @functools.wraps(fn)
    def forward(self: Any, layer: Any, query: Tensor, key: Tensor | None, value: Tensor | None, kv_cache: Tensor, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _BY_METADATA.get(id(attn_metadata)) if attn_metadata is not None else None
        if pending is None or pending.metadata is not attn_metadata or getattr(_local, "active", False):
            return fn(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        session = pending.session
        index = layer_index(getattr(layer, "layer_name", None))
        # Under a graph capture kernels are recorded, not run: there is nothing real to copy, and
        # a gather there would be baked into the graph.
        if index is None or index in pending.layers or not session.wants_layer(index) or session_module.capturing():
            return fn(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        before: dict[str, Tensor | None] | None = None
        with session.guard(f"vLLM {type(self).__name__}.forward (before)"):
            before = _before(self, pending, query, key, value, kv_cache)
        _local.active = True
        try:
            result = fn(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        finally:
            _local.active = False
        if before is not None:
            with session.guard(f"vLLM {type(self).__name__}.forward (after)"):
                output = kwargs["output"] if "output" in kwargs else (args[0] if args else None)
                quantized = kwargs.get("output_scale", args[1] if len(args) > 1 else None) is not None
                if output is None:
                    output = result
                tokens = pending.tokens
                before["output"] = None if quantized or not isinstance(output, Tensor) else output[:tokens].reshape(tokens, int(self.num_heads), -1)
                copy = session.snapshot(before)
                if copy is not None:
                    pending.layers[index] = copy
                    pending.lse_bases[index] = LseBase.E if getattr(self, "lse_base_on_e", True) else LseBase.TWO
        return result

    return forward


def _before(impl: Any, pending: _Pending, query: Tensor, key: Tensor | None, value: Tensor | None, kv_cache: Tensor) -> dict[str, Tensor | None]:
    """Device-side copies taken before the call (no sync): q/k/v clones and the gathered KV rows."""
    dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if dtype not in PLAIN_KV_DTYPES or getattr(impl, "_is_per_token_head_quant", False):
        raise NotImplementedError(f"KV cache dtype {dtype!r} is quantized: per-layer tensors would need its scales, which the trace does not carry")
    k_cache, v_cache = kv_views(impl, kv_cache)
    if int(k_cache.shape[1]) != pending.block_size:
        raise NotImplementedError(f"KV cache blocks hold {int(k_cache.shape[1])} tokens, the block table counts {pending.block_size}")
    if pending.flat_blocks is None:
        # Clamped so that a stale id in an unused column can never index out of the pool (a device
        # assert would take the engine down); the writer only keeps the slots the batch reads.
        pending.flat_blocks = pending.block_table.reshape(-1).to(torch.int64).clamp(0, int(k_cache.shape[0]) - 1)
    blocks = pending.flat_blocks
    tokens, heads, kv_heads = pending.tokens, int(impl.num_heads), int(k_cache.shape[2])
    k_rows = k_cache.index_select(0, blocks).reshape(-1, *k_cache.shape[2:])
    v_rows = v_cache.index_select(0, blocks).reshape(-1, *v_cache.shape[2:])
    return {
        "q": query[:tokens].reshape(tokens, heads, -1).detach().clone(),
        "k_new": key[:tokens].reshape(tokens, kv_heads, -1).detach().clone() if key is not None else None,
        "v_new": value[:tokens].reshape(tokens, kv_heads, -1).detach().clone() if value is not None else None,
        "k_rows": k_rows,
        "v_rows": v_rows,
    }


def table_holds(batch: Batch, block_table: Tensor, block_size: int) -> bool:
    """Whether every block the batch reads is in the step's block table (the layers gathered
    only those). Not so when the engine's table holds ids no pool has: the batch then reads spare
    blocks (convert.readable_rows) whose contents the engine never had."""
    blocks = torch.unique(torch.div(batch.slot_ids, block_size, rounding_mode="floor"))
    return bool(torch.isin(blocks, block_table.reshape(-1).to(torch.int64)).all())


def layer_tensors(host: dict[str, Tensor | None], layer: int, *, batch: Batch, block_table: Tensor, block_size: int, lse_base: LseBase) -> LayerTensors:
    """Writer thread: one layer's host copies -> LayerTensors over exactly the slots `batch` reads.

    `block_table` is the step's host block table (the rows and columns the layers gathered, in
    that order): gathered row i * block_size + j is slot block_table.flat[i] * block_size + j.
    """
    p = f"{LAYER_PREFIX}{layer}."
    flat = block_table.reshape(-1).to(torch.int64)
    k_all, v_all = host[p + "k_rows"], host[p + "v_rows"]
    assert k_all is not None and v_all is not None
    slots = torch.unique(batch.slot_ids)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    # First position of each needed block in the gathered table (a stable sort keeps equal ids in
    # table order, and searchsorted finds the first of them); O(table) memory whatever the ids.
    ordered, order = torch.sort(flat, stable=True)
    first = torch.zeros(0, dtype=torch.int64)
    if slots.numel():
        at = torch.searchsorted(ordered, blocks).clamp_max(max(flat.numel() - 1, 0))
        if flat.numel() == 0 or bool((ordered[at] != blocks).any()):
            raise ValueError(f"layer {layer}: the batch reads a block its block table does not hold")
        first = order[at]
    rows = first * block_size + slots % block_size
    tokens = batch.num_tokens
    k_rows, v_rows = k_all[rows], v_all[rows]
    k_new, v_new = host[p + "k_new"], host[p + "v_new"]
    if k_new is None or v_new is None:
        # No key/value given: the cache already holds this step's K/V at the new tokens' slots.
        at = torch.searchsorted(slots, batch.out_cache_loc)
        k_new, v_new = k_rows[at], v_rows[at]
    q, output = host[p + "q"], host[p + "output"]
    assert q is not None
    return LayerTensors(
        q=q[:tokens],
        k_new=k_new[:tokens],
        v_new=v_new[:tokens],
        kv_slots=slots,
        k_rows=k_rows,
        v_rows=v_rows,
        output=output[:tokens] if output is not None else None,
        lse=None,
        lse_base=lse_base,
    )
