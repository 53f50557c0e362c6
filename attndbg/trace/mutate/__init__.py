"""`attndbg synth --inject KIND`: traces carrying a realistic mistake of one class.

Each module of this package exposes `INJECTIONS: dict[str, Callable[[Trace], Trace]]`, keyed
`<class>:<mistake>` (e.g. "tree-mask:bit-order"), each function documented with the real bug it
imitates (../shared/reference/bugs.md). A mutated trace stays loadable: the mistake is in what the
engine *recorded* (plan, spec mask, graph padding, tensors), never in the batch ground truth.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def catalog() -> dict[str, str]:
    """Kind -> first line of its docstring, read from the modules' source without importing them.

    `attndbg synth --list` uses this so that listing stays instant (the modules import torch);
    `injections()` is the executable truth and a test keeps the two equal.
    """
    out: dict[str, str] = {}
    for name in _MODULES:
        path = Path(__file__).with_name(f"{name}.py")
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {f.name: ast.get_docstring(f) or "" for f in tree.body if isinstance(f, ast.FunctionDef)}
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and target.id == "INJECTIONS" and isinstance(node.value, ast.Dict):
                for key, value in zip(node.value.keys, node.value.values):
                    doc = docs.get(value.id, "") if isinstance(value, ast.Name) else ""
                    out[ast.literal_eval(key)] = (doc.strip().splitlines() or [""])[0]
    return out
