"""The reference hunt's child: every callable of a student build, given each exercise's inputs.

Usage: ``python _hunt.py REQUEST.json`` -> one line of JSON on stdout.

For each chapter of the request, the ``minipaged`` modules of the previous chapter are
dropped from ``sys.modules`` and the chapter's build is imported in their place (torch and
the other libraries stay loaded). Then, for each exercise:

* its inputs are recorded: the spec's ``observe`` runs on the first case that calls the
  student's function, with a recorder in its place (the arguments it is called with); a prediction or a
  concept question is called with no argument, so its inputs are the case itself (the
  workload, the drawn questions);
* every callable defined in the build (module functions, every method of every class,
  private ones too, Triton kernels) is tried as the student's function: as it is (a method
  with the first input as ``self``), on instances built from the first k inputs (the method
  gets the rest), and for a prediction with the workload as its one argument;
* a candidate whose arguments bind is run through the spec's ``observe`` on that case
  (with a time limit; what it raises is data); one that gives the expected observation there
  runs on every case, and its records come back to the parent, which judges them with the
  real package's checker.

Modules that start servers, processes or the command line are not imported (SKIP).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import signal
import sys
import time

SKIP = (
    "minipaged.entrypoints",
    "minipaged.distributed",
    "minipaged.executor",
    "minipaged.grading",
    "minipaged.bench",
    "minipaged.cli",
    "minipaged.book",
    "minipaged.demo",
    "minipaged.sim.cli",
    "minipaged.checks.exercises",
    "minipaged.checks.notebook",
    "minipaged._student_build",
    "minipaged.engine.core_client",  # its clients start the engine-core process
    "minipaged.engine.async_llm",  # starts engine-core threads (a daemon thread at exit aborts)
    "minipaged.model.loader",  # loads checkpoints (a hub id is a network call)
)
# callables that start processes or write files, by name
SKIP_CALLABLES = (
    "minipaged.sim.simulator:_map",
    "minipaged.spec_decode.draft_model:write_layer_skip_draft",
)


class _Recorded(BaseException):
    pass


class _Timeout(BaseException):
    pass


class Recorder:
    """Stands in for the student's function (or kernel): records its first call and stops."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        raise _Recorded()


def _on_alarm(signum, frame):
    raise _Timeout()


@contextlib.contextmanager
def time_limit(seconds):
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def load_build(parent: str):
    for name in [m for m in sys.modules if m == "minipaged" or m.startswith("minipaged.")]:
        del sys.modules[name]
    for old in LOADED:
        if old in sys.path:
            sys.path.remove(old)
    LOADED[:] = [parent]
    sys.path.insert(0, parent)
    importlib.invalidate_caches()
    import minipaged

    assert minipaged.__file__.startswith(parent), minipaged.__file__
    modules = [minipaged]
    for name in _module_names(minipaged.__path__[0], "minipaged"):
        if name.startswith(SKIP):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), time_limit(5):
                modules.append(importlib.import_module(name))
        except BaseException:  # noqa: BLE001 - a module that cannot load offers nothing
            continue
    return modules


LOADED: list = []


def _module_names(path: str, prefix: str) -> list:
    """Every module under ``path``, without importing anything (a package is not entered
    when it is in SKIP)."""
    out = []
    for info in pkgutil.iter_modules([path]):
        name = f"{prefix}.{info.name}"
        if name.startswith(SKIP):
            continue
        out.append(name)
        if info.ispkg:
            out.extend(_module_names(os.path.join(path, info.name), name))
    return out


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def candidates(modules) -> tuple[list, list]:
    """``(callables, classes)``: ``[(name, obj, signature)]``, ``[(name, cls, [(mname, fn, sig)])]``."""
    funcs, classes, seen = [], [], set()
    for mod in modules:
        for attr, obj in sorted(vars(mod).items()):
            if id(obj) in seen:
                continue
            where = f"{mod.__name__}:{attr}"
            if inspect.isclass(obj) and obj.__module__ == mod.__name__:
                seen.add(id(obj))
                methods = []
                for mname, raw in sorted(vars(obj).items()):
                    if mname.startswith("__") and mname not in ("__call__", "__getitem__"):
                        continue
                    fn = raw.fget if isinstance(raw, property) else raw
                    if isinstance(fn, (staticmethod, classmethod)):
                        fn = getattr(obj, mname)
                    if callable(fn):
                        funcs.append((f"{where}.{mname}", fn, _signature(fn)))
                        if not isinstance(raw, (staticmethod, classmethod, property)):
                            methods.append((mname, _signature(fn)))
                classes.append((where, obj, _signature(obj), methods))
            elif inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                seen.add(id(obj))
                funcs.append((where, obj, _signature(obj)))
            elif hasattr(obj, "__getitem__") and type(obj).__name__ in ("JITFunction", "StrippedKernel"):
                seen.add(id(obj))
                funcs.append((where, obj, _signature(getattr(obj, "fn", None))))
    return funcs, classes


def _binds(sig, args, kwargs=None, skip_self=False) -> bool:
    if sig is None:
        return False
    try:
        if skip_self:
            sig.bind(None, *args, **(kwargs or {}))
        else:
            sig.bind(*args, **(kwargs or {}))
    except TypeError:
        return False
    return True


class Outcome:
    """A call made once: what it returned or raised, given back at every later call."""

    def __init__(self, thunk, limit_s):
        self.value = self.error = None
        try:
            with contextlib.redirect_stdout(io.StringIO()), time_limit(limit_s):
                self.value = thunk()
        except BaseException as e:  # noqa: BLE001 - given back as it was
            self.error = e if isinstance(e, Exception) else RuntimeError(type(e).__name__)

    def __call__(self, *args, **kwargs):
        if self.error is not None:
            raise self.error
        return self.value


MEMO: dict = {}  # per chapter: calls with no input (their result is the same for every exercise)


def _once(key, thunk, limit_s):
    if key not in MEMO:
        MEMO[key] = Outcome(thunk, limit_s)
    return MEMO[key]


def _constructs(cls, args, limit_s) -> bool:
    try:
        with contextlib.redirect_stdout(io.StringIO()), time_limit(limit_s):
            cls(*args)
    except BaseException:  # noqa: BLE001
        return False
    return True


def adapters(funcs, classes, args, kwargs, workload, limit_s):
    """``(name, make)``: ``make(case)`` -> the student object for that case. A class is tried
    only with the inputs it can be built from (built once on the first case's inputs); a
    call with no input at all is made once per chapter (``MEMO``)."""
    out = []
    for name, fn, sig in funcs:
        if name.startswith(SKIP_CALLABLES):
            continue
        if _binds(sig, args, kwargs):
            if workload:
                out.append((name, lambda case, fn=fn, name=name: _once(name, fn, limit_s)))
            else:
                out.append((name, lambda case, fn=fn: fn))
        if workload and _binds(sig, (None,)):
            out.append((f"{name}(workload)", lambda case, fn=fn: lambda *a, **k: fn(case)))
    for cname, cls, csig, methods in classes:
        if cname.startswith(SKIP_CALLABLES):
            continue
        if _binds(csig, ()):
            instance = _once(f"{cname}()", cls, 5 * limit_s)
            if instance.error is None:
                for mname, msig in methods:
                    try:
                        bound = getattr(instance.value, mname)
                    except Exception:  # noqa: BLE001
                        continue
                    label = f"{cname}().{mname}"
                    if _binds(msig, args, kwargs, skip_self=True):
                        if workload:
                            out.append((label, lambda case, b=bound, key=label: _once(key, b, limit_s)))
                        else:
                            out.append((label, lambda case, b=bound: b))
                    if workload and _binds(msig, (None,), skip_self=True):
                        out.append((f"{label}(workload)", lambda case, b=bound: lambda *a, **k: b(case)))
        for k in range(1, len(args) + 1):
            if not _binds(csig, args[:k]) or not _constructs(cls, args[:k], limit_s):
                continue
            for mname, msig in methods:
                if _binds(msig, args[k:], kwargs, skip_self=True):
                    out.append(
                        (
                            f"{cname}(inputs[:{k}]).{mname}",
                            lambda case, cls=cls, m=mname, k=k: (
                                lambda *a, **kw: getattr(cls(*a[:k]), m)(*a[k:], **kw)
                            ),
                        )
                    )
        if workload and _binds(csig, (None,)):
            for mname, msig in methods:
                if _binds(msig, (), skip_self=True):
                    out.append(
                        (
                            f"{cname}(workload).{mname}",
                            lambda case, cls=cls, m=mname: lambda *a, **kw: getattr(cls(case), m)(),
                        )
                    )
    return out


def hunt_exercise(spec, job, funcs, classes, limit_s):
    from minipaged.checks._spec import diff, observe_one
    from minipaged.grading.codec import dumps, to_data

    cases = job["cases"]
    # NOTE: the first case that calls the student's function (an ex6.2 case may hold no append)
    probe = 0
    for k, case in enumerate(cases):
        rec = Recorder()
        try:
            with contextlib.redirect_stdout(io.StringIO()), time_limit(30):
                spec.observe(case, rec)
        except BaseException:  # noqa: BLE001 - _Recorded, or an observe that calls nothing
            pass
        if rec.calls:
            probe = k
            break
    args, kwargs = rec.calls[0] if rec.calls else ((), {})
    workload = not args and not kwargs
    tried = adapters(funcs, classes, args, kwargs, workload, limit_s)
    expected, answers = job.get("expected"), job.get("answers")
    hits = []
    slow = []
    t_all = time.perf_counter()
    for name, make in tried:
        t0 = time.perf_counter()

        def run(case):
            with contextlib.redirect_stdout(io.StringIO()), time_limit(limit_s):
                return observe_one(spec, case, (make(case),))

        try:
            first = run(cases[probe])
        except BaseException:  # noqa: BLE001 - a timeout or an exit: not an answer
            continue
        finally:
            if time.perf_counter() - t0 > 0.05:
                slow.append([name, round(time.perf_counter() - t0, 3)])
        if first.get("_not_implemented") or "value" not in first:
            continue
        got = json.loads(dumps(to_data(first)))
        if answers is not None:
            value = got.get("value")
            if type(value) is not dict or sorted(value) != sorted(answers):
                continue
            if not job.get("shape_only") and any(
                diff(a, value[q], tol, 1e-9) for q, (a, tol) in answers.items()
            ):
                continue
        elif expected is not None and diff(expected[probe], got, spec.rel_tol, spec.abs_tol):
            continue
        try:
            records = [first if k == probe else run(c) for k, c in enumerate(cases)]
        except BaseException:  # noqa: BLE001
            continue
        hits.append({"name": name, "records": dumps(records)})
    return {"tried": len(tried), "hits": hits, "seconds": round(time.perf_counter() - t_all, 2), "slow": slow}


def main():
    import torch  # noqa: F401 - loaded once, before any time limit (an import cut short breaks it)

    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    request = json.loads(open(sys.argv[1], encoding="utf-8").read())
    out = {}
    for ch, job in request["chapters"].items():
        modules = load_build(job["build"])
        MEMO.clear()
        from minipaged.checks import get_spec

        funcs, classes = candidates(modules)
        out[ch] = {"callables": len(funcs), "classes": len(classes), "exercises": {}}
        for ex, ex_job in job["exercises"].items():
            out[ch]["exercises"][ex] = hunt_exercise(get_spec(ex), ex_job, funcs, classes, request["limit_s"])
    os.write(1, (json.dumps(out) + "\n").encode())
    # NOTE: no interpreter shutdown: the candidates it ran may leave threads or Triton's
    # bindings in a state whose finalization aborts (SIGABRT after the report is written)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
