"""What each injection is, in one line, without importing it: `attndbg synth --list` stays instant.

An injections module (a detector's `injections`, named by module) imports torch; its
`INJECTIONS = {"kind:mistake": function, ...}` table and the functions' docstrings are read from
its source instead. A table built some other way (a third party's) is imported and read from the
functions: the same lines, only slower. A test keeps the source reading equal to the imported truth.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path

from attndbg.detectors.base import Detector, Injection


def first_line(doc: str | None) -> str:
    return ((doc or "").strip().splitlines() or [""])[0]


def injection_lines(detector: Detector) -> dict[str, str]:
    """KIND:MISTAKE -> the first line of its function's docstring, in the table's order."""
    if not isinstance(detector.injections, str):
        return _lines_of(detector.injections)
    read = _read_source(detector.injections)
    return read if read is not None else _lines_of(importlib.import_module(detector.injections).INJECTIONS)


def _lines_of(table: Mapping[str, Injection]) -> dict[str, str]:
    return {kind: first_line(func.__doc__) for kind, func in table.items()}


def _read_source(module: str) -> dict[str, str] | None:
    """The INJECTIONS table of `module`'s source, when it is a literal dict of string keys and
    function names defined in that module; None when it is not (import it instead)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    docs = {f.name: ast.get_docstring(f) for f in tree.body if isinstance(f, ast.FunctionDef)}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if not (isinstance(target, ast.Name) and target.id == "INJECTIONS"):
            continue
        if not isinstance(node.value, ast.Dict):
            return None
        out = {}
        for key, value in zip(node.value.keys, node.value.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Name) and value.id in docs):
                return None
            out[key.value] = first_line(docs[value.id])
        return out
    return None
