"""Every minipaged module imports, and the package has no import cycle.

The graph is built from the source (``ast``): an edge ``a -> b`` for every
``import minipaged.b`` / ``from minipaged.b import x`` in ``a``, at module level or inside
a function (a lazy import still makes a circle for a reader). Importing a package's
``__init__`` from one of its own modules is allowed (Python runs it first anyway), as are
``if TYPE_CHECKING`` imports. Some arrows are forbidden outright (``LAYERS``): there a
module named in a string (``importlib.import_module("minipaged.x")``) counts as an import.
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


# (importer, imported): packages that must not import each other in this direction.
# The simulator draws its figures in viz's palette (sim -> viz); the pictures know nothing
# of the simulator, and the `minipaged figures` command (minipaged/figures.py) sits above both.
LAYERS = [("minipaged.viz", "minipaged.sim")]
# The worker side (vLLM v1's v1/worker, v1/sample, v1/spec_decode) never imports the engine
# above it: the engine calls the worker, and data comes back as ModelRunnerOutput.
WORKER_SIDE = ("minipaged.worker", "minipaged.sample", "minipaged.spec_decode")
LAYERS += [(pkg, "minipaged.engine") for pkg in WORKER_SIDE]


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _named_imports(path: Path, modules) -> set[str]:
    """Modules imported by a constant name: ``importlib.import_module("minipaged.x")``,
    ``import_module(...)``, ``__import__(...)``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        arg = node.args[0]
        if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
            if isinstance(arg.value, str) and arg.value.startswith("minipaged"):
                target = _resolve(arg.value, modules)
                if target:
                    out.add(target)
    return out


def test_forbidden_arrows():
    modules = _modules()
    found = []
    for mod, path in modules.items():
        targets = _edges(mod, path, modules) | _named_imports(path, modules)
        for importer, imported in LAYERS:
            if _in(mod, importer):
                found += [f"{mod} -> {t}" for t in sorted(targets) if _in(t, imported)]
    assert found == [], found


def test_forbidden_arrows_are_found_when_named_in_a_string(tmp_path):
    """The check sees an import hidden in ``importlib.import_module("...")``."""
    src = tmp_path / "m.py"
    src.write_text(
        'import importlib\n\ndef f():\n    return importlib.import_module("minipaged.sim.memory_waste")\n'
    )
    assert _named_imports(src, _modules()) == {"minipaged.sim.memory_waste"}


def test_worker_side_does_not_import_the_engine():
    """No arrow back up from ``worker/``, ``sample/`` or ``spec_decode/`` into ``engine/``,
    lazy imports inside functions and names in strings included."""
    modules = _modules()
    found = []
    for mod, path in modules.items():
        if any(_in(mod, pkg) for pkg in WORKER_SIDE):
            assert any(_in(mod, pkg) for pkg, _ in LAYERS)
            targets = _edges(mod, path, modules) | _named_imports(path, modules)
            found += [f"{mod} -> {t}" for t in sorted(targets) if _in(t, "minipaged.engine")]
    assert found == [], found
    assert {m for m in modules if _in(m, "minipaged.sample")} >= {
        "minipaged.sample.sampler",
        "minipaged.sample.logprobs",
        "minipaged.sample.rejection_sampler",
    }
