"""No import cycle between attndbg's top-level packages (DESIGN.md "Layout": nothing
imports upward, no two packages import each other).

The rule, computed from the source with `ast` (nothing is imported):

- A node is a top-level part of attndbg: each package `attndbg/<name>/`, each module
  `attndbg/<name>.py` (cli, numerics, machine, ...), and the folder backends/, which installs as
  `attndbg.backends`. Modules inside one node may import each other freely.
- An edge A -> B is any import in a file of A that names a module of B: `import ...` and
  `from ... import ...` (relative ones resolved; `from attndbg import numerics` names the module
  numerics) wherever it stands, at module level, inside a function, under `if TYPE_CHECKING:`;
  and the lazy imports by name: a string constant passed to `importlib.import_module` (or
  `__import__`), and any string constant `attndbg.<module>:<attribute>`, the form in which
  detectors and backends name what their registries load. Function-local and type-only
  imports count: a lazy import only postpones the dependency, and a cycle hidden that way is the
  one that breaks first when someone moves the import to the top.
- The graph over nodes must have no cycle; a failure names each cycle and one file:line per edge.
  KNOWN_EDGES lists the edges of cycles tolerated for now, each with its reason.
- Inside one package, the same edges between its modules must have no circle either (an import of
  a module's own parent packages is no edge), and no module of one detector package
  (attndbg/detectors/<kind>/) imports another detector's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attndbg"
BACKENDS = ROOT / "backends"
# "module:attribute", as Detector and the backend registry name what they load lazily (a bare dotted
# string is not enough: "attndbg.replay" is also the saved-replay format's name).
# Known cycles, each edge that closes one named with why it is tolerated for now. The test fails
# when such an edge is gone too, so the entry goes with it.
KNOWN_EDGES = {
    # profiling.phase starts the timeline's CUPTI collection in a check worker by importing
    # attndbg.timeline.worker by name, and the timeline observes profiling's phases: the
    # worker start-up (checks/workers.py, above both) could attach it instead.
    ("profiling", "timeline"): "attndbg/profiling.py: importlib.import_module('attndbg.timeline.worker')",
}
MODULE_PATH = re.compile(r"attndbg(\.[A-Za-z_][A-Za-z0-9_]*)+:[A-Za-z_][A-Za-z0-9_.]*")


def _nodes() -> set[str]:
    nodes = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    nodes |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    return nodes | {"backends"}


def _sources() -> Iterator[tuple[str, Path]]:
    """(dotted module name as installed, file) for every source file of attndbg and backends/."""
    for base, prefix in ((PACKAGE, ("attndbg",)), (BACKENDS, ("attndbg", "backends"))):
        for path in sorted(base.rglob("*.py")):
            parts = prefix + path.relative_to(base).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imported(module: str, path: Path, tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every dotted module name this file may import, with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # `from attndbg import numerics` imports the module numerics
                yield f"{target}.{alias.name}", node.lineno
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.args[0].value, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            yield node.value.partition(":")[0], node.lineno


def _is_import_module(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def import_graph() -> dict[str, dict[str, str]]:
    """node -> {node it imports: 'file:line' of the first such import}."""
    nodes = _nodes()
    graph: dict[str, dict[str, str]] = {node: {} for node in nodes}
    for module, path in _sources():
        source = module.split(".")[1] if module.count(".") else None
        if source not in nodes:
            continue  # attndbg/__init__.py: the root, no node of its own
        for target, line in _imported(module, path, ast.parse(path.read_text(), str(path))):
            parts = target.split(".")
            if parts[0] != "attndbg" or len(parts) < 2 or parts[1] not in nodes or parts[1] == source:
                continue
            graph[source].setdefault(parts[1], f"{path.relative_to(ROOT)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_problems(graph: dict[str, dict[str, str]], known: dict[tuple[str, str], str], what: str) -> list[str]:
    """Each cycle of `graph` once the `known` edges are taken out (each must still exist), with one
    file:line per edge."""
    for a, b in known:
        assert b in graph[a], f"{a} -> {b} is gone: remove it from the known edges"
        del graph[a][b]
    problems = []
    for component in cycles(graph):
        edges = [f"{a} -> {b} ({graph[a][b]})" for a in component for b in component if b in graph[a]]
        problems.append(f"{what} {' <-> '.join(component)}: " + "; ".join(edges))
    return problems


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = import_graph()
    assert {"backends", "checks", "detectors", "diagnose", "detector_api", "plans", "numerics"} <= graph.keys()
    assert "detector_api" in graph["detectors"] and "diagnose" in graph["detectors"]  # the graph sees real imports
    problems = cycle_problems(graph, KNOWN_EDGES, "cycle")
    assert not problems, "\n".join(problems)


# The built-in adapters may share helpers (backends/flashinfer_runtime.py, plan_view.py, ...) but not
# import each other, except where one adapter runs another by composition.
ADAPTER_EDGES = {
    ("mla", "triton"): "mla's impl=triton is the triton adapter, held as MLABackend._triton and delegated to",
}


def _adapter_modules() -> dict[str, str]:
    """Adapter name -> its dotted module, read from registry.ADAPTERS's literal (nothing imported)."""
    tree = ast.parse((BACKENDS / "registry.py").read_text())
    table = next(
        node.value for node in tree.body if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ADAPTERS" for t in node.targets)
    )
    return {name: path.partition(":")[0] for name, path in ast.literal_eval(table).items()}


def test_no_adapter_module_imports_another() -> None:
    adapters = _adapter_modules()
    assert {"triton", "flashinfer", "fa3", "mla"} <= adapters.keys()
    by_module = {module: name for name, module in adapters.items()}
    found: dict[tuple[str, str], str] = {}
    for name, module in adapters.items():
        path = BACKENDS / (module.rpartition(".")[2] + ".py")
        for target, line in _imported(module, path, ast.parse(path.read_text(), str(path))):
            other = by_module.get(target) or by_module.get(target.rpartition(".")[0])
            if other is not None and other != name:
                found.setdefault((name, other), f"{path.relative_to(ROOT)}:{line}")
    for edge in ADAPTER_EDGES:
        assert edge in found, f"{edge[0]} -> {edge[1]} is gone: remove it from ADAPTER_EDGES"
    problems = [f"adapter {a} imports adapter {b} ({where})" for (a, b), where in sorted(found.items()) if (a, b) not in ADAPTER_EDGES]
    assert not problems, "\n".join(problems) + "\nshared helpers belong in a module of their own (e.g. backends/flashinfer_runtime.py)"


def test_the_rule_sees_lazy_relative_and_string_imports(tmp_path: Path) -> None:
    """A function-local import, a relative one, a 'module:attribute' string and import_module each
    make an edge; a dotted string that is not loaded does not."""
    source = (
        "from .. import numerics\n"
        "def f():\n"
        "    from attndbg.checks import run\n"
        "SPEC = 'attndbg.report.checks:render'\n"
        "importlib.import_module('attndbg.trace.io')\n"
        "FORMAT = 'attndbg.replay'\n"
    )
    path = tmp_path / "x.py"
    path.write_text(source)
    names = {name for name, _ in _imported("attndbg.detectors.x", path, ast.parse(source))}
    assert {"attndbg.numerics", "attndbg.checks", "attndbg.report.checks", "attndbg.trace.io"} <= names
    assert "attndbg.replay" not in names  # a format's name, not an import
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]


# -- inside a package ----------------------------------------------------------------------------
# Module circles inside one package, each edge that closes one named with why it is tolerated for
# now. A module's import of its own parent packages is no edge: importing any module runs its
# parents' __init__ first, and a package's __init__ may import its modules (cli/ registers its
# commands so).
KNOWN_MODULE_EDGES: dict[tuple[str, str], str] = {
    # The recording session makes its flight recorder in ring mode (a function-local import), and
    # the flight recorder, its ring and its spool write through the session's types: the session
    # could be handed a recorder factory by the bootstrap instead.
    ("attndbg.record.session", "attndbg.record.flight"): "attndbg/record/session.py: from attndbg.record.flight import FlightRecorder",
}


def module_graph(sources: Iterator[tuple[str, Path]] | None = None) -> dict[str, dict[str, str]]:
    """module -> {module of the same top-level package it imports: 'file:line' of the first such import}."""
    found = list(sources if sources is not None else _sources())
    modules = {module for module, _ in found}
    graph: dict[str, dict[str, str]] = {module: {} for module in modules}
    for module, path in found:
        package = module.split(".")[:2]
        for target, line in _imported(module, path, ast.parse(path.read_text(), str(path))):
            while target and target not in modules:
                target = target.rpartition(".")[0]  # `from a.b import name`: the module a.b
            if not target or target == module or target.split(".")[:2] != package or module.startswith(target + "."):
                continue
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            graph[module].setdefault(target, f"{where}:{line}")
    return graph


def test_no_module_circle_inside_a_package() -> None:
    graph = module_graph()
    assert "attndbg.checks.step" in graph["attndbg.checks.run"]  # the graph sees real imports
    problems = cycle_problems(graph, KNOWN_MODULE_EDGES, "circle")
    assert not problems, "\n".join(problems)


def detector_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """Each import of one detector package's module by another's (attndbg/detectors/<kind>/): a
    detector knows nothing of another (what two share belongs below them: detector_api, plans,
    diagnose, or detectors/base.py)."""
    def detector(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[:2] == ["attndbg", "detectors"] else None

    return [
        f"{a} -> {b} ({where})"
        for a, targets in sorted(graph.items())
        for b, where in sorted(targets.items())
        if detector(a) is not None and detector(b) is not None and detector(a) != detector(b)
    ]


def test_no_detector_imports_another() -> None:
    graph = module_graph()
    assert any(module.startswith("attndbg.detectors.tree_mask.") for module in graph)
    found = detector_imports(graph)
    assert not found, "\n".join(found)


def test_the_rules_see_a_planted_circle_and_a_detector_importing_another(tmp_path: Path) -> None:
    """A circle of two modules of one package, and tree-mask importing fill-value's module lazily,
    each fail; a module importing its own package's __init__ does not."""
    files = {
        "attndbg.checks.a": "from attndbg.checks import b\n",
        "attndbg.checks.b": "def f():\n    from attndbg.checks.a import x\n",
        "attndbg.checks": "from attndbg.checks import a\n",
        "attndbg.detectors.tree_mask.detect": "def f():\n    from attndbg.detectors.fill_value.detect import detect\n",
        "attndbg.detectors.fill_value.detect": "from attndbg.detectors.base import Detector\n",
        "attndbg.detectors.base": "",
    }
    sources = []
    for module, text in files.items():
        path = tmp_path / (module.replace(".", "_") + ".py")
        path.write_text(text)
        sources.append((module, path))
    graph = module_graph(iter(sources))
    assert cycles(graph) == [["attndbg.checks.a", "attndbg.checks.b"]]
    assert "attndbg.checks" not in graph["attndbg.checks.a"]  # its own package: no edge
    assert [line.split(" (")[0] for line in detector_imports(graph)] == ["attndbg.detectors.tree_mask.detect -> attndbg.detectors.fill_value.detect"]
