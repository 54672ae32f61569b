"""The ``minipaged`` command.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and
``run(args) -> int``; this file routes, and holds the argument types every command uses
(``positive_int``, ``positive_float``, ...: a bad number is an argparse error, exit code 2,
as is a ``ValueError`` from ``run``) and ``dumps_json`` (strict JSON: no NaN / Infinity). Modules are imported when their command
runs, so ``minipaged memory`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("minipaged.demo", "serve a few requests on the course model, step by step"),
    "memory": ("minipaged.sim.memory_waste", "KV memory waste: paged vs contiguous (paper Fig. 2)"),
    "sharing": ("minipaged.sim.sharing", "blocks saved by sharing (paper Fig. 15)"),
    "simulate": ("minipaged.sim.cli", "paper-scale serving experiments on a cost model"),
    "bench": ("minipaged.bench.serving", "real serving benchmark on CPU/GPU"),
    "serve": (
        "minipaged.entrypoints.openai.api_server",
        "an OpenAI-compatible streaming server with a live view of the block tables",
    ),
    "figures": ("minipaged.figures", "regenerate every PNG in figures/"),
    "exercises": ("minipaged.checks.exercises", "write student copies of the exercise notebooks"),
    "grade": ("minipaged.grading.grade", "grade exercise submissions"),
    "book": ("minipaged.book", "the course as a static site (and a chapter as reveal.js slides)"),
}


# -- argument types: a bad value is an argparse error (exit code 2), never a traceback ------
def _number(text: str, kind, what: str, ok) -> float:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "an integer >= 1", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(text, float, "a finite number > 0", lambda v: v > 0)


def float_above_one(text: str) -> float:
    return _number(text, float, "a finite number > 1", lambda v: v > 1)


def positive_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (``"none"``: the empty tuple)."""
    if text.strip().lower() == "none":
        return ()
    return tuple(positive_int(t.strip()) for t in text.split(","))


def strict_json(obj) -> object:
    """``obj`` with every NaN / infinity replaced by None, for ``json.dumps(allow_nan=False)``
    (strict JSON has no Infinity or NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dumps_json(obj, **kwargs) -> str:
    """Strict JSON text of ``obj`` (non-finite numbers become null)."""
    import json

    return json.dumps(strict_json(obj), allow_nan=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="minipaged: KV cache, PagedAttention, continuous batching"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (for provenance)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "_missing", False):
        print(f"minipaged {args.command}: not available in this version", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ValueError as e:  # NOTE: a bad combination of arguments: argparse's style, exit 2
        print(f"minipaged {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
