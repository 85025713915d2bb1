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

ROOT = Path(__file__).resolve().parents[2]
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
    graph = {"rayspec.bench.sweep": {"deployments.operations.plan", "rayspec.engine.llm_engine"}, "deployments.app": {"rayspec.engine.llm_engine"},
             "rayspec_cli.main": {"deployments.app", "rayspec.engine.llm_engine"}, "deployments.operations.plan": {"rayspec_cli.serve"}}
    assert upward_imports(graph) == [("deployments.operations.plan", "rayspec_cli.serve"), ("rayspec.bench.sweep", "deployments.operations.plan")]


def test_the_engine_imports_neither_the_serving_layer_nor_the_cli():
    graph = import_graph()
    assert "rayspec_cli.main" in graph and "deployments.app" in graph["rayspec_cli.serve"]
    assert upward_imports(graph) == []


# >>> layers inside rayspec (written by move_subpackages.py; issue #49 item 6) >>>
# Every module of rayspec belongs to one layer: the entry of RAYSPEC_LAYERS with the longest prefix
# of its name (`rayspec` itself only by name: a new top-level module has no layer until it is given
# one). A layer imports only itself and the layers it names, so a lower layer never reaches up:
#   base       rayspec itself, the top-level modules that import nothing of rayspec (assets,
#              progress, device_io, methods: the proposers by name, imported only when asked for) and
#              rayspec.cpu
#   kv         rayspec.kv: the paged KV cache's books (block manager, KVSpace), host-only
#   model      rayspec.model (the model, its layers, weights, KV cache tensors, ModelRunner) and the EAGLE
#              head's definition and checkpoints (rayspec.eagle.head, .checkpoint)
#   sampling   rayspec.sampling: logits to tokens; beside the model, neither imports the other
#   proposers  rayspec.proposers: drafts, from the model layer's runner and sampling's draws
#   config     rayspec.config: the settings check the method names (rayspec.methods) and the weight
#              formats (rayspec.model.schemes), importing neither torch nor a proposer
#   memory     rayspec.memory: a process's memory from the model's shapes and the config
#   engine     rayspec.engine: LLMEngine and what it drives
#   apps       what builds on the engine: rayspec.bench, the EAGLE trainer (rayspec.eagle's data,
#              train, train_ray, pipeline, prompt_pools)
# and outside rayspec, deployments and rayspec_cli (LOWER_THAN above). So only config, the engine,
# the apps, deployments and the CLI import the proposers, and nothing in rayspec but the apps imports
# rayspec.bench. Two edges cross a layer downward-only by exception (LAYER_EXCEPTIONS): each target
# imports nothing of rayspec, so no circle can form through it.
RAYSPEC_LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # layer: (module prefixes, the other layers it may import)
    "base": (("rayspec", "rayspec.assets", "rayspec.progress", "rayspec.device_io", "rayspec.methods", "rayspec.cpu"),
             ()),
    "kv": (("rayspec.kv",), ("base",)),
    "model": (("rayspec.model", "rayspec.eagle.head", "rayspec.eagle.checkpoint"), ("base", "kv")),
    "sampling": (("rayspec.sampling",), ("base",)),
    "proposers": (("rayspec.proposers",), ("base", "kv", "model", "sampling")),
    "config": (("rayspec.config",), ("base", "kv", "model", "proposers")),
    "memory": (("rayspec.memory",), ("base", "kv", "model", "config")),
    "engine": (("rayspec.engine",), ("base", "kv", "model", "sampling", "proposers", "config", "memory")),
    "apps": (("rayspec.bench", "rayspec.eagle"),
             ("base", "kv", "model", "sampling", "proposers", "config", "memory", "engine")),
}
# (importer prefix, imported module): allowed across the layers, with why
LAYER_EXCEPTIONS = {
    ("rayspec.sampling.logits_processing", "rayspec.proposers.base"): "grammar_draft trims a proposer's Draft",
    ("rayspec.config", "rayspec.engine.drafting"): "the settings read the planner's PROBE_SHARE and check draft_costs",
}


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, (prefixes, _) in RAYSPEC_LAYERS.items():
        for p in prefixes:
            hit = module == p if p == "rayspec" else (module == p or module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = layer, len(p)
    return best


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs inside rayspec where a layer imports one it must not."""
    bad = []
    for module, deps in graph.items():
        if not module.startswith("rayspec.") and module != "rayspec":
            continue
        mine = layer_of(module)
        for dep in deps:
            theirs = layer_of(dep) if dep.split(".")[0] == "rayspec" else "outside"
            if theirs == "outside" or theirs == mine or theirs in RAYSPEC_LAYERS.get(mine, ((), ()))[1]:
                continue
            if any((module == m or module.startswith(m + ".")) and dep == d for m, d in LAYER_EXCEPTIONS):
                continue
            bad.append((module, dep))
    return sorted(bad)


def test_every_rayspec_module_has_a_layer():
    graph = import_graph()
    assert "rayspec.engine.llm_engine" in graph and "rayspec.model.runner" in graph
    assert [m for m in graph if m.split(".")[0] == "rayspec" and layer_of(m) is None] == [], \
        "a module of rayspec outside every layer: give it one in RAYSPEC_LAYERS (or move it into a subpackage)"


def test_the_layer_check_finds_a_violation():
    graph = {"rayspec.model.runner": {"rayspec.sampling.sampler", "rayspec.device_io"},
             "rayspec.sampling.logits_processing": {"rayspec.proposers.base", "rayspec.proposers.ngram"},
             "rayspec.eagle.head": {"rayspec.model.native"}, "rayspec.eagle.data": {"rayspec.engine.llm_engine"},
             "rayspec.memory.plan": {"rayspec.bench.prompts", "rayspec.config"}, "rayspec.config": {"rayspec.engine.drafting"}}
    assert layer_violations(graph) == [("rayspec.memory.plan", "rayspec.bench.prompts"),
                                       ("rayspec.model.runner", "rayspec.sampling.sampler"),
                                       ("rayspec.sampling.logits_processing", "rayspec.proposers.ngram")]


def test_the_layers_inside_rayspec():
    assert layer_violations(import_graph()) == []


def test_the_layer_exceptions_import_nothing_of_rayspec():
    graph = import_graph()
    for _, target in LAYER_EXCEPTIONS:
        assert {d for d in graph[target] if d.split(".")[0] == "rayspec"} == set(), target


def test_the_subpackage_inits_import_nothing_when_imported():
    """A subpackage's __init__ is a docstring and at most lazy re-exports (module __getattr__): importing
    rayspec.engine.sequence must not import the engine, nor rayspec.model.kv_cache the whole model."""
    for init in sorted((ROOT / "rayspec").glob("*/__init__.py")):
        if init.parent.name == "proposers":  # the registry: importing it builds the table of proposers
            continue
        tree = ast.parse(init.read_text())
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "rayspec")
               or isinstance(n, ast.Import) and any(a.name.split(".")[0] == "rayspec" for a in n.names)]
        assert top == [], f"{init.relative_to(ROOT)} imports rayspec modules at import time"


def test_the_old_public_names_stay():
    from rayspec.engine import LLMEngine
    from rayspec.engine.llm_engine import LLMEngine as defined
    from rayspec.sampling import SamplingParams
    from rayspec.sampling.sampler import SamplingParams as params

    assert LLMEngine is defined and SamplingParams is params
# <<< layers inside rayspec <<<


def test_the_ingress_imports_no_torch():
    """A Serve ingress replica (deployments.frontend.ingress) parses, checks and forwards requests: neither
    importing it nor building a replica of it (which validates the app's config) imports torch or the
    engine (its request types, limits and errors are plain data: rayspec.sampling.params,
    rayspec.engine.outputs; the methods and weight formats a config names: rayspec.methods,
    rayspec.model.schemes), so a replica starts in ~1 s of CPU rather than ~2.2 s, without torch's memory."""
    import subprocess
    import sys

    # the module, then a replica of it as Serve builds one (its app's config validated), for each kind of
    # method (by name: rayspec.methods) and with the config's weight formats (rayspec.model.schemes)
    code = ("import sys; import deployments.frontend.ingress as m; cls = m.OpenAIIngress.func_or_class.__bases__[0]\n"
            "for spec in ({'method': 'eagle3', 'draft_model': 'heads/smollm2-135m-eagle3'}, {'method': 'ngram'},\n"
            "             {'method': 'draft_model', 'draft_model': 'd', 'draft_quantization': 'int8'}):\n"
            "    cls({'model': 'smollm2-135m-instruct', 'speculative': spec, 'topology': 'disaggregated',\n"
            "         'engine': {'quantized_weights': 'dequantize'}}, None)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', "
            "'rayspec.engine.llm_engine', 'rayspec.proposers', 'rayspec.model.native'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
