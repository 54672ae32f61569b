"""Every minipaged module imports, and the package has no import cycle.

The graph is built from the source (``ast``): an edge ``a -> b`` for every
``import minipaged.b`` / ``from minipaged.b import x`` in ``a``, at module level or inside
a function (a lazy import still makes a circle for a reader). Importing a package's
``__init__`` from one of its own modules is allowed (Python runs it first anyway), as are
``if TYPE_CHECKING`` imports.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "minipaged"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The module ``name`` refers to (``from pkg import mod`` names a submodule)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges(mod: str, path: Path, modules) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for n in names:
            if n.startswith("minipaged"):
                target = _resolve(n, modules)
                if target and target != mod and not mod.startswith(target + "."):
                    out.add(target)
    return out


def test_every_module_imports():
    for mod in _modules():
        if mod.startswith("minipaged.viz.") or mod.startswith("minipaged.bench."):
            pytest.importorskip("matplotlib")
        importlib.import_module(mod)


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
