"""The kernel library calls an adapter makes for one step, captured by running the adapter itself.

`attndbg repro` must call the library exactly as the adapter does (wrapper class, constructor and
plan() arguments, backend=, dtypes, workspace, the merge). Rather than a second description of
those calls that could drift from the adapter, the adapter's own code runs once against a
stand-in for the library that records every call and returns tensors of the right shapes. The
script is then written from the record (script.py). Nothing runs on a GPU here: tensors the
adapter moves to or makes on CUDA are made on the CPU and tagged (`CUDA_TAG`) while capturing.

Two code paths are captured:
    eager   `backend.run(trace, inputs, plan)`
    graph   attndbg's graph harness (replay/graph.py) over the adapter's `graph_state`: the state's
            construction (static buffers, `use_cuda_graph=True` wrappers), its `load_plan` of the
            padded plan, and its `forward` on the static inputs, each phase's calls kept apart

Per backend, what stands in for the library:
    triton      `_kernels()` -> (decode, extend): our Triton kernels, called by keyword
    flashinfer  `_flashinfer()` -> the flashinfer module; its workspace and plan-copy wait
    fa3, mla    the `flashinfer` and `flashinfer.mla` modules (they import them by name), the
                implementation choice pinned to FlashInfer's (fa3: SM90's backend="fa3")
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from attndbg.backends.base import AttentionInputs, AttentionResult, Backend, Padding
from attndbg.trace.schema import Plan, Trace

CUDA_TAG = "_attndbg_repro_cuda"  # set on a tensor the adapter moved to CUDA
# Calls that hand back (output, lse).
RUN_CALLS = ("run", "forward", "merge_state")


class Expr(str):
    """A value the script computes where it runs (written as this expression, not as a literal)."""

    def __repr__(self) -> str:
        return str(self)


# FlashInfer's MLA kernel family, chosen on the script's GPU as the adapter chooses it on its own.
MLA_BACKEND = Expr("MLA_BACKEND")


@dataclass
class Call:
    target: str  # "flashinfer.BatchDecodeWithPagedKVCacheWrapper", "w0.plan", "decode.decode_attention_fwd"
    args: tuple
    kwargs: dict[str, Any]
    result: Any = None  # a `Library` object (a wrapper) or the tensors handed back


@dataclass
class Library:
    """A stand-in for a module, class or object of the kernel library: records what is called."""

    name: str
    record: list[Call] = field(default_factory=list)
    shapes: tuple = ()  # (tokens, heads, v_head_dim, out dtype): what a run() hands back
    counter: list[int] = field(default_factory=lambda: [0])

    def __getattr__(self, attr: str) -> Library:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Library(f"{self.name}.{attr}", self.record, self.shapes, self.counter)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        parts = self.name.rsplit(".", 2)
        last, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
        # A class makes an object; so does a class's factory (MLAPlanMetadata.csr(...)).
        if last[:1].isupper() or owner[:1].isupper():
            result: Any = Library(f"w{self.counter[0]}", self.record, self.shapes, self.counter)
            self.counter[0] += 1
        elif last in RUN_CALLS:
            tokens, heads, width, dtype = self.shapes
            result = (torch.zeros(tokens, heads, width, dtype=dtype), torch.zeros(tokens, heads, dtype=torch.float32))
        else:
            result = None
        self.record.append(Call(self.name.lstrip("."), args, kwargs, result))
        return result


def _to_cuda(original):
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            copy = self.clone()
            setattr(copy, CUDA_TAG, True)
            return copy
        return original(self, *args, **kwargs)

    return to


def _made_on_cpu(original):
    """torch.zeros/full/empty: a tensor asked for on CUDA is made on the CPU, tagged."""

    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            made = original(*args, **{**kwargs, "device": "cpu"})
            setattr(made, CUDA_TAG, True)
            return made
        return original(*args, **kwargs)

    return make


@contextlib.contextmanager
def stand_ins(backend: Backend, library: Library) -> Iterator[None]:
    """The library replaced by `library` for `backend`'s code, for as long as the block runs."""
    import attndbg.backends.triton as triton_adapter

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "to", _to_cuda(torch.Tensor.to)))
        for factory in ("zeros", "full", "empty"):
            stack.enter_context(mock.patch.object(torch, factory, _made_on_cpu(getattr(torch, factory))))
        if backend.name == "triton":
            stack.enter_context(mock.patch.object(triton_adapter, "_kernels", lambda: (library.decode, library.extend)))
        elif backend.name in ("flashinfer", "fa3", "mla"):
            import attndbg.backends.flashinfer as flashinfer_adapter
            from attndbg.backends.flashinfer_runtime import WORKSPACE_BYTES

            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
            setattr(workspace, CUDA_TAG, True)
            module = library.flashinfer
            stack.enter_context(mock.patch.dict(sys.modules, {"flashinfer": module, "flashinfer.mla": module.mla}))
            stack.enter_context(mock.patch.object(flashinfer_adapter, "_flashinfer", lambda: module))
            for adapter_module in _adapter_modules():
                stack.enter_context(mock.patch.object(adapter_module, "wait_for_pending_plans", lambda: None))
            stack.enter_context(mock.patch.object(flashinfer_adapter.FlashInferBackend, "_workspace", lambda self: workspace))
            stack.enter_context(_pinned_to_flashinfer(backend))
        else:
            raise NotImplementedError(f"repro writes scripts for the triton, flashinfer, fa3 and mla backends; not for {backend.name}")
        yield


def _adapter_modules() -> list:
    import attndbg.backends.fa3 as fa3_adapter
    import attndbg.backends.flashinfer as flashinfer_adapter
    import attndbg.backends.mla as mla_adapter

    return [flashinfer_adapter, fa3_adapter, mla_adapter]


@contextlib.contextmanager
def _pinned_to_flashinfer(backend: Backend) -> Iterator[None]:
    """fa3 and mla choose their implementation from this machine (a GPU, its arch, what is
    installed); a script is written for FlashInfer's: fa3 through backend="fa3" (SM90), mla
    through BatchMLAPagedAttentionWrapper. Nothing to pin for flashinfer itself."""
    import attndbg.backends.fa3 as fa3_adapter
    import attndbg.backends.mla as mla_adapter

    with contextlib.ExitStack() as stack:
        if backend.name == "fa3":
            stack.enter_context(mock.patch.object(fa3_adapter, "select_impl", lambda: fa3_adapter.Impl.FLASHINFER))
        elif backend.name == "mla":
            stack.enter_context(mock.patch.object(type(backend), "impl", lambda self: mla_adapter.MLAImpl.FLASHINFER))
            stack.enter_context(mock.patch.object(mla_adapter, "_flashinfer_backend_name", lambda: MLA_BACKEND))
        yield


def pinned(backend: Backend) -> contextlib.AbstractContextManager:
    """What the adapter decides (capabilities, plans) as it decides it for the script's library."""
    return _pinned_to_flashinfer(backend) if backend.name in ("fa3", "mla") else contextlib.nullcontext()


def _library(trace: Trace, tokens: int, dtype: torch.dtype) -> Library:
    m = trace.model
    width = m.kv_lora_rank if m.kv_lora_rank else m.v_head_dim
    return Library("", shapes=(tokens, m.num_qo_heads, width, dtype))


def capture(backend: Backend, trace: Trace, inputs: AttentionInputs, plan: Plan) -> tuple[list[Call], AttentionResult]:
    """The library calls `backend.run(trace, inputs, plan)` makes, in order, and what it returned."""
    library = _library(trace, inputs.q.shape[0], inputs.q.dtype)
    with stand_ins(backend, library):
        result = backend.run(trace, inputs, plan)
    return library.record, result


@dataclass
class GraphCapture:
    """The graph path's calls by phase, and the harness's static tensors they read."""

    build: list[Call]  # the graph state's construction: wrappers with use_cuda_graph=True
    load: list[Call]  # load_plan of the padded plan, outside the graph
    forward: list[Call]  # inside the graph
    static: AttentionInputs  # the static inputs forward reads (the cache before the step's write)
    values: dict[str, torch.Tensor]  # their contents once loaded: real rows, then padded garbage
    loc: torch.Tensor  # [capacity tokens] where the captured write puts each row's new K/V
    used: int  # rows of the capacity this batch uses: real tokens, then padded requests' tokens
    result: AttentionResult  # what forward handed back (static output views)


def capture_graph(backend: Backend, trace: Trace, inputs: AttentionInputs, plan: Plan, *, padding: Padding, plans: list[Plan], seed: int) -> GraphCapture:
    """The calls of one padded graph replay, as replay/graph.py's harness makes them: the adapter's
    graph state built for `padding.capture_bs`, `plan` (covering capture_bs requests) loaded into
    it, one forward on the static inputs. `plans`: every plan the static buffers must hold."""
    from attndbg.replay.graph import GraphHarness

    library = _library(trace, padding.capture_bs * int(trace.batch.extend_lens.max()), inputs.q.dtype)
    with stand_ins(backend, library):
        harness = GraphHarness(backend, trace, inputs, padding=padding, plans=plans, traces=[trace], seed=seed)
        built = len(library.record)
        harness.load(trace, inputs, plan)
        loaded = len(library.record)
        values = {name: getattr(harness.static, name).clone() for name in ("q", "k_new", "v_new")}
        result = harness.state.forward(harness.static)
    return GraphCapture(
        build=library.record[:built],
        load=library.record[built:loaded],
        forward=library.record[loaded:],
        static=harness.static,
        values=values,
        loc=harness.loc.clone(),
        used=harness.used,
        result=result,
    )
