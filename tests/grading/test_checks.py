"""Tests of minipaged.checks: the harness, the notebook tools, and every exercise checker.

Every exercise is run in-process (no kernel) three ways: the authored solution must pass,
the student stub must fail with "not implemented yet", and a deliberately wrong variant of
the solution must fail on a stated case. The checkers' own references are cross-checked
against the package (scheduler states valid, sharing keeps the manager's invariants).
"""

from __future__ import annotations

import ast
import io
import json
import random
import re
from contextlib import redirect_stdout
from pathlib import Path

import nbformat
import pytest

from minipaged.checks import CHAPTER_MODULES, ExerciseFailure, chapter_of, check, get_spec, list_exercises
from minipaged.checks._harness import is_not_implemented, pass_line
from minipaged.checks._spec import judge, make_cases, observe_all
from minipaged.checks.notebook import (
    MalformedNotebook,
    cell_exercise,
    cell_role,
    cell_source,
    identify_chapter,
    load_authored,
    make_student_copy,
    parse_authored,
    read_submission,
    stub_source,
)
from minipaged.grading.codec import dumps

AUTHORED = load_authored()
KEY = json.loads(
    (Path(__file__).resolve().parents[2] / "notebooks/exercises/_instructor/key.json").read_text()
)


def _exercise_cells(chapter: str):
    """(setup source, {exercise: (solution source, check cell source)}) of an authored notebook."""
    nb = AUTHORED[chapter].nb
    setup = "\n".join(cell_source(c) for c in nb.cells if cell_role(c) == "setup")
    out = {}
    for c in nb.cells:
        if cell_role(c) == "solution":
            out.setdefault(cell_exercise(c), [None, None])[0] = cell_source(c)
        elif cell_role(c) == "check":
            out[cell_exercise(c)][1] = cell_source(c)
    return setup, out


def _check_args(check_src: str) -> tuple[str, list[str]]:
    """The exercise id and the student names a check cell passes to ``check``."""
    for node in ast.walk(ast.parse(check_src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check":
            return node.args[0].value, [a.id for a in node.args[1:]]
    raise AssertionError(f"no check(...) call in {check_src!r}")


def _run_exercise(chapter: str, exercise_id: str, solution: str, namespace: dict | None = None) -> str:
    """Exec setup + earlier solutions + ``solution`` and run the check; return what it printed."""
    setup, cells = _exercise_cells(chapter)
    ns: dict = {} if namespace is None else namespace
    exec(compile(setup, f"<{chapter} setup>", "exec"), ns)
    for ex, (sol, _) in cells.items():  # earlier exercises, as authored (later ones may call them)
        if ex == exercise_id:
            break
        exec(compile(sol, f"<{ex}>", "exec"), ns)
    exec(compile(solution, f"<{exercise_id} solution>", "exec"), ns)
    ex_id, names = _check_args(cells[exercise_id][1])
    assert ex_id == exercise_id
    buf = io.StringIO()
    with redirect_stdout(buf):
        check(ex_id, *[ns[n] for n in names])
    return buf.getvalue()


ALL_EXERCISES = [(ch, ex) for ch in sorted(AUTHORED) for ex in AUTHORED[ch].exercises]


# -- registry and notebooks ------------------------------------------------------------------


def test_every_chapter_has_at_least_three_exercises_and_checkers_match_notebooks():
    assert sorted(AUTHORED) == list(CHAPTER_MODULES)
    registered = list_exercises()
    in_notebooks = [ex for _, ex in ALL_EXERCISES]
    assert sorted(registered) == sorted(in_notebooks)
    for ch in CHAPTER_MODULES:
        exs = AUTHORED[ch].exercises
        assert len(exs) >= 3, f"{ch} has {exs}"
        assert all(chapter_of(ex) == ch for ex in exs)
        assert all(registered[ex] for ex in exs), "every checker has a title"


def test_check_rejects_unknown_ids():
    with pytest.raises(ValueError, match="exercise_id"):
        check("2.1", print)
    with pytest.raises(ValueError, match="unknown exercise_id"):
        check("ex2.99", print)
    with pytest.raises(ValueError, match="no checkers"):
        check("ex12.1", print)


# -- every exercise: solution passes, stub fails ---------------------------------------------


# measuring exercises print what they measured (deterministic), then the verdict line
MEASURING = {
    "ex1.5": 2,
    "ex2.6": 1,
    "ex3.6": 1,
    "ex4.5": 4,
    "ex5.6": 2,
    "ex6.6": 1,
    "ex8.3": 1,
    "ex9.3": 3,
    "ex10.4": 2,
    "ex11.4": 2,
}


@pytest.mark.parametrize("chapter,exercise_id", ALL_EXERCISES)
def test_authored_solution_passes_with_exactly_one_line(chapter, exercise_id):
    _, cells = _exercise_cells(chapter)
    printed = _run_exercise(chapter, exercise_id, cells[exercise_id][0])
    lines = printed.splitlines()
    spec = get_spec(exercise_id)
    assert printed.endswith("\n") and lines[-1] == (spec.line if spec else pass_line(exercise_id))
    assert len(lines) == 1 + MEASURING.get(exercise_id, 0), printed


@pytest.mark.parametrize("chapter,exercise_id", ALL_EXERCISES)
def test_student_stub_fails_as_not_implemented(chapter, exercise_id):
    _, cells = _exercise_cells(chapter)
    stub = stub_source(cells[exercise_id][0])
    assert "NotImplementedError" in stub and "BEGIN SOLUTION" not in stub
    with pytest.raises(ExerciseFailure, match=rf"{exercise_id}: not implemented yet"):
        _run_exercise(chapter, exercise_id, stub)


# (exercise, text in the authored solution, its wrong replacement)
MUTANTS = [
    ("ex0.1", '"s7": "scheduling"', '"s7": "addressing"'),
    ("ex0.2", '"D": [0, 6]', '"D": [6, 0]'),
    ("ex0.3", "* batch_size * (context_len + 1)", "* batch_size * context_len"),
    ("ex0.4", "return None  # each sequence", "return 0  # each sequence"),
    ("ex0.5", '"q2": 12', '"q2": 9'),
    ("ex1.1", 'config.get("num_key_value_heads") or num_heads', "num_heads"),
    ("ex1.2", "return min(max_seq_len, pow2)", "return pow2"),
    ("ex1.3", "cdiv(n, block_size) * block_size", "n"),
    ("ex1.4", "return [0, 8, 24, 0, 28, None]", "return [0, 8, 24, 0, 28, 0]"),
    (
        "ex1.5",
        "return int(budget // model.kv_bytes_per_token) // seq_len",
        "return int(budget // model.kv_bytes_per_token // seq_len) + 1",
    ),
    ("ex1.6", '"q3": "neither"', '"q3": "external"'),
    ("ex2.5", "[3, 2, 5], [], [4, 1, 0]]", "[3, 2, 5], [], [0, 1, 4]]"),
    ("ex2.6", "if free < 0:", "if free <= 0:"),
    ("ex2.7", '"q1": 5', '"q1": 6'),
    ("ex2.1", "queue.num_free_blocks -= 1", "pass"),
    ("ex2.2", "block = queue._head.next_free_block", "block = queue._tail.prev_free_block"),
    ("ex2.3", "return None", "return []"),
    ("ex2.4", "block_table[i // block_size] * block_size", "(i // block_size) * block_size"),
    (
        "ex3.1",
        "block_table.long()[positions // block_size]",
        "block_table.long()[positions % block_table.numel()]",
    ),
    ("ex3.2", "* scale  # [H, L]", "# [H, L]"),
    ("ex3.3", "acc = acc * alpha + ", "acc = acc + "),
    (
        "ex3.4",
        "weights = exp_sums * torch.exp(max_logits - global_max)",
        "weights = exp_sums + 0 * max_logits",
    ),
    ("ex3.5", '"C": [[(1, 4), (4, 4)], [(8, 1)]]', '"C": [[(1, 4), (4, 4), (8, 1)]]'),
    ("ex3.6", "nbytes = 2 * num_kv_heads", "nbytes = 2 * num_heads"),
    ("ex3.7", '"q2": 3', '"q2": 1'),
    (
        "ex4.1",
        "min(request.num_tokens - request.num_computed_tokens, token_budget)",
        "request.num_tokens - request.num_computed_tokens",
    ),
    (
        "ex4.2",
        "if request.num_output_tokens >= params.max_tokens:",
        "if request.num_output_tokens > params.max_tokens:",
    ),
    ("ex4.3", "scheduler.kv_cache_manager.free(request)", "pass"),
    ("ex4.4", '{"A": 1, "C": 1, "D": 5}', '{"A": 1, "C": 1, "D": 4}'),
    ("ex4.5", "finish_step[request.request_id] = step", "finish_step[request.request_id] = step + 1"),
    ("ex4.6", '"q2": "next"', '"q2": "same"'),
    ("ex5.1", "if enable_chunked_prefill or n > max_num_batched_tokens:", "if enable_chunked_prefill:"),
    ("ex5.2", "return max(running,", "return min(running,"),
    ("ex5.3", "scheduler.waiting.insert(i, victim)", "scheduler.waiting.append(victim)"),
    ("ex5.4", "victim = pick_victim(scheduler.running, ranks)", "victim = request"),
    ("ex5.5", '{"scheduled": {"A": 1}, "preempted": ["B"]}', '{"scheduled": {"A": 1}, "preempted": []}'),
    ("ex5.6", "return True  # else nothing could ever run", "return False  # else nothing could ever run"),
    ("ex5.7", '"q2": 5', '"q2": 3'),
    ("ex6.1", "m.block_pool.touch(blocks)", "pass"),
    ("ex6.2", "elif table[-1].ref_cnt > 1:", "elif False:"),
    ("ex6.3", "parent = hash_block_tokens(parent,", "parent = hash_block_tokens(None,"),
    ("ex6.4", "[:max_blocks]", ""),
    ("ex6.5", '"ref_cnt": {0: 2, 2: 1, 3: 1, 4: 1}', '"ref_cnt": {0: 3, 2: 1, 3: 1, 4: 1}'),
    ("ex6.6", "for o in output_lens)\n", "for o in output_lens) + 1\n"),
    ("ex6.7", '"q1": 2', '"q1": 1'),
    ("ex7.1", '{"r0": 1, "r1": 1, "r2": 4}', '{"r0": 1, "r1": 1}'),
    ("ex7.2", "return float(rates[-1])", "return 0.0"),
    ("ex7.3", '"max_num_seqs=32": "same"', '"max_num_seqs=32": "down"'),
    ("ex7.4", '"q3": 14526 // 2048', '"q3": 14526 / 2048'),
    ("ex8.1", "if reserve_full_isl and cdiv", "if not reserve_full_isl and cdiv"),
    ("ex8.2", '"preemptions": 2, "steps": 8}', '"preemptions": 1, "steps": 8}'),
    ("ex8.3", "new[new.index(None)] = new.pop()", "new.remove(None)"),
    ("ex8.4", '"q2": "no"', '"q2": "yes"'),
    ("ex9.1", "if start >= arrival:", "if start > arrival:"),
    ("ex9.2", '"B": {"ttft_ms": 27, "e2e_ms": 39}', '"B": {"ttft_ms": 32, "e2e_ms": 44}'),
    (
        "ex9.3",
        "clock = arrivals[waiting[0].request_id]",
        "clock = arrivals[waiting[0].request_id] + step_cost[0]",
    ),
    ("ex9.4", '"q1": "k+1"', '"q1": "k"'),
    ("ex10.1", "return out + [target_argmax[-1]]", "return out"),
    ("ex10.2", "residual = (p[j] - q[j]).clamp(min=0.0)", "residual = p[j]"),
    (
        "ex10.3",
        '{"scheduled": 4, "lookahead": 2, "blocks": 4, "computed": 10}',
        '{"scheduled": 4, "lookahead": 3, "blocks": 4, "computed": 10}',
    ),
    ("ex10.4", "for i in range(k + 1)", "for i in range(k)"),
    ("ex10.5", '"q3": "draft_model"', '"q3": "ngram"'),
    ("ex11.1", "return F.linear(act, w_down[:, rows])", "return F.linear(act, w_down[:, rows]) / size"),
    ("ex11.2", '"k": [q_end + rank * kv_rows,', '"k": [q_end + rank * q_rows,'),
    (
        "ex11.3",
        '{"kv_heads": 2, "kv_bytes_per_block": 524288, "all_reduces": 65, "all_gathers": 1}',
        '{"kv_heads": 2, "kv_bytes_per_block": 524288, "all_reduces": 64, "all_gathers": 1}',
    ),
    ("ex11.4", "(2 * num_layers + 1) * 2 * (size - 1)", "(2 * num_layers + 1) * 2 * size"),
    ("ex11.5", '"q4": "fewer heads"', '"q4": "fewer blocks"'),
]


def test_every_exercise_has_a_mutant():
    assert sorted(ex for ex, _, _ in MUTANTS) == sorted(ex for _, ex in ALL_EXERCISES)


@pytest.mark.parametrize("exercise_id,old,new", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_wrong_solution_fails_with_a_case(exercise_id, old, new):
    chapter = chapter_of(exercise_id)
    _, cells = _exercise_cells(chapter)
    solution = cells[exercise_id][0]
    assert old in solution, f"the mutant of {exercise_id} no longer applies"
    spec = get_spec(exercise_id)
    if spec is not None and spec.kind == "secret":
        # graded once: the local check only records; the trusted judge, with the key, fails
        # it and says how many answers are wrong, not which
        ns: dict = {}
        assert _run_exercise(chapter, exercise_id, solution.replace(old, new, 1), ns) == spec.line + "\n"
        _, names = _check_args(_exercise_cells(chapter)[1][exercise_id][1])
        cases = make_cases(spec, "graded-run")
        got = dumps(observe_all(spec, cases, tuple(ns[n] for n in names)))
        ok, msg = judge(spec, cases, got, KEY)
        assert not ok and re.fullmatch(
            rf"{re.escape(exercise_id)}: [1-9]\d* of \d+ answers are not right", msg
        ), msg
        return
    with pytest.raises(ExerciseFailure) as info:
        _run_exercise(chapter, exercise_id, solution.replace(old, new, 1))
    msg = str(info.value)
    assert msg.startswith(f"{exercise_id} failed on case "), msg
    assert "smallest first" in msg


def test_failure_names_the_smallest_case_and_expected_vs_got():
    # slot mapping that ignores the block table: the first case in size order that breaks it
    _, cells = _exercise_cells("ch02")
    wrong = cells["ex2.4"][0].replace(
        "block_table[i // block_size] * block_size", "(i // block_size) * block_size"
    )
    with pytest.raises(ExerciseFailure) as info:
        _run_exercise("ch02", "ex2.4", wrong)
    msg = str(info.value)
    assert "slot_mapping(block_table=[1], block_size=1, start=0, end=1)" in msg
    assert "expected 1" in msg and "got      0" in msg


# -- harness ---------------------------------------------------------------------------------


def test_the_stub_is_spotted_through_wrappers():
    class InterpreterError(Exception):  # the shape of triton's wrapper
        pass

    assert is_not_implemented(InterpreterError("NotImplementedError()"))
    try:
        try:
            raise NotImplementedError
        except NotImplementedError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert is_not_implemented(wrapped)
    assert not is_not_implemented(ValueError("x"))


# -- notebook tools --------------------------------------------------------------------------


def test_stub_source_keeps_signatures_and_indentation():
    src = (
        "def f(x):\n"
        '    """doc"""\n'
        "    ### BEGIN SOLUTION\n"
        "    return x + 1\n"
        "    ### END SOLUTION\n"
        "\n"
        "class C:\n"
        "    def g(self):\n"
        "        ### BEGIN SOLUTION\n"
        "        return 2\n"
        "        ### END SOLUTION\n"
    )
    assert stub_source(src) == (
        'def f(x):\n    """doc"""\n    raise NotImplementedError\n\n'
        "class C:\n    def g(self):\n        raise NotImplementedError\n"
    )
    for bad, why in [
        ("x = 1\n", "no ### BEGIN"),
        ("### BEGIN SOLUTION\n", "without ### END"),
        ("### END SOLUTION\n", "without ### BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n", "inside another"),
    ]:
        with pytest.raises(ValueError, match=why):
            stub_source(bad)


@pytest.mark.parametrize("chapter", sorted(AUTHORED))
def test_student_copy_has_no_solution_and_keeps_check_outputs(chapter):
    authored = AUTHORED[chapter]
    student = make_student_copy(authored.nb)
    solution_lines = set()
    for cell in authored.nb.cells:
        if cell_role(cell) == "solution":
            inside = False
            for line in cell_source(cell).splitlines():
                if line.strip() == "### BEGIN SOLUTION":
                    inside = True
                elif line.strip() == "### END SOLUTION":
                    inside = False
                elif inside and line.strip():
                    solution_lines.add(line)
    student_text = "\n".join(cell_source(c) for c in student.cells)
    leaked = [ln for ln in solution_lines if ln in student_text.splitlines()]
    assert not leaked, leaked
    assert "### BEGIN SOLUTION" not in student_text
    parsed = parse_authored(student, authored.path, require_solutions=False)  # ✅ outputs kept
    assert parsed.exercises == authored.exercises
    for a, s in zip(authored.nb.cells, student.cells):
        assert cell_role(a) == cell_role(s) and cell_exercise(a) == cell_exercise(s)
        if cell_role(a) == "solution":
            first = cell_source(a).splitlines()[0]
            assert cell_source(s).splitlines()[0] == first  # the signature is kept
            assert s.outputs == [] and "nbval-ignore-output" in s.metadata["tags"]
        if cell_role(a) == "check":
            assert cell_source(a) == cell_source(s) and a.outputs == s.outputs
    assert student.metadata["minipaged"] == {"chapter": chapter, "copy": "student"}


def test_read_submission_gives_one_line_reasons(tmp_path):
    cases = {
        "trunc.ipynb": '{"cells": [',
        "list.ipynb": "[1, 2]",
        "v3.ipynb": json.dumps({"cells": [], "nbformat": 3}),
        "badcell.ipynb": json.dumps({"cells": [{"cell_type": "weird", "source": ""}], "nbformat": 4}),
        "badsrc.ipynb": json.dumps({"cells": [{"cell_type": "code", "source": 5}], "nbformat": 4}),
    }
    expect = {
        "trunc.ipynb": "invalid JSON",
        "list.ipynb": "no list of cells",
        "v3.ipynb": "version-4",
        "badcell.ipynb": "no valid cell_type",
        "badsrc.ipynb": "no text source",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(MalformedNotebook, match=expect[name]):
            read_submission(tmp_path / name)
    (tmp_path / "bin.ipynb").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(MalformedNotebook, match="not UTF-8"):
        read_submission(tmp_path / "bin.ipynb")
    with pytest.raises(MalformedNotebook, match="file not found"):
        read_submission(tmp_path / "missing.ipynb")
    with pytest.raises(MalformedNotebook, match="directory"):
        read_submission(tmp_path)
    ok = json.dumps({"cells": [{"cell_type": "code", "source": ["x = 1"]}], "nbformat": 4})
    (tmp_path / "min.ipynb").write_text(ok)  # loose but executable: accepted
    assert cell_source(read_submission(tmp_path / "min.ipynb").cells[0]) == "x = 1"


def test_identify_chapter_from_metadata_cells_or_name():
    known = set(AUTHORED)
    nb = make_student_copy(AUTHORED["ch04"].nb)
    assert identify_chapter(nb, "anything.ipynb", known) == "ch04"
    del nb.metadata["minipaged"]
    assert identify_chapter(nb, "anything.ipynb", known) == "ch04"  # from the cells' exercise ids
    bare = nbformat.v4.new_notebook()
    assert identify_chapter(bare, "alice_ch05.ipynb", known) == "ch05"
    assert identify_chapter(bare, "alice.ipynb", known) is None


def test_load_authored_refuses_unexecuted_notebooks(tmp_path):
    nb = nbformat.read(AUTHORED["ch01"].path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbformat.write(nb, tmp_path / "ch01_kv_cache.ipynb")
    with pytest.raises(ValueError, match="execute the authored notebook first"):
        load_authored(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        load_authored(tmp_path / "nope")


# -- the exercises command -------------------------------------------------------------------


def test_exercises_command_writes_student_copies(tmp_path, capsys):
    from minipaged.cli import main

    assert main(["exercises"]) == 0
    listing = capsys.readouterr().out
    assert "ch03  ch03_paged_attention.ipynb" in listing and "ex6.4: the prefix-cache lookup" in listing

    out = tmp_path / "students"
    assert main(["exercises", "--student", str(out)]) == 0
    written = sorted(p.name for p in out.glob("*.ipynb"))
    assert written == sorted(a.name for a in AUTHORED.values())
    assert main(["exercises", "--student", str(out)]) == 2  # no silent overwrite
    assert "--force" in capsys.readouterr().err
    assert main(["exercises", "--student", str(out), "--force", "--chapter", "ch02"]) == 0
    assert main(["exercises", "--chapter", "ch12"]) == 2


# -- the checkers' references agree with the package -----------------------------------------


def test_scheduler_recipes_are_valid_scheduler_states():
    from minipaged.checks._scheduler_cases import build, random_recipe

    rng = random.Random(0)
    for _ in range(300):
        recipe = random_recipe(rng, chunked=None, stops=rng.random() < 0.5)
        s = build(recipe)
        s.check_invariants()
        again = build(recipe)  # twins are identical, block ids included
        assert [s.kv_cache_manager.get_block_ids(r.request_id) for r in s.running] == [
            again.kv_cache_manager.get_block_ids(r.request_id) for r in again.running
        ]


def test_sharing_references_agree_with_the_package():
    from minipaged.checks._spec import diff
    from minipaged.checks.ch06 import (
        _build_pool,
        _prefix_cases,
        _run_ops,
        _sharing_cases,
        pkg_append_slot,
        pkg_block_hashes,
        ref_append_slot,
        ref_block_hashes,
        ref_find_cached_blocks,
        ref_fork,
    )
    from minipaged.core import BlockSpaceManager, Request
    from minipaged.grading.codec import to_data

    # the written-out fork / copy-on-write against BlockSpaceManager.fork / allocate_slots,
    # the same state after every step, with check_invariants holding; and the operations
    # ``_run_ops`` writes out itself (an ex6.1 case's appends, an ex6.2 case's forks) leave
    # the states the package's fork and allocate_slots leave
    for focus in ("fork", "append"):
        for case in _sharing_cases(random.Random(f"test {focus}"), 150, focus=focus):
            by = {}
            for exercise, written_fn, package_fn in (
                ("fork", ref_fork, BlockSpaceManager.fork),
                ("append", ref_append_slot, pkg_append_slot),
            ):
                if focus == "append" or exercise == "fork":  # "fork?" ops are ex6.1's only
                    written = _run_ops(case, written_fn, exercise)
                    package = _run_ops(case, package_fn, exercise)
                    assert diff(to_data(package), to_data(written), 0.0, 0.0) is None  # notes aside
                    assert all(
                        s["invariants (ref_cnt = tables holding a block; free queue = ref_cnt 0)"] == "hold"
                        for s in written
                    )
                    by[exercise] = [{k: v for k, v in s.items() if k != "call"} for s in to_data(package)]
            if len(by) == 2:
                assert by["fork"] == by["append"], case
    rng = random.Random(1)
    for _ in range(200):
        tokens, bs = [rng.randrange(9) for _ in range(rng.randint(0, 30))], rng.choice([1, 2, 3, 16])
        assert ref_block_hashes(tokens, bs) == pkg_block_hashes(tokens, bs)
    for c in _prefix_cases(random.Random("test"), 100):
        m = _build_pool(c)
        for q in c["queries"]:
            assert [b.block_id for b in ref_find_cached_blocks(m.block_pool, q, c["block_size"])] == [
                b.block_id for b in m.get_computed_blocks(Request("q", list(q)))[0]
            ]
