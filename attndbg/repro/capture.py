"""The kernel library calls an adapter makes for one step, captured by running the adapter itself.

`attndbg repro` must call the library exactly as the adapter does (wrapper class, constructor and
plan() arguments, backend=, dtypes, workspace, the merge). Rather than a second description of
those calls that could drift from the adapter, the adapter's own `run()` is executed once against
a stand-in for the library that records every call and returns tensors of the right shapes. The
script is then written from the record (script.py). Nothing runs on a GPU here: tensors the
adapter moves to CUDA are recorded as such (`Tensor.to("cuda")` is intercepted while capturing).

Per backend, what stands in for the library (the adapter's own loader functions, patched):
    triton      `_kernels()` -> (decode, extend): our Triton kernels, called by keyword
    flashinfer  `_flashinfer()` -> the flashinfer module; its workspace and plan-copy wait
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from attndbg.backends.base import AttentionInputs, Backend
from attndbg.trace.schema import Plan, Trace

CUDA_TAG = "_attndbg_repro_cuda"  # set on a tensor the adapter moved to CUDA


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
        last = self.name.rsplit(".", 1)[-1]
        if last[:1].isupper():  # a class: the call makes an object
            result: Any = Library(f"w{self.counter[0]}", self.record, self.shapes, self.counter)
            self.counter[0] += 1
        elif last in ("run", "forward", "merge_state"):
            tokens, heads, width, dtype = self.shapes
            result = (torch.zeros(tokens, heads, width, dtype=dtype), torch.zeros(tokens, heads, dtype=torch.float32))
        else:
            result = None
        self.record.append(Call(self.name, args, kwargs, result))
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


@contextlib.contextmanager
def _stand_ins(backend: Backend, library: Library) -> Iterator[None]:
    import attndbg.backends.triton as triton_adapter

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "to", _to_cuda(torch.Tensor.to)))
        if backend.name == "triton":
            stack.enter_context(mock.patch.object(triton_adapter, "_kernels", lambda: (library.decode, library.extend)))
        elif backend.name == "flashinfer":
            import attndbg.backends.flashinfer as flashinfer_adapter

            workspace = torch.zeros(flashinfer_adapter.WORKSPACE_BYTES, dtype=torch.uint8)
            setattr(workspace, CUDA_TAG, True)
            stack.enter_context(mock.patch.object(flashinfer_adapter, "_flashinfer", lambda: library.flashinfer))
            stack.enter_context(mock.patch.object(flashinfer_adapter, "wait_for_pending_plans", lambda: None))
            stack.enter_context(mock.patch.object(type(backend), "_workspace", lambda self: workspace))
        else:
            raise NotImplementedError(f"repro writes scripts for the triton and flashinfer backends; not yet for {backend.name}")
        yield


def capture(backend: Backend, trace: Trace, inputs: AttentionInputs, plan: Plan) -> list[Call]:
    """The library calls `backend.run(trace, inputs, plan)` makes, in order."""
    m = trace.model
    library = Library("", shapes=(inputs.q.shape[0], m.num_qo_heads, m.v_head_dim, inputs.q.dtype))
    with _stand_ins(backend, library):
        backend.run(trace, inputs, plan)
    for call in library.record:
        call.target = call.target.lstrip(".")
    return library.record
