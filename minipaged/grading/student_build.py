"""The student build: a copy of the package with no implementation that answers an exercise.

Concept
    The sandbox binds this folder in place of the real ``minipaged`` package. It is an AST
    transform of the installed package, made once per chapter and cached per package version
    and content hash:

    * every callable listed in a spec's ``answered_by`` (of the chapter's exercises) has its
      body replaced by a call to ``minipaged._student_build.plug``: when the notebook defines
      a function of the exercise's name with a fitting signature, that function runs ("your
      code powers the rest"); otherwise it raises
      ``NotImplementedError("ex2.3: your notebook's allocate_slots is used here")``;
    * ``minipaged.checks``' chapter modules keep only what the kernel-side driver needs: each
      spec's ``observe`` and what it calls; references, cases, expected values, prediction
      engines and reports are replaced by ``_spec._withheld`` and dropped when nothing else
      uses them;
    * no ``__pycache__`` of the real sources is copied (a ``.pyc`` would hold the original
      code); the build's own sources are byte-compiled into it.

Inputs / outputs
    ``student_build(chapter, cache_dir=None)`` -> path of the built ``minipaged`` folder
    (read-only files). ``strip_targets(chapter)`` -> the ``"module:qualname"`` names stripped.

Invariants
    the build of a chapter contains no function body of a stripped name and no chapter
    module's reference; the real package is never modified.

Failure mode
    an ``answered_by`` name that is not a function of the package raises ``ValueError``.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

WITHHELD_KEYWORDS = ("reference", "expected", "verdict", "report", "cases", "size", "describe", "shape")
HOOK_MODULE = "_student_build.py"
HOOK_SOURCE = '''"""The student build's stand-in for a package function that answers an exercise."""

import sys
import threading

_active = threading.local()


def plug(exercise_id, name, plug_in, args, kwargs):
    """Run the notebook's own ``name`` (when ``plug_in``, or through the stripped function's
    adapter in ``minipaged.grading.plug_ins``), else raise NotImplementedError."""
    from minipaged.grading.plug_ins import adapter_for

    message = f"{exercise_id}: your notebook's {name} is used here"
    adapter = adapter_for(sys._getframe(1))
    fn = getattr(sys.modules.get("__main__"), name, None) if plug_in or adapter else None
    busy = getattr(_active, "names", None)
    if busy is None:
        busy = _active.names = set()
    if fn is None or not callable(fn) or getattr(fn, "__student_build_stub__", False) or name in busy:
        raise NotImplementedError(message)
    busy.add(name)
    try:
        return adapter(fn, *args, **kwargs) if adapter is not None else fn(*args, **kwargs)
    finally:
        busy.discard(name)
'''


def _package_dir() -> Path:
    import minipaged

    return Path(minipaged.__file__).resolve().parent


def strip_targets(chapter: str) -> dict:
    """``{"module:qualname": (exercise id, the exercise's function name, its arity)}``."""
    from minipaged.checks import _specs

    out = {}
    for ex, spec in sorted(_specs(chapter).items()):
        name = spec.signature.split("(")[0].split("[")[0].strip()
        params = spec.signature.split("(", 1)[1].rsplit(")", 1)[0] if "(" in spec.signature else ""
        arity = len([p for p in params.split(",") if p.strip()])
        for target in spec.answered_by:
            out.setdefault(target, (ex, name, arity))
    return out


def _content_hash(root: Path) -> str:
    h = hashlib.sha256(HOOK_SOURCE.encode())
    h.update(Path(__file__).read_bytes())
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _stub_body(fn: ast.FunctionDef, ex: str, name: str, arity: int, in_class: bool) -> list:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    plug_in = (
        fn.name == name
        and not a.vararg
        and not a.kwonlyargs
        and len(positional) == arity
        and not any(
            isinstance(d, ast.Name) and d.id in ("staticmethod", "property") for d in fn.decorator_list
        )
    )
    call = (
        f"return __import__('minipaged._student_build', fromlist=['plug']).plug("
        f"{ex!r}, {name!r}, {plug_in!r}, ({''.join(p + ', ' for p in positional)}), {{}})"
    )
    del in_class
    return ast.parse(call).body


def _strip_module(source: str, qualnames: dict) -> tuple[str, set]:
    tree = ast.parse(source)
    done = set()

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + node.name
                if q in qualnames:
                    ex, name, arity = qualnames[q]
                    node.body = _stub_body(node, ex, name, arity, bool(prefix))
                    done.add(q)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(tree.body, "")
    return ast.unparse(tree) + "\n", done


def _names_used(nodes) -> set:
    used = set()
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Name):
                used.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                used.add(sub.attr)
    return used


def _strip_checks(source: str) -> str:
    """A chapter module of ``minipaged.checks`` with only what ``observe`` needs."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in WITHHELD_KEYWORDS:
                    kw.value = ast.Name("_withheld", ast.Load())
    at = 0
    while at < len(tree.body) and (
        isinstance(tree.body[at], ast.ImportFrom)
        and tree.body[at].module == "__future__"
        or isinstance(tree.body[at], ast.Expr)
        and isinstance(getattr(tree.body[at], "value", None), ast.Constant)
    ):
        at += 1
    tree.body.insert(at, ast.parse("from minipaged.checks._spec import _withheld").body[0])
    changed = True
    while changed:  # drop top-level functions and classes nothing else uses, to a fixed point
        changed = False
        for node in list(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                others = [n for n in tree.body if n is not node]
                if node.name not in _names_used(others):
                    tree.body.remove(node)
                    changed = True
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                defined.add(sub.id)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                node.value.elts = [
                    e
                    for e in node.value.elts
                    if not isinstance(e, ast.Constant) or e.value in _top_names(tree)
                ]
    del defined
    return ast.unparse(tree) + "\n"


def _top_names(tree) -> set:
    out = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def default_cache_dir() -> Path:
    base = os.environ.get("MINIPAGED_BUILD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minipaged", "student-builds"
    )
    return Path(base)


def student_build(chapter: str, cache_dir: Optional[os.PathLike] = None) -> str:
    """The path of ``chapter``'s student build of the package (made on first use, cached)."""
    import minipaged

    src = _package_dir()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    version = getattr(minipaged, "__version__", "0")
    target = cache / f"{version}-{_content_hash(src)}-{chapter}" / "minipaged"
    if (target / HOOK_MODULE).is_file():
        return str(target)
    targets = strip_targets(chapter)
    by_file: dict = {}
    for t, info in targets.items():
        mod, qual = t.split(":")
        rel = Path(*mod.split(".")[1:])
        path = (src / rel).with_suffix(".py")
        if not path.is_file():
            path = src / rel / "__init__.py"
        if not path.is_file():
            raise ValueError(f"answered_by {t!r}: no module file for {mod}")
        by_file.setdefault(path, {})[qual] = info
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{chapter}-", dir=cache))
    out = tmp / "minipaged"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
    for path, quals in by_file.items():
        text, done = _strip_module(path.read_text(encoding="utf-8"), quals)
        missing = set(quals) - done
        if missing:
            raise ValueError(f"answered_by names no function of {path.name}: {sorted(missing)}")
        (out / path.relative_to(src)).write_text(text, encoding="utf-8")
    from minipaged.checks import CHAPTER_MODULES

    for ch in CHAPTER_MODULES:
        p = out / "checks" / f"{ch}.py"
        p.write_text(_strip_checks(p.read_text(encoding="utf-8")), encoding="utf-8")
    (out / HOOK_MODULE).write_text(HOOK_SOURCE, encoding="utf-8")
    import compileall

    compileall.compile_dir(str(out), quiet=2, workers=1)
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target.parent)
    except OSError:  # another grader made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
