"""The grader's side of a check, inside the student's kernel: armed before any student code.

Concept
    ``minipaged grade`` runs one grader cell before the submission's first cell:
    ``arm(chapter, exercises)`` imports the harness and the chapter's checkers (so they
    bind their own references to ``contextlib``, ``io``, the package classes ... before
    the student's code can touch them), records a snapshot of the package's modules and
    classes, of ``builtins`` / ``contextlib`` / ``io`` / ``sys`` / torch's top level and of
    IPython's input-transformer lists, and draws one random token per exercise. It prints
    the tokens; that output goes to the grader only (no student cell has run yet).

    Each grader check cell then calls ``graded_check(exercise_id, *objects)``, which
    (1) puts back every snapshotted attribute the student's cells changed, (2) refuses
    the check if IPython's input transformers were changed, or if an object handed in is
    the package's own code rather than the student's, (3) runs the checker held since
    ``arm`` and, when it passes, prints the ✅ line and a verdict line carrying that
    exercise's token (once; the token is then forgotten).

Inputs / outputs
    ``arm(chapter, exercise_ids)`` prints ``MPTOKENS {json}``; ``graded_check`` prints
    ``✅ exN.M passed`` and ``MPV <token> exN.M`` or raises ``ExerciseFailure``.

Invariants
    the grader counts an exercise only on a verdict line with the token of *this* kernel's
    ``arm``; a printed ✅ line, a replaced ``check`` function or a check cell rewritten by
    a hook never carries the token.

Failure mode
    ``graded_check`` before ``arm`` raises ``RuntimeError``. What this cannot stop: code
    in the same process that reaches the token through frames, ``gc`` or ``ctypes``; the
    static scan (``minipaged.grading.scan``) rejects those constructs before the run.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import sys

_print = builtins.print
_redirect_stdout = contextlib.redirect_stdout
_StringIO = io.StringIO
_isinstance = builtins.isinstance
_getattr = builtins.getattr
_setattr = type.__setattr__
_delattr = type.__delattr__
_len = builtins.len
_list = builtins.list
_dict = builtins.dict
_type = builtins.type
_PLAIN_MODULES = (
    "builtins",
    "contextlib",
    "io",
    "sys",
    "math",
    "random",
    "functools",
    "itertools",
    "collections",
    "operator",
    "torch",
    "torch.nn.functional",
    "numpy",
    "triton",
    "triton.language",
)
# set by ipykernel / IPython themselves on every execution: never put back, never reported
_KERNEL_MANAGED = {
    ("builtins", "input"),
    ("builtins", "raw_input"),
    ("builtins", "_"),
    ("sys", "excepthook"),
    ("sys", "last_value"),
    ("sys", "last_type"),
    ("sys", "last_traceback"),
    ("sys", "last_exc"),
    ("sys", "ps1"),
    ("sys", "ps2"),
    ("sys", "displayhook"),
}
_STRICT_MODULES = ("builtins", "contextlib", "io")  # new names here are removed too


def _state():
    """Closure holding the armed state; not a module global a student cell could read by name."""
    box = {}

    def get():
        return box

    return get


_STATE = _state()


def _snapshot():
    modules = {}
    classes = {}
    for name, mod in _list(sys.modules.items()):
        if mod is None:
            continue
        if name == "minipaged" or name.startswith("minipaged.") or name in _PLAIN_MODULES:
            modules[name] = (mod, _dict(mod.__dict__))
            for v in _list(mod.__dict__.values()):
                if _isinstance(v, type) and (_getattr(v, "__module__", "") or "").startswith(
                    ("minipaged", "contextlib", "io", "_io")
                ):
                    classes[id(v)] = (v, _dict(v.__dict__))
    torch = sys.modules.get("torch")
    if torch is not None and _isinstance(_getattr(torch, "Tensor", None), type):
        classes[id(torch.Tensor)] = (torch.Tensor, _dict(torch.Tensor.__dict__))
    lists = {
        "meta_path": (sys.meta_path, _list(sys.meta_path)),
        "path_hooks": (sys.path_hooks, _list(sys.path_hooks)),
    }
    return modules, classes, lists


def _restore(snap) -> list:
    """Put back what changed since the snapshot; return what was changed (for the reason)."""
    modules, classes, lists = snap
    changed = []
    for name, (mod, saved) in modules.items():
        if sys.modules.get(name) is not mod:
            sys.modules[name] = mod
            changed.append(f"sys.modules[{name!r}]")
        d = mod.__dict__
        if name.startswith("minipaged") or name in _STRICT_MODULES:
            for k in _list(d):
                if (
                    k not in saved
                    and not (k.startswith("__") and k.endswith("__"))
                    and (name, k) not in _KERNEL_MANAGED
                ):
                    # a submodule imported later is fine; anything else is a student's addition
                    if not _isinstance(d[k], _type(sys)):
                        del d[k]
                        changed.append(f"{name}.{k}")
        for k, v in saved.items():
            if d.get(k, _MISSING) is not v:
                if (name, k) in _KERNEL_MANAGED:
                    continue
                d[k] = v
                changed.append(f"{name}.{k}")
    for cls, saved in classes.values():
        cur = cls.__dict__
        for k in _list(cur):
            if k not in saved:
                try:
                    _delattr(cls, k)
                    changed.append(f"{cls.__qualname__}.{k}")
                except (TypeError, AttributeError):
                    pass
        for k, v in saved.items():
            if cur.get(k, _MISSING) is not v and k not in ("__dict__", "__weakref__", "__doc__"):
                try:
                    _setattr(cls, k, v)
                    changed.append(f"{cls.__qualname__}.{k}")
                except (TypeError, AttributeError):
                    pass
    for name, (lst, saved) in lists.items():
        if _getattr(sys, name) is not lst:
            sys.__dict__[name] = lst
            changed.append(f"sys.{name}")
        if _list(lst) != saved:
            lst[:] = saved
            changed.append(f"sys.{name}")
    return changed


_MISSING = object()


def _ipython_hooks():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None:
        return None
    return ip, {
        k: (_getattr(ip, k, None), _list(_getattr(ip, k, None) or []))
        for k in ("input_transformers_cleanup", "input_transformers_post", "ast_transformers")
    }


def arm(chapter: str, exercise_ids) -> None:
    """Import the checkers, snapshot what they rely on, print one token per exercise."""
    import minipaged.checks as checks
    from minipaged.checks import _harness  # noqa: F401  (binds its references now)

    registry = checks._registry(chapter)
    box = _STATE()
    if box.get("armed"):
        raise RuntimeError("already armed")
    tokens = {ex: os.urandom(16).hex() for ex in exercise_ids}
    box.update(
        armed=True,
        registry=_dict(registry),
        tokens=tokens,
        chapter=chapter,
        snapshot=_snapshot(),
        hooks=_ipython_hooks(),
    )
    _print("MPTOKENS " + json.dumps(tokens), flush=True)


def _hooks_changed(saved) -> list:
    if saved is None:
        return []
    ip, lists = saved
    out = []
    for k, (obj, items) in lists.items():
        now = _getattr(ip, k, None)
        if now is not obj or _list(now or []) != items:
            out.append(k)
    return out


def _package_object(obj) -> bool:
    """True if ``obj`` is the package's own code, not something the student wrote."""
    for o in (
        obj,
        _getattr(obj, "fn", None),
        _getattr(obj, "__wrapped__", None),
        _getattr(obj, "func", None),
    ):
        if o is None:
            continue
        mod = _getattr(o, "__module__", None)
        if _isinstance(mod, str) and (mod == "minipaged" or mod.startswith("minipaged.")):
            return True
    return False


def graded_check(exercise_id: str, *objects) -> None:
    """Restore, verify, run the armed checker; print the ✅ line and the verdict token."""
    from minipaged.checks._harness import ExerciseFailure

    box = _STATE()
    if not box.get("armed"):
        raise RuntimeError("the grader's guard was not armed")
    changed = _restore(box["snapshot"])
    hooks = _hooks_changed(box["hooks"])
    if hooks:
        raise ExerciseFailure(
            f"{exercise_id}: the submission changed IPython's {', '.join(hooks)}; "
            "the check cell may have been rewritten, so it does not count"
        )
    for o in objects:
        if _package_object(o):
            raise ExerciseFailure(
                f"{exercise_id}: the object handed to the check is the package's own "
                f"{_getattr(o, '__qualname__', _type(o).__name__)}, not your code"
            )
    fn = box["registry"].get(exercise_id)
    if fn is None:
        raise ExerciseFailure(f"{exercise_id}: no checker armed for this exercise")
    buf = _StringIO()
    with _redirect_stdout(buf):
        fn(*objects)
    token = box["tokens"].pop(exercise_id, None)
    if token is None:
        raise ExerciseFailure(f"{exercise_id}: this exercise was already checked once in this kernel")
    _restore(box["snapshot"])
    if changed:
        _print(
            f"(the grader put back what the submission had changed: {', '.join(sorted(set(changed))[:8])})"
        )
    _print(buf.getvalue(), end="")
    _print(f"MPV {token} {exercise_id}", flush=True)
