"""vLLM (v1 engine) recorder: wraps the attention metadata builders' `build()`.

Entry points: vLLM calls `register()` in every process through the `vllm.general_plugins`
entry point (pyproject.toml); `attndbg.record.bootstrap` calls `install()` once
`vllm.v1.worker.gpu_model_runner` is imported. Both do nothing without a recording session
(ATTNDBG_RECORD) and are idempotent.

Why `build()` (engines.md B6): every runner (V1 and V2) turns each step's
`CommonAttentionMetadata` into per-backend metadata there, outside any CUDA graph, for target and
draft models alike; it sees both the engine-neutral batch and what the backend built.

Which classes: every `AttentionMetadataBuilder` subclass, now and defined later (backends are
imported lazily, when a model picks them), placed by the shared toolkit (`record/hooks.py`).
Patching the base class's `build` alone would not do: it is abstract and every subclass overrides it.

Per call (the outermost wrapped call on this thread; nested ones, such as `super().build()` or a
capture that calls `build`, pass straight through):
- `build_for_cudagraph_capture` is not a step: it is counted as skipped and not recorded;
- `build` and `build_for_drafting` take a step number, and when sampled, start asynchronous host
  copies of the common metadata and of the built metadata's tensors (`session.snapshot`), then
  hand the copies to the writer thread, which builds and writes the Trace: the engine-neutral
  batch, and as evidence the `CommonAttentionMetadata` verbatim (`plan.tensors["common.*"]`, the
  fields and their trimming in `fields`) beside the builder's output under its own names.
  Wrong values never stop recording (the converter records them; the detectors judge them);
- anything that raises inside the hook disables recording with one log line (`session.guard`);
  the engine's metadata is returned unchanged either way.

With `--layers`, `install()` also wraps `AttentionImpl.forward` on every impl class (the same way:
existing subclasses now, later ones through `__init_subclass__`), and a recorded step is held
until its layers ran instead of being submitted at once: see `tensors` for when it is
written and what is copied. Each outermost build call first submits the step its builder built
last. Without `--layers` nothing is held and `forward` is not wrapped.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record.vllm import model as vllm_model
from attndbg.record.vllm import tensors as vllm_tensors
from attndbg.record import hooks
from attndbg.trace.build import source
from attndbg.record.session import RecordingSession, current_session
from attndbg.record.vllm.convert import Speculation, convert_common, host_from_parts, parents_from_tree_bias
from attndbg.record.vllm.fields import COMMON_PREFIX, common_parts
from attndbg.record.vllm.plan import Scalar, plan_from_parts, plan_parts
from attndbg.trace.schema import CaptureSizes, LayerTensors, LseBase, Model, Trace

METHODS = ("build", "build_for_cudagraph_capture", "build_for_drafting")
CAPTURE = "build_for_cudagraph_capture"
# Where the base class lives: vLLM 0.33 (`backend.py`), then older v1 releases (`backends/utils.py`).
BASE_MODULES = ("vllm.v1.attention.backend", "vllm.v1.attention.backends.utils")

_local = threading.local()
_install_lock = threading.Lock()
_atexit_registered = False


@dataclass(frozen=True)
class _Static:
    """What the writer thread needs besides the host copies (read in the hook, no tensors)."""

    model: Model
    backend: str
    device: torch.device
    tp_rank: int
    kv_cache_size: int | None
    speculation: Speculation | None
    scalars: dict[str, Scalar]
    capture: CaptureSizes | None = None


def base_class() -> type:
    """vLLM's `AttentionMetadataBuilder` (ImportError naming the modules tried when absent)."""
    import importlib

    for name in BASE_MODULES:
        try:
            return importlib.import_module(name).AttentionMetadataBuilder
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"no AttentionMetadataBuilder in {', '.join(BASE_MODULES)}: is vLLM (v1) installed?")


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM calls it with no arguments in every process)."""
    install()


def install() -> None:
    """Wrap the builders' build methods, now and for subclasses defined later; with `--layers`,
    the impls' `forward` too. Idempotent."""
    global _atexit_registered
    session = current_session()
    if session is None:
        return
    base = base_class()
    with _install_lock:
        hooks.on_subclass(base, wrap_class)
        for cls in [base, *hooks.subclasses(base)]:
            wrap_class(cls)
        if session.options.layers:
            impl_base = vllm_tensors.impl_base_class()
            hooks.on_subclass(impl_base, wrap_impl_class)
            for cls in [impl_base, *hooks.subclasses(impl_base)]:
                wrap_impl_class(cls)
            if not _atexit_registered:
                # Registered after the session's own close (atexit runs last-in first-out), so
                # the held steps reach the writer before it shuts down.
                atexit.register(vllm_tensors.finish)
                _atexit_registered = True


def wrap_class(cls: type) -> None:
    """Wrap the build methods `cls` defines itself (inherited ones are wrapped where defined)."""
    for name in METHODS:
        hooks.patch(cls, name, functools.partial(_wrap, kind=name))


def wrap_impl_class(cls: type) -> None:
    """Wrap the `forward` an AttentionImpl class defines itself (not the abstract one)."""
    hooks.patch(cls, "forward", vllm_tensors.wrap_forward)


def _wrap(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "active", False):
            return fn(self, *args, **kwargs)
        # This builder builds again: the step it built last has run its layers (vllm_tensors).
        vllm_tensors.release(self)
        _local.active = True
        try:
            result = fn(self, *args, **kwargs)
        finally:
            _local.active = False
        session = current_session()
        if session is not None and session.enabled:
            with session.guard(f"vLLM {type(self).__name__}.{kind}"):
                _record(session, self, kind, args, kwargs, result)
        return result

    return wrapper


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _record(session: RecordingSession, builder: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], metadata: Any) -> None:
    if kind == CAPTURE:
        session.stats.skipped_in_capture += 1  # capture runs dummy batches, not a step
        return
    step = session.next_step()
    if not session.wants(step):
        return
    if kind == "build":
        cm = _arg(args, kwargs, "common_attn_metadata", 1)
        call_scalars: dict[str, Scalar] = {"fast_build": bool(_arg(args, kwargs, "fast_build", 2, False))}
    else:
        cm = _arg(args, kwargs, "common_attn_metadata", 0)
        call_scalars = {"draft_index": int(_arg(args, kwargs, "draft_index", 1, 0))}
    block_size = int(builder.kv_cache_spec.block_size)
    plan_tensors, plan_scalars = plan_parts(metadata, block_size=block_size, max_seq_len=int(cm.max_seq_len))
    common_tensors, common_scalars = common_parts(cm, block_size)
    pool = vllm_model.kv_cache_size(builder)
    static = _Static(
        model=vllm_model.model_from_builder(builder),
        backend=vllm_model.backend_name(type(builder)),
        device=torch.device(getattr(builder, "device", "cpu")),
        tp_rank=vllm_model.tp_rank(),
        kv_cache_size=pool,
        speculation=vllm_model.speculation(builder),
        capture=vllm_model.capture_sizes(builder, cm.block_table_tensor),
        scalars={
            **plan_scalars,
            **{COMMON_PREFIX + k: v for k, v in common_scalars.items()},
            "vllm.call": kind,
            "vllm.builder": type(builder).__name__,
            "vllm.metadata": type(metadata).__name__,
            "vllm.num_reqs": int(cm.num_reqs),
            "vllm.num_actual_tokens": int(cm.num_actual_tokens),
            "vllm.max_query_len": int(cm.max_query_len),
            "vllm.max_seq_len": int(cm.max_seq_len),
            **({"vllm.num_gpu_blocks": pool // block_size} if pool else {}),
            **({"vllm.adaptive_verification": True} if vllm_model.adaptive_verification(builder) else {}),
            **{f"vllm.{k}": v for k, v in call_scalars.items()},
        },
    )
    # The engine's CommonAttentionMetadata, verbatim (fields), and what the builder built.
    tensors: dict[str, Tensor | None] = {f"cm.{k}": v for k, v in common_tensors.items()}
    tensors.update({f"plan.{k}": v for k, v in plan_tensors.items()})
    copy = session.snapshot(tensors)
    if copy is None:
        return
    build = functools.partial(trace_from_host, static=static, step=step)
    if session.options.layers:
        table = tensors["cm.block_table_tensor"]
        assert table is not None
        vllm_tensors.hold(session, builder, metadata, copy, build, tokens=int(cm.num_actual_tokens), block_size=block_size, block_table=table, step=step)
    else:
        session.submit(copy, build, step=step)


def trace_from_host(
    host: dict[str, Tensor | None],
    *,
    static: _Static,
    step: int,
    layers: tuple[int, ...] = (),
    lse_bases: dict[int, LseBase] | None = None,
) -> Trace:
    """Writer thread: host copies of one step (and of its recorded layers) -> Trace (validated
    when written)."""
    common_host = {k.removeprefix("cm."): v for k, v in host.items() if k.startswith("cm.")}
    common = host_from_parts(common_host)
    plan = plan_from_parts(
        static.backend,
        {
            **{k.removeprefix("plan."): v for k, v in host.items() if k.startswith("plan.")},
            **{COMMON_PREFIX + k: v for k, v in common_host.items()},
        },
        static.scalars,
    )
    bias = plan.tensors.get("tree_attn_bias")
    tree = parents_from_tree_bias(bias) if bias is not None and bias.dim() == 2 and bias.shape[0] > 1 else None
    converted = convert_common(
        common,
        block_size=static.model.page_size,
        kv_cache_size=static.kv_cache_size,
        speculation=static.speculation,
        tree_parents=tree,
    )
    if layers and not vllm_tensors.table_holds(converted.batch, common.block_table_tensor, static.model.page_size):
        # The engine's table points outside its pool or at the null block (the invariants
        # detector names the entry): no recorded row holds that KV, so the step is metadata only.
        note = {"vllm.layers_dropped": "the batch reads blocks the engine's block table does not hold"}
        plan = dataclasses.replace(plan, scalars={**plan.scalars, **note})
        layers = ()
    tensors: dict[int, LayerTensors] = {
        layer: vllm_tensors.layer_tensors(
            host,
            layer,
            batch=converted.batch,
            block_table=common.block_table_tensor,
            block_size=static.model.page_size,
            lse_base=(lse_bases or {}).get(layer, LseBase.E),
        )
        for layer in layers
    }
    return Trace(
        source=source(engine="vllm", backend=static.backend, device=static.device, step=step, tp_rank=static.tp_rank),
        model=static.model,
        batch=converted.batch,
        seed=step,
        spec=converted.spec,
        graph=converted.graph,
        plan=plan,
        tensors=tensors,
        capture=static.capture if static.capture is not None and static.capture.known() else None,
    )
