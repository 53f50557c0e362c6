"""Recorder for Hugging Face transformers' continuous batching (`generate_batch`, paged KV cache).

Hooks, all on public extension points of transformers >= 5.20:
- `ModelRunner.compute_batch(model, batch_data)` runs once per forward step, eager or CUDA-graph
  replay, after the batch tensors were prepared. It gives the step: `cu_seq_lens_q`,
  `cu_seq_lens_k["full_attention"]`, `write_index`/`read_index` (one per cache allocator),
  `position_ids`, and the `PagedAttentionCache`.
- with `--layers`, `PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)` sees
  each layer's new k, v and the KV rows it reads before it writes them, and the attention functions
  `"sdpa"` and `"paged|eager"`, re-registered through `AttentionInterface.register`, see q and the
  output, in eager steps (under a CUDA graph they run only at capture, so graph-replayed steps are
  recorded as metadata only). In 5.20 the attention function calls `cache.update` itself (the
  cache in its kwargs); in 5.24 the attention module calls it before the attention function, which
  no longer gets the cache: hooking `update` reads both the same way.

Tested with transformers 5.20.2 (CI, the oldest supported) and 5.24.0.

Engine fields the detectors use (`TRANSFORMERS_FIELDS` below, as data; issue 14):

| engine field | source | trace | read by |
|---|---|---|---|
| cu_seq_lens_q | batch_data, [:num_requests+1] | batch.extend_lens | every detector |
| cu_seq_lens_k["full_attention"] | batch_data, [:num_requests+1] | batch.kv_lens, seq_lens_raw | invariants: seq-lens |
| read_index / write_index | batch_data, per allocator, [:true_read/write_size] | batch.slot_ids / out_cache_loc | replay; fill-value |
| position_ids | batch_data | batch.positions | invariants: positions |
| q, k, v, output (--layers) | the attention function's arguments | tensors | replay, split-merge |
| padded tails (q/kv padding intervals, CUDA graphs) | batch_data past the true sizes | not recorded | fill-value would: transformers' padded rows carry no seq_lens / fill value of their own (they are padded token counts, not padded requests), so there is no graph section to fill |
| seq_lens_sum, plan (indptr, masks, window lists) | none: the engine builds none | not recorded | invariants / tree-mask on SGLang and vLLM only |

Cache indices: transformers addresses a token as a row of a per-layer "shifted" token view in which
block `b` starts at row `b * block_physical_stride` and holds `page_size` tokens. We store dense
slot ids, `slot = (index // stride) * page_size + index % stride`, so `Model.page_size` means what
it says and slot 0 stays the engine's trash (the first two sectors are never handed to requests).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attndbg import profiling
from attndbg.record.build import batch_from_rows, mode_from_lengths, source
from attndbg.record.session import RecordingSession, capturing, current_session
from attndbg.trace.schema import AttentionKind, LayerTensors, LseBase, Model, Trace

ENGINE = "transformers"
# (engine field, where it lands in the trace; "" = not recorded) for the fields the detectors read:
# the module docstring's table, checked against a recorded step by tests/record/test_transformers_live.py.
TRANSFORMERS_FIELDS: tuple[tuple[str, str], ...] = (
    ("cu_seq_lens_q", "batch.extend_lens"),
    ("cu_seq_lens_k", "batch.kv_lens"),
    ("read_index", "batch.slot_ids"),
    ("write_index", "batch.out_cache_loc"),
    ("position_ids", "batch.positions"),
    ("padded tails", ""),
    ("seq_lens_sum", ""),
)
FULL_ATTENTION = "full_attention"
WRAPPED_ATTENTION = ("sdpa", "paged|eager")
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class CacheGeometry:
    """How transformers' cache indices map to dense slots, for the full-attention allocator."""

    allocator_index: int
    stride: int  # rows between consecutive blocks in the token view
    page_size: int  # tokens per page
    num_slots: int  # dense slots covering the whole view

    def to_slots(self, index: Tensor) -> Tensor:
        index = index.to(torch.int64)
        return torch.div(index, self.stride, rounding_mode="floor") * self.page_size + index % self.stride


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
    return CacheGeometry(allocator_index=int(allocator.index), stride=stride, page_size=page, num_slots=(int(k_view.shape[0]) // stride + 1) * page)


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


def _first(value: Any, index: int) -> Any:
    """batch_data holds per-allocator lists (read/write index) and per-type dicts (cu_seq_lens_k)."""
    if isinstance(value, dict):
        return value.get(FULL_ATTENTION)
    if isinstance(value, (list, tuple)):
        return value[index] if len(value) > index else None
    return value


@dataclass
class _StepState:
    """What one step's hooks collect before it is handed to the writer."""

    step: int
    geometry: CacheGeometry
    layers: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    # A layer's new k/v and KV rows read (from cache.update) until its attention output arrives.
    pending: dict[int, dict[str, Tensor]] = field(default_factory=dict)


_local = threading.local()


def _current_io(io: Any, side: str) -> Any:
    """The IO object this step uses: async batching (CUDA graphs without an attention mask)
    alternates two host/device IO pairs; the host side was prepared with the step's requests, the
    device side holds its graphs and padded sizes. Sync batching has one object for both."""
    pairs = getattr(io, "io_pairs", None)
    return getattr(pairs[io.current_pair], f"{side}_io") if pairs is not None else io


def step_words(runner: Any, step: int) -> str:
    """What the range around one recorded step names, read before the step runs, from the host side
    alone (no device read: the range must not change the engine's timing):
    `engine=transformers step=3 mode=DECODE bs=3 graph=replay graph_bs=8`.

    mode and bs from the requests the batch was prepared for (query length, and the cached length
    before the step); `graph` is what compute_batch is about to do: run eagerly, capture a CUDA graph
    (its warm-up forward runs eagerly first), or replay one, keyed as transformers keys its graphs;
    `graph_bs` the padded query-token count the graph was captured for (= padded requests on the
    decode fast path, one token each). A field that this transformers does not expose reads `?`:
    the range is a label and never stops the recording."""
    words = [f"engine={ENGINE}", f"step={step}"]
    io = runner.inputs_and_outputs
    try:
        requests = list(_current_io(io, "host").requests_in_batch)
        query = [int(r.query_length) for r in requests]
        # prepare_batch_tensors already advanced position_offset by the step's query length
        prefix = [int(r.state.position_offset) - q for r, q in zip(requests, query)]
        words += [f"mode={mode_from_lengths(query, prefix).value}", f"bs={len(requests)}"]
    except Exception:  # noqa: BLE001 - another transformers' request states: say so in the label
        words += ["mode=?", "bs=?"]
    try:
        _, use_graph = runner._get_forward_fn(use_block_table=io.use_block_table)
        if not use_graph:
            words.append("graph=eager")
        else:
            graph_io = _current_io(io, "device")
            captured = graph_io.graphs.get_graph(graph_io._get_graph_key()) is not None
            words += [f"graph={'replay' if captured else 'capture'}", f"graph_bs={int(graph_io.num_q_tokens)}"]
    except Exception:  # noqa: BLE001 - as above
        words.append("graph=?")
    return " ".join(words)


def _on_step(session: RecordingSession, runner: Any, model: Any, batch_data: dict[str, Any], call: Any) -> Any:
    start = time.perf_counter()
    step = session.next_step()
    if not session.wants(step):
        session.stats.hook_seconds += time.perf_counter() - start
        return call()
    state: _StepState | None = None
    with session.guard("transformers compute_batch (before)"):
        state = _StepState(step=step, geometry=cache_geometry(batch_data["cache"]))
    _local.state = state
    words = step_words(runner, step)
    session.stats.hook_seconds += time.perf_counter() - start
    try:
        # One range per recorded step, around all of the step's launches: what `nsys profile
        # attndbg record ...` shows, and what `record --timeline` collects the step's kernels by.
        with profiling.phase("engine", words):
            result = call()
    finally:
        _local.state = None
    if state is None:
        return result
    start = time.perf_counter()
    with session.guard("transformers compute_batch (after)"):
        _submit(session, runner, model, batch_data, state)
    session.stats.hook_seconds += time.perf_counter() - start
    return result


def _submit(session: RecordingSession, runner: Any, model: Any, batch_data: dict[str, Any], state: _StepState) -> None:
    io = _current_io(runner.inputs_and_outputs, "host")
    num_requests = int(getattr(io, "num_request_in_batch", len(io.requests_in_batch)))
    a = state.geometry.allocator_index
    write_size = int(io.true_write_sizes[a]) if hasattr(io, "true_write_sizes") else None
    read_size = int(io.true_read_sizes[a]) if hasattr(io, "true_read_sizes") else None
    read_index = _first(batch_data.get("read_index"), a)
    write_index = _first(batch_data["write_index"], a)
    tensors: dict[str, Tensor | None] = {
        "cu_seq_lens_q": batch_data["cu_seq_lens_q"][: num_requests + 1],
        "cu_seq_lens_k": _first(batch_data["cu_seq_lens_k"], a)[: num_requests + 1],
        "write_index": write_index[:write_size] if write_size is not None else write_index,
        "read_index": None if read_index is None else (read_index[:read_size] if read_size is not None else read_index),
        "position_ids": batch_data["position_ids"].reshape(-1),
    }
    for layer, layer_tensors in state.layers.items():
        tensors.update({f"layer{layer}.{name}": t for name, t in layer_tensors.items()})
    copy = session.snapshot(tensors)
    if copy is None:
        return
    config, dtype = model.config, batch_data["cache"].dtype
    device = batch_data["cu_seq_lens_q"].device
    engine_model = model_from_config(config, dtype, state.geometry.page_size)
    geometry, step = state.geometry, state.step
    backend = str(getattr(config, "_attn_implementation", "?"))

    def build(host: dict[str, Tensor | None]) -> Trace:
        return trace_from_step(host, model=engine_model, geometry=geometry, step=step, backend=backend, device=device, layers=sorted(state.layers))

    session.submit(copy, build)


def trace_from_step(host: dict[str, Tensor | None], *, model: Model, geometry: CacheGeometry, step: int, backend: str, device: torch.device | str, layers: list[int]) -> Trace:
    """One recorded step (host tensors) -> Trace."""
    cu_q = host["cu_seq_lens_q"].to(torch.int64)
    cu_k = host["cu_seq_lens_k"].to(torch.int64)
    extend = cu_q.diff()
    kv = cu_k.diff()
    prefix = kv - extend
    total_tokens = int(cu_q[-1])
    write = geometry.to_slots(host["write_index"][:total_tokens])
    read = host["read_index"]
    rows = []
    for b in range(extend.numel()):
        new = write[int(cu_q[b]) : int(cu_q[b + 1])]
        if read is not None and read.numel():
            rows.append(geometry.to_slots(read[int(cu_k[b]) : int(cu_k[b + 1])]))
        else:  # no request read cached KV this step: each row is just its new tokens
            rows.append(new)
    batch = batch_from_rows(
        forward_mode=mode_from_lengths(extend, prefix),
        prefix_lens=prefix,
        extend_lens=extend,
        rows=rows,
        out_cache_loc=write,
        positions=host["position_ids"][:total_tokens],
        seq_lens_raw=kv,
        kv_cache_size=geometry.num_slots,
    )
    tensors = {}
    for layer in layers:
        q = host[f"layer{layer}.q"]
        read_rows = host.get(f"layer{layer}.read_index")
        tensors[layer] = LayerTensors(
            q=q,
            k_new=host[f"layer{layer}.k_new"],
            v_new=host[f"layer{layer}.v_new"],
            kv_slots=geometry.to_slots(read_rows) if read_rows is not None else torch.zeros(0, dtype=torch.int64),
            k_rows=host[f"layer{layer}.k_rows"],
            v_rows=host[f"layer{layer}.v_rows"],
            output=host[f"layer{layer}.output"],
            lse=None,
            lse_base=LseBase.E,
        )
    return Trace(
        source=source(engine=ENGINE, backend=backend, device=device, step=step),
        model=model,
        batch=batch,
        seed=step,
        tensors=tensors,
    )


def _recording_layer(layer: Any) -> tuple[RecordingSession, _StepState] | None:
    """The session and step state when this layer's tensors are recorded now, else None."""
    state: _StepState | None = getattr(_local, "state", None)
    session = current_session()
    if state is None or session is None or layer is None or not session.wants_layer(int(layer)) or capturing():
        # Under a CUDA-graph capture kernels are recorded, not run: there is nothing real to copy.
        return None
    return session, state


def _update_wrapper(original: Any) -> Any:
    """`PagedAttentionCache.update` that keeps a chosen layer's new k/v and the KV rows it reads,
    taken before this layer writes into the cache."""

    def update(self: Any, key_states: Tensor, value_states: Tensor, layer_idx: int, kwargs: dict[str, Any]) -> Any:
        recording = _recording_layer(layer_idx)
        if recording is not None:
            session, state = recording
            with session.guard("transformers cache.update"):
                k_view, v_view = self.layer_to_allocator[int(layer_idx)]._kv_token_views[int(layer_idx)]
                read_index = _first(kwargs.get("read_index"), state.geometry.allocator_index)
                # [1, H, T, D] -> [T, H, D]
                captured = {"k_new": key_states[0].transpose(0, 1).detach().clone(), "v_new": value_states[0].transpose(0, 1).detach().clone()}
                if read_index is not None and read_index.numel():
                    captured.update(read_index=read_index.detach().clone(), k_rows=k_view.index_select(0, read_index), v_rows=v_view.index_select(0, read_index))
                else:
                    empty = k_view.new_zeros((0, *k_view.shape[1:]))
                    captured.update(k_rows=empty, v_rows=empty.clone())
                state.pending[int(layer_idx)] = captured
        return original(self, key_states, value_states, layer_idx, kwargs)

    update.__attndbg_original__ = original  # type: ignore[attr-defined]
    return update


def _attention_wrapper(original: Any) -> Any:
    """An attention function that records q and the output of chosen layers, completing what
    cache.update kept of the layer (new k/v, KV rows read)."""

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(module, "layer_idx", None)
        recording = _recording_layer(layer)
        if recording is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        session, state = recording
        q = query[0].transpose(0, 1).detach().clone()  # [1, H, T, D] -> [T, H, D]
        result = original(module, query, key, value, attention_mask, *args, **kwargs)
        with session.guard("transformers attention (after)"):
            captured = state.pending.pop(int(layer), None)
            if captured is None:
                raise RuntimeError(f"layer {layer}: the attention ran without PagedAttentionCache.update before it (no KV rows to record)")
            output = result[0] if isinstance(result, tuple) else result
            state.layers[int(layer)] = {"q": q, **captured, "output": output[0].detach().clone()}  # [1, T, H, D] -> [T, H, D]
        return result

    attention.__attndbg_original__ = original  # type: ignore[attr-defined]
    return attention


_INSTALLED = False
_ATTENTION_WRAPPED = False


def _wrap_attention() -> None:
    """Wrap the paged cache's update and re-register the paged attention functions; done at the
    first recorded step, when `transformers.modeling_utils` is surely imported (at install time it
    may be half-imported)."""
    global _ATTENTION_WRAPPED
    if _ATTENTION_WRAPPED:
        return
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import AttentionInterface

    if not hasattr(PagedAttentionCache.update, "__attndbg_original__"):
        PagedAttentionCache.update = _update_wrapper(PagedAttentionCache.update)
    for name in WRAPPED_ATTENTION:
        original = AttentionInterface._global_mapping.get(name)
        if original is not None and not hasattr(original, "__attndbg_original__"):
            AttentionInterface.register(name, _attention_wrapper(original))
    _ATTENTION_WRAPPED = True


def install() -> None:
    """Wrap ModelRunner.compute_batch (once per process); the attention functions follow lazily."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers.generation.continuous_batching import model_runner

    original_compute = model_runner.ModelRunner.compute_batch

    def compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> Any:
        session = current_session()
        if session is None or not session.enabled:
            return original_compute(self, model, batch_data)
        if session.options.layers:
            with session.guard("wrapping transformers attention"):
                _wrap_attention()
        return _on_step(session, self, model, batch_data, lambda: original_compute(self, model, batch_data))

    compute_batch.__attndbg_original__ = original_compute  # type: ignore[attr-defined]
    model_runner.ModelRunner.compute_batch = compute_batch
    _INSTALLED = True


def uninstall() -> None:
    """Restore transformers' own functions (tests, benchmarks)."""
    global _INSTALLED, _ATTENTION_WRAPPED
    from transformers.generation.continuous_batching import model_runner
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import AttentionInterface

    compute = model_runner.ModelRunner.compute_batch
    if hasattr(compute, "__attndbg_original__"):
        model_runner.ModelRunner.compute_batch = compute.__attndbg_original__
    if hasattr(PagedAttentionCache.update, "__attndbg_original__"):
        PagedAttentionCache.update = PagedAttentionCache.update.__attndbg_original__
    for name in WRAPPED_ATTENTION:
        current = AttentionInterface._global_mapping.get(name)
        if current is not None and hasattr(current, "__attndbg_original__"):
            AttentionInterface.register(name, current.__attndbg_original__)
    _INSTALLED = _ATTENTION_WRAPPED = False
