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

The adapter takes the stand-in through the Backend contract (`library_calls`): each adapter
looks its library up through backends/script_calls.py, and chooses there what it would choose on
the script's machine. Nothing here knows a backend by name.
"""

from __future__ import annotations

import contextlib
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
    """`backend`'s library calls recorded by `library` (the Backend contract's library_calls), and
    the tensors it would make or move on CUDA made on the CPU and tagged, for as long as the block runs."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "to", _to_cuda(torch.Tensor.to)))
        for factory in ("zeros", "full", "empty"):
            stack.enter_context(mock.patch.object(torch, factory, _made_on_cpu(getattr(torch, factory))))
        stack.enter_context(backend.library_calls(library))
        yield


def pinned(backend: Backend) -> contextlib.AbstractContextManager:
    """What the adapter decides (capabilities, plans) as it decides it for the script's library."""
    return backend.library_calls(None)


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
