"""Static scan of a submission's code cells: what an exercise bans, found in the syntax tree.

Concept
    Before a submission runs, every cell the student can write (setup, solution, extra
    cells) is parsed (after IPython's own magic/shell rewriting) and walked. Names are
    resolved through the cell's imports and simple aliases (``q = FreeKVCacheBlockQueue``),
    so ``importlib.import_module("minipaged." + "checks")``, ``getattr(m, "__class__")``
    or ``K = KVCacheManager; K.allocate_slots(m, ...)`` are found, not only literal text.

Inputs / outputs
    ``scan_cells(sources, chapter)`` -> one list of ``Finding(line, rule, message, tamper)``
    per cell (imports carry over from cell to cell); ``scan_source(source, chapter)``: one cell.
    The grader's judge runs in another process on plain data, so no finding is needed to
    protect a verdict (the cheat suite shows it with the scan off). What the scan is for:
    the package's own implementation of what an exercise asks for, reached directly
    (``rule="reference"``, ``tamper=False``: the package's classes, the checkers'
    references in ``minipaged.checks``) or through reflection (``__class__``, base-class
    calls, ``setattr``: the ``tamper`` findings), which the boundary cannot tell from the
    student's own work. Any finding in an exercise's solution cell zeroes that exercise;
    elsewhere, a reference zeroes the exercises after it and the rest are flags for a human.

Rules (one line each in ``RULES``)
    banned modules (importlib, ctypes, gc, inspect, runpy, IPython, ipykernel, builtins,
    marshal, minipaged.checks) and ``sys`` internals (modules, meta_path, path_hooks,
    _getframe, settrace, setprofile, addaudithook, stdout/stderr); ``eval``/``exec``/
    ``compile``/``__import__``/``globals``/``locals``/``vars``/``setattr``/``delattr``/
    ``breakpoint`` and non-constant ``getattr``; dunder attributes outside a short list
    (``__class__``, ``__dict__``, ``__globals__``, ``__mro__``, ...), frame and traceback
    attributes (``f_back``, ``tb_frame``, ...), ``mro()``, ``super(...)`` with arguments,
    ``type(x).attr``; assigning or deleting an attribute or item of anything imported
    (``contextlib.redirect_stdout = ...``, ``KVCacheManager.allocate_slots = ...``);
    ``get_ipython()`` except the ``%time`` / ``%timeit`` / ``%matplotlib`` magics; and,
    per chapter, the reference classes and functions (``REFERENCES``): they may appear
    only in type annotations and as the class argument of ``isinstance``.

Invariants
    the authored solutions of every chapter scan clean (tested), so an honest solution
    written the way the course teaches is never flagged.

Failure mode
    a cell that does not parse gives no finding (it fails when it runs); the scan never
    raises for student input.

Limits: a static scan cannot see everything Python allows: a student who reaches the
package's implementation in a way the scan misses is stopped by the student build instead
(``student_build.py``: the sandbox's package holds no implementation that answers the
exercise; docs/grading.md, "What is guaranteed").
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from typing import Optional

BANNED_MODULES = (
    "importlib",
    "imp",
    "ctypes",
    "gc",
    "inspect",
    "runpy",
    "IPython",
    "ipykernel",
    "builtins",
    "marshal",
    "code",
    "codeop",
    "pickle",
    "dill",
    "cloudpickle",
    "subprocess",
    "multiprocessing",
    "minipaged.checks",
    "minipaged.grading",
    "jupyter_client",
    "zmq",
)
CHECKER_MODULES = ("minipaged.checks", "minipaged.grading")
BANNED_SYS = (
    "sys.modules",
    "sys.meta_path",
    "sys.path_hooks",
    "sys.path_importer_cache",
    "sys._getframe",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "sys.path",
    "sys.setrecursionlimit",
)  # (sys.stdout and friends may be read, e.g. print(..., file=sys.stderr); assigning them is a patch)
# files and processes: the exercises never need them, and they reach the authored notebooks,
# the package's files or the grader (the sandbox blocks these too; the scan says so first)
BANNED_OS = (
    "os.system",
    "os.popen",
    "os.execv",
    "os.execve",
    "os.execl",
    "os.execlp",
    "os.execvp",
    "os.spawnl",
    "os.spawnv",
    "os.posix_spawn",
    "os.fork",
    "os.kill",
    "os.killpg",
    "os.remove",
    "os.unlink",
    "os.rename",
    "os.replace",
    "os.open",
    "os.write",
    "os.chmod",
    "os.chown",
    "os.symlink",
    "os.link",
    "os.mkdir",
    "os.makedirs",
    "os.rmdir",
    "os.environ",
    "os.putenv",
    "os.getppid",
    "os.listdir",
    "os.scandir",
    "os.walk",
    "os.chdir",
    "pathlib",
    "shutil",
    "socket",
    "signal",
    "glob",
    "tempfile",
    "io.open",
    "io.FileIO",
)
FILE_METHODS = {"write_text", "write_bytes", "read_text", "read_bytes", "symlink_to", "hardlink_to"}
BANNED_CALLS = {
    "eval",
    "exec",
    "compile",
    "__import__",
    "globals",
    "locals",
    "vars",
    "setattr",
    "delattr",
    "breakpoint",
    "open",
    "input",
    "memoryview",
}
ALLOWED_DUNDERS = {
    "__init__",
    "__name__",
    "__doc__",
    "__len__",
    "__iter__",
    "__next__",
    "__repr__",
    "__str__",
    "__post_init__",
    "__qualname__",
}
FRAME_ATTRS = {
    "f_back",
    "f_globals",
    "f_locals",
    "f_builtins",
    "f_code",
    "f_trace",
    "tb_frame",
    "tb_next",
    "gi_frame",
    "gi_code",
    "cr_frame",
    "cr_code",
    "ag_frame",
    "ag_code",
    "co_consts",
    "co_code",
    "mro",
    "func_globals",
}
ALLOWED_MAGICS = {"time", "timeit", "matplotlib"}

# Per chapter: the package objects whose job the exercises ask the student to do. A
# student cell may name them only in annotations and as isinstance's class argument.
REFERENCES: dict[str, tuple[str, ...]] = {
    "ch01": ("minipaged.core.kv.contiguous.ContiguousAllocator", "minipaged.core.KVCacheManager"),
    "ch02": ("minipaged.core.FreeKVCacheBlockQueue", "minipaged.core.KVCacheManager"),
    "ch03": ("minipaged.kernels",),
    "ch04": ("minipaged.core.sched", "minipaged.core.Scheduler", "minipaged.core.PaperScheduler"),
    "ch05": ("minipaged.core.sched", "minipaged.core.Scheduler", "minipaged.core.PaperScheduler"),
    "ch06": (
        "minipaged.core.KVCacheManager",
        "minipaged.core.BlockSpaceManager",
        "minipaged.core.kv.block_manager_v0",
    ),
    "ch08": ("minipaged.core.KVCacheManager", "minipaged.core.sched", "minipaged.core.Scheduler"),
    "ch09": ("minipaged.sim", "minipaged.engine.core.EngineCoreProc", "minipaged.engine.async_llm"),
    "ch10": (
        "minipaged.sample.rejection_sampler.RejectionSampler",
        "minipaged.spec_decode.analysis.expected_tokens_per_step",
        "minipaged.spec_decode.analysis.cost_model_speedup",
        "minipaged.core.sched.scheduler",
        "minipaged.core.Scheduler",
    ),
    "ch11": ("minipaged.model.parallel",),
}
# Uses of a reference that are fine anyway: the chapter 03 setup cell's bare import.
_REFERENCE_OK_IMPORTS = {"minipaged.kernels"}


@dataclass(frozen=True)
class Finding:
    line: int
    rule: str
    message: str
    tamper: bool = True  # can change later checks (patching, reflection, hooks)

    def __str__(self) -> str:
        return f"line {self.line}: {self.message} [{self.rule}]"


def _transform(source: str) -> str:
    """IPython's rewriting of magics and ``!shell`` lines into plain Python calls."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(source)
    except Exception:  # pragma: no cover - IPython missing or odd input
        return source


def _resolve_object(qualname: str):
    """The package object a dotted ``minipaged...`` name stands for, or None."""
    parts = qualname.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


def _prefix_match(name: str, prefixes) -> Optional[str]:
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return p
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, chapter: Optional[str]) -> None:
        self.findings: list[Finding] = []
        self.aliases: dict[str, str] = {}  # local name -> dotted name it stands for
        self.refs = REFERENCES.get(chapter or "", ())
        self._ref_objects = None

    # -- helpers ---------------------------------------------------------------------------
    def flag(self, node, rule: str, message: str, tamper: bool = True) -> None:
        self.findings.append(Finding(getattr(node, "lineno", 0), rule, message, tamper))

    def dotted(self, node) -> Optional[str]:
        """``a.b.c`` with ``a`` resolved through imports/aliases; None if not rooted in one."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(attrs)])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython":
            return ".".join(["get_ipython()", *reversed(attrs)])
        return None

    def ref_objects(self):
        if self._ref_objects is None:
            self._ref_objects = [(r, _resolve_object(r)) for r in self.refs]
        return self._ref_objects

    def reference_of(self, name: str) -> Optional[str]:
        """Which chapter reference the dotted ``name`` is (or lies inside), if any."""
        if not self.refs or not name.startswith("minipaged"):
            return None
        hit = _prefix_match(name, self.refs)
        if hit:
            return hit
        obj = _resolve_object(name)
        if obj is None:
            return None
        for ref_name, ref in self.ref_objects():
            if ref is not None and obj is ref:
                return ref_name
        # a method of a reference class reached through another import path
        for cut in range(len(name.split(".")) - 1, 0, -1):
            head = _resolve_object(".".join(name.split(".")[:cut]))
            if head is not None and any(head is ref for _, ref in self.ref_objects() if ref is not None):
                return ".".join(name.split(".")[:cut])
        return None

    def check_name(self, node, name: str, context: str = "use") -> None:
        m = _prefix_match(name, BANNED_MODULES)
        if m in CHECKER_MODULES:
            # NOTE: the checkers hold a reference of every exercise (ch02.ref_slot_mapping ...)
            self.flag(
                node, "reference", f"uses {name} (the checkers hold the exercises' references)", tamper=False
            )
            return
        if m:
            self.flag(node, "banned-module", f"uses {name} ({m} is not allowed in a submission)")
            return
        if _prefix_match(name, BANNED_SYS):
            self.flag(node, "sys-internals", f"uses {name} (interpreter internals are not allowed)")
            return
        if _prefix_match(name, BANNED_OS):
            self.flag(node, "files-processes", f"uses {name} (files and processes are not allowed)")
            return
        if name.startswith("get_ipython()"):
            self.flag(node, "ipython-hook", f"uses {name} (IPython hooks are not allowed)")
            return
        ref = self.reference_of(name)
        if ref and context != "import":
            self.flag(
                node,
                "reference",
                f"uses the reference {name} (the exercise asks you to write "
                f"it; {ref.rsplit('.', 1)[-1]} may appear only in annotations and isinstance)",
                tamper=False,
            )

    # -- imports and aliases ---------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.check_name(node, a.name, "import")
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                root = a.name.split(".")[0]
                self.aliases[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        if node.module == "minipaged.checks" and [a.name for a in node.names] == ["check"]:
            # the check cells' own import, which students copy to test their code: harmless
            # (the grader never uses the student's `check`), anything more is not
            self.aliases[node.names[0].asname or "check"] = "minipaged.checks.check"
            return
        self.check_name(node, node.module, "import")
        for a in node.names:
            full = f"{node.module}.{a.name}"
            if a.name == "*":
                self.flag(node, "star-import", f"from {node.module} import * (name what you import)")
                continue
            self.check_name(node, full, "import")
            self.aliases[a.asname or a.name] = full

    # -- names, attributes, calls ----------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("__") and node.id.endswith("__") and node.id not in ("__name__", "__file__"):
            self.flag(node, "dunder-name", f"uses {node.id}")
        elif isinstance(node.ctx, ast.Load) and node.id in self.aliases:
            name = self.aliases[node.id]
            if self.reference_of(name) and name not in _REFERENCE_OK_IMPORTS:
                self.check_name(node, name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr.startswith("__") and attr.endswith("__") and attr not in ALLOWED_DUNDERS:
            self.flag(node, "dunder-attribute", f"uses .{attr} (reflection is not allowed)")
        elif attr in FILE_METHODS:
            self.flag(node, "files-processes", f"uses .{attr}() (files are not allowed)")
        elif attr in FRAME_ATTRS:
            self.flag(node, "frame-attribute", f"uses .{attr} (frames and code objects are not allowed)")
        elif (
            isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "type"
            and attr not in ALLOWED_DUNDERS
        ):
            self.flag(
                node,
                "type-attribute",
                f"uses type(...).{attr} (reaching into the class of an "
                "object the check hands you is not allowed)",
            )
        name = self.dotted(node)
        if name is not None:
            self.check_name(node, name)
            # the chain's own value is reported once, here: do not visit the bare root again
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Call):
                self.generic_visit(root)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name):
            if f.id in BANNED_CALLS and f.id not in self.aliases:
                self.flag(node, "banned-builtin", f"calls {f.id}() (not allowed in a submission)")
            elif f.id == "getattr" and not (
                len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                self.flag(node, "getattr", "calls getattr() with a computed name")
            elif f.id == "getattr":
                attr = node.args[1].value
                fake = ast.Attribute(value=node.args[0], attr=attr, ctx=ast.Load())
                ast.copy_location(fake, node)
                self.visit_Attribute(fake)
            elif f.id == "super" and (node.args or node.keywords):
                self.flag(
                    node,
                    "super-args",
                    "calls super(...) with arguments (reaching a base class "
                    "of an object the check hands you is not allowed)",
                )
            elif f.id == "get_ipython":
                self.flag(node, "ipython-hook", "calls get_ipython() (IPython hooks are not allowed)")
            elif f.id == "isinstance" or f.id == "issubclass":
                for a in node.args[:1]:
                    self.visit(a)
                return  # the class argument may name a reference
        elif (
            isinstance(f, ast.Attribute)
            and f.attr in ("run_line_magic", "run_cell_magic")
            and isinstance(f.value, ast.Call)
            and isinstance(f.value.func, ast.Name)
            and f.value.func.id == "get_ipython"
        ):
            magic = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if magic in ALLOWED_MAGICS:
                for a in node.args[1:]:
                    self.visit(a)
                return
            self.flag(
                node,
                "ipython-magic",
                f"uses the %{magic} magic (only %time, %timeit and %matplotlib are allowed)",
            )
            return
        self.generic_visit(node)

    # -- stores: patching ------------------------------------------------------------------
    def _store_target(self, target, verb: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._store_target(t, verb)
            return
        if isinstance(target, ast.Starred):
            self._store_target(target.value, verb)
            return
        if isinstance(target, (ast.Attribute, ast.Subscript)):
            base = target.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            name = self.dotted(target.value) if not isinstance(target.value, ast.Subscript) else None
            root = base.id if isinstance(base, ast.Name) else None
            if name is not None or (root is not None and root in self.aliases):
                shown = name or self.aliases[root]
                what = f"{shown}.{target.attr}" if isinstance(target, ast.Attribute) else f"{shown}[...]"
                self.flag(target, "patch", f"{verb} {what} (patching a module or class is not allowed)")

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._store_target(t, "assigns")
        # simple aliases: q = FreeKVCacheBlockQueue; c = importlib
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            src = self.dotted(node.value) if isinstance(node.value, (ast.Name, ast.Attribute)) else None
            if src is not None:
                self.aliases[node.targets[0].id] = src
            elif node.targets[0].id in self.aliases:
                del self.aliases[node.targets[0].id]  # rebound to something else
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store_target(node.target, "changes")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._store_target(node.target, "assigns")
        if node.value is not None:
            self.visit(node.value)
        # the annotation may name a reference: not visited

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._store_target(t, "deletes")
        self.generic_visit(node)

    # -- annotations are allowed to name references ----------------------------------------
    def _visit_function(self, node) -> None:
        for d in node.decorator_list:
            self.visit(d)
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None and a.arg in self.aliases:
                del self.aliases[a.arg]  # a parameter shadows an import inside the function
        for d in [*args.defaults, *args.kw_defaults]:
            if d is not None:
                self.visit(d)
        for stmt in node.body:
            self.visit(stmt)

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for b in node.bases:
            self.visit(b)
        for k in node.keywords:
            self.flag(node, "class-keyword", f"class {node.name}({k.arg}=...) (metaclasses are not allowed)")
        for d in node.decorator_list:
            self.visit(d)
        for stmt in node.body:
            self.visit(stmt)


def _dedup(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in sorted(findings, key=lambda f: f.line):
        if (f.line, f.message) not in seen:
            seen.add((f.line, f.message))
            out.append(f)
    return out


def scan_cells(sources: list[str], chapter: Optional[str] = None) -> list[list[Finding]]:
    """Scan a notebook's student cells in run order; imports and aliases carry from cell to
    cell, as they do in the kernel. One list of findings per cell."""
    s = _Scanner(chapter)
    out = []
    for source in sources:
        s.findings = []
        try:
            tree = ast.parse(_transform(source))
        except SyntaxError:
            out.append([])
            continue
        s.visit(tree)
        out.append(_dedup(s.findings))
    return out


def scan_source(source: str, chapter: Optional[str] = None) -> list[Finding]:
    """Every banned construct in one cell's source (IPython syntax allowed)."""
    return scan_cells([source], chapter)[0]


RULES = {
    "banned-module": "imports or uses a module that can reach the grader or the interpreter's internals",
    "sys-internals": "uses sys.modules / meta_path / _getframe / settrace / stdout ...",
    "ipython-hook": "uses get_ipython() (input transformers, events, shell)",
    "ipython-magic": "uses a magic other than %time, %timeit, %matplotlib",
    "banned-builtin": "eval / exec / compile / __import__ / globals / locals / vars / setattr / open ...",
    "getattr": "getattr with a computed name",
    "dunder-name": "a __dunder__ name such as __builtins__ or __import__",
    "dunder-attribute": "an attribute such as .__class__, .__dict__, .__globals__, .__mro__",
    "frame-attribute": "frame, traceback or code-object attributes, .mro()",
    "type-attribute": "type(obj).method: a base-class method of an object the check hands you",
    "super-args": "super(cls, obj): a base-class method of an object the check hands you",
    "patch": "assigns or deletes an attribute or item of something imported",
    "class-keyword": "a class with a metaclass or other class keyword",
    "star-import": "from X import *",
    "files-processes": "files and processes: open, pathlib, shutil, os.system / kill / remove ...",
    "reference": "uses the chapter's reference implementation outside annotations and isinstance",
}
