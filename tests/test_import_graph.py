"""The module graph: no import cycles, and the layers point one way (app -> engine -> backends).

The graph is read from the source with `ast`, not by importing: every `import` counts,
module-level, inside a function or under `if TYPE_CHECKING`, because a function-local
import that dodges a cycle hides the cycle without removing it. Relative imports are
resolved to the `panechat.*` names setup.py maps the folders to, and importing a
submodule from outside its package also counts as importing the package (its `__init__`
runs first).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"app": "panechat.app", "engine": "panechat.engine", "backends": "panechat.backends",
            "themes": "panechat.themes"}  # ROOTS in setup.py


def module_names(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the mapped folders."""
    out = {}
    for folder, dotted in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((dotted, *parts))] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in module `name` may load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        here = name.split(".") if is_package else name.split(".")[:-1]
        up = here[: len(here) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" for a in node.names]  # a submodule, else (below) the module `base`


def import_graph(root: Path, packages: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body."""
    modules = module_names(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, path.name == "__init__.py"):
                    while target and target not in modules:  # `import a.b.c` of a non-module: its package
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        edges.add(target)
                    # ... and from outside a package, a submodule runs the package's __init__ first
                    parent = target.rpartition(".")[0]
                    while parent in modules and not (name == parent or name.startswith(parent + ".")):
                        edges.add(parent)
                        parent = parent.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that ends where it starts (["a", "b", "a"]), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, todo = [start], [iter(sorted(graph.get(start, ())))]  # depth-first, without recursion
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                done.add(path.pop())
                todo.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                todo.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]], layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """'m imports t' for each module m of package `layer` importing one of `forbidden`."""
    return sorted(f"{m} imports {t}" for m, targets in graph.items() if _inside(m, layer)
                  for t in targets if any(_inside(t, f) for f in forbidden))


# -- the cycle finder and the graph reader, on small made-up inputs ------------------------
@pytest.mark.parametrize("graph,cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, None),  # a diamond is no cycle
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, ["b", "c", "d", "b"]),
    ({"x": {"a"}, "a": {"x2"}, "x2": set(), "m": {"n"}, "n": {"m"}}, ["m", "n", "m"]),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_reader_sees_relative_and_function_local_imports(tmp_path):
    """A cycle hidden in a function body (the habit this test exists to catch) is found."""
    pkg = tmp_path / "app"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("class UsageError(Exception):\n    pass\n\n"
                                "def main():\n    from .oneshot import run\n    return run()\n")
    (pkg / "oneshot.py").write_text("from .cli import UsageError\n\ndef run():\n    raise UsageError\n")
    (pkg / "server" / "__init__.py").write_text("from .app import create_app\n")
    (pkg / "server" / "app.py").write_text("from . import errors\nimport json\n"
                                           "from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from ..cli import main\n")
    (pkg / "server" / "errors.py").write_text("from ..cli import UsageError as E, main\n")
    (pkg / "tui.py").write_text("import panechat.app.server.errors\n")
    graph = import_graph(tmp_path, {"app": "panechat.app"})
    assert graph == {
        "panechat.app": set(),
        "panechat.app.cli": {"panechat.app.oneshot"},
        "panechat.app.oneshot": {"panechat.app.cli"},
        "panechat.app.server": {"panechat.app.server.app"},
        "panechat.app.server.app": {"panechat.app.server.errors", "panechat.app.cli"},
        "panechat.app.server.errors": {"panechat.app.cli"},
        "panechat.app.tui": {"panechat.app.server.errors", "panechat.app.server"},
    }
    assert find_cycle(graph) == ["panechat.app.cli", "panechat.app.oneshot", "panechat.app.cli"]


def test_layer_violations():
    graph = {"p.engine": {"p.backends"}, "p.engine.x": {"p.engine", "p.app.cli"}, "p.engineering": {"p.app"},
             "p.backends.y": {"p.engine.x"}}
    assert layer_violations(graph, "p.engine", ("p.app",)) == ["p.engine.x imports p.app.cli"]
    assert layer_violations(graph, "p.backends", ("p.engine", "p.app")) == ["p.backends.y imports p.engine.x"]


# -- the real tree -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_the_folders_are_the_installed_packages():
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    roots = [ast.literal_eval(n.value) for n in tree.body
             if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["ROOTS"]]
    assert roots == [PACKAGES]


def test_the_reader_sees_the_tree(graph):
    assert len(graph) > 50 and "panechat.app.cli" in graph and "panechat.engine.serving.engine" in graph
    assert "panechat.engine.serving.engine" in graph["panechat.app.engine_factory"]


def test_no_import_cycles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, ("import cycle: " + " -> ".join(cycle) +
                           "; move what both sides share into a module of its own")


B, E = "panechat.backends", "panechat.engine"


@pytest.mark.parametrize("layer,forbidden", [
    (E, ("panechat.app",)),
    (B, (E, "panechat.app")),
    # the backends stand side by side: none reaches into another
    (f"{B}.cpu", (f"{B}.cuda", f"{B}.mlx")),
    (f"{B}.cuda", (f"{B}.cpu", f"{B}.mlx")),
    (f"{B}.mlx", (f"{B}.cpu", f"{B}.cuda")),
    # what a weight type is (the registry, a tensor as stored) knows no backend
    (f"{B}.quant", (f"{B}.cpu", f"{B}.cuda", f"{B}.mlx", f"{B}.base", f"{B}.self_check")),
    # inside the engine: reading files, text, the model and the KV cache know nothing of serving
    (f"{E}.gguf", (f"{E}.text", f"{E}.model", f"{E}.kv", f"{E}.serving", f"{E}.catalog")),
    (f"{E}.text", (f"{E}.model", f"{E}.kv", f"{E}.serving", f"{E}.catalog")),
    (f"{E}.model", (f"{E}.kv", f"{E}.serving", f"{E}.catalog")),
    (f"{E}.kv", (f"{E}.text", f"{E}.model", f"{E}.serving", f"{E}.catalog")),
    (f"{E}.catalog", (f"{E}.serving", f"{E}.kv")),
])
def test_layers_point_down(graph, layer, forbidden):
    bad = layer_violations(graph, layer, forbidden)
    assert not bad, (f"{layer} may not import {', '.join(forbidden)} (docs/architecture.md, "
                     "'The module graph'): " + "; ".join(bad))
