"""The package's import graph has no cycle: dependencies point one way (launch -> worker -> planes -> small
shared types). Every import counts, the ones inside functions too (a lazy import hides a cycle, it does not
remove it). Pure logic: the sources are parsed (ast), nothing is imported."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deadpool_hpc")
PKG = "deadpool_hpc"


def _modules(root: str = ROOT, pkg: str = PKG) -> dict[str, str]:
    """Module name -> file, for every .py file of the package (a package is named by its __init__.py)."""
    mods = {}
    for d, _dirs, files in os.walk(root):
        rel = os.path.relpath(d, os.path.dirname(root)).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                mods[rel if f == "__init__.py" else f"{rel}.{f[:-3]}"] = os.path.join(d, f)
    assert f"{pkg}.launch.cli" in mods or pkg != PKG, sorted(mods)
    return mods


def _resolve(name: str, mods: dict[str, str]) -> str | None:
    """The innermost module of the package that ``name`` (a module, or a module plus an attribute) names."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, str], pkg: str = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top, in a function, or under TYPE_CHECKING alike).
    The implicit import of a module's parent packages is not an edge (it cannot make a cycle by itself)."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        here = mod if is_pkg else mod.rpartition(".")[0]
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        deps: set[str] = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in base
            for t in targets:
                if t == pkg or t.startswith(pkg + "."):
                    dep = _resolve(t, mods)
                    if dep and dep != mod:
                        deps.add(dep)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules, the first repeated at the end), or None. Depth-first search, three colours."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_a_lazy_cycle(tmp_path):
    """The checker itself: a cycle made only of imports inside functions is found, a one-way graph passes."""
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("def g():\n    from . import a\n")
    mods = _modules(str(pkg), "pk")
    g = import_graph(mods, "pk")
    assert g["pk.a"] == {"pk.sub.b"} and g["pk.sub.b"] == {"pk.c"} and g["pk.c"] == {"pk.a"}
    assert find_cycle(g) == ["pk.a", "pk.sub.b", "pk.c", "pk.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(_modules(str(pkg), "pk"), "pk")) is None


@pytest.mark.parametrize("scope", ["deadpool_hpc.launch", "deadpool_hpc"])
def test_no_import_cycle(scope):
    mods = _modules()
    graph = import_graph(mods)
    sub = {m: {d for d in deps if d == scope or d.startswith(scope + ".")} for m, deps in graph.items()
           if m == scope or m.startswith(scope + ".")}
    cycle = find_cycle(sub)
    assert cycle is None, f"import cycle among {scope} modules: {' -> '.join(cycle)}"
