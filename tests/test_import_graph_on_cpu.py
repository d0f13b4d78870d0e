"""No import cycle among the modules of the thundersync_verl package.

Why:
1. An import cycle means two modules are one unit spread over two files: neither can be read,
   tested or changed alone, and which of them loads first decides whether a name exists yet.
   A lazy import inside a function or under ``if TYPE_CHECKING`` hides the symptom, not the
   coupling, so every import statement counts, wherever it stands.
2. The graph is read statically (``ast``), so no module is executed: ``import a.b``,
   ``from a import b`` (an edge to module ``a.b`` when it exists, else to ``a``) and relative
   imports at any depth are resolved to package modules; imports of anything outside the
   package are ignored. A string handed to ``importlib`` is not seen.
3. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit edges are
   left out, or every package that re-exports its own modules would count as a cycle.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "thundersync_verl"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module a ``from ... import`` statement names (None when it leaves the root)."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(parts) - 1:
        return None
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules that ``module`` imports anywhere in its source."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            if base is None:
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    out.add(target)
                elif base in modules:
                    out.add(base)
    out.discard(module)  # a package importing from itself ("from . import x" resolved above)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` (iterative), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                components.append(sorted(comp))
    return sorted(components)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module."""
    return [one_cycle(graph, comp) for comp in strongly_connected(graph) if len(comp) > 1]


def test_the_package_has_no_import_cycle():
    modules = package_modules()
    assert len(modules) >= 50 and f"{PACKAGE}.core.accumulator" in modules
    found = cycles(import_graph(modules))
    listing = "\n".join(" -> ".join(c) for c in found)
    assert not found, f"{len(found)} import cycle(s) among package modules:\n{listing}"


def test_the_core_facade_is_imported_by_no_core_module():
    graph = import_graph(package_modules())
    users = sorted(m for m, deps in graph.items() if f"{PACKAGE}.core.accumulator" in deps)
    assert users == [], users  # reached only through the package's lazy export (core/__init__.py ``__getattr__``)
    from thundersync_verl import core

    assert core._EXPORTS["StreamingGradientAccumulator"] == "accumulator"


# ----- the checker itself, on a package written for the purpose -------------------------------
def _write(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return import_graph(package_modules(root / "pkg", "pkg"))


@pytest.mark.parametrize(
    "b_source",
    [
        "from . import a\n",
        "from .a import X\n",
        "import pkg.a\n",
        "from pkg import a\n",
        "def f():\n    from .a import X\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n",
    ],
)
def test_checker_sees_every_spelling_of_an_import(tmp_path, b_source):
    graph = _write(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/a.py": "from .b import Y\nX = 1\n", "pkg/b.py": b_source + "Y = 2\n"},
    )
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_checker_resolves_parents_and_ignores_package_reexports(tmp_path):
    graph = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import helper\n",
            "pkg/top.py": "import os\nfrom .sub.deep import thing\n",
            "pkg/sub/__init__.py": "from .deep import thing as helper\n",
            "pkg/sub/deep.py": "from .. import top\nfrom ..sub import deep\nthing = 1\n",
        },
    )
    assert graph["pkg.sub.deep"] == {"pkg.top"}
    assert graph["pkg.top"] == {"pkg.sub.deep"}
    assert graph["pkg"] == {"pkg.sub"}
    assert cycles(graph) == [["pkg.sub.deep", "pkg.top", "pkg.sub.deep"]]


def test_checker_passes_an_acyclic_package(tmp_path):
    graph = _write(
        tmp_path,
        {"pkg/__init__.py": "from .a import X\n", "pkg/a.py": "from .b import Y\nX = Y\n", "pkg/b.py": "Y = 2\n"},
    )
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert cycles(graph) == []
