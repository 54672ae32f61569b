"""Whose submission is this, and that student's seed: from the instructor, never the notebook.

Concept
    A notebook's metadata is the student's to edit, so neither the identity nor the seed of
    a submission is read from it. The student id comes from *where* the submission is: a
    roster file the instructor passes (``--roster FILE``: a CSV with the columns
    ``student_id`` and ``file``; ``file`` is a notebook or a folder of them, relative to the
    roster's folder) or nbgrader's layout (``submitted/<student_id>/<assignment>/*.ipynb``).
    The student's seed is ``HMAC-SHA256(instructor secret, student id)``: the same for the
    copy handed out (``minipaged exercises --student OUT --roster FILE``) and for grading, and
    not computable by a student who does not hold the secret, so a classmate's seed copied
    into the metadata changes nothing.

Inputs / outputs
    ``load_secret(path=None)`` -> bytes (the file, else ``$MINIPAGED_GRADING_SECRET``);
    ``student_seed(secret, student_id)`` -> hex str; ``load_roster(path)`` -> ``Roster``;
    ``Roster.student_of(path)`` -> id or None; ``nbgrader_student(path)`` -> id or None.

Invariants
    one file belongs to at most one student (a roster naming a file twice is refused).

Failure mode
    a missing secret, an unreadable or malformed roster -> ``ValueError`` naming the problem.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SECRET_ENV = "MINIPAGED_GRADING_SECRET"


def load_secret(path=None) -> bytes:
    """The instructor's secret: the bytes of ``path`` (stripped), else ``$MINIPAGED_GRADING_SECRET``."""
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--secret {path}: cannot read the secret file ({e.strerror or e})") from None
        if not secret:
            raise ValueError(f"--secret {path}: the secret file is empty")
        return secret
    env = os.environ.get(SECRET_ENV, "").strip()
    if not env:
        raise ValueError(
            f"no instructor secret: pass --secret FILE or set ${SECRET_ENV} "
            "(the per-student seeds are HMACs of the student ids under it)"
        )
    return env.encode()


def student_seed(secret: bytes, student_id: str) -> str:
    """``HMAC-SHA256(secret, student_id)`` as hex: the seed of that student's variants and cases."""
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ValueError("the instructor secret must be non-empty bytes")
    if not isinstance(student_id, str) or not student_id.strip():
        raise ValueError(f"a student id must be a non-empty string, got {student_id!r}")
    return hmac.new(bytes(secret), student_id.strip().encode(), hashlib.sha256).hexdigest()


def _key(path) -> str:
    return os.path.realpath(os.path.abspath(path))


@dataclass
class Roster:
    path: Path
    files: dict = field(default_factory=dict)  # real path of a notebook -> student id
    folders: dict = field(default_factory=dict)  # real path of a folder -> student id

    @property
    def students(self) -> list[str]:
        return sorted(set(self.files.values()) | set(self.folders.values()))

    def student_of(self, path) -> Optional[str]:
        p = _key(path)
        if p in self.files:
            return self.files[p]
        for folder, sid in self.folders.items():
            if p.startswith(folder.rstrip(os.sep) + os.sep):
                return sid
        return None

    def notebooks(self) -> list[tuple[str, str]]:
        """(notebook path, student id) for every notebook the roster names, in roster order."""
        out = [(p, sid) for p, sid in self.files.items()]
        for folder, sid in self.folders.items():
            out += [(str(p), sid) for p in sorted(Path(folder).rglob("*.ipynb"))]
        return out


def load_roster(path) -> Roster:
    """Read a roster CSV (``student_id,file``; ``file`` a notebook or a folder)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"--roster {path}: cannot read it ({e.strerror or e})") from None
    reader = csv.DictReader(text.splitlines())
    fields = [f.strip() for f in reader.fieldnames or []]
    if "student_id" not in fields or "file" not in fields:
        raise ValueError(
            f"--roster {path}: the header must name the columns student_id and file, got {fields}"
        )
    roster = Roster(path=path)
    for lineno, row in enumerate(reader, start=2):
        row = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
        sid, file = row.get("student_id", ""), row.get("file", "")
        if not sid or not file:
            raise ValueError(f"--roster {path}, line {lineno}: a student_id and a file are needed")
        target = Path(file) if os.path.isabs(file) else path.parent / file
        key = _key(target)
        owner = roster.files.get(key) or roster.folders.get(key)
        if owner is not None and owner != sid:
            raise ValueError(f"--roster {path}, line {lineno}: {file} is already {owner}'s")
        (roster.folders if target.is_dir() else roster.files)[key] = sid
    return roster


def nbgrader_student(path) -> Optional[str]:
    """The student id of nbgrader's layout ``.../submitted/<student_id>/<assignment>/<file>``
    (or ``autograded/``), else None."""
    parts = Path(os.path.abspath(path)).parts
    if len(parts) >= 4 and parts[-4] in ("submitted", "autograded"):
        return parts[-3]
    return None


def identify(paths, roster: Optional[Roster] = None, nbgrader: bool = False) -> dict:
    """``{path: student id or None}``: from the roster, else (``nbgrader``) the folder layout."""
    out = {}
    for p in paths:
        sid = roster.student_of(p) if roster is not None else None
        if sid is None and nbgrader:
            sid = nbgrader_student(p)
        out[str(p)] = sid
    return out
