"""How a backend's run of a step was made: its variant, as a closed set of types.

    Eager()                 the plan derived from the batch, run once (or --repeat times)
    Recorded()              the plan the engine recorded in the trace
    Graph(capture_bs, fill) the derived plan padded to capture_bs rows (padded seq_lens = fill)
                            and replayed in a CUDA graph

Code matches on the types (`isinstance(run.variant, Graph)`, `match`); `label` is the text the
reports, the JSON (`variant`, docs/json.md) and the crash sink (`activity.launching`) show, and
`parse_variant` reads a label back where only the JSON is left (the verdict line of a folder).
Both live here, next to each other, so the strings exist in exactly one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Eager:
    @property
    def label(self) -> str:
        return "eager"


@dataclass(frozen=True)
class Recorded:
    @property
    def label(self) -> str:
        return "recorded plan"


@dataclass(frozen=True)
class Graph:
    capture_bs: int  # rows the graph was captured for; rows past the batch are padding
    fill: int  # the seq_len padded rows carry (the backend's fill value unless --fill-value)

    @property
    def label(self) -> str:
        return f"graph bs={self.capture_bs} fill={self.fill}"


Variant = Eager | Recorded | Graph

EAGER = Eager()
RECORDED = Recorded()

_GRAPH_LABEL = re.compile(r"graph bs=(\d+) fill=(-?\d+)")


def parse_variant(label: str) -> Variant:
    """The variant a `label` names (the inverse of `Variant.label`); ValueError for any other text."""
    if label == EAGER.label:
        return EAGER
    if label == RECORDED.label:
        return RECORDED
    graph = _GRAPH_LABEL.fullmatch(label)
    if graph is None:
        raise ValueError(f"{label!r} is not a run variant: expected 'eager', 'recorded plan' or 'graph bs=N fill=V'")
    return Graph(capture_bs=int(graph[1]), fill=int(graph[2]))


def run_name(backend: str, variant: Variant) -> str:
    """How reports name a run: the backend alone for its eager run, else backend and variant
    ('triton', 'triton recorded plan', 'triton graph bs=8 fill=1')."""
    return backend if isinstance(variant, Eager) else f"{backend} {variant.label}"
