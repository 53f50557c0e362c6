"""transformers' CUDA graphs as the recorder sees them: which graph a step captures or replays, the
in-graph probes of its layers (record/probes.py), the pointer audit of its inputs
(record/pointer_audit.py) and the logits' finiteness flag `--when nan` reads.

`ModelRunner.compute_batch` decides per step (transformers 5.20-5.24): no graph for the path
(`_get_forward_fn` -> use_cuda_graph False: eager); a graph for the device IO's key
(`_get_graph_key`: padded query tokens, and for the varlen path the padded KV reads) that is not
captured yet (`_capture_graph`: one eager warm-up forward, then the capture; the warm-up computes
the step); or one that is (`graph.replay()`). Async batching alternates two IO pairs with a graph
set each, so a graph is keyed by its IO object too.

The graphs' inputs are `batch_data`'s tensors: views of the IO's static storage
(`get_model_kwargs`), the same addresses at every step unless something reallocates them. The KV
cache is left out of the audit (allocated once; walking it every replay would cost more than the
check is worth).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attndbg.record.pointer_audit import PointerAudit
from attndbg.record.probes import Phase, ProbeBook

AUDIT_SKIP = ("cache",)  # batch_data entries not audited (see the module docstring)

BOOK = ProbeBook()
AUDIT = PointerAudit()
_hooked_models: weakref.WeakSet[Any] = weakref.WeakSet()


def current_io(io: Any, side: str) -> Any:
    """The IO object this step uses: async batching (CUDA graphs without an attention mask)
    alternates two host/device IO pairs; the host side was prepared with the step's requests, the
    device side holds its graphs and padded sizes. Sync batching has one object for both."""
    pairs = getattr(io, "io_pairs", None)
    return getattr(pairs[io.current_pair], f"{side}_io") if pairs is not None else io


@dataclass(frozen=True)
class GraphStep:
    phase: str  # probes.Phase: EAGER, CAPTURE or REPLAY
    key: Hashable | None  # (id of the device IO, transformers' graph key); None when eager
    padded_tokens: int | None  # the query tokens the graph is captured for


EAGER = GraphStep(Phase.EAGER, None, None)


def graph_step(runner: Any) -> GraphStep:
    """What `compute_batch` is about to do, read from the host side alone (no device read)."""
    io = runner.inputs_and_outputs
    _, use_graph = runner._get_forward_fn(use_block_table=io.use_block_table)
    if not use_graph:
        return EAGER
    graph_io = current_io(io, "device")
    key = graph_io._get_graph_key()
    captured = graph_io.graphs.get_graph(key) is not None
    return GraphStep(Phase.REPLAY if captured else Phase.CAPTURE, (id(graph_io), tuple(key)), int(graph_io.num_q_tokens))


def compute_stream(runner: Any) -> torch.cuda.Stream | None:
    """The stream the step's forward runs on (None: the current one, or the CPU)."""
    return getattr(runner.inputs_and_outputs, "compute_stream", None)


def audited(batch_data: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in batch_data.items() if name not in AUDIT_SKIP}


def hook_logits(model: Any, on_logits: Any) -> None:
    """`on_logits(logits)` after each forward of `model` (registered once per model)."""
    if model in _hooked_models:
        return

    def after_forward(module: Any, args: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if isinstance(logits, Tensor):
            on_logits(logits)

    model.register_forward_hook(after_forward)
    _hooked_models.add(model)


def finite_rows(logits: Tensor) -> Tensor:
    """[rows] bool: each logits row free of NaN and Inf (one reduction on the device)."""
    return torch.isfinite(logits.reshape(-1, logits.shape[-1])).all(dim=-1)
