"""The package's modules import each other in one direction: the intra-package import graph has no cycle.

The graph is read from the source with `ast` (no module is executed): every `import` and `from ... import`
that names a `minimax_ref` module, at module level or inside a function, is an edge; imports under
`if TYPE_CHECKING:` are left out because they never execute. `from P import n` is an edge to the module
`P.n` when that is a module, else to `P` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "minimax_ref"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, except those in `if TYPE_CHECKING:` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, str], package: str = PACKAGE) -> dict[str, set[str]]:
    """Edges module -> imported modules of `package`, from the sources `modules` (dotted name -> code)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        is_pkg = name == package or any(other.startswith(name + ".") for other in modules)
        here = name.split(".") if is_pkg else name.split(".")[:-1]  # the package relative imports start from
        for node in _imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base_parts = here[: len(here) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                # `import minimax_ref.x.y` names the module itself; keep the longest known prefix
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and (target == package or target.startswith(package + ".")) and target != name:
                    graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` with more than one module (each holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle [a, b, ..., a] per strongly connected component with more than one module."""
    cycles = []
    for comp in strongly_connected(graph):
        start = min(comp)
        # breadth-first from start back to start inside the component: the shortest cycle through it
        prev: dict[str, str] = {}
        frontier, seen, end = [start], {start}, None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        end = v
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def _package_graph() -> dict[str, set[str]]:
    return import_graph({name: path.read_text(encoding="utf-8") for name, path in _module_names(ROOT).items()})


def test_the_package_has_no_import_cycle():
    graph = _package_graph()
    cycles = find_cycles(graph)
    groups = [", ".join(sorted(c)) for c in strongly_connected(graph)]
    assert not cycles, ("import cycles in minimax_ref (one cycle each; the modules that import each other "
                        "in a circle):\n" + "\n".join(f"{' -> '.join(c)}   [{g}]" for c, g in zip(cycles, groups)))


def test_the_graph_sees_function_level_and_relative_imports():
    graph = _package_graph()
    # generate loads the drafter and the speculative loop only when asked, inside `generate`
    gen = "minimax_ref.generation."
    assert {gen + "decoding", gen + "speculative", gen + "drafter"} <= graph[gen + "generate"]
    assert "minimax_ref.generation.sampling" in graph["minimax_ref.generation.drafter"]
    assert "minimax_ref.generation.decoding" in graph["minimax_ref.generation.speculative"]
    assert "minimax_ref.model.decoder" not in graph["minimax_ref.generation.drafter"]  # only under TYPE_CHECKING there


@pytest.mark.parametrize(("sources", "cycle"), [
    # a function-level import closes the cycle
    ({"p": "", "p.a": "from .b import f", "p.b": "def g():\n    from . import c", "p.c": "import p.a"},
     ["p.a", "p.b", "p.c", "p.a"]),
    # a subpackage's relative import two levels up
    ({"p": "", "p.a": "from .s import name", "p.s": "from .x import y", "p.s.x": "from .. import a"},
     ["p.a", "p.s", "p.s.x", "p.a"]),
    ({"p": "", "p.a": "from . import b", "p.b": "from .a import name"}, ["p.a", "p.b", "p.a"]),
])
def test_cycles_are_found(sources, cycle):
    assert find_cycles(import_graph(sources, package="p")) == [cycle]


def test_type_checking_imports_and_one_way_imports_are_not_cycles():
    sources = {"p": "", "p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
               "p.b": "from .a import A\nimport os\n", "p.c": "from p import a, b"}
    graph = import_graph(sources, package="p")
    assert graph == {"p": set(), "p.a": set(), "p.b": {"p.a"}, "p.c": {"p.a", "p.b"}}
    assert find_cycles(graph) == []


def test_generation_never_reaches_the_fast_path():
    """Everything the generation layers import, directly or not, at module level or in a function."""
    graph = _package_graph()
    layers = [f"minimax_ref.generation.{m}" for m in ("sampling", "decoding", "drafter", "speculative", "generate")]
    seen, todo = set(), list(layers)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    assert "minimax_ref.model.decoder" in seen  # the walk does reach the reference model
    fast = sorted(m for m in seen if m == "minimax_ref.fast" or m.startswith("minimax_ref.fast."))
    assert not fast, f"generation imports the fast path: {fast}"
