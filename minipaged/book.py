"""``minipaged book OUT``: the course as a static site to browse before running it.

Inputs: a checkout of the course (``--root``, default the one this package lives in): the
chapter notebooks ``notebooks/NN*.ipynb`` with their stored outputs, ``figures/``, ``docs/*.md``,
``README.md`` and the exercise notebooks, of which only the *student copies* are rendered (made
by ``minipaged exercises --student``, so no solution reaches the site).
Output: ``OUT/index.html`` and the same tree as the checkout (``notebooks/NN.html``,
``notebooks/exercises/chNN.html``, ``docs/NAME.html``, ``figures/``), so every relative link
and picture of a notebook or a page works unchanged once ``.ipynb`` / ``.md`` become ``.html``;
repository files a page links to (``minipaged/core/kv/block_pool.py``) are copied beside it.
Nothing is executed (nbconvert's HTML exporter over the stored outputs).
``--slides CHAPTER`` also writes ``OUT/slides/NAME.slides.html`` (nbconvert's reveal.js
exporter; each ``#``/``##`` heading starts a slide) with reveal.js 4 and require.js copied
beside it from the npm registry at build time (cached in ``~/.cache/minipaged/book``), so the
slides start without the internet (MathJax and web fonts still come from their CDN and are
left out offline: formulas then read as TeX); where npm cannot fetch them the slides point at the CDN and
the command says so.
Invariant: every local link and image of every page resolves inside OUT (a link to a missing
file is an error naming the page and the link). Failure: ``ValueError`` for a bad ``--root`` or
an unknown chapter.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REVEAL_VERSION = "4.6.1"  # the layout nbconvert's reveal template expects (dist/, plugin/notes/)
REQUIREJS_VERSION = "2.3.7"
JQUERY_VERSION = "3.7.1"
REVEAL_CDN = f"https://unpkg.com/reveal.js@{REVEAL_VERSION}"
_REQUIRE_CDN = f"https://cdnjs.cloudflare.com/ajax/libs/require.js/{REQUIREJS_VERSION}/require.min.js"
_JQUERY_CDN = f"https://cdnjs.cloudflare.com/ajax/libs/jquery/{JQUERY_VERSION}/jquery.min.js"

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.5; color: #222; }}
pre, code {{ background: #f5f5f5; }} pre {{ padding: .6rem; overflow-x: auto; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: .2rem .5rem; }}
img {{ max-width: 100%; }} nav {{ margin-bottom: 1.5rem; }}
</style></head>
<body><nav><a href="{home}">minipaged course</a></nav>
{body}
</body></html>
"""

_HREF = re.compile(r'(?P<attr>\b(?:href|src))="(?P<url>[^"]*)"')


def add_arguments(parser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder to write the site into (made if missing)")
    parser.add_argument(
        "--root", metavar="DIR", help="the course checkout (default: the one this package is installed from)"
    )
    parser.add_argument(
        "--slides",
        metavar="CHAPTER",
        action="append",
        help="also write this chapter as reveal.js slides (e.g. 03 or 03_paged_attention; repeatable)",
    )
    parser.add_argument(
        "--reveal-prefix",
        metavar="URL",
        help="where the slides load reveal.js from (default: a copy in OUT/slides fetched with npm)",
    )


def run(args) -> int:
    site = build_site(args.out, root=args.root, slides=args.slides or (), reveal_prefix=args.reveal_prefix)
    for note in site["notes"]:
        print(f"minipaged book: {note}", file=sys.stderr)
    print(f"wrote {len(site['pages'])} pages into {args.out} (open {Path(args.out) / 'index.html'})")
    for path in site["slides"]:
        print(f"wrote slides {path}")
    return 0


# -- the checkout ---------------------------------------------------------------------------
def course_root(root: str | os.PathLike | None = None) -> Path:
    """The checkout holding ``notebooks/`` and ``figures/`` (``ValueError`` if it is not one)."""
    path = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    if not (path / "notebooks").is_dir() or not list((path / "notebooks").glob("00_*.ipynb")):
        raise ValueError(
            f"{path} is not a course checkout (no notebooks/00_*.ipynb); pass --root DIR of a clone"
        )
    return path


def chapter_notebooks(root: Path) -> list[Path]:
    """The chapters and appendix notebooks, in course order (``00``, ``01``, ..., ``03a``, ..., ``99``)."""
    return sorted(p for p in (root / "notebooks").glob("[0-9][0-9]*.ipynb"))


def find_chapter(root: Path, name: str) -> Path:
    for nb in chapter_notebooks(root):
        if nb.stem == name or nb.stem.split("_", 1)[0] == name:
            return nb
    known = ", ".join(nb.stem.split("_", 1)[0] for nb in chapter_notebooks(root))
    raise ValueError(f"no chapter {name!r} (known: {known})")


def notebook_title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


# -- links ----------------------------------------------------------------------------------
def _is_local(url: str) -> bool:
    return bool(url) and not re.match(r"^([a-z][a-z0-9+.-]*:|//|#)", url, re.I)


def _rewrite_links(text: str, page: Path, root: Path, out: Path, broken: list[str]) -> str:
    """``.ipynb``/``.md`` links become ``.html``; other repository files a page links to are
    copied into ``out``; a link to nothing in the checkout is recorded in ``broken``."""
    rel_page = page.relative_to(out)

    def fix(m: re.Match) -> str:
        url = html.unescape(m.group("url"))
        if not _is_local(url):
            return m.group(0)
        path, _, frag = url.partition("#")
        path = path.split("?", 1)[0]
        if not path:
            return m.group(0)
        if path.endswith((".ipynb", ".md")):
            new = path.rsplit(".", 1)[0] + ".html"
            if (
                new.endswith("README.html")
                and (page.parent / new).resolve() == (out / "README.html").resolve()
            ):
                new = new[: -len("README.html")] + "index.html"
        else:
            new = path
        target = (page.parent / new).resolve()
        if not target.exists():
            source = (root / rel_page.parent / path).resolve()
            if source.is_file() and root.resolve() in source.parents:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            elif source.is_dir() and root.resolve() in source.parents:
                pass  # a folder: the browser lists nothing, so point at its README if there is one
            else:
                broken.append(f"{rel_page}: {url}")
        value = new + (f"#{frag}" if frag else "")
        return f'{m.group("attr")}="{html.escape(value, quote=True)}"'

    return _HREF.sub(fix, text)


# -- pages ----------------------------------------------------------------------------------
def _markdown_page(md_path: Path, out_path: Path, home: str) -> str:
    import mistune

    render = mistune.create_markdown(plugins=["table", "strikethrough", "url"], escape=False)
    text = md_path.read_text(encoding="utf-8")
    title = next((ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#")), md_path.stem)
    return _PAGE.format(title=html.escape(title), home=home, body=render(text))


def _home(page: Path, out: Path) -> str:
    return os.path.relpath(out / "index.html", page.parent).replace(os.sep, "/")


def _student_copies(root: Path, into: Path) -> list[Path]:
    """The exercise notebooks as students get them (``minipaged exercises --student``)."""
    import nbformat

    from minipaged.checks.notebook import load_authored, make_student_copy

    into.mkdir(parents=True, exist_ok=True)
    for a in load_authored(root / "notebooks" / "exercises").values():
        nbformat.write(make_student_copy(a.nb, seed=None), into / a.name)
    return sorted(into.glob("ch*.ipynb"))


def build_site(
    out: str | os.PathLike,
    root: str | os.PathLike | None = None,
    slides=(),
    reveal_prefix: str | None = None,
) -> dict:
    """Write the site into ``out``; return ``{"pages", "slides", "notes"}`` (paths relative to
    ``out``). ``ValueError`` if a page links to a file that is not in the checkout."""
    import nbformat
    from nbconvert import HTMLExporter

    root = course_root(root)
    slide_chapters = [find_chapter(root, name) for name in slides]  # a bad name fails before any work
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for folder in ("figures",):
        if (root / folder).is_dir():
            shutil.copytree(root / folder, out / folder, dirs_exist_ok=True)

    (out / "index.html").write_text("")  # written last; pages link home before it exists
    exporter = HTMLExporter(template_name="lab")
    broken: list[str] = []
    pages: list[str] = []
    entries: dict[str, list[tuple[str, str]]] = {"Chapters": [], "Exercises": [], "Notes": []}

    def write(page: Path, text: str) -> None:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(_rewrite_links(text, page, root, out, broken), encoding="utf-8")
        pages.append(page.relative_to(out).as_posix())

    for path in chapter_notebooks(root):
        nb = nbformat.read(path, as_version=4)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
        page = out / "notebooks" / f"{path.stem}.html"
        write(page, body)
        entries["Chapters"].append((page.relative_to(out).as_posix(), f"{path.stem}: {notebook_title(nb)}"))

    with tempfile.TemporaryDirectory() as tmp:
        for path in _student_copies(root, Path(tmp)):
            nb = nbformat.read(path, as_version=4)
            body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
            page = out / "notebooks" / "exercises" / f"{path.stem}.html"
            write(page, body)
            entries["Exercises"].append(
                (page.relative_to(out).as_posix(), f"{path.stem}: {notebook_title(nb)}")
            )

    readme = root / "README.md"
    for md in sorted((root / "docs").glob("*.md")):
        page = out / "docs" / f"{md.stem}.html"
        write(page, _markdown_page(md, page, _home(page, out)))
        entries["Notes"].append((page.relative_to(out).as_posix(), md.stem.replace("_", " ")))
    if readme.exists():
        page = out / "README.html"
        write(page, _markdown_page(readme, page, "index.html"))
        entries["Notes"].insert(0, ("README.html", "README (install, commands, results)"))

    body = ["<h1>minipaged: how vLLM serves language models</h1>",
            "<p>The course's chapters with their stored outputs, the exercises as students get them "
            "(no solutions), and the notes. Run them with <code>jupyter lab notebooks/00_overview.ipynb"
            "</code>.</p>"]  # fmt: skip
    for heading, items in entries.items():
        body.append(f"<h2>{heading}</h2><ul>")
        body += [f'<li><a href="{html.escape(href)}">{html.escape(label)}</a></li>' for href, label in items]
        body.append("</ul>")
    index = out / "index.html"
    index.write_text(_PAGE.format(title="minipaged course", home="index.html", body="\n".join(body)))
    pages.insert(0, "index.html")

    notes: list[str] = []
    slide_paths = [write_slides(root, path, out, reveal_prefix, notes) for path in slide_chapters]
    if broken:
        raise ValueError("local links to files that do not exist: " + "; ".join(broken))
    return {"pages": pages, "slides": slide_paths, "notes": notes}


# -- slides ---------------------------------------------------------------------------------
def _npm_package(name: str, version: str, cache: Path) -> Path | None:
    """``name@version`` unpacked under ``cache`` (fetched once with ``npm pack``), or None."""
    dest = cache / f"{name}-{version}"
    if (dest / "package.json").exists():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                [npm, "pack", f"{name}@{version}", "--silent"],
                cwd=tmp,
                check=True,
                capture_output=True,
                timeout=120,
            )
        except (subprocess.SubprocessError, OSError):
            return None
        tgz = next(Path(tmp).glob("*.tgz"), None)
        if tgz is None:
            return None
        with tarfile.open(tgz) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(Path(tmp) / "package"), dest)
    return dest


def _reveal_assets(slides_dir: Path, notes: list[str]) -> tuple[str, str, str]:
    """(reveal prefix, require.js url, jQuery url) for pages in ``slides_dir``: local copies
    when npm can fetch them, else the CDN (with a note)."""
    cache = Path(os.environ.get("MINIPAGED_CACHE", Path.home() / ".cache" / "minipaged")) / "book"
    reveal = _npm_package("reveal.js", REVEAL_VERSION, cache)
    requirejs = _npm_package("requirejs", REQUIREJS_VERSION, cache)
    jquery = _npm_package("jquery", JQUERY_VERSION, cache)
    if reveal is None or requirejs is None or jquery is None:
        notes.append(
            "npm could not fetch reveal.js and require.js: the slides load them from the CDN "
            "(they need the internet when opened; pass --reveal-prefix for a local copy)"
        )
        return REVEAL_CDN, _REQUIRE_CDN, _JQUERY_CDN
    local = slides_dir / "reveal.js"
    for part in ("dist", "plugin"):
        shutil.copytree(reveal / part, local / part, dirs_exist_ok=True)
    shutil.copyfile(requirejs / "require.js", slides_dir / "require.js")
    shutil.copyfile(jquery / "dist" / "jquery.min.js", slides_dir / "jquery.min.js")
    return "reveal.js", "require.js", "jquery.min.js"


def slide_notebook(nb):
    """A copy of ``nb`` cut into slides: a markdown cell that opens with a ``#`` or ``##``
    heading starts a slide, a ``###`` heading a sub-slide, every other cell continues."""
    import copy

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        first = cell.source.lstrip().split("\n", 1)[0] if cell.cell_type == "markdown" else ""
        if re.match(r"^#{1,2} ", first):
            kind = "slide"
        elif first.startswith("### "):
            kind = "subslide"
        else:
            kind = "-"
        cell.metadata["slideshow"] = {"slide_type": kind}
    if nb.cells:
        nb.cells[0].metadata["slideshow"] = {"slide_type": "slide"}
    return nb


def write_slides(root: Path, path: Path, out: Path, reveal_prefix: str | None, notes: list[str]) -> str:
    import nbformat
    from nbconvert import SlidesExporter

    slides_dir = out / "slides"
    slides_dir.mkdir(parents=True, exist_ok=True)
    if reveal_prefix:
        prefix, require, jquery = reveal_prefix, _REQUIRE_CDN, _JQUERY_CDN
    else:
        prefix, require, jquery = _reveal_assets(slides_dir, notes)
    exporter = SlidesExporter(
        reveal_url_prefix=prefix, reveal_scroll=True, require_js_url=require, jquery_url=jquery
    )
    nb = slide_notebook(nbformat.read(path, as_version=4))
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
    # NOTE: slides/ sits beside notebooks/, so the chapter's ../figures/ pictures resolve unchanged
    page = slides_dir / f"{path.stem}.slides.html"
    page.write_text(body, encoding="utf-8")
    return page.relative_to(out).as_posix()
