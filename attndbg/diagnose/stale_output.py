"""An engine output that does not depend on its step's inputs, judged across a recording's steps.

A kernel left out of a captured CUDA graph (launched on another stream at capture, so never
captured: SGLang #5404, fixed by #5419 for merge_state_v2) does not run at replay: every replay
returns what sits in its output buffer, the output of the launch at capture. Within one step that
looks like any wrong output; across steps it is unmistakable: two steps whose q and new K/V differ
recorded the same output bits. No attention over different queries and keys gives identical bits,
so the model's claim is exact: the later step's output is the earlier one's, independent of its
own inputs.

Each step keeps a digest of its recorded layers (hashes of the output and of q, new k and v, by
layer and shape): small, so it travels from a check worker to the recording's state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from attndbg.trace.schema import Trace

NAME = "stale-output"
CAUSE = (
    "The step's output does not depend on its own inputs: it is bit for bit an earlier step's. A kernel that was "
    "left out of the captured CUDA graph (launched on another stream during capture, as SGLang's merge_state_v2 "
    "before #5419, SGLang #5404) does not run at replay, so its output buffer still holds an earlier launch's result."
)


@dataclass(frozen=True)
class OutputDigest:
    """What the stale-output judgement keeps of one recorded layer of one step."""

    step: int
    layer: int
    group: tuple  # (tp rank, layer, output shape, dtype): outputs that can be compared
    graph: str  # "a replay of the decode graph captured at bs=8", or "an eager step"
    output: str  # hash of the output's bytes
    inputs: str  # hash of q, new k and new v


@dataclass(frozen=True)
class StaleOutput:
    """A step whose recorded output is an earlier step's, bit for bit, though its inputs differ."""

    step: int
    layer: int
    earlier_step: int
    graph: str
    earlier_graph: str

    @property
    def mechanism(self) -> str:
        return NAME

    @property
    def summary(self) -> str:
        return "an output independent of this step's inputs: bit for bit an earlier step's output (a kernel outside the captured graph)"

    def to_json(self) -> dict:
        return {
            "mechanism": NAME,
            "summary": self.summary,
            "params": [{"layer": self.layer, "earlier_step": self.earlier_step, "graph": self.graph, "earlier_graph": self.earlier_graph}],
        }


def _hash(*tensors: Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        flat = t.detach().cpu().contiguous().flatten()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def _graph(trace: Trace) -> str:
    graph = trace.graph
    mode = trace.batch.forward_mode.value
    if graph is not None and graph.is_graph_replay:
        return f"a replay of the {mode} graph captured at bs={graph.capture_bs}"
    return f"an eager {mode} step"


def output_digests(trace: Trace) -> tuple[OutputDigest, ...]:
    """One digest per recorded layer that holds the engine's output."""
    out = []
    for layer, tensors in sorted(trace.tensors.items()):
        if tensors.output is None or tensors.output.numel() == 0:
            continue
        group = (trace.source.tp_rank, layer, tuple(tensors.output.shape), str(tensors.output.dtype))
        inputs = _hash(tensors.q, tensors.k_new, tensors.v_new)
        out.append(OutputDigest(trace.source.step, layer, group, _graph(trace), _hash(tensors.output), inputs))
    return tuple(out)


class StaleOutputs:
    """The digests seen so far, by group and output hash (the first step that produced each)."""

    def __init__(self) -> None:
        self.first: dict[tuple, dict[str, OutputDigest]] = {}

    def observe(self, digests: tuple[OutputDigest, ...]) -> list[StaleOutput]:
        found = []
        for now in digests:
            seen = self.first.setdefault(now.group, {})
            earlier = seen.setdefault(now.output, now)
            if earlier is not now and earlier.inputs != now.inputs:
                found.append(StaleOutput(now.step, now.layer, earlier.step, now.graph, earlier.graph))
        return found
