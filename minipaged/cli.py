"""The ``minipaged`` command.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and
``run(args) -> int``; this file only routes. Modules are imported when their command
runs, so ``minipaged memory`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("minipaged.demo", "serve a few requests on the course model, step by step"),
    "memory": ("minipaged.sim.memory_waste", "KV memory waste: paged vs contiguous (paper Fig. 2)"),
    "sharing": ("minipaged.sim.sharing", "blocks saved by sharing (paper Fig. 15)"),
    "simulate": ("minipaged.sim.cli", "paper-scale serving experiments on a cost model"),
    "bench": ("minipaged.bench.serving", "real serving benchmark on CPU/GPU"),
    "figures": ("minipaged.viz.figures", "regenerate every PNG in figures/"),
    "exercises": ("minipaged.checks.exercises", "write student copies of the exercise notebooks"),
    "grade": ("minipaged.checks.grade", "grade exercise submissions"),
}


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
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "_missing", False):
        print(f"minipaged {args.command}: not available in this version", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
