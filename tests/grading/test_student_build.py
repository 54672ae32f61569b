"""The student build itself: stripped bodies gone (sources and .pyc), references gone, the
real package untouched, cached per version and content hash, the stub's message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import minipaged
from minipaged.grading.student_build import strip_targets, student_build

REAL = Path(minipaged.__file__).resolve().parent


@pytest.fixture(scope="module")
def ch02(tmp_path_factory):
    return Path(student_build("ch02", tmp_path_factory.mktemp("builds")))


def test_a_stripped_body_is_in_no_source_and_no_pyc(ch02):
    body = "self.num_free_blocks -= 1"  # a line of FreeKVCacheBlockQueue.remove's body
    assert body in (REAL / "core" / "kv" / "block.py").read_text()
    assert body not in (ch02 / "core" / "kv" / "block.py").read_text()
    pycs = list((ch02 / "core" / "kv" / "__pycache__").glob("block.*.pyc"))
    assert pycs and all(
        b"num_free_blocks" not in p.read_bytes() or b"-= 1" not in p.read_bytes() for p in pycs
    )
    assert "minipaged.core.kv.block:FreeKVCacheBlockQueue.remove" in strip_targets("ch02")


def test_the_checks_references_are_absent(ch02):
    text = (ch02 / "checks" / "ch02.py").read_text()
    assert "def ref_slot_mapping" not in text and "def reference_free_queues" not in text
    assert "def ref_slot_mapping" in (REAL / "checks" / "ch02.py").read_text()


def test_the_real_package_is_untouched(ch02):
    assert "__student_build" not in (REAL / "core" / "kv" / "kv_cache_manager.py").read_text()
    assert not (REAL / "_student_build.py").exists()


def test_cached_per_version_and_content_hash(ch02):
    again = Path(student_build("ch02", ch02.parents[1]))
    assert again == ch02
    assert ch02.parent.name.startswith(f"{minipaged.__version__}-") and ch02.parent.name.endswith("-ch02")


def test_a_stripped_function_raises_the_exercise_message_without_a_notebook_function(ch02):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import minipaged; assert minipaged.__file__.startswith(sys.argv[1])\n"
        "from minipaged.core import KVCacheManager\n"
        "try:\n    KVCacheManager(4, 2).allocate_slots('r', 3)\n"
        "except NotImplementedError as e:\n    print(e)\n"
        "def allocate_slots(manager, request_id, num_new_tokens):\n    return ['mine']\n"
        "print(KVCacheManager(4, 2).allocate_slots('r', 3))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ch02.parent)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ex2.3: your notebook's allocate_slots is used here", "['mine']"]
