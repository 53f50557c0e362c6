"""Which plan each run of a FlashInfer dump used, and which runs form one cascade.

A run uses the latest plan *of the same wrapper*: pairs are keyed by (process_id, self_id), in
session order (interop.md §1.6; flashinfer-bench pairs by process only, which mixes SGLang's
ragged, paged and decode wrappers). An `__init__` with a known key starts a new wrapper (CPython
reuses ids). One plan serves every layer's run until the next plan: the run's index since its
plan is its layer. SGLang's cascade extend is a ragged run and a paged run (each returning its
LSE) followed by `merge_state` of the two (interop.md §1.5).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from attndbg.interop.flashinfer_dump import Call


class Kind(enum.Enum):
    DECODE = "DecodeWithPagedKVCacheWrapper"
    PAGED = "BatchPrefillWithPagedKVCacheWrapper"
    RAGGED = "BatchPrefillWithRaggedKVCacheWrapper"
    MLA = "BatchMLAPagedAttentionWrapper"

    @classmethod
    def of(cls, wrapper: str) -> Kind | None:
        # CUDAGraphBatchDecodeWithPagedKVCacheWrapper logs its plan/run under its own name.
        return next((k for k in cls if wrapper.endswith(k.value)), None)


@dataclass(frozen=True)
class Run:
    """One attention run with the plan and constructor of its wrapper (None: not in the dump)."""

    kind: Kind
    run: Call
    plan: Call | None
    init: Call | None
    layer: int  # runs of this wrapper since its plan


@dataclass(frozen=True)
class Cascade:
    """SGLang's cached extend: new tokens through the ragged wrapper, the prefix through the paged
    one (non-causal), their states merged by `merge_state`."""

    ragged: Run
    paged: Run
    merge: Call


@dataclass
class _Wrapper:
    init: Call | None = None
    plan: Call | None = None
    runs: int = 0


def pair_runs(calls: list[Call]) -> tuple[list[Run | Cascade], list[str]]:
    """Runs (and cascades) in session order, with notes on calls that are none of them."""
    wrappers: dict[tuple[int, int | None], _Wrapper] = {}
    out: list[Run | Cascade] = []
    notes: list[str] = []
    for call in calls:
        if call.function.startswith("merge_state"):
            cascade = _cascade(out, call)
            if cascade is None:
                notes.append(f"{call.directory.name}: {call.function} not after a ragged and a paged run of one process: not imported (a merge alone is no attention step)")
            continue
        kind = Kind.of(call.wrapper)
        if kind is None:
            notes.append(f"{call.directory.name}: {call.function} is not an attention wrapper attndbg imports")
            continue
        key = (call.process_id, call.self_id)
        if call.method == "__init__":
            wrappers[key] = _Wrapper(init=call)
        elif call.method == "plan":
            state = wrappers.setdefault(key, _Wrapper())
            state.plan, state.runs = call, 0
        elif call.method in ("run", "forward", "forward_return_lse", "run_return_lse"):
            state = wrappers.setdefault(key, _Wrapper())
            out.append(Run(kind=kind, run=call, plan=state.plan, init=state.init, layer=state.runs))
            state.runs += 1
        else:
            notes.append(f"{call.directory.name}: {call.function}: not a plan or run")
    return out, notes


def _cascade(items: list[Run | Cascade], merge: Call) -> Cascade | None:
    """Replace the last two runs with their cascade when they are a ragged and a paged run of the
    merge's process."""
    if len(items) < 2 or not all(isinstance(i, Run) and i.run.process_id == merge.process_id for i in items[-2:]):
        return None
    a, b = items[-2], items[-1]
    kinds = {a.kind, b.kind}
    if kinds != {Kind.RAGGED, Kind.PAGED}:
        return None
    ragged, paged = (a, b) if a.kind is Kind.RAGGED else (b, a)
    cascade = Cascade(ragged=ragged, paged=paged, merge=merge)
    del items[-2:]
    items.append(cascade)
    return cascade
