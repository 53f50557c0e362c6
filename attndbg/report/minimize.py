"""`attndbg minimize`'s result, for people: what was kept, what was removed, before and after."""

from __future__ import annotations

from attndbg.minimize.search import Outcome
from attndbg.plural import counted
from attndbg.trace.schema import Trace


def step_line(trace: Trace) -> str:
    """One line of the step's size: mode, requests, tokens, KV lengths, heads, page, graph padding."""
    b, m = trace.batch, trace.model
    lens = b.kv_lens.tolist()
    shown = ", ".join(map(str, lens[:8])) + (f", ... ({len(lens)})" if len(lens) > 8 else "")
    graph = f", graph capture_bs={trace.graph.capture_bs}" if trace.graph is not None else ""
    return f"{b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens=[{shown}] heads {m.num_qo_heads}:{m.num_kv_heads} page {m.page_size}{graph}"


def render_outcome(outcome: Outcome, backend: str, output: str) -> str:
    removed = "; ".join(outcome.removed) if outcome.removed else "nothing (no smaller step shows it)"
    skipped = f"; {outcome.invalid} not applicable or refused by the loader" if outcome.invalid else ""
    symptom = f"; its repro's symptom: {outcome.symptom}" if outcome.symptom else "; its repro's symptom: none kept (the step's script did not reproduce)"
    return "\n".join(
        [
            f"kept:    {outcome.target} with --backend {backend}{symptom}",
            f"removed: {removed}",
            f"before:  {step_line(outcome.original)}",
            f"after:   {step_line(outcome.trace)}",
            f"wrote {output}: {counted(outcome.tried, 'candidate')} checked, each in a fresh worker process{skipped}; {outcome.seconds:.0f} s",
        ]
    )
