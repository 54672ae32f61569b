#!/usr/bin/env bash
# Regenerate, execute and finalize every chapter notebook (run from the repo root).
# Usage: bash notebooks/_build/build_all.sh [NAME...]   e.g. 02_block_tables
set -euo pipefail
names=("$@")
[ ${#names[@]} -gt 0 ] || names=($(cd notebooks/_build && ls [0-9]*.py | sed 's/\.py$//'))
for name in "${names[@]}"; do
  python "notebooks/_build/$name.py"
  jupyter nbconvert --to notebook --execute --inplace "notebooks/$name.ipynb" >/dev/null 2>&1
  python notebooks/_build/finalize.py "notebooks/$name.ipynb"
done
