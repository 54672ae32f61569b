"""The code base is ruff-clean: lint and format, configured in pyproject.toml ([tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    res = subprocess.run(_ruff() + args, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"ruff {' '.join(args)} found problems:\n{res.stdout}\n{res.stderr}"
