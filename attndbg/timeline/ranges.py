"""What an attndbg range names: step, backend, variant, phase, read from its NVTX messages.

`profiling.phase(name, detail)` writes `attndbg/<name> <detail>`, where detail is `key=value`
words: the step's label (`step=0 mode=DECODE bs=3`, `profiling.step_label`), the step file's name
on the range around all of its work (`attndbg/step trace=decode_gqa.pt ...`, `profiling.step_range`:
step numbers repeat from file to file) and what the phase adds
(`backend=triton variant=eager`, `variant=graph capture_bs=8 fill=1`; `variant=padded ...` where the
graph's padded sequence ran eagerly, nothing captured; `probe=decode_stage2 on crafted partials`
on a launch that is no run of the step: a detector's merge of crafted states). Under `record`, an
engine's recorded step is one range, `attndbg/engine engine=transformers step=3 mode=DECODE bs=3
graph=replay graph_bs=8` (graph: eager, capture or replay), its variant read as `graph replay bs=8`.
A word without `=`
belongs to the value before it (`variant=recorded plan`). A range names what its own message says and what
its enclosing ranges say (a `plan` range inside `backend/triton` is triton's), the inner words
winning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from attndbg.timeline.records import Range

PREFIX = "attndbg/"


def parse(message: str) -> tuple[str, dict[str, str]]:
    """'attndbg/run step=0 mode=DECODE bs=3 backend=triton variant=recorded plan' ->
    ('run', {'step': '0', 'mode': 'DECODE', 'bs': '3', 'backend': 'triton', 'variant': 'recorded plan'})."""
    name, _, detail = message.removeprefix(PREFIX).partition(" ")
    words: dict[str, str] = {}
    last = ""
    for token in detail.split():
        key, eq, value = token.partition("=")
        if eq and key:
            words[key] = value
            last = key
        elif last:
            words[last] += " " + token
    kind, _, what = name.partition("/")
    if kind in ("backend", "detector") and what:
        words.setdefault(kind, what)
    return name, words


@dataclass(frozen=True)
class Names:
    """What one range names, its enclosing ranges' words included ("" where nothing says)."""

    phase: str  # the range's own name: "run", "plan", "replay", "reference", "backend/triton", "detector/split-merge"
    step: str = ""
    trace: str = ""  # the step file's name ("decode_gqa.pt"), from the enclosing `step` range
    mode: str = ""
    batch_size: str = ""
    backend: str = ""
    variant: str = ""  # "eager", "recorded plan", "graph bs=8 fill=1", "padded bs=8 fill=1" (not captured)
    probe: str = ""  # a launch on crafted inputs, in place of a variant: "decode_stage2 on crafted partials"
    detector: str = ""
    batch: str = ""  # inside a graph replay: which batch was replayed ("decoy", "real")

    def label(self) -> str:
        """'run · triton · eager', what a summary line or trace event is called."""
        return " · ".join(part for part in (self.phase, self.backend, self.variant, self.probe, self.batch) if part)


def names(range_: Range, by_id: Mapping[int, Range]) -> Names:
    """The names `range_` carries, read from it and its enclosing ranges (`by_id`: its process's ranges)."""
    chain: list[Range] = []
    seen: set[int] = set()
    current: Range | None = range_
    while current is not None and current.id not in seen:  # a parent cycle would be our bug: stop rather than spin
        chain.append(current)
        seen.add(current.id)
        current = by_id.get(current.parent) if current.parent is not None else None
    words: dict[str, str] = {}
    for outer in reversed(chain):
        words.update(parse(outer.message)[1])
    phase, _ = parse(range_.message)
    variant = words.get("variant", "")
    if variant in ("graph", "padded") and "capture_bs" in words:
        variant = f"{variant} bs={words['capture_bs']}" + (f" fill={words['fill']}" if "fill" in words else "")
    elif not variant and "graph" in words:  # an engine's step (record)
        variant = words["graph"] if words["graph"] == "eager" else f"graph {words['graph']} bs={words.get('graph_bs', '?')}"
    return Names(
        phase=phase,
        step=words.get("step", ""),
        trace=words.get("trace", ""),
        mode=words.get("mode", ""),
        batch_size=words.get("bs", ""),
        backend=words.get("backend", ""),
        variant=variant,
        probe=words.get("probe", ""),
        detector=words.get("detector", ""),
        batch=words.get("batch", ""),
    )
