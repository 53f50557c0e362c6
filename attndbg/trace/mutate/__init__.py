"""`attndbg synth --inject KIND`: traces carrying a realistic mistake of one class.

Each module of this package exposes `INJECTIONS: dict[str, Callable[[Trace], Trace]]`, keyed
`<class>:<mistake>` (e.g. "tree-mask:bit-order"), each function documented with the real bug it
imitates (../shared/reference/bugs.md). A mutated trace stays loadable: the mistake is in what the
engine *recorded* (plan, spec mask, graph padding, tensors), never in the batch ground truth.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from attndbg.trace.schema import Trace

_MODULES = ("invariants", "tree_mask", "fill_value", "split_merge")


def injections() -> dict[str, Callable[[Trace], Trace]]:
    out: dict[str, Callable[[Trace], Trace]] = {}
    for name in _MODULES:
        try:
            module = importlib.import_module(f"attndbg.trace.mutate.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"attndbg.trace.mutate.{name}":
                raise
            continue
        out.update(module.INJECTIONS)
    return out


def inject(trace: Trace, kind: str) -> Trace:
    table = injections()
    if kind not in table:
        raise KeyError(kind)
    return table[kind](trace)
