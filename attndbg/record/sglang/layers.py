"""Per-layer tensors of SGLang eager steps (`attndbg record --layers`): q, new k/v, the KV rows the
batch reads, the engine's output (and LSE when the backend returns one).

Why it is split the way it is:
- the metadata hook (`init_forward_metadata`) knows the batch but runs before any layer, so with
  layers requested it does not submit its step: it leaves a `PendingStep` on its thread;
- `AttentionBackend.forward(q, k, v, layer, forward_batch, ...)` is the one call that sees a
  layer's q/k/v, its layer id and the batch: its hook copies the layer's tensors into the pending
  step of the same ForwardBatch (identity), KV rows first, before the backend writes this step's KV;
- the step is submitted when `ModelRunner.forward` returns, or, for forwards that do not go through
  it (warm-up, draft steps driven from `model.forward`), when the next step is recorded.

Nothing here synchronises the device: the slots the batch reads are gathered on the device with a
host-known total (`repeat_interleave(..., output_size=)`), each layer is one `session.snapshot`,
and the writer thread checks the gathered slots against the Batch built from the host copies.
Under a CUDA-graph capture (or replay, where the Python attention code does not run) nothing is
copied: those steps stay metadata-only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from attndbg.record.host_copy import HostCopy, StepCopies
from attndbg.record.session import RecordingSession, capturing
from attndbg.trace.schema import LayerTensors, LseBase, Trace

FORWARD_PARAMS = ("q", "k", "v", "layer", "forward_batch")  # AttentionBackend.forward's leading parameters
SLOTS = "layers.read_slots"  # the metadata copy's key for the slots the batch reads
LSE_BASE_TWO = ("flashinfer", "flashinfer_mla")  # FlashInfer kernels write base-2 LSEs (engines.md A4.3)

_local = threading.local()  # .pending: PendingStep | None; .forward_depth: nested backend.forward calls


@dataclass
class PendingStep:
    """A recorded step whose layers are still running. Lives on the thread that planned it."""

    session: RecordingSession
    forward_batch: Any  # the ForwardBatch the step was planned for; layers of other batches are ignored
    metadata: HostCopy
    build: Callable[[dict[str, Tensor | None]], Trace]
    read_slots: Tensor  # device int64 [R]: req_to_token entries the batch reads, in Batch.slot_ids order
    num_tokens: int | None  # query rows of this step when known on the host (else q's rows)
    mla: bool
    lse_base: LseBase
    layers: dict[int, HostCopy] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # layers whose forward ran (a second call drops the layer)
    step: int | None = None  # the step's number (the flight recorder's ring names it)

    def copies(self) -> StepCopies:
        parts = {"": self.metadata}
        parts.update({f"layer{layer}.": copy for layer, copy in sorted(self.layers.items())})
        return StepCopies(parts)


def read_slots(fb: Any, req_to_token: Tensor, *, batch_size: int, extra: int) -> Tensor:
    """The KV slots the batch reads, request by request (the used part of each req_to_token row),
    gathered on the device without a sync: the total comes from host-side lengths.

    `extra` is added to every seq_len (TARGET_VERIFY seq_lens exclude the draft tokens)."""
    seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
    if seq_lens_cpu is not None and not seq_lens_cpu.is_cuda:
        total = int(seq_lens_cpu[:batch_size].sum()) + extra * batch_size
    elif isinstance(getattr(fb, "seq_lens_sum", None), int):
        total = int(fb.seq_lens_sum) + extra * batch_size
    else:
        raise NotImplementedError("the ForwardBatch has neither seq_lens_cpu nor seq_lens_sum on the host: the KV rows it reads cannot be sized without a device sync")
    device = req_to_token.device
    kv = fb.seq_lens[:batch_size].to(device=device, dtype=torch.int64) + extra
    request = torch.repeat_interleave(torch.arange(batch_size, device=device), kv, output_size=total)
    start = torch.cumsum(kv, 0) - kv
    column = torch.arange(total, device=device) - start[request]
    rows = fb.req_pool_indices[:batch_size].to(device=device, dtype=torch.int64)[request]
    return req_to_token[rows, column].to(torch.int64)


def pending() -> PendingStep | None:
    return getattr(_local, "pending", None)


def hold(step: PendingStep) -> None:
    """Leave `step` on this thread until its layers ran (a step left over is submitted first)."""
    flush()
    _local.pending = step


def flush() -> None:
    """Submit this thread's pending step (metadata plus the layers recorded so far)."""
    step = pending()
    _local.pending = None
    if step is None:
        return
    with step.session.guard("sglang submitting a step with layers"):
        step.session.submit(step.copies(), _build_with_layers(step), step=step.step)


def discard() -> None:
    """Drop this thread's pending step (its forward raised: its layers are incomplete)."""
    _local.pending = None


def _build_with_layers(step: PendingStep) -> Callable[[dict[str, Tensor | None]], Trace]:
    layers = sorted(step.layers)
    build, base = step.build, step.lse_base

    def build_trace(host: dict[str, Tensor | None]) -> Trace:
        trace = build(host)
        slots = trace.batch.slot_ids
        gathered = host[SLOTS]
        if gathered is None or not torch.equal(gathered.to(torch.int64), slots):
            raise ValueError(f"step {trace.source.step}: the KV slots gathered on the device ({None if gathered is None else gathered.numel()}) are not the Batch's slot_ids ({slots.numel()}); the host-side lengths disagree with seq_lens")
        tensors = {}
        for layer in layers:
            t = {name: host.get(f"layer{layer}.{name}") for name in ("q", "k_new", "v_new", "k_rows", "v_rows", "output", "lse")}
            if t["q"].shape[0] != trace.batch.num_tokens:
                raise ValueError(f"step {trace.source.step} layer {layer}: q has {t['q'].shape[0]} rows, the batch has {trace.batch.num_tokens} query tokens")
            tensors[layer] = LayerTensors(
                q=t["q"],
                k_new=t["k_new"],
                v_new=t["v_new"],
                kv_slots=slots,
                k_rows=t["k_rows"],
                v_rows=t["v_rows"],
                output=t["output"],
                lse=t["lse"],
                lse_base=base,
            )
        return replace(trace, tensors=tensors)

    return build_trace


# -- the attention call ---------------------------------------------------------------------------


def forward_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """q, k, v, layer, forward_batch of a backend.forward call, positional or by name (SGLang's
    hybrid backends delegate with keywords)."""
    bound = dict(zip(FORWARD_PARAMS, args))
    bound.update({name: kwargs[name] for name in FORWARD_PARAMS if name in kwargs})
    return bound


def _kv_pool(backend: Any) -> Any:
    pool = getattr(backend, "token_to_kv_pool", None)
    if pool is None:
        from sglang.srt.model_executor import forward_context

        pool = forward_context.get_token_to_kv_pool()
    return pool


def _supported_pool(backend: Any, pool: Any) -> None:
    """Refuse the pools whose rows are not `buffer[slot]` for the req_to_token slot ids."""
    translator = getattr(backend, "kv_index_translator", None)
    if getattr(translator, "is_translating", False):
        raise NotImplementedError("the KV pool translates req_to_token's virtual ids to physical rows (unified hybrid allocator / fused draft pool): per-layer KV rows are not recorded for it")
    if getattr(pool, "use_hnd", False):
        raise NotImplementedError("the KV pool uses the HND page layout: per-layer KV rows are not recorded for it")
    if hasattr(pool, "translate_loc_from_full_to_swa"):  # BaseSWAKVPool
        raise NotImplementedError(f"{type(pool).__name__} keeps layers in sub-pools with their own slot ids: per-layer KV rows are not recorded for it")


def capture_inputs(step: PendingStep, backend: Any, bound: dict[str, Any], kwargs: dict[str, Any]) -> tuple[int, dict[str, Tensor]] | None:
    """Device copies of the layer's q / new k, v / KV rows before the backend runs, or None when
    this call is not recorded (another batch, a layer not asked for, no new keys, in a capture)."""
    layer, fb = bound.get("layer"), bound.get("forward_batch")
    if capturing() or fb is not step.forward_batch or not hasattr(layer, "layer_id") or not hasattr(layer, "tp_q_head_num"):
        return None  # in a capture, another batch's call, or not a RadixAttention layer (mamba and friends)
    layer_id = int(layer.layer_id)
    if not step.session.wants_layer(layer_id):
        return None
    if layer_id in step.seen:
        # A second call of one layer in one step (chunked-prefix MLA runs the prefix chunks and
        # the new tokens separately): no single call is the step's attention, so none is kept.
        step.layers.pop(layer_id, None)
        return None
    step.seen.add(layer_id)
    q, k, v = bound.get("q"), bound.get("k"), bound.get("v")
    if q is None or k is None or kwargs.get("idx_q") is not None or kwargs.get("topk_indices") is not None:
        return None  # K/V written elsewhere (shared KV layers) or sparse attention: nothing standard to record
    hq, hkv = int(layer.tp_q_head_num), int(layer.tp_k_head_num)
    head_dim = int(getattr(layer, "qk_head_dim", layer.head_dim))
    v_dim = int(layer.v_head_dim)
    t = step.num_tokens if step.num_tokens is not None else int(q.shape[0])
    pool = _kv_pool(backend)
    _supported_pool(backend, pool)
    slots = step.read_slots
    if step.mla:
        # Schema MLA convention: q and k are [latent | rope] (head_dim wide), values are the
        # latent part of the keys, so v_new / v_rows are stored empty.
        q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
        q_full = torch.cat([q.reshape(-1, hq, v_dim), q_rope.reshape(-1, hq, head_dim - v_dim)], -1) if q_rope is not None else q.reshape(-1, hq, head_dim)
        k_full = torch.cat([k.reshape(-1, 1, v_dim), k_rope.reshape(-1, 1, head_dim - v_dim)], -1) if k_rope is not None else k.reshape(-1, 1, head_dim)
        k_buffer = pool.get_key_buffer(layer_id)
        _check_rows(k_buffer, (1, head_dim), "MLA key buffer")
        k_rows = k_buffer.index_select(0, slots)
        captured = {
            "q": q_full[:t].detach().clone(),
            "k_new": k_full[:t].detach().clone(),
            "v_new": k_full.new_empty((t, 1, 0)),
            "k_rows": k_rows,
            "v_rows": k_rows.new_empty((k_rows.shape[0], 1, 0)),
        }
    else:
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        _check_rows(k_buffer, (hkv, head_dim), "key buffer")
        _check_rows(v_buffer, (hkv, v_dim), "value buffer")
        captured = {
            "q": q.reshape(-1, hq, head_dim)[:t].detach().clone(),
            "k_new": k.reshape(-1, hkv, head_dim)[:t].detach().clone(),
            "v_new": v.reshape(-1, hkv, v_dim)[:t].detach().clone(),
            # Gathered now, before the backend writes this step's K/V into the pool.
            "k_rows": k_buffer.index_select(0, slots),
            "v_rows": v_buffer.index_select(0, slots),
        }
    return layer_id, captured


def _check_rows(buffer: Tensor, row_shape: tuple[int, int], what: str) -> None:
    if buffer.dim() != 3 or tuple(buffer.shape[1:]) != row_shape:
        raise NotImplementedError(f"the KV pool's {what} has shape {list(buffer.shape)}, expected [slots, {row_shape[0]}, {row_shape[1]}]: per-layer KV rows are not recorded for this layout")


def capture_output(step: PendingStep, layer: int, captured: dict[str, Tensor], result: Any, layer_obj: Any) -> None:
    """Add the engine's output (and LSE when returned) and start the layer's host copy."""
    hq, v_dim = int(layer_obj.tp_q_head_num), int(layer_obj.v_head_dim)
    t = captured["q"].shape[0]
    output, lse = (result[0], result[1]) if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(output, Tensor) or output.numel() < t * hq * v_dim:
        return  # not an attention output we can read: the layer is not recorded
    captured["output"] = output.reshape(-1, hq, v_dim)[:t].detach()
    # LSE only when the backend's forward returned it ((output, lse), e.g. return_lse=True);
    # a plain forward returns the output alone and the trace's lse stays None.
    captured["lse"] = lse.reshape(-1, hq)[:t].detach() if isinstance(lse, Tensor) and lse.numel() >= t * hq else None
    copy = step.session.snapshot(captured)
    if copy is not None:
        step.layers[layer] = copy


def lse_base(backend_name: str) -> LseBase:
    return LseBase.TWO if backend_name in LSE_BASE_TWO else LseBase.E


def forward_depth() -> int:
    return getattr(_local, "forward_depth", 0)


def enter_forward() -> None:
    _local.forward_depth = forward_depth() + 1


def leave_forward() -> None:
    _local.forward_depth = forward_depth() - 1
