"""The layering of attndbg/compare/__init__.py: compare (formats, result types) sits below the
runner (replay), which sits below whatever judges or renders its results. An import the other way
is the old replay <-> compare cycle coming back; read every import, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attndbg

ROOT = Path(attndbg.__file__).parent
# What each layer may not import: everything above it.
ABOVE = {
    "compare": ("replay", "checks", "detectors", "diagnose", "report", "cli"),
    "replay": ("checks", "detectors", "diagnose", "report", "cli"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_layer_imports_nothing_above_it(layer: str) -> None:
    upward = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
        for path in sorted((ROOT / layer).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[:2] in (["attndbg", above] for above in ABOVE[layer])
    ]
    assert upward == []


def test_the_rule_sees_an_upward_import(tmp_path: Path) -> None:
    """The check above would catch the cycle as it was (compare.replay_diff importing replay.saved)."""
    bad = tmp_path / "replay_diff.py"
    bad.write_text("def f():\n    from attndbg.replay.saved import SavedReplay\n")
    assert (2, "attndbg.replay.saved") in _imports(bad)
