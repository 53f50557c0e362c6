"""Recorder for Hugging Face transformers' continuous batching (`generate_batch`, paged KV cache).

Hooks, all on public extension points of transformers >= 5.20:
- `ModelRunner.compute_batch(model, batch_data)` runs once per forward step, eager or CUDA-graph
  replay, after the batch tensors were prepared. It gives the step: `cu_seq_lens_q`,
  `cu_seq_lens_k["full_attention"]`, `write_index`/`read_index` (one per cache allocator),
  `position_ids`, and the `PagedAttentionCache`.
- with `--layers`, `PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)` sees
  each layer's new k, v and the KV rows it reads before it writes them, and the attention functions
  `"sdpa"` and `"paged|eager"`, re-registered through `AttentionInterface.register`, see q and the
  output, in eager steps. Under a CUDA graph they run only at capture: there they capture in-graph
  probes of q, new k/v and the output (record/probes.py, graphs.py), so a replayed step carries
  those four, read from the graph's staging (not the KV rows: copying every row read each step
  would cost more than the step's attention). In 5.20 the attention function calls `cache.update`
  itself (the cache in its kwargs); in 5.24 the attention module calls it before the attention
  function, which no longer gets the cache: hooking `update` reads both the same way.
- with `--when nan`, a forward hook on the model flags each logits row's finiteness on the device
  (captured into graphs as a probe too);
- `ContinuousBatchingManager._handle_critical_error`, where the generation loop ends on an
  exception (a CUDA error surfaces there, at the step's sync, after compute_batch returned): in
  ring mode it fires the ring.

Each recorded step's metadata is copied before compute_batch runs (on the step's compute stream,
ordered after the inputs' writes): the step is in the flight recorder's ring before any of its
kernels can fault. At each graph replay the inputs' data pointers are compared with the capture's
(record/pointer_audit.py).

Tested with transformers 5.20.2 (CI, the oldest supported) and 5.24.0.

Engine fields the detectors use (`TRANSFORMERS_FIELDS` below, as data):

| engine field | source | trace | read by |
|---|---|---|---|
| cu_seq_lens_q | batch_data, [:num_requests+1] | batch.extend_lens | every detector |
| cu_seq_lens_k["full_attention"] | batch_data, [:num_requests+1] | batch.kv_lens, seq_lens_raw | invariants: seq-lens |
| read_index / write_index | batch_data, per allocator, [:true_read/write_size] | batch.slot_ids / out_cache_loc | replay; fill-value |
| position_ids | batch_data | batch.positions | invariants: positions |
| q, k, v, output (--layers) | the attention function's arguments; graph replays: in-graph probes | tensors | replay, split-merge |
| padded tails (q/kv padding intervals, CUDA graphs) | batch_data past the true sizes | not recorded | fill-value would: transformers' padded rows carry no seq_lens / fill value of their own (they are padded token counts, not padded requests), so there is no graph section to fill |
| seq_lens_sum, plan (indptr, masks, window lists) | none: the engine builds none | not recorded | invariants / tree-mask on SGLang and vLLM only |

How a step's copies become a trace (slot ids, padding cut, indices outside the cache kept as
evidence): `trace.py`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attndbg import profiling
from attndbg.record.pointer_audit import report_moved
from attndbg.record.probes import Phase
from attndbg.record.session import OpenStep, RecordingSession, capturing, current_session
from attndbg.record.transformers.graphs import AUDIT, BOOK, EAGER, GraphStep, audited, compute_stream, current_io, finite_rows, graph_step, hook_logits
from attndbg.record.transformers.trace import ENGINE, CacheGeometry, cache_geometry, model_from_config, per_allocator, trace_from_step
from attndbg.record.triggers import LOGITS_FINITE, from_exception
from attndbg.trace.build import device_name, mode_from_lengths
from attndbg.trace.schema import Model, Trace

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
WRAPPED_ATTENTION = ("sdpa", "paged|eager")
PER_TOKEN = ("q", "k_new", "v_new", "output")  # cut to the step's real tokens (graph padding past them)
PER_READ = ("read_index", "k_rows", "v_rows")  # cut to the step's real KV reads


@dataclass
class _StepState:
    """What one step's hooks collect before it is handed to the writer."""

    step: int
    geometry: CacheGeometry
    graph: GraphStep = EAGER
    tokens: int | None = None  # the step's real query tokens (host), None: not known
    reads: int | None = None  # its real KV reads (host)
    writes: int | None = None  # its real KV writes (host)
    requests: int | None = None
    probing: bool = False  # the step sizes or captures in-graph probes, or reads them
    layers: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    # A layer's new k/v and KV rows read (from cache.update) until its attention output arrives.
    pending: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    extra: dict[str, Tensor] = field(default_factory=dict)  # the logits' finiteness flag

    def cut(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-token tensors to the real tokens, KV reads to the real reads, flags to the requests."""
        limits = (self.tokens, self.reads, self.requests, None)
        out = {}
        for name, t in tensors.items():
            limit = limits[_cut_by(name)]
            out[name] = t[:limit] if limit is not None and t.dim() else t
        return out


@functools.cache
def _cut_by(name: str) -> int:
    """Which of _StepState.cut's limits a recorded tensor's name is cut by (0 tokens, 1 reads,
    2 requests, 3 none): asked once per name, not at every step."""
    leaf = name.rsplit(".", 1)[-1]
    return 0 if leaf in PER_TOKEN else 1 if leaf in PER_READ else 2 if name == LOGITS_FINITE else 3


_local = threading.local()


def step_words(runner: Any, step: int, graph: GraphStep | None = None) -> str:
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
        requests = list(current_io(io, "host").requests_in_batch)
        query = [int(r.query_length) for r in requests]
        # prepare_batch_tensors already advanced position_offset by the step's query length
        prefix = [int(r.state.position_offset) - q for r, q in zip(requests, query)]
        words += [f"mode={mode_from_lengths(query, prefix).value}", f"bs={len(requests)}"]
    except Exception:  # noqa: BLE001 - another transformers' request states: say so in the label
        words += ["mode=?", "bs=?"]
    try:
        graph = graph_step(runner) if graph is None else graph
        words += ["graph=eager"] if graph.phase == Phase.EAGER else [f"graph={graph.phase}", f"graph_bs={graph.padded_tokens}"]
    except Exception:  # noqa: BLE001 - as above
        words.append("graph=?")
    return " ".join(words)


def _on_step(session: RecordingSession, runner: Any, model: Any, batch_data: dict[str, Any], call: Any) -> Any:
    start = time.perf_counter()
    step = session.next_step()
    wanted = session.wants(step)
    graph = EAGER
    read: GraphStep | None = None  # what the label says: None (it reads `?`) when this transformers hides it
    with session.guard("transformers graph audit"):
        graph = read = graph_step(runner)
        if graph.phase == Phase.REPLAY:  # a moved input of the graph about to replay: said once, fires the ring
            # batch_data itself, not audited(batch_data): the replay follows only the routes found
            # at capture, which never enter what audited() leaves out (one dict less a step)
            report_moved(session, AUDIT.replayed(graph.key, batch_data), step=step, what="transformers batch_data")
    # Probes are captured into every graph, recorded step or not (`--steps` may leave out the
    # warm-up that captures them), and every replay of a probed graph is counted (probes.py).
    probing = graph.key is not None and _probes_wanted(session)
    state: _StepState | None = None
    handle: OpenStep | None = None
    stream = None
    if wanted or (probing and graph.phase == Phase.CAPTURE):
        with session.guard("transformers compute_batch (before)"):
            stream = compute_stream(runner)
            state = _state(session, runner, step, graph, batch_data, probing=probing)
            if wanted:
                if probing and graph.phase == Phase.REPLAY:
                    BOOK.before_replay(graph.key)  # the last moment this graph's previous values exist
                handle = _open(session, model, batch_data, state, stream)
    _local.state = state
    if state is not None and state.probing:
        BOOK.begin(graph.key, graph.phase)
    session.stats.hook_seconds += time.perf_counter() - start
    try:
        if handle is None or not profiling.labels_read():
            # No range where nobody reads it: without a timeline's observer or an NVTX tool
            # injected, NVTX ranges are no-ops, yet opening one costs the engine's thread a few
            # microseconds a step.
            result = call()
        else:
            # One range per recorded step, around all of the step's launches: what `nsys profile
            # attndbg record ...` shows, and what `record --timeline` collects the step's kernels by.
            # Worded in full (the words cost the engine's thread tens of microseconds a step).
            with profiling.phase("engine", step_words(runner, step, read)):
                result = call()
    except Exception as e:
        if handle is not None:
            with session.guard("transformers compute_batch (failed)"):
                session.fail_step(handle, e, "transformers compute_batch")
        raise
    finally:
        _local.state = None
        if state is not None and state.probing:
            BOOK.end()
    start = time.perf_counter()
    with session.guard("transformers compute_batch (after)"):
        if graph.phase == Phase.CAPTURE:
            AUDIT.captured(graph.key, audited(batch_data))
            for why in BOOK.skipped(graph.key):
                session.note_once(f"in-graph probe not captured: {why}")
        if state is not None and handle is not None:
            _close(session, state, handle, stream)
        elif probing and graph.phase == Phase.REPLAY:
            BOOK.replayed(graph.key, read=False)
    session.stats.hook_seconds += time.perf_counter() - start
    return result


def _probes_wanted(session: RecordingSession) -> bool:
    flight = session.flight
    return bool(session.options.layers) or (flight is not None and flight.when.nan)


def _state(session: RecordingSession, runner: Any, step: int, graph: GraphStep, batch_data: dict[str, Any], *, probing: bool) -> _StepState:
    """The step's sizes, read from its host IO once (`_open` cuts the metadata by them)."""
    geometry = _cache_geometry(batch_data["cache"])
    io = current_io(runner.inputs_and_outputs, "host")
    a = geometry.allocator_index
    requests = getattr(io, "num_request_in_batch", None)
    tokens = getattr(io, "total_seqlen_q", None)
    reads = getattr(io, "true_read_sizes", None)
    writes = getattr(io, "true_write_sizes", None)
    return _StepState(
        step=step,
        geometry=geometry,
        graph=graph,
        tokens=int(tokens) if isinstance(tokens, int) else None,
        reads=int(reads[a]) if reads is not None else None,
        writes=int(writes[a]) if writes is not None else None,
        requests=int(requests) if requests is not None else len(io.requests_in_batch),
        probing=probing,
    )


def _open(session: RecordingSession, model: Any, batch_data: dict[str, Any], state: _StepState, stream: torch.cuda.Stream | None) -> OpenStep | None:
    """Copy the step's metadata before the call, on the step's compute stream (made to wait for
    the stream that wrote the inputs), and hand the step over."""
    a = state.geometry.allocator_index
    write_size = state.writes
    read_index = per_allocator(batch_data.get("read_index"), a)
    write_index = per_allocator(batch_data["write_index"], a)
    metadata: dict[str, Tensor | None] = {
        "cu_seq_lens_q": batch_data["cu_seq_lens_q"][: state.requests + 1],
        "cu_seq_lens_k": per_allocator(batch_data["cu_seq_lens_k"], a)[: state.requests + 1],
        "write_index": write_index[:write_size] if write_size is not None else write_index,
        "read_index": None if read_index is None else (read_index[: state.reads] if state.reads is not None else read_index),
        "position_ids": batch_data["position_ids"].reshape(-1),
    }
    current = None
    if stream is not None:
        current = torch.cuda.current_stream()  # looked up once: the copies switch to `stream` and back
        stream.wait_stream(current)
    copy = session.snapshot(metadata, stream=stream, current=current)
    if copy is None:
        return None
    device = batch_data["cu_seq_lens_q"].device
    device_name(device)  # asked now (cached per device): a trace may be built after a CUDA error
    engine_model, backend = _engine_model(batch_data["cache"], model.config, state.geometry.page_size)
    geometry, step = state.geometry, state.step

    def build(host: dict[str, Tensor | None]) -> Trace:
        return trace_from_step(host, model=engine_model, geometry=geometry, step=step, backend=backend, device=device)

    return session.open_step(step, copy, build)


_GEOMETRY_CACHE: list[tuple[weakref.ref[Any], CacheGeometry]] = []  # the last (cache, its geometry)


def _cache_geometry(cache: Any) -> CacheGeometry:
    """cache_geometry, read once per cache (its allocators are fixed for its life) rather than every
    step; held by a weak reference, so a finished generation's cache is not kept alive."""
    for ref, geometry in _GEOMETRY_CACHE:
        if ref() is cache:
            return geometry
    geometry = cache_geometry(cache)
    try:
        _GEOMETRY_CACHE[:] = [(weakref.ref(cache), geometry)]
    except TypeError:  # a cache that takes no weak reference: read every step, as before
        pass
    return geometry


_MODEL_CACHE: list[tuple[weakref.ref[Any], Any, Model, str]] = []  # the last (cache, config, model, backend)


def _engine_model(cache: Any, config: Any, page_size: int) -> tuple[Model, str]:
    """model_from_config (the cache's dtype, its page size) and the attention implementation the
    config names, read once per generation (its cache) rather than every step: transformers' config
    attribute reads cost the engine's thread microseconds each, and an implementation changes only
    between generations (`set_attn_implementation`). A config that raises is asked again each
    step, as before."""
    for ref, cached_config, model, backend in _MODEL_CACHE:
        if ref() is cache and cached_config is config:
            return model, backend
    model = model_from_config(config, cache.dtype, page_size)
    backend = str(getattr(config, "_attn_implementation", "?"))
    with contextlib.suppress(TypeError):  # a cache that takes no weak reference: read every step
        _MODEL_CACHE[:] = [(weakref.ref(cache), config, model, backend)]
    return model, backend


def _close(session: RecordingSession, state: _StepState, handle: OpenStep, stream: torch.cuda.Stream | None) -> None:
    """The call returned: the eager layers' tensors (or a replay's probe reading) join the step."""
    tensors = {f"layer{layer}.{name}": t for layer, layer_tensors in state.layers.items() for name, t in layer_tensors.items()}
    tensors.update(state.extra)
    if tensors:
        handle.copy.add(state.cut(tensors), stream=stream)
    done = None
    if state.probing and state.graph.phase == Phase.REPLAY:
        reading = BOOK.replayed(state.graph.key, stream=stream, shape=state.cut)
        if reading is not None:
            handle.copy.add_reading(reading)
            # Recorded on `stream` after all the step queued (its copies above included): the
            # ring's mark of the step's end too, one event a step rather than two.
            done = reading.done
    session.close_step(handle, stream=stream, done=done)


def _layer_state(layer: Any) -> tuple[RecordingSession, _StepState] | None:
    """The session and step state when this layer's tensors are recorded (or probed) now, else None."""
    state: _StepState | None = getattr(_local, "state", None)
    session = current_session()
    if state is None or session is None or layer is None or not session.wants_layer(int(layer)):
        return None
    return session, state


def _on_logits(logits: Tensor) -> None:
    """`--when nan`: each logits row's finiteness, flagged on the device (a probe under a graph)."""
    state: _StepState | None = getattr(_local, "state", None)
    if state is None:
        return
    flag = finite_rows(logits)
    if state.probing:
        BOOK.probe(LOGITS_FINITE, flag)
    if not capturing():
        state.extra[LOGITS_FINITE] = flag


def _update_wrapper(original: Any) -> Any:
    """`PagedAttentionCache.update` that keeps a chosen layer's new k/v and the KV rows it reads,
    taken before this layer writes into the cache; inside a capture, probes of the new k/v."""

    def update(self: Any, key_states: Tensor, value_states: Tensor, layer_idx: int, kwargs: dict[str, Any]) -> Any:
        recording = _layer_state(layer_idx)
        if recording is not None:
            session, state = recording
            with session.guard("transformers cache.update"):
                # [1, H, T, D] -> [T, H, D]
                k_new, v_new = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
                if state.probing:
                    BOOK.probe(f"layer{layer_idx}.k_new", k_new)
                    BOOK.probe(f"layer{layer_idx}.v_new", v_new)
                if not capturing():  # under a capture kernels are recorded, not run: nothing real to copy
                    k_view, v_view = self.layer_to_allocator[int(layer_idx)]._kv_token_views[int(layer_idx)]
                    read_index = per_allocator(kwargs.get("read_index"), state.geometry.allocator_index)
                    captured = {"k_new": k_new.detach().clone(), "v_new": v_new.detach().clone()}
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
    cache.update kept of the layer (new k/v, KV rows read); inside a capture, probes of both."""

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(module, "layer_idx", None)
        recording = _layer_state(layer)
        if recording is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        session, state = recording
        q = query[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]
        if state.probing:
            with session.guard("transformers attention probe (before)"):
                BOOK.probe(f"layer{layer}.q", q)
        kept = None if capturing() else q.detach().clone()
        result = original(module, query, key, value, attention_mask, *args, **kwargs)
        output = (result[0] if isinstance(result, tuple) else result)[0]  # [1, T, H, D] -> [T, H, D]
        if state.probing:
            with session.guard("transformers attention probe (after)"):
                BOOK.probe(f"layer{layer}.output", output)
        if kept is not None:
            with session.guard("transformers attention (after)"):
                captured = state.pending.pop(int(layer), None)
                if captured is None:
                    raise RuntimeError(f"layer {layer}: the attention ran without PagedAttentionCache.update before it (no KV rows to record)")
                state.layers[int(layer)] = {"q": kept, **captured, "output": output.detach().clone()}
        return result

    attention.__attndbg_original__ = original  # type: ignore[attr-defined]
    return attention


def _critical_error_wrapper(original: Any) -> Any:
    """`ContinuousBatchingManager._handle_critical_error`: the generation loop ends on an exception
    (a CUDA error surfaces there, at the step's sync): in ring mode, the ring is written."""

    def _handle_critical_error(self: Any, error: Exception, *args: Any, **kwargs: Any) -> Any:
        session = current_session()
        if session is not None and session.flight is not None:
            with session.guard("transformers critical error"):
                session.flight.fire(from_exception(error, session.flight.in_flight_step(), "transformers' generation loop"))
        return original(self, error, *args, **kwargs)

    _handle_critical_error.__attndbg_original__ = original  # type: ignore[attr-defined]
    return _handle_critical_error


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
        if session.flight is not None and session.flight.when.nan:
            with session.guard("hooking transformers logits"):
                hook_logits(model, _on_logits)
        return _on_step(session, self, model, batch_data, lambda: original_compute(self, model, batch_data))

    compute_batch.__attndbg_original__ = original_compute  # type: ignore[attr-defined]
    model_runner.ModelRunner.compute_batch = compute_batch
    manager = _manager_class()
    if manager is not None and hasattr(manager, "_handle_critical_error") and not hasattr(manager._handle_critical_error, "__attndbg_original__"):
        manager._handle_critical_error = _critical_error_wrapper(manager._handle_critical_error)
    _INSTALLED = True


def _manager_class() -> Any:
    """transformers' ContinuousBatchingManager, when this version has it where 5.20-5.24 do."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return None
    return ContinuousBatchingManager


def uninstall() -> None:
    """Restore transformers' own functions (tests, benchmarks)."""
    global _INSTALLED, _ATTENTION_WRAPPED
    from transformers.generation.continuous_batching import model_runner
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.modeling_utils import AttentionInterface

    compute = model_runner.ModelRunner.compute_batch
    if hasattr(compute, "__attndbg_original__"):
        model_runner.ModelRunner.compute_batch = compute.__attndbg_original__
    manager = _manager_class()
    handler = getattr(manager, "_handle_critical_error", None)
    if handler is not None and hasattr(handler, "__attndbg_original__"):
        manager._handle_critical_error = handler.__attndbg_original__
    if hasattr(PagedAttentionCache.update, "__attndbg_original__"):
        PagedAttentionCache.update = PagedAttentionCache.update.__attndbg_original__
    for name in WRAPPED_ATTENTION:
        current = AttentionInterface._global_mapping.get(name)
        if current is not None and hasattr(current, "__attndbg_original__"):
            AttentionInterface.register(name, current.__attndbg_original__)
    _INSTALLED = _ATTENTION_WRAPPED = False
