"""What a graph-replay repro runs: the step's padding as the engine recorded it, and the plan of
the padded batch.

The padding is the trace's graph section: capture_bs, and the seq_len its padded rows carry (the
smallest recorded in the padded rows, else the runner's fill value: a Padding holds one value, and
the smallest is the one a kernel may not take). The plan covers capture_bs requests, as the
engine's graph kernels read it:

    recorded   the engine's plan as recorded; where it covers the real requests only (synth, a
               recorder that trims), the padded requests' pieces of the adapter's padded plan are
               appended (minimize/plan.pad_plan); a tensor recorded at capture_bs rows is kept
    derived    the adapter's own plan for the padded batch (derive_plan with the Padding)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attndbg.backends.base import Backend, Padding
from attndbg.minimize.plan import pad_plan
from attndbg.replay import graph as graph_replay
from attndbg.trace.schema import Plan, Trace


@dataclass(frozen=True)
class PaddedStep:
    padding: Padding
    plan: Plan  # capture_bs requests
    derived: Plan  # the adapter's padded plan (the static buffers are sized to hold both)


def graph_reason(backend: Backend, trace: Trace) -> str | None:
    """Why `trace` cannot be scripted as a graph replay through `backend` (None: it can)."""
    graph = trace.graph
    if graph is None or not graph.is_graph_replay:
        return "the step was not recorded as a CUDA-graph replay (it has no graph padding to replay)"
    if graph.capture_bs < trace.batch.batch_size:
        return f"its graph section's capture_bs={graph.capture_bs} is below the batch's {trace.batch.batch_size} requests"
    if not graph_replay.supports_graph(trace):
        return f"{trace.batch.forward_mode.value} steps are not replayed under CUDA graphs (decode and tree verify are)"
    return backend.graph_unsupported_reason(trace)


def padding_of(trace: Trace) -> Padding:
    graph = trace.graph
    assert graph is not None
    padded = graph.padded_seq_lens[trace.batch.batch_size : graph.capture_bs]
    fill = int(padded.min()) if padded.numel() else graph.fill_value
    return Padding(capture_bs=graph.capture_bs, fill_value=max(fill, 0))


def padded_step(backend: Backend, trace: Trace, plan: Plan | None) -> PaddedStep:
    """The padding and the padded plan: `plan` (the recorded one) padded, or the derived one when None."""
    padding = padding_of(trace)
    derived = backend.derive_plan(trace, padding)
    if plan is None or padding.capture_bs == trace.batch.batch_size:
        return PaddedStep(padding, plan or derived, derived)
    return PaddedStep(padding, pad_plan(replace(trace, plan=plan), derived, capture_bs=padding.capture_bs), derived)
