"""Copy detection, as courses use MOSS or JPlag: winnowing fingerprints of solution cells.

Concept
    Each exercise's solution cells of a submission (joined) are fingerprinted with the
    ``copydetect`` package (Python tokens, identifiers and literals normalised, so renaming
    does not hide a copy; winnowing keeps one hash per window) and compared with three
    sources: every module of the installed package, the authored solutions of the same
    exercise, and the same exercise of every other submission of the run. What the student
    copy hands out (signatures, docstrings: the stubbed cell) is boilerplate and never counts.
    A pair is *flagged* when at least ``THRESHOLD`` of the solution's fingerprinted tokens
    also appear in the other text and the shared part is at least ``MIN_OVERLAP`` tokens:
    flagged, never zeroed; the instructor decides.

Inputs / outputs
    ``detect(entries, authored_by_chapter)`` with ``entries`` = ``[(name, chapter, nb)]`` ->
    ``[Match]`` (submission, exercise, other, similarity, copied slices);
    ``write_html(matches, texts, path)`` writes the side-by-side report.

Invariants
    the result depends on the texts only (deterministic); a cell equal to its stub has no
    fingerprint and matches nothing.

Failure mode
    a cell that does not tokenize is fingerprinted as plain text; nothing here raises for a
    submission's content.
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass
from pathlib import Path

NOISE = 25  # k: shorter matches (in normalised characters) are noise
GUARANTEE = 30  # every match this long is found (window = GUARANTEE - NOISE + 1)
THRESHOLD = 0.8  # flagged: this share of the solution's fingerprinted code is in the other text
MIN_OVERLAP = 60  # ... and the shared code is at least this long (normalised characters)


@dataclass
class Match:
    submission: str
    exercise: str
    other: str  # "package:minipaged/core/kv/block_table.py", "authored:ex2.3", or a submission
    similarity: float
    slices: tuple  # (copied [starts, ends] in the solution, in the other text)

    def __str__(self) -> str:
        return f"{self.exercise} ~ {self.other} ({self.similarity:.0%})"


def _fingerprint(name: str, text: str, boilerplate=()):
    from copydetect import CodeFingerprint

    try:
        return CodeFingerprint(
            name, NOISE, GUARANTEE - NOISE + 1, list(boilerplate), language="python", fp=io.StringIO(text)
        )
    except Exception:  # noqa: BLE001 - text that pygments cannot lex: compare it raw
        return CodeFingerprint(
            name, NOISE, GUARANTEE - NOISE + 1, list(boilerplate), filter=False, fp=io.StringIO(text)
        )


def package_sources() -> dict[str, str]:
    """``{"package:minipaged/...py": text}`` for every module of the installed package."""
    import minipaged

    root = Path(minipaged.__file__).resolve().parent
    return {
        f"package:{p.relative_to(root.parent)}": p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(root.rglob("*.py"))
    }


def solution_texts(nb) -> dict[str, str]:
    """``{exercise: its solution cells, joined}`` of one notebook."""
    from minipaged.checks.notebook import cell_exercise, cell_role, cell_source

    out: dict[str, list] = {}
    for cell in nb.cells:
        if cell.get("cell_type") == "code" and cell_role(cell) == "solution" and cell_exercise(cell):
            out.setdefault(cell_exercise(cell), []).append(cell_source(cell))
    return {ex: "\n\n".join(srcs) for ex, srcs in out.items()}


def _stubs(authored) -> dict[str, str]:
    from minipaged.checks.notebook import stub_source

    out = {}
    for ex, text in solution_texts(authored.nb).items():
        try:
            out[ex] = stub_source(text)
        except ValueError:
            out[ex] = ""
    return out


def detect(entries, authored_by_chapter: dict, package: dict | None = None) -> tuple[list[Match], dict]:
    """``(matches, texts)``: the flagged pairs of every submission's solutions, and
    ``{source name: text}`` of what was compared (for the report)."""
    from copydetect import compare_files

    package = package_sources() if package is None else package
    pkg_fp = {name: _fingerprint(name, text) for name, text in package.items()}
    texts = dict(package)
    boiler: dict[tuple, object] = {}
    authored_fp: dict[str, object] = {}
    subs: dict[str, dict] = {}  # exercise -> {submission: fingerprint}
    for a in authored_by_chapter.values():
        for ex, stub in _stubs(a).items():
            boiler[ex] = _fingerprint("stub", stub).hashes if stub else []
        for ex, text in solution_texts(a.nb).items():
            authored_fp[ex] = _fingerprint(f"authored:{ex}", text, boiler.get(ex, []))
            texts[f"authored:{ex}"] = text
    for name, _chapter, nb in entries:
        if nb is None:
            continue
        for ex, text in solution_texts(nb).items():
            fp = _fingerprint(name, text, boiler.get(ex, []))
            if len(fp.hashes):
                subs.setdefault(ex, {})[name] = fp
                texts[f"{name}#{ex}"] = text
    matches: list[Match] = []

    def compare(sub, ex, fp, other, ofp):
        overlap, (sim, _), slices = compare_files(fp, ofp)
        if overlap >= MIN_OVERLAP and sim >= THRESHOLD:
            matches.append(Match(sub, ex, other, float(sim), slices))

    for ex, by_sub in subs.items():
        for sub, fp in by_sub.items():
            for other, ofp in pkg_fp.items():
                compare(sub, ex, fp, other, ofp)
            if ex in authored_fp:
                compare(sub, ex, fp, f"authored:{ex}", authored_fp[ex])
            for other, ofp in by_sub.items():
                if other != sub:
                    compare(sub, ex, fp, other, ofp)
    return matches, texts


def by_submission(matches: list[Match]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in sorted(matches, key=lambda m: (m.submission, m.exercise, -m.similarity, m.other)):
        out.setdefault(m.submission, []).append(str(m))
    return out


def _marked(text: str, slices) -> str:
    starts, ends = (list(slices[0]), list(slices[1])) if len(slices) == 2 and len(slices[0]) else ([], [])
    out, pos = [], 0
    for s, e in sorted(zip(starts, ends)):
        s, e = max(int(s), pos), int(e)
        if e <= s:
            continue
        out.append(html.escape(text[pos:s]))
        out.append(f"<mark>{html.escape(text[s:e])}</mark>")
        pos = e
    out.append(html.escape(text[pos:]))
    return "".join(out)


def write_html(matches: list[Match], texts: dict, path) -> None:
    """The report: one section per flagged pair, both texts with the copied parts marked."""
    rows, sections = [], []
    for k, m in enumerate(sorted(matches, key=lambda m: (-m.similarity, m.submission, m.exercise))):
        rows.append(
            f"<tr><td><a href='#m{k}'>{html.escape(m.submission)}</a></td><td>{m.exercise}</td>"
            f"<td>{html.escape(m.other)}</td><td>{m.similarity:.0%}</td></tr>"
        )
        other_text = texts.get(m.other, texts.get(f"{m.other}#{m.exercise}", ""))
        sections.append(
            f"<h2 id='m{k}'>{html.escape(m.submission)} {m.exercise} ~ {html.escape(m.other)} "
            f"({m.similarity:.0%})</h2><div class='pair'>"
            f"<pre>{_marked(texts.get(f'{m.submission}#{m.exercise}', ''), m.slices[0])}</pre>"
            f"<pre>{_marked(other_text, m.slices[1])}</pre></div>"
        )
    Path(path).write_text(
        "<!doctype html><meta charset='utf-8'><title>minipaged grade: copy detection</title>"
        "<style>body{font-family:sans-serif}.pair{display:flex;gap:1em}pre{flex:1;overflow:auto;"
        "background:#f6f6f6;padding:.5em}mark{background:#fd6}</style>"
        f"<h1>Copy detection: {len(matches)} flagged pairs</h1>"
        f"<p>Winnowing fingerprints (copydetect, k={NOISE}, window {GUARANTEE - NOISE + 1}); a pair is "
        f"flagged when at least {THRESHOLD:.0%} of a solution's fingerprinted code, and at least "
        f"{MIN_OVERLAP} normalised characters, is in the other text. Flagged, not zeroed.</p>"
        "<table border=1 cellpadding=4><tr><th>submission</th><th>exercise</th><th>like</th>"
        f"<th>similarity</th></tr>{''.join(rows)}</table>{''.join(sections)}",
        encoding="utf-8",
    )
