"""Generate notebooks/99_instructor_appendix.ipynb (run from the repo root).

    bash notebooks/_build/build_all.sh 99_instructor_appendix
"""

from _nb import code, md, write

md(r"""
# Instructor's appendix: the code the exercises ask for

**Open this after the exercise notebooks have been handed in.** The chapters show the
functions below by their contract only (signature and docstring, `minipaged.viz.source.contract`),
because an exercise asks a student to write each body. Here are the package's own bodies,
for the instructor and for the student who has finished: compare them with your solution.
`tests/viz/test_no_printed_answers.py` keeps every other notebook from printing them.

The list is `minipaged.viz.source.EXERCISE_BODIES` (exercise id -> the functions it asks
for). The scheduler's loops are not here either: chapters 04 and 08 show them as pseudocode and
an outline read off the source (`minipaged.viz.loops`), because ex4.1 and ex5.4 ask for their
two phases; read `minipaged/core/sched/scheduler.py` and `paper.py` once those are handed in.
""")

code(r"""
from minipaged.viz.source import EXERCISE_BODIES, resolve, source

for exercise, paths in EXERCISE_BODIES.items():
    print(exercise, "asks for", ", ".join(p.split(":")[1] for p in paths))
""")

md(r"""
## The bodies, exercise by exercise

(A code tour: nbval runs the cell, which fails if a function was renamed, but does not
compare the code it prints.)
""")

code(r"""
# a code tour (inspect.getsource(fn) of each function): nbval does not compare the code it prints
printed = set()
for exercise, paths in EXERCISE_BODIES.items():
    for path in paths:
        if path in printed:
            print(f"=== {exercise}: {path} (printed above)\n")
            continue
        printed.add(path)
        print(f"=== {exercise}: {path}\n")
        print(source(resolve(path)))
""")

write("99_instructor_appendix")
