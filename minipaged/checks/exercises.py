"""``minipaged exercises [--student OUT] [--nbgrader OUT]``: list the exercises, or write
student copies, or an nbgrader source assignment.

Inputs / outputs
    without ``--student``: prints each chapter's exercise notebook and its exercises.
    ``--student OUT``: writes one student copy per authored notebook into ``OUT`` (same
    file names). A student copy has ``raise NotImplementedError`` in place of every
    solution region (function signatures and docstrings kept) and keeps the stored
    ``✅ exN.M passed`` outputs of the check cells, so ``pytest --nbval OUT/ch02_*.ipynb``
    passes exactly when every exercise of that chapter is right.
    ``--seed S`` (with ``--student``): the copies carry seed ``S`` (say, the student's id):
    the workloads of the prediction exercises that have variants are drawn from it and
    written into the copy, and the grader draws that student's graded cases from it too.
    ``--nbgrader OUT``: writes ``OUT/source/<--assignment>/`` with nbgrader metadata
    (``nbgrader_export.py``): run nbgrader's ``generate_assignment`` / ``autograde`` there.

Invariants
    a student copy holds no line of any solution region (checked as it is written).

Failure mode
    missing or unexecuted authored notebooks -> a message and exit code 2; an existing
    file in OUT is overwritten only with ``--force``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--student", metavar="OUT", help="write student copies into folder OUT")
    parser.add_argument(
        "--source",
        metavar="DIR",
        help="folder of the authored exercise notebooks (default: notebooks/exercises of this checkout)",
    )
    parser.add_argument(
        "--chapter", metavar="chNN", action="append", help="only this chapter (repeatable; default: all)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing files in OUT")
    parser.add_argument(
        "--seed",
        metavar="S",
        help="with --student: this student's variant (e.g. the student's id): the prediction "
        "workloads and the graded cases are drawn from it, so two students' answers differ",
    )
    parser.add_argument(
        "--roster",
        metavar="FILE",
        help="with --student: one copy per student of the roster CSV (student_id column) in "
        "OUT/<student_id>/, each drawn from HMAC(--secret, student id), as `minipaged grade --roster` draws",
    )
    parser.add_argument(
        "--secret", metavar="FILE", help="the instructor's secret (default: $MINIPAGED_GRADING_SECRET)"
    )
    parser.add_argument(
        "--nbgrader",
        metavar="OUT",
        help="write an nbgrader source assignment into course folder OUT (OUT/source/NAME/)",
    )
    parser.add_argument(
        "--assignment",
        metavar="NAME",
        default="minipaged",
        help="the nbgrader assignment name (default: minipaged)",
    )


def run(args) -> int:
    import nbformat

    from minipaged.checks.notebook import (
        cell_exercise,
        cell_role,
        cell_source,
        load_authored,
        make_student_copy,
    )

    try:
        authored = load_authored(args.source)
    except ValueError as e:
        print(f"minipaged exercises: {e}", file=sys.stderr)
        return 2
    chapters = sorted(authored)
    if args.chapter:
        unknown = [c for c in args.chapter if c not in authored]
        if unknown:
            print(
                f"minipaged exercises: no exercises for {unknown} (known: {', '.join(chapters)})",
                file=sys.stderr,
            )
            return 2
        chapters = [c for c in chapters if c in args.chapter]

    if args.nbgrader:
        from minipaged.grading.nbgrader_export import write_assignment

        try:
            written = write_assignment(authored, args.nbgrader, args.assignment, chapters, force=args.force)
        except FileExistsError as e:
            print(f"minipaged exercises: {e} exist; pass --force to overwrite", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"minipaged exercises: {e}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
        print(f"next: cd {args.nbgrader} && nbgrader generate_assignment {args.assignment}")
        if not args.student:
            return 0

    if not args.student:
        for ch in chapters:
            a = authored[ch]
            print(f"{ch}  {a.name}")
            titles = {}
            for cell in a.nb.cells:
                if cell_role(cell) == "spec" and cell_exercise(cell):
                    first = cell_source(cell).strip().splitlines()[0] if cell_source(cell).strip() else ""
                    titles[cell_exercise(cell)] = first.lstrip("#").strip()
            for ex in a.exercises:
                print(f"    {titles.get(ex, ex)}")
        return 0

    out = Path(args.student)
    if args.roster:
        from minipaged.grading.roster import load_roster, load_secret, student_seed

        try:
            secret, roster = load_secret(args.secret), load_roster(args.roster)
        except ValueError as e:
            print(f"minipaged exercises: {e}", file=sys.stderr)
            return 2
        for sid in roster.students:
            folder = out / sid
            folder.mkdir(parents=True, exist_ok=True)
            for ch in chapters:
                target = folder / authored[ch].name
                if target.exists() and not args.force:
                    print(f"minipaged exercises: {target} exists; pass --force to overwrite", file=sys.stderr)
                    return 2
                nbformat.write(make_student_copy(authored[ch].nb, seed=student_seed(secret, sid)), target)
            print(f"wrote {folder}/  ({len(chapters)} notebooks)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    targets = [(authored[ch], out / authored[ch].name) for ch in chapters]
    existing = [str(t) for _, t in targets if t.exists()]
    if existing and not args.force:
        print(f"minipaged exercises: {', '.join(existing)} exist; pass --force to overwrite", file=sys.stderr)
        return 2
    for a, target in targets:
        nbformat.write(make_student_copy(a.nb, seed=args.seed), target)
        print(f"wrote {target}  ({len(a.exercises)} exercises)")
    return 0
