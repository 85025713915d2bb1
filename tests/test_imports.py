"""No import circles in rayspec/, deployments/ and rayspec_cli/, and the layers in order: the engine
(rayspec) imports neither the Ray Serve layer (deployments) nor the CLI (rayspec_cli), and
deployments does not import the CLI, which sits above both.

A circle (a imports b, b imports a) works only while the imports stay inside functions or run in
a lucky order, and it hides which module is the base. The graph is read from the source with
ast, so every import counts: top-level, inside functions, under TYPE_CHECKING, absolute and
relative.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rayspec", "deployments", "rayspec_cli")
# package -> the packages it must never import (a lower layer reaching up)
LOWER_THAN = {"rayspec": ("deployments", "rayspec_cli"), "deployments": ("rayspec_cli",)}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names this module imports, wherever the import statement sits; `from a import b`
    gives both a and a.b (b may be a module or a name in a)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this package, 2 its parent, ...
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (the longest known prefix of each name)."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        edges = set()
        for name in imported_names(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != module:
                edges.add(".".join(parts))
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; a module that
    imports itself is skipped by import_graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import x\n")
    (pkg / "top.py").write_text("import pkg.sub.leaf\nfrom pkg import other\n")
    (pkg / "other.py").write_text("from .sub.leaf import f\nimport os\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf", "pkg.other", "pkg"}, "pkg.other": {"pkg.sub.leaf"}}
    assert cycles(graph) == [["pkg.other", "pkg.sub.leaf", "pkg.top"]]  # the function-level import counts


def test_no_import_circles():
    graph = import_graph()
    assert "rayspec.eagle.train_ray" in graph and "deployments.app" in graph
    assert "rayspec.eagle.train" in graph["rayspec.eagle.train_ray"]  # train_ray builds on train, not back
    assert cycles(graph) == []


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs where a package imports one it must not (LOWER_THAN)."""
    return sorted((module, dep) for module, deps in graph.items() for dep in deps
                  if dep.split(".")[0] in LOWER_THAN.get(module.split(".")[0], ()))


def test_the_layer_check_finds_an_upward_import():
    graph = {"rayspec.bench.sweep": {"deployments.operations.plan", "rayspec.engine"}, "deployments.app": {"rayspec.engine"},
             "rayspec_cli.main": {"deployments.app", "rayspec.engine"}, "deployments.operations.plan": {"rayspec_cli.serve"}}
    assert upward_imports(graph) == [("deployments.operations.plan", "rayspec_cli.serve"), ("rayspec.bench.sweep", "deployments.operations.plan")]


def test_the_engine_imports_neither_the_serving_layer_nor_the_cli():
    graph = import_graph()
    assert "rayspec_cli.main" in graph and "deployments.app" in graph["rayspec_cli.serve"]
    assert upward_imports(graph) == []
