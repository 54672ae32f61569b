"""The shape of a scheduler loop, without its lines: phases and the calls each makes.

Chapters 04 and 08 read vLLM v1's ``Scheduler.schedule`` and the paper's
``PaperScheduler.schedule`` side by side, but exercises ex4.1 (the waiting phase) and
ex5.4 (the running phase) ask a student to write pieces of that very loop, so no chapter
prints its lines (``tests/viz/test_no_printed_answers.py``'s rule). What a chapter prints
instead is read off the real source with ``ast``, so it cannot drift from the code:

    from minipaged.viz.loops import loop_outline, outline_text, diff_outlines_text
    print(outline_text(Scheduler.schedule))              # its phases and their calls
    print(diff_outlines_text(Scheduler.schedule, PaperScheduler.schedule, ("v1", "paper")))

inputs: a function whose body marks its phases with numbered comments on a line of their
own (``# 1. RUNNING first ...``, ``# 2. WAITING ...``), each right above the top-level
statement that is the phase.
outputs: ``loop_outline(fn)`` -> ``[(phase title, [call names])]`` in source order: a
``setup`` phase (the statements before phase 1), the numbered phases, an ``end of step``
phase (the statements after the last one); a call name is the callee as written
(``kv.allocate_slots``, ``self._preempt``, ``self.running.pop``), each once, in order of
first appearance, builtins (``len``, ``sum``...) left out. ``*_text`` render them.
invariants: an outline holds no line of the function's code, only callee names and the
function's own phase comments.
failure mode: a function without numbered phase comments -> ``ValueError`` naming it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import textwrap

_PHASE = re.compile(r"^\s*#\s*(\d+)\.\s+(.*\S)\s*$")
_BUILTINS = set(dir(builtins))


def _call_name(node: ast.Call) -> str:
    return ast.unparse(node.func)


def _calls(stmts: list[ast.stmt]) -> list[str]:
    seen: dict[str, None] = {}
    nodes = [n for s in stmts for n in ast.walk(s) if isinstance(n, ast.Call)]
    for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        name = _call_name(n)
        if name not in _BUILTINS:
            seen.setdefault(name, None)
    return list(seen)


def loop_outline(fn) -> list[tuple[str, list[str]]]:
    """``[(phase title, [callee names])]`` of ``fn``'s body, in source order (see the module)."""
    src = textwrap.dedent(inspect.getsource(fn))
    lines = src.splitlines()
    phases = [
        (i + 1, f"{m.group(1)}. {m.group(2)}") for i, line in enumerate(lines) if (m := _PHASE.match(line))
    ]
    if not phases:
        raise ValueError(
            f"fn: {getattr(fn, '__qualname__', fn)!r} has no numbered phase comments ('# 1. ...')"
        )
    body = ast.parse(src).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    starts = [line for line, _ in phases]
    groups: list[list[ast.stmt]] = [[] for _ in range(len(phases) + 2)]  # setup, phases, end
    for stmt in body:
        before = [k for k, start in enumerate(starts) if start < stmt.lineno]
        if not before:
            groups[0].append(stmt)
        else:
            k = before[-1]
            # a phase is the first top-level statement after its comment; what follows the
            # last phase's statement is the end of the step
            owned = groups[k + 1]
            if k == len(phases) - 1 and owned:
                groups[-1].append(stmt)
            else:
                owned.append(stmt)
    titles = ["setup"] + [title for _, title in phases] + ["end of step"]
    return [(t, _calls(g)) for t, g in zip(titles, groups)]


def outline_text(fn) -> str:
    """``fn``'s outline: a line per phase, then its calls indented, one per line."""
    name = getattr(fn, "__qualname__", str(fn))
    out = [f"{name}: its phases and the calls each makes (read the lines in {fn.__module__})"]
    for title, calls in loop_outline(fn):
        out.append(f"  {title}")
        out.extend(f"      {c}" for c in calls)
    return "\n".join(out)


def diff_outlines(fn_a, fn_b) -> list[tuple[str, str, list[str], list[str], list[str]]]:
    """Phase by phase (paired in order): ``(title a, title b, only a, both, only b)``."""
    a, b = loop_outline(fn_a), loop_outline(fn_b)
    if len(a) != len(b):
        raise ValueError(f"fn_a has {len(a) - 2} numbered phases, fn_b {len(b) - 2}: they cannot be paired")
    rows = []
    for (ta, ca), (tb, cb) in zip(a, b):
        rows.append(
            (
                ta,
                tb,
                [c for c in ca if c not in cb],
                [c for c in ca if c in cb],
                [c for c in cb if c not in ca],
            )
        )
    return rows


def diff_outlines_text(fn_a, fn_b, labels: tuple[str, str] = ("a", "b")) -> str:
    """The two loops phase by phase: calls only in ``a``, in both, only in ``b``."""
    la, lb = labels
    out = []
    for ta, tb, only_a, both, only_b in diff_outlines(fn_a, fn_b):
        out.append(f"{la}: {ta}" if ta == tb else f"{la}: {ta}\n{lb}: {tb}")
        out.append(f"    both      : {', '.join(both) or '-'}")
        out.append(f"    only {la:5s}: {', '.join(only_a) or '-'}")
        out.append(f"    only {lb:5s}: {', '.join(only_b) or '-'}")
    return "\n".join(out)
