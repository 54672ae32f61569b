"""Code tours that do not give away the exercises.

A chapter tours the package's code with ``inspect.getsource``. Where an exercise asks a
student to write a function, the chapter shows only its *contract*: the signature and
the docstring (``contract``), or for a Triton kernel the pseudocode of its docstring
(``kernel_pseudocode``). The bodies are printed by the instructor's appendix
(``notebooks/99_instructor_appendix.ipynb``), to be opened after the exercise notebook has
been handed in, and ``tests/viz/test_no_printed_answers.py`` fails when a chapter's stored
output contains one of them.

    from minipaged.viz.source import contract, body, EXERCISE_BODIES
    print(contract(KVCacheManager.allocate_slots))   # the signature, the docstring, then ...
    body(resolve("minipaged.core.kv.block_table:BlockTable.slot"))  # the lines a student writes

inputs: a function, method or ``triton.jit`` kernel (its Python function is ``.fn``).
outputs: strings; nothing is printed here.
invariants: ``contract(fn)`` contains no line of ``body(fn)`` (a docstring that quotes its
own code would break that, and the test would say so).
failure mode: an object without a docstring -> ``ValueError`` naming it (a contract needs one).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap

# Exercise id -> the package functions whose bodies that exercise asks a student to write
# ("module:qualname"). The chapters show these by contract only.
EXERCISE_BODIES: dict[str, tuple[str, ...]] = {
    "ex2.3": ("minipaged.core.kv.kv_cache_manager:KVCacheManager.allocate_slots",),
    "ex2.4": (
        "minipaged.core.kv.block_table:BlockTable.slot",
        "minipaged.core.kv.block_table:BlockTable.slot_mapping",
    ),
    "ex3.2": ("minipaged.kernels.reference:paged_attention_ref",),
    "ex3.3": ("minipaged.kernels.paged_attention:_attend_kv_range",),
    "ex3.4": ("minipaged.kernels.paged_attention:_paged_attention_reduce_kernel",),
    "ex6.1": ("minipaged.core.kv.block_manager_v0:BlockSpaceManager.fork",),
    "ex6.2": ("minipaged.core.kv.block_manager_v0:BlockSpaceManager.allocate_slots",),
    "ex6.4": ("minipaged.core.kv.kv_cache_manager:KVCacheManager.get_computed_blocks",),
}


def resolve(path: str):
    """The object named ``"package.module:Class.attr"``."""
    if ":" not in path:
        raise ValueError(f"path must be 'module:qualname', got {path!r}")
    module, qualname = path.split(":", 1)
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _python_fn(fn):
    return getattr(fn, "fn", fn)  # a triton.jit kernel wraps its Python function


def _split(fn) -> tuple[str, str, str]:
    """(signature lines, docstring, body) of ``fn``'s source, dedented."""
    src = textwrap.dedent(inspect.getsource(_python_fn(fn)))
    lines = src.splitlines()
    i = 0
    while lines[i].lstrip().startswith("@"):  # decorators
        i += 1
    # the signature ends at the first line ending in ':' outside brackets
    depth, j = 0, i
    for j in range(i, len(lines)):
        code = lines[j].split("#", 1)[0]
        depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
        if depth == 0 and code.rstrip().endswith(":"):
            break
    signature = "\n".join(lines[i : j + 1])
    rest = "\n".join(lines[j + 1 :])
    doc = inspect.getdoc(_python_fn(fn)) or ""
    stripped = rest.lstrip()
    for quote in ('"""', "'''"):
        if stripped.startswith(quote):
            end = stripped.index(quote, 3) + 3
            rest = stripped[end:]
            break
    return signature, doc, textwrap.dedent(rest.strip("\n"))


def contract(fn) -> str:
    """The signature and docstring of ``fn``, then ``...``: what a chapter may show."""
    signature, doc, _ = _split(fn)
    if not doc:
        raise ValueError(f"fn: {getattr(fn, '__qualname__', fn)!r} has no docstring, so no contract to show")
    indent = " " * 4
    doc_lines = "\n".join(indent + line if line else "" for line in doc.splitlines())
    return f'{signature}\n{indent}"""\n{doc_lines}\n{indent}"""\n{indent}...'


def kernel_pseudocode(fn) -> str:
    """The pseudocode block of a kernel's docstring (after ``Pseudocode::``), dedented."""
    doc = inspect.getdoc(_python_fn(fn)) or ""
    if "Pseudocode::" not in doc:
        raise ValueError(
            f"fn: {getattr(fn, '__qualname__', fn)!r} has no 'Pseudocode::' block in its docstring"
        )
    head, pseudo = doc.split("Pseudocode::", 1)
    return head.strip() + "\n\npseudocode:\n" + textwrap.dedent(pseudo).strip("\n")


def body(fn) -> str:
    """The body of ``fn`` without its signature and docstring: what an exercise asks for."""
    return _split(fn)[2]


def source(fn) -> str:
    """The whole source of ``fn``, dedented (the instructor's appendix prints this)."""
    return textwrap.dedent(inspect.getsource(_python_fn(fn)))
