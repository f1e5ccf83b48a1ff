"""The house's shape, read from its own imports: no import circle, no module over 400 lines, and
the leaf packages import only what the README's arrows allow.

Every ``import`` counts, also one inside a function (a lazy import still ties two modules
together). Packages are the top-level folders with an ``__init__.py``, tests aside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 400
#: package -> the project's packages it may import (README, "Layout and arrows")
LEAVES = {"runconfig": set(), "availability": {"runconfig"}}


def modules(root: Path = ROOT) -> dict[str, Path]:
    pkgs = sorted(p.parent.name for p in root.glob("*/__init__.py") if p.parent.name != "tests")
    out = {}
    for pkg in pkgs:
        for f in sorted((root / pkg).rglob("*.py")):
            out[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (``from pkg import name`` counts ``pkg.name``
    when that is a module, else ``pkg``)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        parts = m.split(".")
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = parts[:len(parts) - node.level + (1 if is_pkg else 0)] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                names = subs if subs and len(subs) == len(node.names) else [mod, *subs]
            for name in names:
                while name and name not in mods:  # import a.b.c where only a.b is ours
                    name = name.rpartition(".")[0]
                if name and name != m:
                    graph[m].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_the_walker_finds_a_circle_and_a_lazy_import(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from .y import f\n")
    (tmp_path / "a" / "y.py").write_text("def f():\n    from a.x import g  # lazy\n")
    (tmp_path / "a" / "z.py").write_text("import a.x\n")
    graph = import_graph(modules(tmp_path))
    assert graph["a.z"] == {"a.x"}
    assert circles(graph) == [["a.x", "a.y"]]


def test_a_package_reexporting_its_modules_is_no_circle(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from .m import M\n")
    (tmp_path / "p" / "m.py").write_text("from p.other import O\n")
    (tmp_path / "p" / "other.py").write_text("")
    graph = import_graph(modules(tmp_path))
    assert graph == {"p": {"p.m"}, "p.m": {"p.other"}, "p.other": set()}
    assert circles(graph) == []


def test_no_import_circle():
    found = circles(import_graph(modules()))
    assert not found, "import circles (each a group of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_module_over_the_limit():
    over = sorted((len(f.read_text().splitlines()), m) for m, f in modules().items()
                  if len(f.read_text().splitlines()) > LIMIT)
    assert not over, f"modules over {LIMIT} lines (split by job): " + ", ".join(f"{m} ({n})" for n, m in over)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_packages_import_only_their_arrows(leaf):
    mods = modules()
    graph = import_graph(mods)
    reached = {dep.split(".")[0] for m, deps in graph.items() if m.split(".")[0] == leaf for dep in deps}
    assert reached - {leaf} <= LEAVES[leaf], f"{leaf} imports {sorted(reached - {leaf} - LEAVES[leaf])}"
