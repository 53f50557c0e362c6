"""What the code knows about a backend lives in backends/: no backend name is written as a string in
attndbg/checks, attndbg/detectors, attndbg/trace or attndbg/replay, and none is compared
with (`==`, `!=`, `in`) anywhere outside backends/ and the engine recorders of attndbg/record. A
line may keep one only with a comment saying why ("names a backend: ..." or "not a backend name:
..."); the tests read string tokens, so names in comments and docstring prose are free, but a whole
string equal to a name is not."""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

from attndbg.backends import engine_names, registry

PACKAGES = ("attndbg/checks", "attndbg/detectors", "attndbg/trace", "attndbg/replay")
ROOT = Path(__file__).resolve().parents[2]
JUSTIFIED = ("names a backend:", "not a backend name:")


def _backend_names() -> set[str]:
    """Every kernel adapter's name and every engine backend name attndbg knows. The reference is
    left out: it is the ground truth every run is compared with, not a kernel library."""
    names = set(engine_names.UNADAPTED)
    for cls in engine_names.adapters():
        if cls.name != "reference":
            names |= {cls.name, *cls.engine_names}
    return names


def _hits(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line number, line) of each plain string token equal to a name, on a line without a justification."""
    lines = source.splitlines()
    hits = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.STRING:
            continue
        body = token.string.lstrip("rbuRBU")
        if body[:1] not in "\"'" or body[:3] in ('"""', "'''"):
            continue  # f-strings are split into parts on 3.12; docstrings are prose
        line = lines[token.start[0] - 1]
        if body[1:-1] in names and not any(mark in line for mark in JUSTIFIED):
            hits.append((token.start[0], line.strip()))
    return hits


def test_no_backend_name_is_switched_on_outside_backends() -> None:
    names = _backend_names()
    assert {"triton", "flashinfer", "fa3", "mla", "FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"} <= names
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in _hits(path.read_text(), names)
    ]
    assert not hits, "backend names outside backends/ (move the knowledge onto the adapter):\n" + "\n".join(hits)


def test_the_scan_finds_a_planted_name() -> None:
    source = 'if plan.backend == "fa3":\n    pass\nx = "mla"  # not a backend name: an attention kind\ny = f"{x} on triton"\n'
    assert _hits(source, _backend_names()) == [(1, 'if plan.backend == "fa3":')]


def test_registry_knows_every_name_it_lists() -> None:
    for name in registry.BUILTIN:
        assert registry.adapter_class(name).name == name


# Comparisons of backend names are checked in every package of attndbg but these: backends/ owns
# the names, record/ hooks engine backends by theirs. A package that must compare one for now is
# listed in COMPARED_EXCEPTIONS with why (none today: repro/ asks each adapter for its library calls).
COMPARED_OWNERS = ("attndbg/backends/", "attndbg/record/")
COMPARED_EXCEPTIONS: dict[str, str] = {}


def _compared(source: str, names: set[str]) -> Iterator[int]:
    """The line of each comparison (==, !=, in, not in) with a string equal to a name, alone or in a
    tuple, list or set, on a line without a justification."""
    lines = source.splitlines()

    def strings(node: ast.expr) -> Iterator[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                yield from strings(element)

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if any(name in names for side in (node.left, *node.comparators) for name in strings(side)):
            if not any(mark in lines[node.lineno - 1] for mark in JUSTIFIED):
                yield node.lineno


def test_no_backend_name_is_compared_outside_backends_and_record() -> None:
    names = _backend_names()
    hits, excepted = [], set()
    for path in sorted((ROOT / "attndbg").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        if where.startswith(COMPARED_OWNERS):
            continue
        for line in _compared(path.read_text(), names):
            package = next((p for p in COMPARED_EXCEPTIONS if where.startswith(p + "/")), None)
            if package is not None:
                excepted.add(package)
            else:
                hits.append(f"{where}:{line}")
    assert excepted == set(COMPARED_EXCEPTIONS), "an exception no longer compares a backend name: remove it"
    assert not hits, "backend names compared outside backends/ and record/ (ask the adapter instead):\n" + "\n".join(hits)


def test_the_comparison_scan_finds_a_planted_one() -> None:
    source = 'if backend.name in ("flashinfer", "x"):\n    pass\nok = kind == "mla"  # not a backend name: an attention kind\nalso = name != "fa3"\n'
    assert list(_compared(source, _backend_names())) == [1, 4]
