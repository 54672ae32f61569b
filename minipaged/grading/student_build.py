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
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

# targets whose name and arity match the exercise's function but whose parameters mean other
# things: the notebook's function is never plugged in for them (the stub raises)
NO_PLUG_IN: dict = {}
# how the notebook's function stands in for a stripped callable whose parameters differ from
# the exercise's: an expression of ``fn`` (the notebook's function) and the callable's parameters
ADAPTERS = {
    "minipaged.sim.cost_model:ModelConfig.kv_bytes_per_token": (
        "fn({'num_hidden_layers': self.num_layers, 'num_attention_heads': self.num_heads, "
        "'num_key_value_heads': self.num_kv_heads, 'hidden_size': self.hidden_size, "
        "'head_dim': self.head_dim}, self.dtype_bytes)"
    ),
    "minipaged.core.sched.utils:num_new_tokens": (
        "fn(__import__('types').SimpleNamespace(num_tokens=num_left, num_computed_tokens=0), budget, "
        "chunked, max_num_batched_tokens)"
    ),
}
WITHHELD_KEYWORDS = ("reference", "expected", "verdict", "report", "cases", "size", "describe", "shape")
HOOK_MODULE = "_student_build.py"
HOOK_SOURCE = '''"""The student build's stand-in for a package function that answers an exercise."""

import sys
import threading

_active = threading.local()


def _notebook_function(exercise_id, name):
    fn = getattr(sys.modules.get("__main__"), name, None)
    busy = getattr(_active, "names", None)
    if busy is None:
        busy = _active.names = set()
    if fn is None or not callable(fn) or getattr(fn, "__student_build_stub__", False) or name in busy:
        raise NotImplementedError(f"{exercise_id}: your notebook's {name} is used here")
    return fn, busy


def plug(exercise_id, name, plug_in, args, kwargs):
    """Run the notebook's own ``name`` (when ``plug_in``), else raise NotImplementedError."""
    if not plug_in:
        raise NotImplementedError(f"{exercise_id}: your notebook's {name} is used here")
    return plug_with(exercise_id, name, lambda fn: fn(*args, **kwargs))


def plug_with(exercise_id, name, call):
    """``call(the notebook's name)``: a stripped callable whose parameters differ from the
    exercise's function, through its adapter; NotImplementedError when the notebook has none."""
    fn, busy = _notebook_function(exercise_id, name)
    busy.add(name)
    try:
        return call(fn)
    finally:
        busy.discard(name)


class StrippedKernel:
    """A stripped Triton kernel: launching it (``kernel[grid](...)``) raises."""

    __student_build_stub__ = True

    def __init__(self, exercise_id, name):
        self.message = f"{exercise_id}: your notebook's {name} is used here"

    def __getitem__(self, grid):
        raise NotImplementedError(self.message)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(self.message)

    def run(self, *args, **kwargs):
        raise NotImplementedError(self.message)
'''


def _package_dir() -> Path:
    import minipaged

    return Path(minipaged.__file__).resolve().parent


def strip_targets(chapter: str) -> dict:
    """``{"module:qualname": (exercise id, the exercise's function name, its arity)}``."""
    from minipaged.checks._registry import _specs

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


def _is_kernel(fn: ast.FunctionDef) -> bool:
    """Decorated with ``triton.jit`` (or ``jit``, with or without arguments)."""
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Attribute) and d.attr == "jit") or (isinstance(d, ast.Name) and d.id == "jit"):
            return True
    return False


def _plugs_in(target: str, fn: ast.FunctionDef, name: str, arity: int) -> bool:
    """The notebook's ``name`` stands in for ``fn`` when the names and the arities agree, the
    parameters are plain positional ones and ``target`` is not in ``NO_PLUG_IN``."""
    a = fn.args
    positional = a.posonlyargs + a.args
    return (
        target not in NO_PLUG_IN
        and fn.name == name
        and not a.vararg
        and not a.kwonlyargs
        and len(positional) - len(a.defaults) <= arity <= len(positional)
        and not any(
            isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod", "property")
            for d in fn.decorator_list
        )
    )


def _stub_body(fn: ast.FunctionDef, ex: str, name: str, plug_in: bool, arity: int = 0) -> list:
    """``fn``'s new body: hand every argument to ``plug`` (keyword-only and ``*args`` too)."""
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if plug_in:  # NOTE: the parameters past the exercise's arity keep their defaults
        positional = positional[:arity]
    args = "(" + "".join(p + ", " for p in positional) + ")"
    if a.vararg:
        args += f" + tuple({a.vararg.arg})"
    kwargs = "{" + ", ".join(f"{k.arg!r}: {k.arg}" for k in a.kwonlyargs) + "}"
    if a.kwarg:
        kwargs = f"dict({kwargs}, **{a.kwarg.arg})"
    call = (
        f"return __import__('minipaged._student_build', fromlist=['plug']).plug("
        f"{ex!r}, {name!r}, {plug_in!r}, {args}, {kwargs})"
    )
    return ast.parse(call).body


def _strip_module(source: str, qualnames: dict, module: str = "") -> tuple[str, set]:
    """``source`` with the bodies of ``qualnames`` (``{qualname: (exercise, name, arity)}``)
    replaced by stubs; functions under ``if`` / ``try`` / ``with`` blocks count as top level
    (Triton kernels are defined under ``if HAS_TRITON:``); a Triton kernel becomes a
    ``StrippedKernel``."""
    tree = ast.parse(source)
    done = set()

    def visit(body, prefix):
        for k, node in enumerate(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + node.name
                if q in qualnames:
                    ex, name, arity = qualnames[q]
                    if _is_kernel(node):
                        stub = ast.parse(
                            f"{node.name} = __import__('minipaged._student_build', "
                            f"fromlist=['StrippedKernel']).StrippedKernel({ex!r}, {name!r})"
                        ).body[0]
                        body[k] = ast.copy_location(stub, node)
                    elif _phase_plug(node, f"{module}:{q}", ex):  # one phase of a step (ch04/ch05)
                        pass
                    elif f"{module}:{q}" in ADAPTERS:
                        node.body = ast.parse(
                            f"return __import__('minipaged._student_build', fromlist=['plug_with'])"
                            f".plug_with({ex!r}, {name!r}, lambda fn: {ADAPTERS[module + ':' + q]})"
                        ).body
                    else:
                        plug_in = _plugs_in(f"{module}:{q}", node, name, arity)
                        node.body = _stub_body(node, ex, name, plug_in, arity)
                    done.add(q)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []), prefix)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, prefix)

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
    # drop top-level functions and classes nothing else uses, to a fixed point
    uses = {id(n): _names_used([n]) for n in tree.body}
    count: dict = {}
    for n in tree.body:
        for name in uses[id(n)]:
            count[name] = count.get(name, 0) + 1
    changed = True
    while changed:
        changed = False
        for node in list(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                if count.get(node.name, 0) - (node.name in uses[id(node)]) <= 0:
                    tree.body.remove(node)
                    for name in uses[id(node)]:
                        count[name] -= 1
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


def _base_build(src: Path, cache: Path, tag: str) -> Path:
    """What every chapter's build shares, made once per version and content hash: the
    package's sources (no ``__pycache__``, no ``.so``), ``minipaged.checks`` without
    references, the hook module, byte-compiled. A chapter's build is a copy of it with that
    chapter's targets stripped."""
    base = cache / f"{tag}-base" / "minipaged"
    if (base / HOOK_MODULE).is_file():
        return base
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=cache))
    out = tmp / "minipaged"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
    from minipaged.checks._registry import CHAPTER_MODULES

    for ch in CHAPTER_MODULES:
        p = out / "checks" / f"{ch}.py"
        p.write_text(_strip_checks(p.read_text(encoding="utf-8")), encoding="utf-8")
    (out / HOOK_MODULE).write_text(HOOK_SOURCE, encoding="utf-8")
    import compileall

    compileall.compile_dir(str(out), quiet=2, workers=1)
    try:
        os.rename(tmp, base.parent)
    except OSError:  # another grader made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return base


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
    digest = _content_hash(src)
    target = cache / f"{version}-{digest}-{chapter}" / "minipaged"
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
    base = _base_build(src, cache, f"{version}-{digest}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{chapter}-", dir=cache))
    out = tmp / "minipaged"
    shutil.copytree(base, out)
    import py_compile

    for path, quals in by_file.items():
        module = "minipaged." + ".".join(path.relative_to(src).with_suffix("").parts)
        dest = out / path.relative_to(src)
        # NOTE: the base's text: a checks module there is already without its references
        text, done = _strip_module(dest.read_text(encoding="utf-8"), quals, module.removesuffix(".__init__"))
        missing = set(quals) - done
        if missing:
            raise ValueError(f"answered_by names no function of {path.name}: {sorted(missing)}")
        dest.chmod(0o644)
        dest.write_text(text, encoding="utf-8")
        # NOTE: overwrites the base's .pyc of the original source (it would hold the body)
        py_compile.compile(str(dest), cfile=importlib.util.cache_from_source(str(dest)), doraise=True)
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target.parent)
    except OSError:  # another grader made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# == chapters 03-05: a scheduler step's phases, and the adapters of ch04/ch05 ==================
# ``PHASE_PLUGS``: ``(target, exercise) -> (k, helper, targets)``: in that chapter's build only
# the k-th top-level ``while`` loop of the target's body (a phase of ``schedule()``) is
# replaced, by ``targets = minipaged.grading.plug_ins.helper(self, out, budget, exercise,
# name)``; the rest of the method stays the package's (the other phase, the output's
# bookkeeping). The exercise is the first of the chapter's that lists the target in its
# ``answered_by`` (``strip_targets``): ex4.1 (admission) in ch04, ex5.4 (running) in ch05.
PHASE_PLUGS = {
    ("minipaged.core.sched.scheduler:Scheduler.schedule", "ex4.1"): (1, "v1_waiting_phase", "budget"),
    ("minipaged.core.sched.scheduler:Scheduler.schedule", "ex5.4"): (0, "v1_running_phase", "budget"),
    ("minipaged.core.sched.paper:PaperScheduler.schedule", "ex5.4"): (
        0,
        "paper_running_phase",
        "budget, preempted",
    ),
}
# the notebook's exercise function given the package method's arguments through
# ``plug_ins`` (an expression of ``fn`` and the method's parameters, as ``ADAPTERS``)
ADAPTERS_CH03_CH05 = {
    "minipaged.core.sched.scheduler:Scheduler.update_from_output": (
        "__import__('minipaged.grading.plug_ins', fromlist=['v1_update'])"
        ".v1_update(fn, self, output, sampled_token_ids)"
    ),
}
# same name and arity as the exercise's function, other parameters: never plugged in
NO_PLUG_IN_CH03_CH05 = {
    # (self, output, sampled): the notebook's update_from_output takes the scheduled pairs
    "minipaged.core.sched.paper:PaperScheduler.update_from_output": "ex4.3",
}
ADAPTERS.update(ADAPTERS_CH03_CH05)
NO_PLUG_IN.update(NO_PLUG_IN_CH03_CH05)


def _phase_plug(fn: ast.FunctionDef, target: str, ex: str) -> bool:
    """Replace one phase of ``fn`` (``PHASE_PLUGS``) in place; False when none is listed."""
    plug = PHASE_PLUGS.get((target, ex))
    if plug is None:
        return False
    k, helper, targets = plug
    from minipaged.checks._registry import get_spec

    name = get_spec(ex).signature.split("(")[0].strip()
    loops = [i for i, node in enumerate(fn.body) if isinstance(node, ast.While)]
    if len(loops) <= k:
        raise ValueError(f"PHASE_PLUGS {target!r}: no loop {k} in its body (phases moved?)")
    call = ast.parse(
        f"{targets} = __import__('minipaged.grading.plug_ins', fromlist=[{helper!r}])"
        f".{helper}(self, out, budget, {ex!r}, {name!r})"
    ).body[0]
    fn.body[loops[k]] = ast.copy_location(call, fn.body[loops[k]])
    return True


# -- the local check, as in the build (issue 35, item 5) -------------------------------------
#
# ``minipaged.checks``' local check runs the student's side of an exercise with what the
# chapter's build strips (its exercises' ``answered_by``) stripped the same way: the *same
# function objects* get the stub's code for the duration of the check (so a reference captured
# in a default argument, a decorator or an alias is stripped too), a Triton kernel's launch
# raises, and a stub runs the notebook's own function where the build would plug it in. A
# student whose code calls the package's implementation then reads locally what grading will
# say: ``ex2.3: your notebook's allocate_slots is used here``.


def _local_hook(namespaces: list):
    """The build's hook module (``HOOK_SOURCE``), its notebook function looked up in
    ``namespaces`` (those of the student's objects) before ``__main__``."""
    import types

    hook = types.ModuleType("minipaged._student_build")
    exec(compile(HOOK_SOURCE, "<minipaged._student_build>", "exec"), hook.__dict__)
    from_main = hook._notebook_function

    def _notebook_function(exercise_id, name):
        fn = next((ns[name] for ns in namespaces if callable(ns.get(name))), None)
        if fn is None:
            return from_main(exercise_id, name)
        busy = getattr(hook._active, "names", None)
        if busy is None:
            busy = hook._active.names = set()
        if getattr(fn, "__student_build_stub__", False) or name in busy:
            raise NotImplementedError(f"{exercise_id}: your notebook's {name} is used here")
        return fn, busy

    hook._notebook_function = _notebook_function
    return hook


def _resolve(target: str):
    """The function (a method's, a property's getter) or Triton kernel ``target`` names."""
    import importlib

    module, qualname = target.split(":")
    owner = importlib.import_module(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    raw = vars(owner)[parts[-1]]
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    fn = fn.fget if isinstance(fn, property) else fn
    return fn


_LOCAL_STUBS: dict = {}  # target -> the stub's code object (made once per process)


def _find_def(body: list, parts: list):
    """The definition of the qualname ``parts`` in ``body`` (as ``_strip_module`` walks it:
    classes, and ``if`` / ``try`` / ``with`` blocks as top level), or ``None``."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = [n for block in ("body", "orelse", "finalbody") for n in getattr(node, block, [])]
            inner += [n for h in getattr(node, "handlers", []) for n in h.body]
            hit = _find_def(inner, parts)
            if hit is not None:
                return hit
        elif isinstance(node, ast.ClassDef) and len(parts) > 1 and node.name == parts[0]:
            return _find_def(node.body, parts[1:])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parts == [node.name]:
            return node
        elif isinstance(node, ast.Assign) and len(parts) == 1:
            if any(getattr(t, "id", None) == parts[0] for t in node.targets):
                return node  # a Triton kernel: ``name = StrippedKernel(...)``
    return None


def _local_stub_code(target: str, fn, ex: str, name: str, arity: int):
    """The code object the build gives ``target`` (its module's source through
    ``_strip_module``, that one name stripped), with ``fn``'s free variables (a method that
    calls ``super()`` has ``__class__``)."""
    import importlib
    import inspect

    key = (target, ex, name, arity)
    if key in _LOCAL_STUBS:
        return _LOCAL_STUBS[key]
    module, qualname = target.split(":")
    source = inspect.getsource(importlib.import_module(module))
    text, done = _strip_module(source, {qualname: (ex, name, arity)}, module)
    node = _find_def(ast.parse(text).body, qualname.split("."))
    if qualname not in done or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"{target}: not a function the student build strips")
    node.decorator_list = []
    node.returns = None
    for a in (
        node.args.posonlyargs + node.args.args + node.args.kwonlyargs + [node.args.vararg, node.args.kwarg]
    ):
        if a is not None:
            a.annotation = None
    # NOTE: defaults live on the function object, not its code: none are evaluated here
    node.args.defaults = []
    node.args.kw_defaults = [None] * len(node.args.kwonlyargs)
    free = fn.__code__.co_freevars
    node.body = [ast.Expr(ast.Name(v, ast.Load())) for v in free] + node.body
    outer = ast.parse("def _outer():\n    pass\n").body[0]
    outer.body = [ast.parse(f"{v} = None").body[0] for v in free] + [node]
    code = compile(ast.fix_missing_locations(ast.Module([outer], [])), f"<stripped {target}>", "exec")
    outer_code = next(c for c in code.co_consts if hasattr(c, "co_consts"))
    stub = next(c for c in outer_code.co_consts if hasattr(c, "co_name") and c.co_name == node.name)
    if stub.co_freevars != free:
        raise ValueError(f"{target}: its stub's free variables {stub.co_freevars} are not {free}")
    _LOCAL_STUBS[key] = stub
    return stub


def _stripped_launch(message: str):
    def launch(*args, **kwargs):
        raise NotImplementedError(message)

    return launch


def _student_namespaces(objects) -> list:
    """The global namespaces the student's objects were defined in (the notebook's, or a
    test's dict), not the package's own modules."""
    out = []
    for obj in objects:
        fn = getattr(obj, "fn", obj)  # a Triton kernel's Python function
        ns = getattr(fn, "__globals__", None)
        if type(ns) is dict and not str(ns.get("__name__", "")).startswith("minipaged") and ns not in out:
            out.append(ns)
    return out


class as_in_the_build:
    """``with as_in_the_build(spec, objects):`` what the student build of the exercise's chapter
    strips (every ``answered_by`` of the chapter, as grading's sandbox has them) is stripped
    here too, and restored on exit: each function's ``__code__`` is the build's stub's, a
    Triton kernel's ``run`` (and the interpreter's ``rewrite``) raises; a stub's notebook
    function is looked up in the namespaces of ``objects`` (the student's), then
    ``__main__``. Not reentrant across threads: the local check runs in one."""

    def __init__(self, spec, objects=()):
        self.spec = spec
        self.objects = tuple(objects)
        self._undo: list = []
        self._hooked = False
        self._saved_hook = None

    def __enter__(self):
        import sys

        from minipaged.checks._registry import chapter_of

        targets = strip_targets(chapter_of(self.spec.exercise_id))
        if not targets:
            return self
        key = "minipaged._student_build"
        self._saved_hook = sys.modules.get(key)
        sys.modules[key] = _local_hook(_student_namespaces(self.objects))
        self._hooked = True
        try:
            for target, (ex, name, arity) in targets.items():
                fn = _resolve(target)
                if hasattr(fn, "run") and hasattr(fn, "fn"):  # a Triton kernel
                    message = f"{ex}: your notebook's {name} is used here"
                    for attr in ("run", "rewrite"):
                        if hasattr(fn, attr):
                            self._undo.append((fn, attr, vars(fn).get(attr), attr in vars(fn)))
                            setattr(fn, attr, _stripped_launch(message))
                    continue
                code = _local_stub_code(target, fn, ex, name, arity)
                self._undo.append((fn, "__code__", fn.__code__, True))
                fn.__code__ = code
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        import sys

        while self._undo:
            obj, attr, value, had = self._undo.pop()
            if had:
                setattr(obj, attr, value)
            else:
                delattr(obj, attr)
        if self._hooked:
            self._hooked = False
            if self._saved_hook is None:
                sys.modules.pop("minipaged._student_build", None)
            else:
                sys.modules["minipaged._student_build"] = self._saved_hook
        return False


# -- ch07 (issue 35): the chapter's stripped callables and the notebook's sustainable_rate ----
ADAPTERS.update(
    {
        # a sweep's own curve, its level as the notebook's factor (x the light-load latency)
        "minipaged.sim.simulator:RateSweep.sustainable_rate": (
            "fn(self.rates, self.normalized_latencies, "
            "factor if threshold is None else threshold / self.normalized_latencies[0])"
        ),
    }
)
# an absolute latency level, not the notebook's factor: the stub raises
NO_PLUG_IN.update({"minipaged.sim.simulator:sustainable_rate": "threshold is not a factor"})
