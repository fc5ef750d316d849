"""The package's layout: no import circles, few top-level modules, shared helpers that import nothing above them."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "art_malleability"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that ``path`` imports, at any depth (functions and ``TYPE_CHECKING`` included)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            targets.update(n if n in modules else node.module for n in names)
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
    found = set()
    for target in targets:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules:
            found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    """Module → the modules importing it runs first: its imports and, for a submodule, the packages above them."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imports(path, modules) - {name}:
            deps.add(target)
            parts = target.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts)) if not name.startswith(".".join(parts[:i])))
        graph[name] = deps - {"art_malleability"}
    return graph


def test_the_package_has_no_import_circles():
    graph = _graph()
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import circle: {' -> '.join(err.args[1])}")
    # what was sorted is the package: every module file, and the imports they make (a check that found no modules or
    # no imports would sort anything; the set of the order had been compared with the graph's, which always holds)
    assert len(order) == len(graph) == len(list(PACKAGE.rglob("*.py")))
    assert "art_malleability.audit.params" in graph["art_malleability.audit.estimator"]
    assert sum(len(deps) for deps in graph.values()) > 2 * len(graph)
    position = {name: i for i, name in enumerate(order)}
    assert all(position[dep] < position[name] for name, deps in graph.items() for dep in deps)


def test_the_check_finds_a_circle():
    graph = _graph()
    graph["art_malleability._utils.checks"].add("art_malleability.audit.estimator")
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(graph).static_order())


def test_at_most_eight_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_shared_helpers_import_nothing_above_them():
    graph = _graph()
    above = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith("art_malleability._utils")
        for dep in deps
        if not dep.startswith("art_malleability._utils")
    }
    assert not above


BENCHMARKS = PACKAGE.parent / "benchmarks"


def _private_crossings() -> list[str]:
    """Imports of a private module or name of another subpackage (``_utils``, the package's shared helpers, aside)."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *BENCHMARKS.glob("*.py")]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        own = parts[1] if parts[0] == "art_malleability" and len(parts) > 2 else parts[-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("art_malleability.")):
                continue
            target = node.module.split(".")
            if target[1] in (own, "_utils"):
                continue
            names = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
            if any(p.startswith("_") for p in target[2:]) or names:
                found.append(f"{path.relative_to(PACKAGE.parent)}: {node.module} {names}")
    return found


def test_no_private_name_crosses_a_subpackage_boundary():
    """Subpackages (and the benchmarks) use each other's public names only; ``_utils`` is the shared private base."""
    assert not _private_crossings()


#: The package's layers, top to bottom (docs/concepts.md): a module imports only its own subpackage and those below.
LAYERS = (
    ("art_malleability", "cli"),
    ("paper",),
    ("audit",),
    ("validation",),
    ("influence",),
    ("ntk",),
    ("linalg",),
    ("metrics", "data"),
    ("models",),
    ("distributed",),
    ("_utils",),
)


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    part = parts[1] if len(parts) > 1 else parts[0]
    for depth, members in enumerate(LAYERS):
        if part in members:
            return part, depth
    raise AssertionError(f"{module} is in no layer of LAYERS")


def _upward_imports() -> list[str]:
    found = []
    for name, deps in _graph().items():
        part, depth = _layer(name)
        for dep in deps:
            dep_part, dep_depth = _layer(dep)
            if dep_part != part and dep_depth <= depth:
                found.append(f"{name} -> {dep}")
    return sorted(found)


def test_imports_point_down_the_layers():
    """No module imports a subpackage of its own layer or one above it."""
    assert not _upward_imports()


def test_the_layer_check_finds_an_upward_import(monkeypatch):
    graph = _graph()
    graph["art_malleability.ntk.convergence"] = graph["art_malleability.ntk.convergence"] | {
        "art_malleability.influence.ridge"}
    monkeypatch.setattr(__import__(__name__), "_graph", lambda: graph)
    assert _upward_imports() == ["art_malleability.ntk.convergence -> art_malleability.influence.ridge"]
