"""Replay: data, plans, kernels (eager, recorded plan, CUDA graph), and every comparison.

Each backend yields one row per variant it ran (`variants`: typed, with the labels shown here):
  Eager            the plan derived from the batch, run once (or --repeat times, checked bitwise)
  Recorded         the plan the engine recorded in the trace, when it was built by this backend
  Graph            the derived plan padded to a capture size and replayed in a real CUDA graph
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from attndbg import machine
from attndbg.backends import registry
from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, KernelError, KernelUnsupported, Padding, PartialStates
from attndbg.backends.options import BackendOptions
from attndbg.compare.tolerance import Comparison
from attndbg.profiling import phase, step_label
from attndbg.replay import activity
from attndbg.replay import graph as graph_replay
from attndbg.replay.step_data import StepData
from attndbg.plans.guard import Refusal, merge_refusal, real_requests_only, refusal
from attndbg.replay.variants import EAGER, RECORDED, Graph, Variant
from attndbg.trace.errors import TraceError
from attndbg.backends.reference import natural_lse
from attndbg.numerics import LN2, LOG2E
from attndbg.trace.schema import LseBase, MergeStates, Plan, Trace


class RunStatus(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # this trace uses a feature the backend lacks
    UNAVAILABLE = "unavailable"  # the backend cannot run on this machine
    ERROR = "error"  # the kernel raised, or a recorded plan would read outside the cache


class PlanSource(enum.Enum):
    DERIVED = "derived"
    RECORDED = "recorded"
    BOTH = "both"


@dataclass(frozen=True)
class BackendRun:
    name: str
    status: RunStatus
    description: str
    variant: Variant = EAGER
    reason: str | None = None  # why it did not run, or what failed besides the numbers, for people
    comparison: Comparison | None = None
    result: AttentionResult | None = None  # CPU copies
    plan: Plan | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # failures beyond tolerance (bits, padding, KV writes), for people
    graph: graph_replay.GraphOutcome | None = None  # the same facts as data, for detectors (graph variant only)
    repeat_identical: bool | None = None  # --repeat N > 1: were all N eager runs bitwise identical
    # The plan guard refused the recorded plan before launch (status ERROR, or UNSUPPORTED where
    # the plan could not be read; `reason` ends "(not launched)" for people): the same fact as
    # data, so detectors need not read the reason.
    refused: Refusal | None = None


@dataclass(frozen=True)
class ReplayResult:
    trace: Trace
    trace_path: str
    reference: AttentionResult
    runs: list[BackendRun]
    layer: int | None = None  # whose recorded tensors were the data; None: drawn from the trace's seed

    @property
    def failed(self) -> bool:
        return any(r.status in (RunStatus.FAILED, RunStatus.ERROR) for r in self.runs)


@dataclass(frozen=True)
class ReplayOptions:
    layer: int | None = None  # recorded layer whose tensors to use
    backend_options: BackendOptions = BackendOptions()  # each backend's options (--backend-option); absent: its defaults
    plan: PlanSource = PlanSource.DERIVED
    repeat: int = 1  # eager runs per backend; all must be bitwise identical
    cuda_graph: bool = False
    capture_bs: int | None = None  # default: the next SGLang capture size above the batch
    fill_value: int | None = None  # default: each backend's own fill value
    graph_capture: bool = True  # False: the graph sequence runs eagerly (CPU tests)
    max_memory: int | None = None  # --max-memory: refuse a step whose data needs more (default: the device's free memory)


class _Context:
    """What every backend run of one step shares: the step's data and references (`StepData`), and
    what of the step it runs when not all of it (`part`, announced with each launch)."""

    def __init__(self, trace: Trace, options: ReplayOptions, data: StepData | None = None, part: str | None = None):
        self.trace = trace
        self.options = options
        self.label = step_label(trace)
        self.data = data if data is not None and data.layer == options.layer else StepData(trace, layer=options.layer, max_memory=options.max_memory, cuda_graph=options.cuda_graph)
        self.part = part

    def announced(self, label: str) -> str:
        """What a launch of the variant `label` is announced as: 'eager', or 'eager, request 3 alone'
        in a detector's replay of part of the step (a crash then names the sub-batch)."""
        return label if self.part is None else f"{label}, {self.part}"

    def compare(self, result: AttentionResult) -> Comparison:
        return self.data.compare(result)


def replay(
    trace: Trace,
    trace_path: str,
    backend_names: list[str],
    options: ReplayOptions = ReplayOptions(),
    *,
    data: StepData | None = None,
    adapter: Callable[[str], Backend] | None = None,
    part: str | None = None,
) -> ReplayResult:
    """Run `backend_names` on one step. `data`: the step's inputs and references when the caller
    already built them (a check shares one per step); it must come from the same batch and seed.
    `adapter`: name -> the adapter to run, configured with `options.backend_options` (a check's
    context hands out one per step; default: a new one from the registry). `part`: what of a step
    `trace` is, when a detector replays part of it ("request 3 alone"), announced with each launch."""
    ctx = _Context(trace, options, data, part)
    runs: list[BackendRun] = []
    try:
        for name in backend_names:
            with phase(f"backend/{name}", ctx.label):  # creating a backend may launch kernels (its workspace): inside its range
                backend = registry.create(name, options=options.backend_options) if adapter is None else adapter(name)
                runs.extend(_runs_of(backend, ctx))
    except TraceError as e:  # the step cannot be replayed here (its data does not fit)
        raise (e if e.path else e.in_file(trace_path)) from None
    return ReplayResult(trace=trace, trace_path=trace_path, reference=ctx.data.reference, runs=runs, layer=options.layer)


def run_derived(trace: Trace, backend: Backend, *, data: StepData, what: str) -> BackendRun:
    """One eager run of the plan `backend` derives from the batch, compared with `data`'s reference.

    For a detector that runs one adapter it holds, configured its own way, and names the launch
    itself (split-merge runs FlashInfer's cascade and paged extend paths one after the other,
    announced as 'extend_path=cascade' so a crash names the path): the same checks, derived plan,
    announced launch and comparison as `replay`'s eager variant, without its per-step memo (the
    adapter and its options are the caller's)."""
    ctx = _Context(trace, ReplayOptions(layer=data.layer), data)
    reason = backend.unavailable_reason()
    if reason:
        return BackendRun(backend.name, RunStatus.UNAVAILABLE, "", reason=reason)
    reason = backend.unsupported_reason(trace)
    if reason:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, "", reason=reason)
    with phase(f"backend/{backend.name}", ctx.label):
        with phase("plan", f"{ctx.label} backend={backend.name} variant={EAGER.label} {what}"):
            plan = backend.derive_plan(trace)
        return _eager(backend, ctx, ctx.data.on(backend.device()), plan, backend.describe(), EAGER, 1, what)


def merge(backend: Backend, states: PartialStates, *, what: str) -> AttentionResult:
    """`backend`'s merge of `states` alone (CPU copies), for a detector that probes a merge kernel
    with crafted states (split-merge's empty splits): no step's plan reaches such a launch, so it
    has no place in `replay`, but it is guarded and announced like every launch here, so a fault
    in it is that backend's crash (replay/activity.py). Nothing is compared, and what the kernel
    raises propagates (a probe that cannot run is its detector's failure). States the kernel would
    read outside of are never launched: ValueError (they are the caller's own)."""
    problem = merge_refusal(states)
    if problem is not None:
        raise ValueError(f"{backend.name} merge not launched ({what}): {problem}")
    # probe=<what>: a word of its own (a bare word would extend backend=), and in place of a
    # variant, which names how a step's run was made: crafted states are no run of the step.
    with phase("merge", f"backend={backend.name} probe={what}"), activity.launching(backend.name, what):
        result = backend.merge_states(states.to(backend.device()))
    return AttentionResult(output=result.output.cpu(), lse=result.lse.cpu())


def given_states(states: MergeStates, base: LseBase) -> PartialStates:
    """A merge step's states as a merge kernel of LSE `base` takes them, the way a correct caller
    hands them over: [tokens, heads, states, Dv] and the LSEs converted from the step's base."""
    lse = natural_lse(states.s, states.lse_base) * (LOG2E if base is LseBase.TWO else 1.0)
    return PartialStates(states.v.permute(1, 2, 0, 3), lse.to(torch.float32).permute(1, 2, 0), rows=states.mask)


def _merge_step(backend: Backend, ctx: _Context, description: str) -> BackendRun:
    """`backend`'s merge of a merge step's given states (trace.merge), run `repeat` times, its LSE
    read back as natural log and compared with the float64 merge."""
    base = backend.capabilities().lse_base
    states = given_states(ctx.trace.merge, base)
    try:
        start = time.perf_counter()
        runs = [merge(backend, states, what=ctx.announced("merge step")) for _ in range(ctx.options.repeat)]
        seconds = (time.perf_counter() - start) / len(runs)
    except KernelUnsupported as e:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, reason=str(e))
    except (KernelError, RuntimeError) as e:  # what the library raised, first line
        return BackendRun(backend.name, RunStatus.ERROR, description, reason=(str(e).strip().splitlines() or [type(e).__name__])[0])
    problems = [f"run {i + 1} differs from run 1 (not deterministic)" for i, again in enumerate(runs[1:], 1) if not (torch.equal(again.output, runs[0].output) and torch.equal(again.lse, runs[0].lse))][:1]
    lse = runs[0].lse.double() * (LN2 if base is LseBase.TWO else 1.0)
    result = AttentionResult(output=runs[0].output, lse=lse)
    comparison = ctx.compare(result)
    status = RunStatus.PASSED if comparison.passed and not problems else RunStatus.FAILED
    identical = None if ctx.options.repeat < 2 else not problems
    return BackendRun(backend.name, status, description, comparison=comparison, result=result, seconds=seconds, problems=problems, repeat_identical=identical)


def _runs_of(backend: Backend, ctx: _Context) -> list[BackendRun]:
    reason = backend.unavailable_reason()
    if reason:
        return [BackendRun(backend.name, RunStatus.UNAVAILABLE, "", reason=reason)]
    description = backend.describe()
    reason = backend.unsupported_reason(ctx.trace)
    if reason:
        return [BackendRun(backend.name, RunStatus.UNSUPPORTED, description, reason=reason)]
    if ctx.trace.merge is not None:  # a merge of given states: no plan, no graph, one eager merge
        return [_merge_step(backend, ctx, description)]
    with _explained_if_slow(backend, ctx.trace):
        inputs = ctx.data.on(backend.device())
        runs = []
        if ctx.options.plan is not PlanSource.RECORDED:
            # The eager run of the derived plan is the same for every variant of the step: run once.
            key = (backend.name, ctx.options.backend_options.of(backend.name), ctx.options.repeat)
            if key not in ctx.data.eager_runs:
                with phase("plan", f"{ctx.label} backend={backend.name} variant={EAGER.label}"):
                    plan = backend.derive_plan(ctx.trace)
                ctx.data.eager_runs[key] = _eager(backend, ctx, inputs, plan, description, EAGER, ctx.options.repeat)
            runs.append(ctx.data.eager_runs[key])
        if ctx.options.plan is not PlanSource.DERIVED:
            runs.append(_recorded(backend, ctx, inputs, description))
        if ctx.options.cuda_graph:
            runs.append(_graph(backend, ctx, inputs, description))
    return runs


_ANNOUNCED: set[tuple] = set()
# Set (by check's compile phase, for its workers) when the kernels were built up front: the note
# below would only repeat what that phase said.
PREBUILT_VARIABLE = "ATTNDBG_KERNELS_PREBUILT"
# How long a kernel shape's first runs in a process may take before the note says why. Warm disk
# caches load in milliseconds: said up front, the note repeated ~270 times per process on a server
# recording whose kernels were all on disk (bench/server_sweep.py on an H200).
FIRST_USE_NOTE_AFTER_S = 5.0


@contextmanager
def _explained_if_slow(backend: Backend, trace: Trace) -> Iterator[None]:
    """Run the body; if it is a kernel shape's first runs in this process and they take longer than
    FIRST_USE_NOTE_AFTER_S, say (once per process and shape, while they still run) that the library
    may be compiling, so a long first step is explained and a fast one is not noise."""
    note = backend.first_use_note()
    m = trace.model
    key = (backend.name, trace.batch.forward_mode, m.head_dim, m.v_head_dim, m.q_dtype, m.kv_dtype, m.page_size, m.gqa_group)
    if note is None or key in _ANNOUNCED or os.environ.get(PREBUILT_VARIABLE):
        yield  # nothing to explain, said already, or check's compile phase built it and said so
        return
    _ANNOUNCED.add(key)
    line = (
        f"attndbg: {backend.name}: first {trace.batch.forward_mode.value} step with head_dim {m.head_dim}, "
        f"{m.q_dtype} (KV {m.kv_dtype}), page {m.page_size}, GQA group {m.gqa_group} in this process, "
        f"still running after {FIRST_USE_NOTE_AFTER_S:.0f} s: {note}\n"
    )
    timer = threading.Timer(FIRST_USE_NOTE_AFTER_S, lambda: (sys.stderr.write(line), sys.stderr.flush()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _execute(backend: Backend, ctx: _Context, inputs: AttentionInputs, plan: Plan, variant: Variant, what: str | None = None) -> tuple[AttentionResult, float]:
    """One run; the launch is announced as `what` (default: the variant's label, and the part of the step replayed)."""
    start = time.perf_counter()
    with phase("run", f"{ctx.label} backend={backend.name} variant={variant.label}"), activity.launching(backend.name, what or ctx.announced(variant.label)):
        result = backend.run(ctx.trace, inputs, plan)
        if inputs.q.is_cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return AttentionResult(output=result.output.cpu(), lse=result.lse.cpu()), seconds


def _eager(
    backend: Backend, ctx: _Context, inputs: AttentionInputs, plan: Plan, description: str, variant: Variant, repeat: int, what: str | None = None
) -> BackendRun:
    try:
        result, seconds = _execute(backend, ctx, inputs, plan, variant, what)
        problems = []
        for run in range(2, repeat + 1):
            again, _ = _execute(backend, ctx, inputs, plan, variant, what)
            if not (torch.equal(again.output, result.output) and torch.equal(again.lse, result.lse)):
                differing = int((again.output != result.output).sum() + (again.lse != result.lse).sum())
                problems.append(f"run {run} differs from run 1 in {differing} elements (not deterministic)")
                break
    except KernelUnsupported as e:  # the library cannot build or run this configuration: not a failure
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant=variant, reason=str(e), plan=plan)
    except KernelError as e:
        return BackendRun(backend.name, RunStatus.ERROR, description, variant=variant, reason=str(e), plan=plan)
    comparison = ctx.compare(result)
    status = RunStatus.PASSED if comparison.passed and not problems else RunStatus.FAILED
    identical = None if repeat < 2 else not problems
    return BackendRun(
        backend.name, status, description, variant, comparison=comparison, result=result, plan=plan, seconds=seconds, problems=problems, repeat_identical=identical
    )


def _recorded(backend: Backend, ctx: _Context, inputs: AttentionInputs, description: str) -> BackendRun:
    variant = RECORDED
    plan = ctx.trace.plan
    if plan is None:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant, reason="the trace has no recorded plan")
    if plan.backend != backend.name:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant, reason=f"the recorded plan was built by {plan.backend!r}; only that backend can run it")
    real = real_requests_only(ctx.trace, plan)
    if real is not plan:
        description += f" (the real {ctx.trace.batch.batch_size} requests of a plan padded to capture_bs={ctx.trace.graph.capture_bs})"
    refused = refusal(ctx.trace, real, backend)
    if refused is not None:
        # An incomplete plan failed nothing: it was not run (unsupported), an unsafe one is an error.
        status = RunStatus.UNSUPPORTED if refused.unread else RunStatus.ERROR
        return BackendRun(backend.name, status, description, variant, reason=refused.message + " (not launched)", plan=plan, refused=refused)
    return _eager(backend, ctx, inputs, real, description, variant, 1)


def _graph(backend: Backend, ctx: _Context, inputs: AttentionInputs, description: str) -> BackendRun:
    trace, options = ctx.trace, ctx.options
    fill = backend.cuda_graph_fill_value if options.fill_value is None else options.fill_value
    capture_bs = options.capture_bs or graph_replay.default_capture_bs(trace)
    variant = Graph(capture_bs=capture_bs, fill=fill)
    reason = backend.graph_unsupported_reason(trace)
    if reason:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant, reason=reason)
    if capture_bs < trace.batch.batch_size:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant, reason=f"capture bs {capture_bs} < the batch's {trace.batch.batch_size}")
    capture = options.graph_capture and machine.cuda_available() and inputs.q.is_cuda
    if options.graph_capture and not capture:
        return BackendRun(backend.name, RunStatus.UNAVAILABLE, description, variant, reason="CUDA graphs need a CUDA GPU and a backend running on it")
    try:
        # variant=graph capture_bs=N fill=V, not the variant's label: its "bs=" would read as the step's
        # batch size. variant=padded where nothing is captured (check without --cuda-graph runs the
        # padded sequence eagerly on the static buffers): its `capture` and `replay` ranges launch
        # kernels one by one, and a timeline must not look there for a cudaGraphLaunch.
        padded = "graph" if capture else "padded"
        with phase("capture+replay", f"{ctx.label} backend={backend.name} variant={padded} capture_bs={capture_bs} fill={fill}"), activity.launching(backend.name, ctx.announced(variant.label)):
            start = time.perf_counter()
            outcome = graph_replay.graph_replay(
                backend, trace, inputs, padding=Padding(capture_bs=capture_bs, fill_value=fill), capture=capture, seed=trace.seed
            )
            seconds = time.perf_counter() - start
    except KernelUnsupported as e:
        return BackendRun(backend.name, RunStatus.UNSUPPORTED, description, variant, reason=str(e))
    except KernelError as e:
        return BackendRun(backend.name, RunStatus.ERROR, description, variant, reason=str(e))
    comparison = ctx.compare(outcome.result)
    problems = []
    if not outcome.eager_bitwise_equal:
        problems.append(f"graph replay differs from the same step run eagerly (max abs {outcome.eager_max_abs:.3e}; same plan, same buffers)")
    if outcome.padded_nonfinite:
        problems.append(f"{outcome.padded_nonfinite} NaN/Inf values in padded rows (they can leak through per-batch reductions)")
    if outcome.stray_kv_slots:
        problems.append(f"padded tokens wrote KV slots {outcome.stray_kv_slots}, not only the dummy slot")
    if not outcome.pointers_stable:
        problems.append("plan buffers moved between capture and replay (the graph reads the old pointers)")
    status = RunStatus.PASSED if comparison.passed and not problems else RunStatus.FAILED
    return BackendRun(
        backend.name, status, description, variant, comparison=comparison, result=outcome.result, seconds=seconds, problems=problems, graph=outcome
    )
