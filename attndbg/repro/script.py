"""Write a standalone reproduction script of one step: `attndbg repro`.

The script needs torch and the kernel library only (never attndbg): it rebuilds the step's tensors
(embedded when small, else in a `.pt` of plain tensors beside it), makes the library calls the
adapter makes (captured from the adapter's own code, capture.py), compares the output with a
float64 reference computed inline from the KV slots each query row sees (attndbg's visibility,
written out as data), prints the failing rows and the versions, and exits 1 when it reproduces (a
row beyond tolerance, or NaN/Inf where the reference is finite), 0 when not.

Two modes (`Mode`): eager, the adapter's run(); graph, a CUDA-graph replay as the engine ran the
step: the padded batch (capture_bs, the recorded padding, padded.py) through the adapter's graph
state (static buffers, `use_cuda_graph=True` wrappers), the step's KV write and the attention
captured with torch.cuda.graph and replayed after the plan is loaded again; the comparison is on
the real rows, and the padded rows' non-finite outputs are counted (any: it reproduces too).
Without a GPU the graph script runs the same sequence eagerly on the static buffers (Triton).

For the triton backend the "library" is our Triton kernels (SGLang's decode/extend design as we
ship them): their source is copied into the script, so it runs with torch and triton alone.
"""

from __future__ import annotations

import base64
import enum
import io as bytes_io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attndbg.backends import registry
from attndbg.backends.base import AttentionInputs, Backend, ScriptLibrary
from attndbg.backends.options import BackendOptions
from attndbg.replay.data import build_inputs
from attndbg.plans.guard import real_requests_only
from attndbg.repro import padded, template
from attndbg.repro.capture import CUDA_TAG, Call, capture, capture_graph, pinned
from attndbg.trace.schema import Plan, Trace
from attndbg.trace.visibility import visibility

# Tensors up to this many bytes (saved) are embedded in the script as base64; larger go beside it.
EMBED_BYTES = 256 * 1024
INPUTS = ("q", "k_new", "v_new", "k_cache", "v_cache")
# Keyword arguments the kernels write their results into: made NaN in the script, never shipped.
OUTPUT_KWARGS = ("out", "lse", "o", "o_extend", "lse_extend", "attn_logits", "attn_lse")


class Mode(enum.Enum):
    EAGER = "eager"
    GRAPH = "graph"


@dataclass(frozen=True)
class Repro:
    text: str  # the script
    tensors: dict[str, torch.Tensor]  # what it loads
    embedded: bool  # the tensors are in the script (else in `<script>.pt` beside it)
    plan_source: str  # "recorded" or "derived"
    mode: Mode
    note: str = ""  # what people should know of the choice (a graph step written eagerly, and why)


class _Writer:
    """Names every tensor the calls use and renders arguments as Python expressions; tensor
    definitions go to `defs` (module level), calls to the list the caller keeps."""

    def __init__(self, inputs: dict[str, torch.Tensor], plan: Plan, on_device: bool):
        self.inputs = inputs  # expression -> tensor: 'X["q"]', 'S["q"]'
        self.plan_names = {id(t): name for name, t in plan.tensors.items()}
        self.on_device = on_device  # every tensor to the device (Triton: its kernels take no host tensors)
        self.saved: dict[str, torch.Tensor] = {}
        self.defs: list[str] = []
        self.names: dict[int, str] = {}  # id(tensor) -> variable
        self.named: list[tuple[torch.Tensor, str]] = []  # tensors with a variable, for views of them

    def find(self, t: torch.Tensor) -> str | None:
        """`t` as an expression of a tensor already known (itself, or a view of its storage)."""
        if id(t) in self.names:
            return self.names[id(t)]
        known = [*((base, name) for name, base in self.inputs.items()), *self.named]
        for base, name in known:
            if t is base:
                return name
        for base, name in known:
            if t.numel() and base.numel() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                return f"{name}.as_strided({tuple(t.shape)}, {tuple(t.stride())}, {t.storage_offset()})"
        return None

    def tensor(self, t: torch.Tensor, hint: str, *, output: bool = False) -> str:
        found = self.find(t)
        if found is not None:
            return found
        # Where the adapter's caller keeps it: the plan's own tensors on the host (the runner hands
        # plans over as derived or recorded), what the adapter moved or made on the GPU there.
        device = "DEVICE" if self.on_device or getattr(t, CUDA_TAG, False) or id(t) not in self.plan_names else '"cpu"'
        if id(t) in self.plan_names:
            hint = self.plan_names[id(t)]
        elif t.dtype == torch.uint8 and hint.endswith("_arg0"):
            hint = "workspace"  # a wrapper's first argument
        var = re.sub(r"\W", "_", hint)
        while var in self.saved or var in self.names.values() or var in ("T", "X", "S"):
            var += "_"
        flat = t.flatten()
        if output or (t.numel() > 64 and (torch.isnan(flat).all() or bool((flat == flat[0]).all()))):
            value = "float('nan')" if output or torch.isnan(flat[0]) else repr(flat[0].item())
            self.defs.append(f"{var} = torch.full({tuple(t.shape)}, {value}, dtype={t.dtype}, device={device})")
        else:
            self.saved[var] = t.detach().cpu().clone()
            self.defs.append(f'{var} = T["{var}"].to({device})')
        self.names[id(t)] = var
        self.named.append((t, var))
        return var

    def value(self, v: Any, hint: str, *, output: bool = False) -> str:
        if isinstance(v, torch.Tensor):
            return self.tensor(v, hint, output=output and v.is_floating_point())
        if isinstance(v, (tuple, list)):
            inner = ", ".join(self.value(x, f"{hint}_{i}") for i, x in enumerate(v))
            return f"({inner},)" if isinstance(v, tuple) else f"[{inner}]"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return f"float('{v}')"
        if hasattr(v, "record"):  # a wrapper object made by an earlier call
            return v.name
        return repr(v)

    def call(self, index: int, call: Call) -> str:
        short = call.target.rsplit(".", 1)[-1]
        args = [self.value(a, f"{short}_arg{i}") for i, a in enumerate(call.args)]
        args += [f"{k}={self.value(v, k, output=k in OUTPUT_KWARGS)}" for k, v in call.kwargs.items()]
        text = f"{call.target}({', '.join(args)})"
        result = call.result
        if hasattr(result, "record"):
            return f"{result.name} = {text}"
        if isinstance(result, tuple):
            for j, t in enumerate(result):
                self.names[id(t)] = f"r{index}[{j}]"
            return f"r{index} = {text}"
        return text

    def result_of(self, call: Call) -> str:
        """The script's name of what a run call handed back (its tuple's variable)."""
        return self.names[id(call.result[0])].removesuffix("[0]") if isinstance(call.result, tuple) and call.result else ""

    def calls(self, calls: list[Call], start: int = 0) -> list[str]:
        return [self.call(start + i, c) for i, c in enumerate(calls)]


def _seen(trace: Trace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row, the KV slots it sees ([T, most] int64, -1 past the end), its request and its row within it."""
    batch = trace.batch
    rows: list[torch.Tensor] = []
    request, within = [], []
    for b in range(batch.batch_size):
        visible = visibility(trace, b)
        slots = batch.request_slots(b)
        for r in range(visible.shape[0]):
            rows.append(slots[visible[r]])
            request.append(b)
            within.append(r)
    most = max([r.numel() for r in rows], default=0)
    seen = torch.full((len(rows), most), -1, dtype=torch.int64)
    for t, r in enumerate(rows):
        seen[t, : r.numel()] = r
    return seen, torch.tensor(request, dtype=torch.int64), torch.tensor(within, dtype=torch.int64)


def _choose_mode(backend: Backend, trace: Trace, mode: Mode | None) -> tuple[Mode, str]:
    """The mode asked for, else graph for a step recorded as a graph replay that can be replayed so."""
    reason = padded.graph_reason(backend, trace)
    if mode is Mode.GRAPH and reason:
        raise ValueError(f"--graph: {reason}")
    if mode is not None:
        return mode, ""
    graph = trace.graph
    if graph is None or not graph.is_graph_replay:
        return Mode.EAGER, ""
    if reason:
        return Mode.EAGER, f"a graph replay written as an eager run: {reason}"
    return Mode.GRAPH, ""


def build(
    trace: Trace,
    backend_name: str,
    *,
    plan_source: str | None = None,
    layer: int | None = None,
    source_name: str = "",
    mode: Mode | None = None,
    backend_options: BackendOptions | None = None,
) -> Repro:
    """The script for `trace`'s step on `backend_name` (configured by its entry of
    `backend_options`): the recorded plan when the trace holds one of this backend (`plan_source`
    None or "recorded"), else the one the adapter derives; a graph replay when `mode` says so, or
    by default when the step was one."""
    backend = registry.create(backend_name, options=backend_options)
    # A script is how a known library defect at this shape is shown: it is written, not refused.
    backend.run_known_defects = True
    library = backend.script_library()
    if library is None:
        raise NotImplementedError(f"{backend_name} writes no repro scripts (its adapter states no library calls)")
    with pinned(backend):
        reason = backend.unsupported_reason(trace)
        if reason:
            raise ValueError(f"{backend_name} cannot run this step: {reason}")
        recorded = trace.plan is not None and trace.plan.backend == backend_name
        if plan_source == "recorded" and not recorded:
            raise ValueError(f"the trace holds no plan recorded by {backend_name}")
        use_recorded = recorded and plan_source != "derived"
        if use_recorded:
            _check_scalars(backend, trace)
        chosen, note = _choose_mode(backend, trace, mode)
        inputs = build_inputs(trace, layer=layer, device="cpu")
        if chosen is Mode.GRAPH:
            return _graph(backend, library, trace, inputs, use_recorded, source_name)
        plan = real_requests_only(trace, trace.plan) if use_recorded else backend.derive_plan(trace)
        calls, result = capture(backend, trace, inputs, plan)
    writer = _Writer({f'X["{n}"]': getattr(inputs, n) for n in INPUTS}, plan, on_device=library.tensors_on_device)
    lines = writer.calls(calls)
    output = writer.find(result.output)
    merge = backend.script_merge(plan, [writer.result_of(c) for c in calls if c.target.endswith(".run")]) if output is None else None
    if merge is not None:
        lines += ["", *merge.lines]
        output = merge.output
    if output is None:
        raise NotImplementedError(f"{backend_name}: this step's output is computed outside the library's calls (a merge in torch); not scripted yet")
    source = "recorded" if use_recorded else "derived"
    tensors = {**_tensors(trace, inputs, writer.saved), **(merge.tensors if merge is not None else {})}
    data, embedded = _embed(tensors)
    text = template.render(
        trace, backend_name, library, defs=writer.defs, calls=lines, output=output, plan_source=source, source_name=source_name, data=data
    )
    return Repro(text=text, tensors=tensors, embedded=embedded, plan_source=source, mode=Mode.EAGER, note=note)


def _check_scalars(backend: Backend, trace: Trace) -> None:
    """A recorded plan lacking a scalar its launch reads cannot be scripted: one line naming it."""
    declaration = backend.plan_declaration(trace, trace.plan)
    missing = [name for name in (declaration.scalars if declaration is not None else ()) if name not in trace.plan.scalars]
    if missing:
        raise ValueError(
            f"the recorded {trace.plan.backend} plan has no {', '.join(missing)} (scalars its launch reads; the recorder or importer did not write "
            "them): --plan derived scripts the adapter's own plan of the batch"
        )


def _graph(backend: Backend, library: ScriptLibrary, trace: Trace, inputs: AttentionInputs, use_recorded: bool, source_name: str) -> Repro:
    step = padded.padded_step(backend, trace, trace.plan if use_recorded else None)
    got = capture_graph(backend, trace, inputs, step.plan, padding=step.padding, plans=[step.plan, step.derived], seed=trace.seed)
    static = {f'S["{n}"]': getattr(got.static, n) for n in INPUTS}
    writer = _Writer(static, step.plan, on_device=library.tensors_on_device)
    build_lines = writer.calls(got.build)
    load_lines = writer.calls(got.load, len(got.build))
    forward_lines = writer.calls(got.forward, len(got.build) + len(got.load))
    output = writer.find(got.result.output)
    if output is None:
        raise NotImplementedError(f"{backend.name}: the graph's output is not a buffer the library writes; not scripted yet")
    mla = got.static.v_new.data_ptr() == got.static.k_new.data_ptr()
    extra = {f"S_{n}": v for n, v in got.values.items() if not (mla and n == "v_new")}
    tensors = {**_tensors(trace, inputs, writer.saved), **extra, "LOC": _recorded_loc(trace, got.loc, got.used)}
    data, embedded = _embed(tensors)
    source = "recorded" if use_recorded else "derived"
    text = template.render(
        trace,
        backend.name,
        library,
        defs=writer.defs,
        calls=build_lines,
        output=output,
        plan_source=source,
        source_name=source_name,
        data=data,
        graph=template.GraphParts(load=load_lines, forward=forward_lines, padding=step.padding, used=got.used, static_mla=mla),
    )
    return Repro(text=text, tensors=tensors, embedded=embedded, plan_source=source, mode=Mode.GRAPH)


def _recorded_loc(trace: Trace, loc: torch.Tensor, used: int) -> torch.Tensor:
    """Where the captured write puts each row's K/V: the harness's (out_cache_loc, padded rows at
    the dummy slot), with the padded rows' slots as the engine recorded them where it did."""
    recorded = trace.graph.padded_out_cache_loc.to(loc.dtype)
    tokens, end = trace.batch.num_tokens, min(used, recorded.numel())
    loc = loc.clone()
    loc[tokens:end] = recorded[tokens:end]
    return loc


def _tensors(trace: Trace, inputs: AttentionInputs, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen, request, within = _seen(trace)
    return {**{name: getattr(inputs, name).contiguous() for name in INPUTS}, **saved, "SEEN": seen, "REQUEST": request, "ROW": within}


def _embed(tensors: dict[str, torch.Tensor]) -> tuple[str | None, bool]:
    buffer = bytes_io.BytesIO()
    torch.save(tensors, buffer)
    embedded = buffer.tell() <= EMBED_BYTES
    return (base64.b64encode(buffer.getvalue()).decode() if embedded else None), embedded


def write(repro: Repro, path: str | Path) -> list[Path]:
    """The script at `path` (and its tensors beside it when not embedded); the files written."""
    path = Path(path)
    path.write_text(repro.text, encoding="utf-8")
    written = [path]
    if not repro.embedded:
        torch.save(repro.tensors, path.with_suffix(".pt"))
        written.append(path.with_suffix(".pt"))
    return written
