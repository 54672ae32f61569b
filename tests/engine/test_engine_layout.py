"""The engine's layout as vLLM v1's ``v1/engine/``, read from the source (``ast``):
``engine/core.py`` knows no frontend, exactly one module builds outputs, and the
engine reads no scheduler state through ``getattr`` (the arrows between packages:
``tests/test_imports.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "minipaged"
OUTPUT_CLASSES = {"RequestOutput", "CompletionOutput"}


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def _imported_modules(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def test_engine_core_holds_no_frontend():
    tree = _tree(ROOT / "engine" / "core.py")
    names = _names(tree) | _imported_modules(tree)
    for frontend in ("LLMEngine", "AsyncLLM", "OutputProcessor", "Processor", "RequestOutput"):
        assert frontend not in names, f"engine/core.py names {frontend}"
    assert not any(m.startswith("minipaged.engine.") for m in _imported_modules(tree)), (
        "engine/core.py imports another engine module"
    )


def test_exactly_one_module_builds_outputs():
    """``RequestOutput(...)`` / ``CompletionOutput(...)`` are called in one module only."""
    builders = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in OUTPUT_CLASSES:
                    builders.add(str(path.relative_to(ROOT)))
    assert builders == {"engine/output_processor.py"}, builders


def test_no_getattr_on_scheduler_state():
    """``trace.py`` and the engine read the schedulers through their attributes, never a
    ``getattr`` with a default (a private or missing field papered over)."""
    for rel in ("trace.py", "engine/llm_engine.py", "engine/core.py"):
        for node in ast.walk(_tree(ROOT / rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                target = ast.unparse(node.args[0])
                assert "sched" not in target, f"{rel}: getattr({target}, ...)"
