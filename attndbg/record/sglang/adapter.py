"""SGLang recorder: hooks on the attention backend (and graph runner) that write one trace per step.

Hook points (engines.md A6), each found by feature, not by SGLang version:
- `init_forward_metadata(fb)` on every AttentionBackend subclass: eager steps (both APIs);
- SGL-new `init_forward_metadata_out_graph(view, in_capture)`: graph replays, where `view` is the
  runner's SimpleNamespace with `num_padding`; `in_capture=True` (startup capture) is skipped;
- SGL-classic `CudaGraphRunner.replay_prepare(fb)`: graph replays; after it returns, the runner's
  static buffers are padded and `bs`/`raw_bs` are set, and the backend's
  `init_forward_metadata_replay_cuda_graph` has refilled its graph buffers;
- `RadixAttention.__init__`: remembers the layers, whose shape and numerics the Model records;
- SGL-new `build_replay_fb_view`: attaches the padded out_cache_loc buffer to the view;
- `build_inner_fb_view`: a multi-step draft backend's per-step view of the EAGLE draft graph
  runner's replay view (which has `num_padding`) keeps no padding; the hook carries it over
  (`DRAFT_PADDING`), so each draft step's sub-backend replay (`init_forward_metadata_out_graph`)
  is recorded as its bs x topk branch rows (draft.py);
- `TritonMultiStepDraftBackend.init_forward_metadata_out_graph`: Triton's replay calls no
  sub-backend (its steps read their rows of the multi-step graph buffers), so each step is
  recorded from its sub-backend's graph buffers once the call returned;
- `EAGLEDraftExtendCudaGraphRunner.execute` and the multi-layer draft-extend runners' per-step
  `MultiLayerEagleDraftExtendCudaGraphRunner.replay`: the view each hands its backend at a
  DRAFT_EXTEND_V2 replay is its own, without `num_padding`; the runner and the real batch size are
  kept on the thread, so the backend's `init_forward_metadata_out_graph` hook records the replay
  (each layer's step of a multi-layer draft, by its own backend) with the runner's padded buffers
  as its graph section;
- the flight recorder's pointer audit at graph capture and replay, and the EAGLE workers' `verify`
  for `--when 'accept<X'` (`flight.py`);
- with `--layers`: `forward(q, k, v, layer, forward_batch, ...)` on every AttentionBackend subclass
  that defines it (per-layer tensors of eager steps, `layers`), and `ModelRunner.forward`,
  at whose end a step with layers is submitted.

Every hook runs the engine's own code first and unchanged, then records inside `session.guard`
(a failure logs once and stops recording; the engine's result is returned regardless). Hooks only
take device views and start async host copies (`session.snapshot`); the Trace is built on the
writer thread. Pools: classic ForwardBatch carries `req_to_token_pool`; SGL-new removed it, so it
comes from the published forward context or the backend (every backend keeps its pools).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from attndbg.record.sglang import flight as sglang_flight
from attndbg.record.sglang import layers as sglang_layers
from attndbg.record import hooks
from attndbg.trace.build import package_version, source
from attndbg.record.session import RecordingSession, capturing, current_session
from attndbg.record.sglang.batch import BatchInfo, UnsupportedStep, batch_from_host, capture_batch, engine_mode_name, trace_mode
from attndbg.record.sglang.draft import DraftDecode, DraftStepUnknown, branch_graph, draft_decode, draft_topk
from attndbg.record.sglang.graph import PADDED_OUT_CACHE_LOC, STATIC_SIZES, GraphInfo, capture_graph_from_runner, capture_graph_from_view, graph_from_host
from attndbg.record.sglang.model import kv_cache_size, model_from_backend
from attndbg.record.sglang.plan import PlanCapture, capture_plan, cut_on_device, is_verify_mask, plan_from_host
from attndbg.record.sglang.spec import SpecInfo, algorithm_name, capture_spec, spec_from_host
from attndbg.trace.mask_geometry import mask_length
from attndbg.trace.schema import AttentionKind, EngineBuffer, ForwardMode, MaskLayout, Model, Source, Trace

BACKEND_NAMES = {  # class name -> the trace's backend name (fill-value rules and replay use these)
    "TritonAttnBackend": "triton",
    "FlashInferAttnBackend": "flashinfer",
    "FlashAttentionBackend": "fa3",
    "FlashMLABackend": "flashmla",
    "FlashInferMLAAttnBackend": "flashinfer_mla",
    "TRTLLMMLABackend": "trtllm_mla",  # a FlashInferMLAAttnBackend subclass: first in its MRO
}

_installed = False
_layers: list[weakref.ref] = []  # RadixAttention layers in construction order
_local = threading.local()  # .depth: nesting of instrumented backend calls on this thread


# -- what one recorded step holds until the writer builds it ------------------------------------


@dataclass(frozen=True)
class _Step:
    source: Source
    model: Model
    kv_cache_size: int
    batch: BatchInfo
    spec: SpecInfo | None
    plan: PlanCapture | None
    graph: GraphInfo | None

    def build(self, host: dict[str, Tensor | None]) -> Trace:
        def part(prefix: str) -> dict[str, Tensor | None]:
            return {k[len(prefix) :]: v for k, v in host.items() if k.startswith(prefix)}

        batch = batch_from_host(self.batch, part("batch."), kv_cache_size=self.kv_cache_size)
        buffers: dict[str, EngineBuffer] = {}
        spec = plan = None
        if self.spec is not None:
            spec, mask_buffer = spec_from_host(self.spec, part("spec."), batch.prefix_lens)
            if mask_buffer is not None:
                buffers["spec.custom_mask"] = mask_buffer
        if self.plan is not None:
            plan, plan_buffers = plan_from_host(self.plan, part("plan."))
            buffers.update(plan_buffers)
        return Trace(
            source=self.source,
            model=self.model,
            batch=batch,
            seed=self.source.step,
            spec=spec,
            graph=graph_from_host(self.graph, part("graph.")) if self.graph is not None else None,
            plan=plan,
            buffers=buffers,
            capture=self.graph.capture if self.graph is not None else None,
        )


def backend_name(backend: Any, mode: ForwardMode) -> str:
    """SGL-new stamps the resolved names on the backend; else the class (or a parent) names it."""
    stamped = getattr(backend, "decode_attention_backend_str" if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) else "prefill_attention_backend_str", None)
    if isinstance(stamped, str) and stamped:
        return {"flashattention": "fa3"}.get(stamped, stamped)
    for cls in type(backend).__mro__:
        if cls.__name__ in BACKEND_NAMES:
            return BACKEND_NAMES[cls.__name__]
    return type(backend).__name__


def req_to_token_of(backend: Any, fb: Any) -> Tensor:
    pool = getattr(fb, "req_to_token_pool", None)  # SGL-classic ForwardBatch
    if pool is None:
        with contextlib.suppress(ImportError, AssertionError):
            from sglang.srt.model_executor import forward_context

            if forward_context.has_forward_context():
                pool = forward_context.get_req_to_token_pool()
    if pool is None:
        pool = getattr(backend, "req_to_token_pool", None)
    if pool is not None:
        return pool.req_to_token
    table = getattr(backend, "req_to_token", None)
    if table is None:
        raise ValueError(f"{type(backend).__name__} exposes no req_to_token pool and no forward context is active")
    return table


def layer_for(backend: Any) -> Any:
    """A RadixAttention layer of the backend's model: the latest one with its head count."""
    live = [layer for layer in (ref() for ref in _layers) if layer is not None]
    heads = getattr(backend, "num_head", None)
    for layer in reversed(live):
        if heads is None or layer.tp_q_head_num == heads:
            return layer
    raise ValueError("no RadixAttention layer was constructed after attndbg installed its hooks; the model's shape is unknown")


def _tp_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


@functools.lru_cache(maxsize=1)
def _sglang_version() -> str:
    return package_version("sglang")


def record_step(session: RecordingSession, backend: Any, fb: Any, *, raw_bs: int | None = None, graph: tuple[GraphInfo, dict[str, Tensor]] | None = None) -> bool:
    """Snapshot one step and queue it for the writer; False when the step is not recorded.

    With `--layers`, an eager step is not queued here but held until its layers ran
    (`layers`); a step still held from an earlier forward is queued first."""
    sglang_layers.flush()
    step = session.next_step()
    if not session.wants(step):
        return False
    if capturing():
        session.stats.skipped_in_capture += 1
        return False
    try:
        mode = trace_mode(fb)
    except UnsupportedStep:
        return False  # IDLE and friends: nothing for attention to get wrong
    draft = None
    if mode is ForwardMode.DECODE:
        try:
            # A replay view's batch_size is the padded one, as its out_cache_loc (the runner's buffer) is.
            draft = draft_decode(fb, backend, int(fb.batch_size))
        except DraftStepUnknown:
            return False  # its branch rows cannot be told: nothing recorded rather than a wrong batch
    # FlashInfer's graph wrappers are looked up by the padded request count; Triton's buffers hold
    # a row per branch of a draft step.
    graph_bs = graph[0].capture_bs if graph else None
    if graph is not None and draft is not None:
        graph = branch_graph(graph[0], graph[1], draft)
    req_to_token = req_to_token_of(backend, fb)
    binfo, btensors = capture_batch(fb, req_to_token, raw_bs=raw_bs, draft=draft)
    tensors: dict[str, Tensor | None] = {f"batch.{k}": v for k, v in btensors.items()}
    sinfo = None
    spec_info = getattr(fb, "spec_info", None)
    if mode is ForwardMode.TARGET_VERIFY:
        layout = _mask_mode(backend)
        capacity = is_verify_mask(backend, spec_info.custom_mask)
        sinfo, stensors = capture_spec(
            spec_info, batch_size=binfo.batch_size, prefix_sum=_host_prefix_sum(fb, binfo.batch_size), algorithm=algorithm_name(fb), layout=layout, capacity=capacity
        )
        tensors.update({f"spec.{k}": v for k, v in stensors.items()})
    verify = mode is ForwardMode.TARGET_VERIFY
    sized = _sized_for_step(fb, mode) and graph is None
    model = model_from_backend(backend, layer_for(backend))
    # The seq_lens a FlashMLA forward hands its kernel as cache_seqlens: a graph's padded buffer.
    seq_lens = graph[1]["padded_seq_lens"] if graph is not None else getattr(fb, "seq_lens", None)
    options = dict(graph_bs=graph_bs, graph_rows=graph[0].capture_bs if graph else None, verify=verify, draft_extend=mode is ForwardMode.DRAFT_EXTEND, extend=mode in (ForwardMode.EXTEND, ForwardMode.MIXED), spec_info=spec_info, sized=sized, model=model, seq_lens=seq_lens)
    plan = capture_plan(backend, **options)
    if plan is None:
        for child in getattr(backend, "attn_backend_list", None) or []:
            plan = capture_plan(child, **options)
            if plan is not None:
                break
    if plan is not None:
        if graph is not None and (plan.backend == "triton" or draft is not None):  # SGLang Triton's buffers', or a draft step's rows
            cut_on_device(plan, _graph_reads(graph[0], mode, binfo.tokens_per_req, draft))
        plan.scalars.update(_engine_sums(backend, fb, graph, raw_bs))
        if draft is not None:  # the multi-step draft backend's host facts: seq_lens count neither
            plan.scalars.update({"draft_topk": draft.topk, "draft_step": draft.step})
        tensors.update({f"plan.{k}": v for k, v in plan.tensors.items()})
    if graph is not None:
        tensors.update({f"graph.{k}": v for k, v in graph[1].items()})
    record = _Step(
        source=source(engine="sglang", backend=backend_name(backend, mode), device=req_to_token.device, step=step, tp_rank=_tp_rank(), engine_version=_sglang_version()),
        model=model,
        kv_cache_size=kv_cache_size(backend),
        batch=binfo,
        spec=sinfo,
        plan=plan,
        graph=graph[0] if graph else None,
    )
    # Under graph replay no layer runs in Python; a draft step's layer slots (layers.read_slots, by
    # request) are not its branch rows: its metadata is recorded without them.
    layers = bool(session.options.layers) and graph is None and draft is None
    if layers:
        _instrument_model_runner()
        extra = binfo.tokens_per_req if mode is ForwardMode.TARGET_VERIFY else 0
        tensors[sglang_layers.SLOTS] = sglang_layers.read_slots(fb, req_to_token, batch_size=binfo.batch_size, extra=extra)
    copy = session.snapshot(tensors)
    if copy is None:
        return False
    if not layers:
        session.submit(copy, record.build, step=step)
        return True
    sglang_layers.hold(
        sglang_layers.PendingStep(
            session=session,
            forward_batch=fb,
            metadata=copy,
            build=record.build,
            read_slots=tensors[sglang_layers.SLOTS],
            num_tokens=_num_tokens(fb, binfo),
            mla=record.model.attention is AttentionKind.MLA,
            lse_base=sglang_layers.lse_base(record.source.backend),
            step=step,
        )
    )
    return True


def _num_tokens(fb: Any, binfo: BatchInfo) -> int | None:
    """The step's query rows when the host knows them (a padded batch's q has more rows)."""
    if binfo.tokens_per_req:
        return binfo.batch_size * binfo.tokens_per_req
    extend = getattr(fb, "extend_seq_lens_cpu", None)
    if extend is not None and not isinstance(extend, Tensor):
        return int(sum(extend[: binfo.batch_size]))
    if isinstance(extend, Tensor) and not extend.is_cuda:
        return int(extend[: binfo.batch_size].sum())
    return None


def _graph_reads(info: GraphInfo, mode: ForwardMode, draft_tokens: int, draft: DraftDecode | None = None) -> dict[str, int]:
    """What a graph replay's Triton kernels read of the capacity buffers, from the padded seq_lens'
    host mirror (SGLang fills kv_indptr and mask_indptr from the same seq_lens on the device):
    decode and verify read sum(seq_lens) KV ids (verify: the prefixes), verify sum(n * (seq_len + n))
    mask elements; a draft step's branch rows (either backend) each its prefix and step + 1 draft
    tokens. Nothing without a host mirror: the buffers are then copied whole and cut on the host."""
    seq = info.host_seq_lens
    if seq is None or mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        return {}
    reads = {"kv_indices": sum(seq) + (len(seq) * (draft.step + 1) if draft is not None else 0)}
    if mode is ForwardMode.TARGET_VERIFY:
        reads["custom_mask"] = mask_length(MaskLayout.FULL, batch_size=len(seq), draft_token_num=draft_tokens, prefix_sum=sum(seq))
    return reads


REPLAY_SEQ_LENS_SUM = "_attndbg_replay_seq_lens_sum"  # what classic SGLang's runner passed the backend at replay


def _engine_sums(backend: Any, fb: Any, graph: tuple[GraphInfo, dict[str, Tensor]] | None, raw_bs: int | None) -> dict[str, int]:
    """The engine's own host sums, as the backend received them (detectors check them against
    seq_lens; real bugs get them wrong, so they are never recomputed here):
    `seq_lens_sum` (eager: the ForwardBatch's; SGL-new replay: the view's, padding included;
    classic replay: the value the runner passed to init_forward_metadata_replay_cuda_graph), and
    a verify step's `spec_seq_lens_sum` (EagleVerifyInput.seq_lens_sum, which sizes its FULL mask)."""
    sums: dict[str, int] = {}
    if graph is not None and raw_bs is None:
        value = getattr(backend, REPLAY_SEQ_LENS_SUM, None)  # classic replay
    else:
        value = getattr(fb, "seq_lens_sum", None)
    if isinstance(value, int) and not isinstance(value, bool):
        sums["seq_lens_sum"] = int(value)
    spec_sum = getattr(getattr(fb, "spec_info", None), "seq_lens_sum", None)
    if engine_mode_name(fb) == "TARGET_VERIFY" and isinstance(spec_sum, int) and not isinstance(spec_sum, bool):
        sums["spec_seq_lens_sum"] = int(spec_sum)
    return sums


def _host_prefix_sum(fb: Any, batch_size: int) -> int | None:
    """The real requests' verify prefix lengths summed on the host, without a device sync: from
    seq_lens_cpu when the engine keeps it (our own sum, so an engine's wrong seq_lens_sum does not
    cut the evidence), else the spec input's or the batch's seq_lens_sum, else None."""
    seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
    if isinstance(seq_lens_cpu, Tensor) and not seq_lens_cpu.is_cuda:
        return int(seq_lens_cpu[:batch_size].sum())
    for value in (getattr(fb.spec_info, "seq_lens_sum", None), getattr(fb, "seq_lens_sum", None)):
        if isinstance(value, int) and not isinstance(value, bool) and not hasattr(fb, "num_padding"):
            return int(value)  # (an SGL-new replay view's sum includes the padded requests)
    return None


def _sized_for_step(fb: Any, mode: ForwardMode) -> bool:
    """Whether SGLang's Triton backend sized this eager step's kv_indices from a host sum (decode
    and verify: `torch.empty(seq_lens_sum)`; extend: sum(extend_prefix_lens_cpu)); without one it
    over-allocates by design (`bs * max_context_len`), and a draft decode takes the spec input's."""
    if mode is ForwardMode.DECODE and getattr(getattr(fb, "spec_info", None), "kv_indices", None) is not None:
        return False
    if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        value = getattr(fb, "seq_lens_sum", None)
        return isinstance(value, int) and not isinstance(value, bool)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return getattr(fb, "extend_prefix_lens_cpu", None) is not None
    return False


def _mask_mode(backend: Any) -> Any:
    """The backend's TreeMaskMode when it says (SGL-new VerifyMask.mode), else None (by size)."""
    from attndbg.record.sglang.spec import TREE_MASK_MODES

    verify_mask = getattr(backend, "verify_mask", None)
    mode = getattr(verify_mask, "mode", None)
    return TREE_MASK_MODES.get(getattr(mode, "name", ""), None)


# -- hooks ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _nested() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _outermost() -> bool:
    return getattr(_local, "depth", 0) == 0


def _active() -> RecordingSession | None:
    session = current_session()
    return session if session is not None and session.enabled else None


def _wrap_eager(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_forward_metadata(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        session = _active() if _outermost() else None
        with _nested():
            result = original(self, forward_batch, *args, **kwargs)
        if session is not None:
            with session.guard("sglang init_forward_metadata"):
                record_step(session, self, forward_batch)
        return result

    return init_forward_metadata


def _wrap_out_graph(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_forward_metadata_out_graph(self: Any, forward_batch: Any, in_capture: bool = False, *args: Any, **kwargs: Any) -> Any:
        session = _active() if _outermost() and not in_capture else None
        with _nested():
            result = original(self, forward_batch, in_capture, *args, **kwargs)
        if _outermost() and (in_capture or hasattr(forward_batch, "num_padding")):
            sglang_flight.audit_out_graph(self, forward_batch, in_capture=in_capture)
        # Only replays are recorded here (the view has num_padding, or a draft step's view the
        # padding of the runner's); eager steps come through init_forward_metadata, whose default
        # calls this method nested.
        extend_runner = getattr(_local, DRAFT_EXTEND_RUNNER, None)
        if session is not None and hasattr(forward_batch, DRAFT_PADDING):
            with session.guard("sglang draft step init_forward_metadata_out_graph"):
                _record_draft_view(session, self, forward_batch)
        elif session is not None and hasattr(forward_batch, "num_padding"):
            with session.guard("sglang init_forward_metadata_out_graph"):
                _record_view(session, self, forward_batch)
        elif session is not None and extend_runner is not None and engine_mode_name(forward_batch) == "DRAFT_EXTEND_V2":
            with session.guard("sglang draft extend init_forward_metadata_out_graph"):
                _record_draft_extend_view(session, self, forward_batch, *extend_runner)
        return result

    return init_forward_metadata_out_graph


DRAFT_PADDING = "attndbg_draft_num_padding"  # the runner's num_padding, added to a draft step's inner view


def _record_draft_view(session: RecordingSession, backend: Any, view: Any) -> None:
    """One draft step of an EAGLE draft graph replay, as its sub-backend refilled its graph
    buffers: the view's batch is the runner's padded one, its out_cache_loc the runner's padded
    buffer ([bs, topk, steps]), its positions one per branch row."""
    topk = draft_topk(getattr(view, "spec_info", None))
    bs = int(view.batch_size)
    if topk is None or getattr(view, PADDED_OUT_CACHE_LOC, None) is None:
        sglang_layers.flush()
        session.next_step()  # branch rows unknown: not recorded (record_step says the same of an eager one)
        return
    graph = capture_graph_from_view(
        view,
        fill_value=int(backend.get_cuda_graph_seq_len_fill_value()),
        tokens_per_req=topk,
        backend=backend,
        num_padding=int(getattr(view, DRAFT_PADDING)),
        slots_per_req=getattr(view, PADDED_OUT_CACHE_LOC).numel() // max(bs, 1),
    )
    record_step(session, backend, view, raw_bs=graph[0].raw_bs, graph=graph)


DRAFT_EXTEND_RUNNER = "draft_extend_runner"  # on _local: (runner, real batch size) while a draft-extend graph runner replays


def _record_draft_extend_view(session: RecordingSession, backend: Any, view: Any, runner: Any, raw_bs: int | None) -> None:
    """A DRAFT_EXTEND_V2 graph replay (EAGLEDraftExtendCudaGraphRunner.execute, or one layer's step
    of the multi-layer runner): its view has no num_padding and carries no positions (the
    single-layer runner's out_cache_loc is cut at the real tokens, the multi-layer one's is the
    padded buffer), so the padded section is read from the runner's static buffers (padded rows:
    seq_lens at the fill, slots and positions 0, extend lengths the window) on a copy: the engine's
    view stays as it is."""
    buffers = getattr(runner, "buffers", None)
    width = getattr(runner, "captured_req_width", None)
    if buffers is None or raw_bs is None or not isinstance(width, int) or isinstance(width, bool) or width < 1:
        sglang_layers.flush()
        session.next_step()  # a runner of another shape, or no real batch size: padding unknown, not recorded
        return
    bs = int(view.batch_size)
    record = copy.copy(view)
    record.positions = buffers.positions[: bs * width]
    record.extend_seq_lens = buffers.extend_seq_lens[:bs]
    setattr(record, PADDED_OUT_CACHE_LOC, buffers.out_cache_loc[: bs * width])
    setattr(record, STATIC_SIZES, (buffers.seq_lens.numel(), buffers.out_cache_loc.numel()))
    graph = capture_graph_from_view(
        record, fill_value=int(runner.seq_len_fill_value), tokens_per_req=width, backend=backend, num_padding=bs - raw_bs
    )
    record_step(session, backend, record, raw_bs=raw_bs, graph=graph)


def _keeps_draft_extend_runner(real_bs: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Wraps a draft-extend graph runner's replay method, whose view for its backend's
    init_forward_metadata_out_graph is a SimpleNamespace of its own, without the padding: the
    runner and the real batch size (`real_bs(runner, *args, **kwargs)`, None when it has none) are
    kept on this thread for that call's hook."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(_local, DRAFT_EXTEND_RUNNER, None)
            kept = None
            if _active() is not None:
                raw = real_bs(self, *args, **kwargs)
                kept = (self, int(raw) if isinstance(raw, int) and not isinstance(raw, bool) else None)
            setattr(_local, DRAFT_EXTEND_RUNNER, kept)
            try:
                return original(self, *args, **kwargs)
            finally:
                setattr(_local, DRAFT_EXTEND_RUNNER, outer)

        return replay

    return wrap


def _executed_batch_size(runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """`EAGLEDraftExtendCudaGraphRunner.execute(forward_batch, ...)`: the real batch it pads."""
    return forward_batch.batch_size


def _prepared_batch_size(runner: Any, *args: Any, **kwargs: Any) -> Any:
    """`MultiLayerEagleDraftExtendCudaGraphRunner.replay(bs, ...)`: its composite's prepare padded
    the shared buffers and set the step runner's raw_bs before calling it."""
    return getattr(runner, "raw_bs", None)


def _record_view(session: RecordingSession, backend: Any, view: Any) -> None:
    """An SGL-new replay: the view's padded buffers are the graph section."""
    if getattr(view, PADDED_OUT_CACHE_LOC, None) is None:
        sglang_layers.flush()
        session.next_step()  # a view built elsewhere than build_replay_fb_view: padding unknown, not recorded
        return
    per_req = 1 if view.forward_mode.name == "DECODE" else len(view.positions) // max(int(view.batch_size), 1)
    graph = capture_graph_from_view(view, fill_value=int(backend.get_cuda_graph_seq_len_fill_value()), tokens_per_req=per_req, backend=backend)
    record_step(session, backend, view, raw_bs=graph[0].raw_bs, graph=graph)


def _wrap_replay_prepare(original: Callable) -> Callable:
    @functools.wraps(original)
    def replay_prepare(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, forward_batch, *args, **kwargs)
        session = _active()
        if session is not None:
            with session.guard("sglang CudaGraphRunner.replay_prepare"):
                graph = capture_graph_from_runner(self)
                record_step(session, self.model_runner.attn_backend, forward_batch, graph=graph)
        return result

    return replay_prepare


def _wrap_replay_metadata(original: Callable) -> Callable:
    """SGL-classic `init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens,
    seq_lens_sum, ...)`: keeps the seq_lens_sum the runner passed (the engine's own, padding
    included or not), which `replay_prepare`'s hook records once the call returned."""

    @functools.wraps(original)
    def init_forward_metadata_replay_cuda_graph(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        value = kwargs.get("seq_lens_sum", args[3] if len(args) > 3 else None)
        with contextlib.suppress(AttributeError):  # a backend with __slots__ keeps nothing
            setattr(self, REPLAY_SEQ_LENS_SUM, value)
        sglang_flight.audit_classic_replay(self, args, kwargs)
        return result

    return init_forward_metadata_replay_cuda_graph


def _wrap_view_builder(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_replay_fb_view(forward_batch: Any, buffers: Any, bs: int, raw_bs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        view = original(forward_batch, buffers, bs, raw_bs, num_tokens, *args, **kwargs)
        out_cache_loc = getattr(buffers, "out_cache_loc", None)
        if out_cache_loc is not None:
            setattr(view, PADDED_OUT_CACHE_LOC, out_cache_loc[:num_tokens])
            seq_lens = getattr(buffers, "seq_lens", None)
            if isinstance(seq_lens, Tensor):  # the static buffers' rows and tokens: what the graphs hold
                setattr(view, STATIC_SIZES, (seq_lens.numel(), out_cache_loc.numel()))
        return view

    return build_replay_fb_view


def _wrap_triton_draft_out_graph(original: Callable) -> Callable:
    """Triton's multi-step draft backend at a draft graph replay refills every step's rows of its
    graph buffers (the sub-backends' kv_indptr and cuda_graph_kv_indices are those rows) without
    calling a sub-backend: each draft step is recorded here, through the step's view as
    `build_inner_fb_view` makes it, whose spec input names the step's lists (the engine's spec
    input holds no step's at a replay)."""

    @functools.wraps(original)
    def init_forward_metadata_out_graph(self: Any, forward_batch: Any, in_capture: bool = False, *args: Any, **kwargs: Any) -> Any:
        result = original(self, forward_batch, in_capture, *args, **kwargs)
        session = _active() if _outermost() and not in_capture and hasattr(forward_batch, "num_padding") else None
        if session is not None:
            with session.guard("sglang Triton draft steps init_forward_metadata_out_graph"):
                _record_triton_draft_steps(session, self, forward_batch)
        return result

    return init_forward_metadata_out_graph


def _record_triton_draft_steps(session: RecordingSession, multi: Any, view: Any) -> None:
    from sglang.srt.model_executor import forward_batch_info

    bs, topk = int(view.batch_size), int(multi.topk)
    for i, sub in enumerate(multi.attn_backends):
        step_view = forward_batch_info.build_inner_fb_view(view, bs=bs, forward_mode=view.forward_mode)
        # What the step's kernels read: its rows of the multi-step buffers (the sub-backend's own).
        step_view.spec_info = SimpleNamespace(num_tokens_per_req=topk, kv_indptr=multi.kv_indptr[i, : bs * topk + 1], kv_indices=multi.cuda_graph_kv_indices[i])
        _record_draft_view(session, sub, step_view)


def _wrap_inner_view_builder(original: Callable) -> Callable:
    """`build_inner_fb_view(forward_batch, *, bs, forward_mode, ...)`: the per-step view a
    multi-step draft backend hands each sub-backend. Of the EAGLE draft graph runner's replay view
    (`num_padding` set, its out_cache_loc the runner's padded buffer) it keeps no padding, so the
    sub-backend's replay could not be told from an eager plan: the padding and the padded buffer
    are carried over under our own names, so the engine's code never sees a field it does not set."""

    @functools.wraps(original)
    def build_inner_fb_view(forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        view = original(forward_batch, *args, **kwargs)
        padding = getattr(forward_batch, "num_padding", None)
        if isinstance(padding, int) and not isinstance(padding, bool) and padding >= 0 and _active() is not None:
            with contextlib.suppress(AttributeError):  # a view type that takes no new attribute
                setattr(view, DRAFT_PADDING, padding)
                # The runner swapped its padded static buffer in as the batch's out_cache_loc.
                setattr(view, PADDED_OUT_CACHE_LOC, getattr(forward_batch, "out_cache_loc", None))
        return view

    return build_inner_fb_view


def _wrap_forward(original: Callable) -> Callable:
    """`AttentionBackend.forward`: the layer's tensors go to this thread's held step (if any)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = sglang_layers.pending()
        if step is None or sglang_layers.forward_depth() > 0 or not step.session.enabled:
            return original(self, *args, **kwargs)  # no step wants layers, or a delegated inner call
        captured = None
        bound = sglang_layers.forward_args(args, kwargs)
        with step.session.guard("sglang attention forward (before)"):
            captured = sglang_layers.capture_inputs(step, self, bound, kwargs)
        sglang_layers.enter_forward()
        try:
            result = original(self, *args, **kwargs)
        finally:
            sglang_layers.leave_forward()
        if captured is not None:
            with step.session.guard("sglang attention forward (after)"):
                sglang_layers.capture_output(step, captured[0], captured[1], result, bound["layer"])
        return result

    return forward


def _wrap_model_forward(original: Callable) -> Callable:
    """`ModelRunner.forward`: when it returns, every layer of the step ran; the held step goes
    to the writer. A forward that raises leaves incomplete layers: its step is dropped."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            sglang_layers.discard()
            raise
        sglang_layers.flush()
        return result

    return forward


def _instrument_model_runner() -> None:
    """Wrap ModelRunner.forward once SGLang imported it (never imported from here: at plugin load
    the model runner's import closure may not be ready)."""
    module = sys.modules.get("sglang.srt.model_executor.model_runner")
    runner = getattr(module, "ModelRunner", None)
    if runner is not None:
        hooks.patch(runner, "forward", _wrap_model_forward)


def _wrap_layer_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _layers.append(weakref.ref(self))

    return __init__


def instrument_backend_class(cls: type) -> None:
    """Wrap the metadata entry points and the attention call a backend class defines (idempotent)."""
    hooks.patch(cls, "init_forward_metadata", _wrap_eager)
    hooks.patch(cls, "init_forward_metadata_out_graph", _wrap_out_graph)
    hooks.patch(cls, "init_forward_metadata_replay_cuda_graph", _wrap_replay_metadata)  # SGL-classic
    hooks.patch(cls, "init_forward_metadata_capture_cuda_graph", sglang_flight.wrap_capture_metadata)  # SGL-classic
    hooks.patch(cls, "forward", _wrap_forward)


def install() -> None:
    """Install the hooks (idempotent); nothing unless a recording session is active."""
    global _installed
    if _installed or current_session() is None:
        return
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import RadixAttention

    _installed = True
    hooks.patch(RadixAttention, "__init__", _wrap_layer_init)
    instrument_backend_class(AttentionBackend)
    for cls in hooks.subclasses(AttentionBackend):
        instrument_backend_class(cls)
    hooks.on_subclass(AttentionBackend, instrument_backend_class)
    _instrument_model_runner()
    sglang_flight.install_verify_hooks()
    with contextlib.suppress(ImportError):  # SGL-classic only
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

        hooks.patch(CudaGraphRunner, "replay_prepare", _wrap_replay_prepare)
    with contextlib.suppress(ImportError):  # SGL-new only
        from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner

        if not hooks.is_hooked(runner.build_replay_fb_view):
            runner.build_replay_fb_view = hooks.mark(_wrap_view_builder(runner.build_replay_fb_view))
    with contextlib.suppress(ImportError, AttributeError):
        from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend

        hooks.patch(TritonMultiStepDraftBackend, "init_forward_metadata_out_graph", _wrap_triton_draft_out_graph)
    with contextlib.suppress(ImportError, AttributeError):  # SGL-new only
        from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

        hooks.patch(EAGLEDraftExtendCudaGraphRunner, "execute", _keeps_draft_extend_runner(_executed_batch_size))
    with contextlib.suppress(ImportError, AttributeError):  # SGL-new only
        from sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner import MultiLayerEagleDraftExtendCudaGraphRunner

        hooks.patch(MultiLayerEagleDraftExtendCudaGraphRunner, "replay", _keeps_draft_extend_runner(_prepared_batch_size))
    with contextlib.suppress(ImportError, AttributeError):  # SGL-new's multi-step draft backends import it at each call
        from sglang.srt.model_executor import forward_batch_info

        if not hooks.is_hooked(forward_batch_info.build_inner_fb_view):
            forward_batch_info.build_inner_fb_view = hooks.mark(_wrap_inner_view_builder(forward_batch_info.build_inner_fb_view))


def register() -> None:
    """SGLang's `sglang.srt.plugins` entry point: SGLang calls it in every process it loads plugins in."""
    install()
