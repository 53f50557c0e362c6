"""What detectors share for one step: the trace, which backends to use, the recorded plan's
reading, and memoized replays.

Detectors consume replay results rather than re-running kernels themselves: `replay()` runs the
runner once per distinct (backends, options) and hands every detector the same result. Every run
of the step, whatever its options, reads the same inputs and is judged against the same reference:
`data(layer)` builds them once per step (on the GPU when there is one). What the recorded plan says
is read once too: `plan()` (attndbg/plans), the only way a detector reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from attndbg import machine
from attndbg.backends import registry
from attndbg.backends.base import Backend
from attndbg.backends.options import BackendOptions
from attndbg.plans.reading import PlanReading, read
from attndbg.replay.runner import BackendRun, ReplayOptions, ReplayResult, replay, run_derived
from attndbg.replay.step_data import StepData
from attndbg.trace.schema import Trace
from attndbg.trace.subbatch import SubBatch


@dataclass(frozen=True)
class CheckOptions:
    backends: tuple[str, ...] | None = None  # None: every backend that can run here
    cuda_graph: bool = False  # also replay under CUDA graphs where a GPU is present
    layer: int | None = None
    # Backends left out of this step (a check worker re-checks a step without the one that crashed).
    exclude: tuple[str, ...] = ()
    max_memory: int | None = None  # --max-memory: a step whose data needs more is not checked (default: the device's free memory)
    # --backend-option: each backend's options, in every replay of the step (a detector that
    # forces one backend's options, as split-merge forces Triton's split count, keeps its own).
    backend_options: BackendOptions = BackendOptions()


@dataclass
class CheckContext:
    trace: Trace
    path: str
    options: CheckOptions = CheckOptions()
    _replays: dict[ReplayOptions, ReplayResult] = field(default_factory=dict)
    _backends: tuple[str, ...] | None = None
    # The step's adapters, one per (backend, its options): made by `adapter`, the one place a
    # detector gets one (to ask what it can run, to derive a plan) and the runner runs them.
    _adapters: dict[tuple[str, object], Backend] = field(default_factory=dict)
    _data: dict[int | None, StepData] = field(default_factory=dict)
    # Kernel backends whose runs were compared with the reference on this step, in order of first run.
    _compared: dict[str, None] = field(default_factory=dict)
    _plan: PlanReading | None = None

    @property
    def step(self) -> int:
        return self.trace.source.step

    def plan(self) -> PlanReading:
        """The reading of the step's recorded plan (layout, per-request KV, visibility, scalars,
        problems), made once per step: every detector and mistake model reads the plan through it."""
        if self._plan is None:
            self._plan = read(self.trace)
        return self._plan

    def backends(self) -> tuple[str, ...]:
        """Kernel backends to exercise (never the reference): asked for, or all that run here."""
        if self._backends is None:
            names = self.options.backends or tuple(registry.backend_names())
            usable = []
            for name in names:
                if name == "reference" or name in self.options.exclude:
                    continue
                backend = self.adapter(name)
                if backend.unavailable_reason() is None and backend.unsupported_reason(self.trace) is None:
                    usable.append(name)
            self._backends = tuple(usable)
        return self._backends

    def adapter(self, name: str, options: BackendOptions | None = None) -> Backend:
        """The adapter named `name` with its entry of `options` (None: the step's --backend-option;
        `BackendOptions()`: its defaults), made once per step. KeyError when no adapter has that name."""
        options = self.options.backend_options if options is None else options
        key = (name, options.of(name))
        if key not in self._adapters:
            adapter = registry.create(name, options=options)
            # A check runs a step a backend's known library defect predicts wrong (a crash stays in
            # its worker): the kernels detector confirms or contradicts the prediction by the run.
            adapter.run_known_defects = True
            self._adapters[key] = adapter
        return self._adapters[key]

    def backends_consulted(self) -> tuple[str, ...]:
        """The kernel backends whose kernels ran on this step and were compared with the reference
        (a backend a detector only considered, or whose every run was refused, is not one)."""
        return tuple(self._compared)

    def _note_compared(self, result: ReplayResult) -> ReplayResult:
        for run in result.runs:
            if run.comparison is not None and run.name != "reference":
                self._compared.setdefault(run.name)
        return result

    def data(self, layer: int | None = None) -> StepData:
        """The step's inputs (recorded tensors of `layer`, else seeded) and references, built once."""
        if layer not in self._data:
            self._data[layer] = StepData(self.trace, layer=layer, max_memory=self.options.max_memory, cuda_graph=self.options.cuda_graph)
        return self._data[layer]

    def graph_options(self, *, capture_bs: int | None = None, fill_value: int | None = None) -> ReplayOptions:
        """The replay options of a detector's padded (graph) runs of the step: padded to `capture_bs`
        (None: the next SGLang capture size above the batch) with `fill_value` (None: each
        backend's own). Every detector's graph replays take these, so --cuda-graph means one thing."""
        return ReplayOptions(
            layer=self.options.layer,
            cuda_graph=True,
            # A real capture only with --cuda-graph on a GPU. Otherwise the same padded sequence runs
            # eagerly on the static buffers: it still judges what padding does to the real rows (fill
            # values, a sub-batch padded to its own capture size), and the CPU tests run it so.
            graph_capture=self.options.cuda_graph and machine.cuda_available(),
            capture_bs=capture_bs,
            fill_value=fill_value,
        )

    def replay(self, options: ReplayOptions | None = None, backends: tuple[str, ...] | None = None, *, trace: Trace | None = None) -> ReplayResult:
        """Replay the step (or `trace`, the same batch with another plan) with the step's shared data.
        Replays of the step itself are memoized per (options, backends)."""
        options = self._with_backend_options(options)
        names = backends if backends is not None else self.backends()
        if trace is not None:
            return self._replay(trace, options, names, self.data(options.layer))
        key = (options, names)
        if key not in self._replays:
            self._replays[key] = self._replay(self.trace, options, names, self.data(options.layer))
        return self._replays[key]

    def replay_sub_batch(self, sub: SubBatch, options: ReplayOptions, backends: tuple[str, ...], *, part: str) -> ReplayResult:
        """Replay `sub`, a sub-batch of the step (attndbg.trace.subbatch), on its rows of the step's
        data, as `replay` replays the step: the step's adapters and --backend-option, each launch
        announced with `part` ("request 3 alone"), so a crash in it names the sub-batch."""
        options = self._with_backend_options(options)
        return self._replay(sub.trace, options, backends, self.data(options.layer).sub_batch(sub), part=part)

    def _with_backend_options(self, options: ReplayOptions | None) -> ReplayOptions:
        options = options or ReplayOptions(layer=self.options.layer)
        return replace(options, backend_options=self.options.backend_options.overridden_by(options.backend_options))

    def _replay(self, trace: Trace, options: ReplayOptions, names: tuple[str, ...], data: StepData, part: str | None = None) -> ReplayResult:
        def adapter(name: str) -> Backend:
            return self.adapter(name, options.backend_options)

        return self._note_compared(replay(trace, self.path, list(names), options, data=data, adapter=adapter, part=part))

    def run_derived(self, name: str, options: BackendOptions, *, what: str) -> BackendRun:
        """One eager run of `name`'s derived plan with `options` forced (over --backend-option), on
        the step's shared data, announced as `what`: a detector's own run of one configuration.
        Counted among the backends consulted when it was compared with the reference: the verdict
        says which steps no kernel was compared on, and a step whose only kernel runs are these
        (split-merge's cascade on an extend) was compared."""
        options = self.options.backend_options.overridden_by(options)
        run = run_derived(self.trace, self.adapter(name, options), data=self.data(self.options.layer), what=what)
        if run.comparison is not None:
            self._compared.setdefault(name)
        return run
