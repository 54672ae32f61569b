"""The course map names every chapter notebook and every exercise notebook.

The map is in three places: chapter 00's "Map of the course" cell, ``docs/course_path.md``
and the README's chapter table. Each must name every chapter notebook in ``notebooks/``
(``NN_name.ipynb``, appendices such as ``03a_...`` and ``99_...`` included) by its stem, and
every exercise notebook in ``notebooks/exercises/`` by its ``chNN`` prefix. A new notebook
that the map omits fails here, naming the notebook and the place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def chapter_stems() -> list[str]:
    return sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]*.ipynb"))


def exercise_prefixes() -> list[str]:
    return sorted({p.name[:4] for p in (REPO / "notebooks" / "exercises").glob("ch[0-9][0-9]_*.ipynb")})


def _named_exercises(text: str) -> set[str]:
    """``chNN`` named in text, alone or in a range ``chAA_x`` .. ``chBB_y``."""
    named = set(re.findall(r"\bch\d\d", text))
    for a, b in re.findall(r"`ch(\d\d)_\w+`\s*\.\.\s*`ch(\d\d)_\w+`", text):
        named |= {f"ch{i:02d}" for i in range(int(a), int(b) + 1)}
    return named


def chapter00_map() -> str:
    nb = json.loads((REPO / "notebooks" / "00_overview.ipynb").read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown" and "Map of the course" in src:
            return src
    raise AssertionError("chapter 00 has no 'Map of the course' cell")


def _omitted(text: str, stems: list[str]) -> list[str]:
    """Stems not named in text: by the stem as a word, or a map row starting ``| **NN ``."""
    out = []
    for stem in stems:
        number = stem.partition("_")[0]
        if re.search(rf"\b{re.escape(stem)}\b", text):
            continue
        if re.search(rf"^\| \*\*{re.escape(number)} ", text, re.M):  # chapter 00's rows: | **01 KV cache** |
            continue
        out.append(stem)
    return out


def test_the_map_sees_every_notebook_there_is():
    stems = chapter_stems()
    assert "00_overview" in stems and len(stems) >= 12, stems


def test_chapter00_map_names_every_chapter_and_exercise():
    text = chapter00_map()
    missing = _omitted(text, chapter_stems())
    assert not missing, f"chapter 00's map of the course omits {missing} (notebooks/_build/00_overview.py)"
    ex = [p for p in exercise_prefixes() if p not in _named_exercises(text)]
    assert not ex, f"chapter 00's map omits the exercise notebooks {ex}"


def test_course_path_names_every_chapter_and_exercise():
    text = (REPO / "docs" / "course_path.md").read_text(encoding="utf-8")
    missing = _omitted(text, chapter_stems())
    assert not missing, f"docs/course_path.md omits the chapter notebooks {missing}"
    ex = [p for p in exercise_prefixes() if p not in _named_exercises(text)]
    assert not ex, f"docs/course_path.md omits the exercise notebooks {ex}"


def test_readme_chapter_table_names_every_chapter():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    missing = _omitted(text, chapter_stems())
    assert not missing, f"README.md's chapter table omits {missing}"


def test_omitted_finds_a_missing_stem():
    assert _omitted(
        "| **02 block tables** | ... `03a_cpu_backend`\n| x **04 y**",
        ["02_block_tables", "03a_cpu_backend", "04_x"],
    ) == ["04_x"]
