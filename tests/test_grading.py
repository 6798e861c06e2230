"""The instructor workflow: ``release`` student versions, ``grade`` submissions per exercise.

Three layers, to keep the suite fast:

* **Static checks on every course notebook** (no kernel): releasing is
  deterministic; each stub stands exactly where a solution was and nothing of
  the solution is left; check cells and every other cell are unchanged; the
  grading ids are stable and unique; a released notebook matches its
  instructor notebook; the graded copy of a submission is the instructor's
  notebook with only the exercise cells taken from the submission.
* **A class of small submissions graded for real** (a three-exercise fixture
  course, about a second of work each): full marks, zero, one wrong answer,
  tampered checks, and every failure mode the grader must survive; then, with
  hidden checks added to the fixture, an answer fitted to the visible checks, a
  memory hog, an output flood, processes left running and an attempt to echo
  the hidden checks into the report.
* **One course notebook graded for real** (the instructor copy, the released
  copy, a wrong answer behind a tampered check). Every course notebook is
  graded this way behind the opt-in marker: ``pytest -m grading tests/test_grading.py``.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import nbformat
import pytest

from conftest import FIXTURES, REPO, course_notebooks
from utils import sizes
from utils.course import grading, grading_plugin, student
from utils.course.student import (BEGIN, END, HIDDEN_BEGIN, HIDDEN_END, find_exercises, release,
                           release_notebook, strip_solutions)

COURSE = FIXTURES / "grading" / "course"
TINY = COURSE / "01-tiny" / "01_double.ipynb"
TINY_NAME = "01-tiny/01_double.ipynb"
NOTEBOOKS = course_notebooks()
IDS = [str(p.relative_to(REPO)) for p in NOTEBOOKS]
# The course notebook the default suite grades for real: one of the fastest at smoke size,
# with two independent exercises (so a wrong answer in one must leave the other standing).
REPRESENTATIVE = REPO / "02-mixed-precision" / "02_autocast.ipynb"
SOLUTIONS = {  # the fixture's exercises, as a student who solved them writes them
    "exercise-1": "# Exercise 1: return twice the input\ndef double(x):\n    return 2 * x\n",
    "exercise-2": "# Exercise 2: the hypotenuse\ndef hypotenuse(a, b):\n    return (a * a + b * b) ** 0.5\n",
    "exercise-3": "# Exercise 3: the mean\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
}


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "utils", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def read(path):
    return nbformat.read(path, as_version=4)


def released(nb_path=TINY, course=COURSE):
    nb = read(nb_path)
    return release_notebook(nb, student.notebook_name(nb_path, course))


def submission(base, **sources):
    """A copy of a released notebook with some exercise cells' sources replaced (None: deleted)."""
    nb = copy.deepcopy(base)
    keep = []
    for cell in nb.cells:
        ex = cell.metadata.get("course", {})
        if ex.get("role") == "exercise" and ex["id"].replace("-", "_") in sources:
            new = sources[ex["id"].replace("-", "_")]
            if new is None:
                continue
            cell.source = new
        keep.append(cell)
    nb.cells = keep
    return nb


def solved(base, **overrides):
    return submission(base, **{**{k.replace("-", "_"): v for k, v in SOLUTIONS.items()}, **overrides})


def gradebook(out):
    with open(out / "gradebook.csv", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == list(grading.GRADEBOOK_COLUMNS)
    return rows


def by_student(rows, name):
    return {r["exercise"]: r for r in rows if r["student"] == name}


# --- release: static checks on every course notebook ----------------------------------------

def _split_regions(source):
    """(text outside the solution regions, in order) by plain line scanning, not the regex."""
    outside, current, inside = [], [], False
    for line in source.splitlines(keepends=True):
        if line.strip().startswith(BEGIN):
            outside.append(("".join(current), re.match(r"[ \t]*", line).group(0)))
            current, inside = [], True
        elif line.strip().startswith(END):
            inside = False
        elif not inside:
            current.append(line)
    return outside, "".join(current)


@pytest.fixture(scope="module")
def course_release(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    written = release(None, out)
    return out, written


def test_release_writes_every_course_notebook_and_module_files(course_release):
    out, written = course_release
    assert sorted(p.relative_to(out) for p in written) == \
        sorted(p.relative_to(REPO) for p in NOTEBOOKS)
    # helper files a notebook imports or launches travel with its module
    if (REPO / "01-torch-compile" / "compile_probe.py").exists():
        assert (out / "01-torch-compile" / "compile_probe.py").is_file()
    if (REPO / "05-distributed" / "scripts").is_dir():
        assert (out / "05-distributed" / "scripts" / "ddp_train.py").is_file()
    assert not list(out.rglob("__pycache__"))


def test_release_is_deterministic(course_release, tmp_path):
    first, _ = course_release
    release(None, tmp_path)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=IDS)
def test_release_of_each_course_notebook(nb_path, course_release):
    out, _ = course_release
    name = nb_path.relative_to(REPO).as_posix()
    inst, stud = read(nb_path), read(out / name)
    exercises = find_exercises(inst)
    assert exercises, "every course notebook has exercises"
    assert [c.cell_type for c in inst.cells] == [c.cell_type for c in stud.cells]
    assert [c.get("id") for c in inst.cells] == [c.get("id") for c in stud.cells]

    ids = [ex.id for ex in exercises]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"exercise-\d+(-\d+)?", i) for i in ids)
    assert stud.metadata["course"] == {"notebook": name, "exercises": ids, "format": 1}
    roles = {}
    for ex in exercises:
        roles[ex.cell_index] = {"id": ex.id, "role": "exercise"}
        assert ex.check_index is not None, f"{ex.title}: a check cell follows"
        roles[ex.check_index] = {"id": f"{ex.id}-check", "role": "check", "exercise": ex.id}
    for i, (a, b) in enumerate(zip(inst.cells, stud.cells)):
        assert b.metadata.get("course") == roles.get(i), f"cell {i + 1}: grading ids"
        if b.cell_type == "code":
            assert b.outputs == [] and b.execution_count is None
        if i not in {ex.cell_index for ex in exercises}:
            assert a.source == b.source, f"cell {i + 1} changed (check cells must be kept as they are)"
            continue
        # the exercise cell: exactly the text around the solutions, a stub where each one was
        ex = next(e for e in exercises if e.cell_index == i)
        outside, tail = _split_regions(a.source)
        stub = f'raise NotImplementedError("Student exercise: {ex.title}")\n'
        expected = "".join(before + indent + stub for before, indent in outside) + tail
        assert b.source == expected, f"{ex.title}: the stub stands exactly where the solution was"
        assert BEGIN not in b.source and END not in b.source


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=IDS)
def test_grading_matches_and_rebuilds_each_course_notebook(nb_path, course_release):
    out, _ = course_release
    name = nb_path.relative_to(REPO).as_posix()
    course = grading._Course(REPO)
    stud = read(out / name)
    assert course.match(stud, out / name) == (name, "")
    # without its metadata it is still found by its file name
    bare = copy.deepcopy(stud)
    bare.metadata.pop("course")
    assert course.match(bare, out / name)[0] == name
    inst, exercises = course.load(name)
    ex_cells = {ex.cell_index for ex in exercises}
    # the released copy, graded: the instructor notebook with the stubs in the exercise cells
    graded, notes, empty = grading.build_graded(inst, exercises, stud)
    assert not empty and not any(notes.values())
    for i, (a, b, s) in enumerate(zip(inst.cells, graded.cells, stud.cells)):
        assert b.source == (s.source if i in ex_cells else a.source), f"cell {i + 1}"
    # the instructor's own notebook submitted as it is (no ids): matched by the exercise
    # comments, and every solution goes in unchanged
    graded, notes, _ = grading.build_graded(inst, exercises, read(nb_path))
    assert [c.source for c in graded.cells] == [c.source for c in inst.cells]


def test_strip_solutions_keeps_the_indentation_and_rejects_unbalanced_markers():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\nprint(f(1))\n"
    assert strip_solutions(src, "Exercise 9") == \
        'def f(x):\n    raise NotImplementedError("Student exercise: Exercise 9")\n\nprint(f(1))\n'
    with pytest.raises(ValueError, match="unbalanced solution markers in Exercise 9"):
        strip_solutions("### BEGIN SOLUTION\nx = 1\n", "Exercise 9")


def test_exercise_ids_come_from_the_numbers_and_stay_unique():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(f"# Exercise {n}: x\n{BEGIN}\nx = 1\n{END}") for n in (2, 2)
    ] + [nbformat.v4.new_code_cell(f"{BEGIN}\ny = 1\n{END}"), nbformat.v4.new_code_cell("assert y")])
    exercises = find_exercises(nb)
    assert [e.id for e in exercises] == ["exercise-2", "exercise-2-2", "exercise-3"]
    assert [e.check_index for e in exercises] == [None, None, 3]  # an exercise is no check
    assert exercises[2].title == "Exercise 3"


def test_release_reports_unbalanced_markers_clearly(tmp_path):
    bad = tmp_path / "01-mod" / "01_bad.ipynb"
    bad.parent.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"# Exercise 1: x\n{BEGIN}\nx = 1\n")]), bad)
    with pytest.raises(ValueError, match="^01-mod/01_bad.ipynb: cell 1: unbalanced solution markers"):
        release([bad], tmp_path / "out", course_root=tmp_path)


# --- grading: units -------------------------------------------------------------------------

def test_student_names_come_from_folders_and_file_names(tmp_path):
    (tmp_path / "alice" / "sub").mkdir(parents=True)
    (tmp_path / "alice" / "sub" / "01_double.ipynb").write_text("{}")
    (tmp_path / "alice" / ".hidden.ipynb").write_text("{}")
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "01_double.ipynb").write_text("{}")
    (tmp_path / "carol__01_double.ipynb").write_text("{}")
    (tmp_path / "dave.ipynb").write_text("{}")
    (tmp_path / "empty").mkdir()
    subs = grading.collect_submissions([tmp_path / "alice", tmp_path / "bob" / "01_double.ipynb",
                                        tmp_path / "carol__01_double.ipynb",
                                        tmp_path / "dave.ipynb", tmp_path / "empty"])
    assert [(s.student, s.path.name) for s in subs] == [
        ("alice", "01_double.ipynb"), ("bob", "01_double.ipynb"),
        ("carol", "carol__01_double.ipynb"), ("dave", "dave.ipynb"), ("empty", "empty")]
    with pytest.raises(FileNotFoundError, match="no such submission"):
        grading.collect_submissions([tmp_path / "nobody"])
    with pytest.raises(ValueError, match="at least one submission"):
        grading.collect_submissions([])


def test_a_class_folder_given_as_one_student_is_refused(tmp_path):
    """`grade submissions/` instead of `grade submissions/*`: refused, with the right command,
    never a gradebook with one student called 'submissions'."""
    nb = nbformat.v4.new_notebook()
    for student in ("alice", "bob", "carol"):
        (tmp_path / "submissions" / student).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "submissions" / student / "01_measuring_performance.ipynb")
    with pytest.raises(ValueError, match=r"looks like a class.*grade .*submissions/\* --out"):
        grading.collect_submissions([tmp_path / "submissions"])
    # the students' folders themselves are fine, and so is one student whose notebooks sit in
    # module folders (a layout the README allows)
    assert len(grading.collect_submissions(sorted((tmp_path / "submissions").iterdir()))) == 3
    for module in ("00-foundations", "02-mixed-precision"):
        (tmp_path / "dave" / module).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "dave" / module / "01_measuring_performance.ipynb")
    assert {s.student for s in grading.collect_submissions([tmp_path / "dave"])} == {"dave"}
    # the command line says it in one line and exits 2
    r = subprocess.run([sys.executable, "-m", "utils", "grade", str(tmp_path / "submissions"),
                        "--out", str(tmp_path / "grades")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "looks like a class" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "grades" / "gradebook.csv").exists()


def test_the_graded_copy_takes_only_the_exercise_cells():
    course = grading._Course(COURSE)
    inst, exercises = course.load(TINY_NAME)
    sub = solved(released(), exercise_3=None)  # exercise 3's cell deleted
    for cell in sub.cells:
        meta = cell.metadata.get("course", {})
        if meta.get("role") == "check":
            cell.source = "pass  # the student 'fixed' the check"
            cell.metadata["tags"] = ["raises-exception", "skip"]
        if meta.get("id") == "exercise-1":
            cell.metadata["tags"] = ["skip"]
    sub.cells.insert(1, nbformat.v4.new_code_cell("TWO = 3  # a cell of the student's own"))
    sub.cells.append(copy.deepcopy(sub.cells[4]))  # exercise 1's cell, twice
    graded, notes, empty = grading.build_graded(inst, exercises, sub)
    assert len(graded.cells) == len(inst.cells)
    for i, (a, b) in enumerate(zip(inst.cells, graded.cells)):
        ex = next((e for e in exercises if e.cell_index == i), None)
        if ex is None:
            assert b.source == a.source and b.metadata.get("tags") == a.metadata.get("tags")
        elif ex.id == "exercise-3":
            assert b.source == strip_solutions(a.source, ex.title)  # missing: the released stub
        else:
            assert b.source == SOLUTIONS[ex.id] and "tags" not in b.metadata
    assert notes["exercise-3"] == [
        "the exercise cell is missing from the submission (graded as the released stub)"]
    assert notes["exercise-1"] == ["2 cells carry this exercise's id; the first was graded"]
    assert not empty
    _, _, empty = grading.build_graded(inst, exercises, submission(released(), exercise_2="# hm\n\n"))
    assert empty == {"exercise-2"}


def test_results_are_signed_and_forgeries_rejected(tmp_path):
    key = b"k" * 64
    good = {"cell": 0, "status": "passed", "message": ""}
    good["hmac"] = grading_plugin.sign(key, good)
    forged = {"cell": 1, "status": "passed", "message": "", "hmac": "0" * 64}
    relabelled = {**good, "cell": 2}  # a real signature moved to another cell
    path = tmp_path / "cells.json"
    path.write_text(json.dumps({"cells": [good, forged, relabelled]}))
    cells, tampered = grading._read_results(path, key)
    assert list(cells) == [0] and tampered
    path.write_text(json.dumps({"cells": [good]}))
    assert grading._read_results(path, key) == ({0: good}, False)
    assert grading._read_results(path, b"another key") == ({}, True)


def test_the_plugin_says_what_happened_to_a_cell():
    from types import SimpleNamespace as NS

    def message(exc=None, outputs=(), timed_out=False):
        item = NS(test_outputs=list(outputs), parent=NS(timed_out=timed_out),
                  config=NS(getoption=lambda name, default=None: 30.0))
        return grading_plugin._message(item, NS(excinfo=NS(value=exc) if exc else None))

    tb = ["\x1b[0;31m---------\x1b[0m", "Cell \x1b[0;32mIn[3], line 2\x1b[0m",
          "\x1b[0;32m----> 2\x1b[0m \x1b[38;5;28;01massert\x1b[39;00m x \x1b[38;5;241m==\x1b[39m 1"]
    err = {"output_type": "error", "ename": "AssertionError", "evalue": "", "traceback": tb}
    assert message(RuntimeError("x"), [err]) == "AssertionError at `assert x == 1`"
    err = {"output_type": "error", "ename": "ValueError", "evalue": "bad size\nmore"}
    assert message(RuntimeError("x"), [err]) == "ValueError: bad size\nmore"
    intr = {"output_type": "error", "ename": "KeyboardInterrupt", "evalue": ""}
    assert message(RuntimeError("x"), [intr], timed_out=True) == \
        "timed out: the cell ran past the per-cell limit of 30 s"
    assert message(RuntimeError("Timeout of 30 seconds exceeded while executing cell. Failed to "
                                "interrupt kernel in 5 seconds")).endswith("so its kernel was shut down")
    assert message(RuntimeError("Timeout of 5 seconds exceeded waiting for output.")).startswith(
        "the kernel sent no output")
    assert message(RuntimeError("Kernel dead on test start")) == \
        "not run: the kernel had stopped in an earlier cell"
    assert message(grading_plugin.KernelDiedError("the kernel died (exit code 3)")) == \
        "the kernel died (exit code 3)"


def test_grade_rejects_bad_arguments_clearly(tmp_path):
    for kw, message in ((dict(jobs=0), "jobs must be at least 1, got 0"),
                        (dict(timeout_s=0), "timeout must be a positive number of seconds"),
                        (dict(notebook_timeout_s=-1), "notebook timeout must be a positive")):
        with pytest.raises(ValueError, match=message):
            grading.grade([TINY], tmp_path, course_root=COURSE, progress=False, **kw)
    with pytest.raises(FileNotFoundError, match="holds no course notebooks"):
        grading.grade([TINY], tmp_path, course_root=tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="no such submission file or folder"):
        grading.grade([tmp_path / "nobody.ipynb"], tmp_path, course_root=COURSE, progress=False)


def test_the_grade_command_keeps_going_past_files_it_cannot_grade(tmp_path):
    (tmp_path / "ann__01_double.ipynb").write_text("{not json")
    (tmp_path / "ann__scratch.ipynb").write_text("{not json")
    (tmp_path / "ann.pdf").write_bytes(b"%PDF-1.4")
    out = tmp_path / "grades"
    r = cli("grade", str(tmp_path / "ann__01_double.ipynb"), str(tmp_path / "ann__scratch.ipynb"),
            str(tmp_path / "ann.pdf"), "--course", str(COURSE), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    # the invalid file named like a course notebook counts 0 of its 3 exercises; the other
    # invalid file belongs to no course notebook and has a row of its own
    assert "3 file(s) of 1 student(s): 0 of 3 exercises passed." in r.stdout
    assert [(row["student"], row["exercise"], row["reason"].split(" (")[0])
            for row in gradebook(out)] == [
        ("ann", "", "not a notebook"), ("ann", "exercise-1", "not a valid notebook"),
        ("ann", "exercise-2", "not a valid notebook"), ("ann", "exercise-3", "not a valid notebook"),
        ("ann", "", "not a valid notebook")]
    assert (out / "reports" / "ann.md").is_file() and (out / "summary.md").is_file()


# --- grading a class for real (fixture course) ----------------------------------------------

STEAL = '''# Exercise 1: return twice the input
import json, os, pathlib
import utils

MARK = "### BEGIN " + "SOLUTION"  # spelled so that this cell does not find itself


def stolen(title="Exercise 1:"):
    """An instructor notebook near here or near utils, and its solution to exercise 1."""
    here = pathlib.Path.cwd()
    for root in (here, here.parent, here.parent.parent,
                 pathlib.Path(utils.__file__).resolve().parent.parent):
        for nb in sorted(root.rglob("*.ipynb")):
            try:
                cells = json.loads(nb.read_text())["cells"]
            except Exception:
                continue
            for cell in cells:
                src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                if MARK in src and title in src:
                    return src, str(nb)
    return None, None


source, where = stolen()
print("STOLEN FROM", where)
print("UTILS AT", utils.__file__)
print("CWD", os.getcwd())
print("REPO VISIBLE", any(REPO_PATH in v for v in [os.getcwd(), utils.__file__,
                                                   *os.environ.values()]))
if source:
    exec(source)
else:
    def double(x):
        return None
'''

FORGE = '''# Exercise 1: return twice the input
import json, os, signal


def double(x):
    return 2 * x


environ = open(f"/proc/{os.getppid()}/environ", "rb").read().split(b"\\0")
path = next(e.split(b"=", 1)[1].decode() for e in environ
            if e.startswith(b"COURSE_GRADING_RESULTS="))
fake = [{"cell": n, "status": "passed", "message": "", "hmac": "0" * 64} for n in range(50)]
with open(path, "w") as f:
    json.dump({"cells": fake}, f)
os.kill(os.getppid(), signal.SIGKILL)  # and stop the real plugin from writing again
'''


def test_the_steal_attempt_works_where_the_instructor_files_are_visible(monkeypatch):
    """Negative control: run from the instructor's module folder, the attempt finds the solution."""
    import utils

    monkeypatch.chdir(TINY.parent)
    ns = {"REPO_PATH": str(REPO), "utils": utils}
    code = STEAL.split("source, where = stolen()")[0]
    exec(code, ns)
    source, where = ns["stolen"]()
    assert where == str(TINY) and "return TWO * x" in source


def _write_class(folder, plan):
    for name, nb in plan.items():
        (folder / name).mkdir(parents=True)
        nbformat.write(nb, folder / name / "01_double.ipynb")


def _passed(rows, name):
    return {k: r["passed"] == "true" for k, r in by_student(rows, name).items()}


@pytest.mark.notebook
def test_a_class_grades_in_minutes_and_keeps_going_past_bad_submissions(tmp_path):
    base = released()
    subs = tmp_path / "submissions"
    carol = solved(base, exercise_2="# Exercise 2\ndef hypotenuse(a, b):\n    return a + b\n")
    # carol's wrong answer sits behind an edited check, and she deleted check 3
    carol.cells = [c for c in carol.cells if c.metadata.get("course", {}).get("id") != "exercise-3-check"]
    for c in carol.cells:
        if c.metadata.get("course", {}).get("id") == "exercise-2-check":
            c.source = "pass  # nothing to see here"
    _write_class(subs, {
        "alice": solved(base),
        "bob": base,
        "carol": carol,
        "dave": solved(base, exercise_1=SOLUTIONS["exercise-1"] + "while True:\n    pass\n"),
        "erin": solved(base, exercise_2="import os\nos._exit(3)\n"),
    })
    (subs / "bob" / "notes.txt").write_text("I ran out of time")
    (subs / "broken__01_double.ipynb").write_text('{"cells": [')
    (subs / "weird__01_double.ipynb").write_text('{"hello": "world"}')
    stranger = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(stranger, subs / "stranger__99_unknown.ipynb")

    out = tmp_path / "grades"
    t0 = time.monotonic()
    grading.grade(sorted(subs.iterdir()), out, course_root=COURSE, timeout_s=10, jobs=2,
                  progress=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 120, f"grading the class took {elapsed:.0f} s"
    rows = gradebook(out)

    full = {"exercise-1": True, "exercise-2": True, "exercise-3": True}
    assert _passed(rows, "alice") == full
    assert all(r["points"] == "1" and r["reason"] == "" for r in by_student(rows, "alice").values())
    bob = by_student(rows, "bob")
    assert _passed(rows, "bob") == {"exercise-1": False, "exercise-2": False, "exercise-3": False,
                                    "": False}
    assert all(bob[e]["reason"] == "not done: the exercise still raises the released stub's "
               "NotImplementedError" and bob[e]["points"] == "0" for e in full)
    assert bob[""]["reason"] == "not a notebook (.ipynb): skipped"
    # the tampered checks came from the instructor: only the wrong answer is lost
    assert _passed(rows, "carol") == {"exercise-1": True, "exercise-2": False, "exercise-3": True}
    assert by_student(rows, "carol")["exercise-2"]["reason"] == \
        "check: AssertionError: hypotenuse(3, 4) should be 5"
    # a loop is interrupted at the per-cell limit, and the cells after it still run
    dave = by_student(rows, "dave")
    assert _passed(rows, "dave") == {"exercise-1": False, "exercise-2": True, "exercise-3": True}
    assert dave["exercise-1"]["reason"] == \
        "exercise cell: timed out: the cell ran past the per-cell limit of 10 s"
    # a dead kernel fails its cell at once, and what came after it was not run
    erin = by_student(rows, "erin")
    assert _passed(rows, "erin") == {"exercise-1": True, "exercise-2": False, "exercise-3": False}
    assert erin["exercise-2"]["reason"].startswith(
        "exercise cell: the kernel died (exit code 3) while running this cell")
    assert erin["exercise-3"]["reason"].startswith("not run: the kernel stopped earlier, in cell 6 of 11")
    # files that cannot be graded are in the gradebook with the reason
    for who, error in (("broken", "NotJSONError"), ("weird", "")):  # 0 of 3 under 01_double
        got = by_student(rows, who)
        assert set(got) == set(full) and all(r["reason"].startswith(f"not a valid notebook ({error}")
                                             and r["passed"] == "false" for r in got.values())
    assert by_student(rows, "stranger")[""]["reason"].startswith(
        "belongs to no course notebook: it carries no course metadata")
    # the per-student report names each failed exercise with the assertion message
    report = (out / "reports" / "carol.md").read_text()
    assert "**2 of 3 points**" in report
    assert "- **Exercise 2: the hypotenuse of a right triangle** (`exercise-2`): check: " \
           "AssertionError: hypotenuse(3, 4) should be 5" in report
    assert "| alice | 01-tiny/01_double.ipynb | 3 | 3 |  |" in (out / "summary.md").read_text()


@pytest.mark.notebook
def test_crashes_import_errors_empty_cells_and_attempts_on_the_grader(tmp_path):
    base = released()
    subs = tmp_path / "submissions"
    mallory = solved(base, exercise_1=(
        "# NBVAL_RAISES_EXCEPTION\n" + SOLUTIONS["exercise-1"]
        + 'raise RuntimeError("the marker would hide this")\n'),
        exercise_2="# NBVAL_SKIP\ndef hypotenuse(a, b):\n    return 0\n")
    for c in mallory.cells:
        if c.metadata.get("course", {}).get("role") == "check":
            c.metadata["tags"] = ["raises-exception"]
    _write_class(subs, {
        "frank": solved(base, exercise_1="import ctypes\nctypes.string_at(0)  # a segfault\n"),
        "grace": solved(base, exercise_1="import no_such_module_for_the_grading_test\n"),
        "heidi": solved(base, exercise_1="", exercise_3=None),
        "ivan": submission(base, exercise_1=STEAL.replace("REPO_PATH", repr(str(REPO)))),
        "judy": submission(base, exercise_1=FORGE),
        "mallory": mallory,
    })
    (subs / "olivia__01_double.ipynb").write_bytes(TINY.read_bytes())  # the instructor's own file
    out = tmp_path / "grades"
    grading.grade(sorted(subs.iterdir()), out, course_root=COURSE, timeout_s=30, jobs=2,
                  progress=False)
    rows = gradebook(out)
    assert _passed(rows, "olivia") == {"exercise-1": True, "exercise-2": True, "exercise-3": True}
    frank = by_student(rows, "frank")
    assert frank["exercise-1"]["reason"].startswith(
        "exercise cell: the kernel died (killed by SIGSEGV) while running this cell")
    assert not any(_passed(rows, "frank").values())
    grace = by_student(rows, "grace")
    assert grace["exercise-1"]["reason"] == ("exercise cell: ModuleNotFoundError: No module named "
                                             "'no_such_module_for_the_grading_test'")
    assert _passed(rows, "grace") == {"exercise-1": False, "exercise-2": True, "exercise-3": True}
    heidi = by_student(rows, "heidi")
    assert _passed(rows, "heidi") == {"exercise-1": False, "exercise-2": True, "exercise-3": False}
    assert heidi["exercise-1"]["reason"] == "the exercise cell is empty"
    assert heidi["exercise-3"]["reason"].endswith(
        "the exercise cell is missing from the submission (graded as the released stub)")
    # reading the instructor's solution from disk found nothing to read
    assert not _passed(rows, "ivan")["exercise-1"]
    ivan = read(out / "executed" / "ivan" / TINY_NAME)
    printed = "".join(o.get("text", "") for c in ivan.cells if c.cell_type == "code"
                      for o in c.outputs)
    assert "STOLEN FROM None" in printed and "UTILS AT " in printed
    if not sys.prefix.startswith(str(REPO)):  # a virtual environment inside the checkout shows
        assert "REPO VISIBLE False" in printed
    assert by_student(rows, "ivan")["exercise-1"]["reason"].startswith(
        "check: AssertionError: double(21) gave None, expected 42; review by hand")
    # forged results, and a killed grader process, give nothing
    judy = by_student(rows, "judy")
    assert not any(_passed(rows, "judy").values())
    assert judy[""]["reason"].startswith("the grader's results file held records the grader did not sign")
    # nbval markers in the student's cells, and tags on their check cells, change nothing
    mallory = by_student(rows, "mallory")
    assert _passed(rows, "mallory") == {"exercise-1": False, "exercise-2": False, "exercise-3": True}
    assert mallory["exercise-1"]["reason"] == "exercise cell: RuntimeError: the marker would hide this"


@pytest.mark.notebook
def test_a_kernel_that_ignores_the_interrupt_is_killed_at_the_wall_clock_limit(tmp_path):
    pid_file = tmp_path / "kernel.pid"
    stubborn = (f"import os\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                "while True:\n    try:\n        while True:\n            pass\n"
                "    except KeyboardInterrupt:\n        pass\n")
    path = tmp_path / "zoe" / "01_double.ipynb"
    path.parent.mkdir()
    nbformat.write(solved(released(), exercise_1=stubborn), path)
    t0 = time.monotonic()
    [g] = grading.grade([path.parent], tmp_path / "out", course_root=COURSE, timeout_s=120,
                        notebook_timeout_s=20, progress=False)
    assert time.monotonic() - t0 < 60
    reasons = {r.exercise: r.reason for r in g.rows}
    assert reasons["exercise-1"] == reasons["exercise-2"] == (
        "not run: grading of this notebook was stopped at its wall-clock limit of 20 s")
    assert reasons[""] == "stopped at the wall-clock limit of 20 s (--notebook-timeout)"
    import psutil

    pid = int(pid_file.read_text())
    time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, \
        "the looping kernel was killed with the run"


# --- hidden checks, resource limits, GPUs and feedback (issue 23) ----------------------------

# Check 2 gets a hidden assertion without a message between its visible ones; check 3 opens
# with a hidden assertion that has one (so the cell's first line is hidden too).
HIDDEN_2 = "assert hypotenuse(5, 12) == 13"
HIDDEN_3 = 'assert mean([2, 4]) == 3, "the mean of two values is their midpoint"'
SECRETS = (HIDDEN_2, HIDDEN_3)


def _course_with_hidden_checks(folder):
    """The fixture course, copied, with a hidden block in checks 2 and 3."""
    shutil.copytree(COURSE, folder)
    path = folder / TINY_NAME
    nb = read(path)
    for ex in find_exercises(nb):
        cell = nb.cells[ex.check_index]
        lines = cell.source.splitlines()
        if ex.id == "exercise-2":
            cell.source = "\n".join(lines[:2] + [HIDDEN_BEGIN, HIDDEN_2, HIDDEN_END] + lines[2:])
        elif ex.id == "exercise-3":
            cell.source = "\n".join([HIDDEN_BEGIN, HIDDEN_3, HIDDEN_END] + lines)
    nbformat.write(nb, path)
    return folder


def test_hidden_checks_leave_the_student_version_and_bad_markers_are_refused(tmp_path):
    course = _course_with_hidden_checks(tmp_path / "course")
    inst = read(course / TINY_NAME)
    stud = release_notebook(inst, TINY_NAME)
    text = json.dumps(stud.cells)
    assert not any(secret in text for secret in SECRETS) and "HIDDEN TESTS" not in text
    checks = {c.metadata["course"]["id"]: c.source for c in stud.cells
              if c.metadata.get("course", {}).get("role") == "check"}
    assert checks["exercise-2-check"].splitlines()[2] == student.HIDDEN_NOTE
    assert checks["exercise-3-check"].startswith(student.HIDDEN_NOTE + "\n# Check Exercise 3")
    # the exercises and their ids are those of the course without hidden checks
    assert stud.metadata["course"] == released().metadata["course"]
    # an indented block becomes `pass`, so the loop it sat in is still Python
    loop = f"for x in (1, 2):\n    {HIDDEN_BEGIN}\n    assert x\n    {HIDDEN_END}\n"
    assert student.strip_hidden(loop) == f"for x in (1, 2):\n    pass  {student.HIDDEN_NOTE}\n"
    for bad, message in ((f"{HIDDEN_BEGIN}\nassert x\n", "never closed"),
                         (f"assert x\n{HIDDEN_END}\n", "never opened"),
                         (f"{HIDDEN_BEGIN}\n{HIDDEN_BEGIN}\n{HIDDEN_END}\n", "inside the one")):
        with pytest.raises(ValueError, match=message):
            student.strip_hidden(bad)
    # in an exercise cell a hidden block would be replaced by the student's cell: refused
    ex = find_exercises(inst)[0]
    inst.cells[ex.cell_index].source += f"\n{HIDDEN_BEGIN}\nassert double(1) == 2\n{HIDDEN_END}"
    nbformat.write(inst, course / TINY_NAME)
    with pytest.raises(ValueError, match=r"^01-tiny/01_double.ipynb: cell 4 \(Exercise 1.*"
                                         r"hidden checks belong in the check cell"):
        release([course / TINY_NAME], tmp_path / "out", course_root=course)


def test_a_failed_hidden_check_says_so_without_its_source():
    blocks = [(3, 5)]
    rec = {"ename": "AssertionError", "lines": [4]}
    assert grading._hidden_safe(rec, "AssertionError at `assert f(5) == 13`", blocks) == \
        "a hidden check failed"
    assert grading._hidden_safe(rec, "AssertionError: the midpoint", blocks) == \
        "a hidden check failed: the midpoint"
    assert grading._hidden_safe({"ename": "NameError", "lines": [4]},
                                "NameError: name 'secret_reference' is not defined", blocks) == \
        "a hidden check failed (it raised NameError)"
    # a failure in a visible line of the same cell is shown as it is
    assert grading._hidden_safe({**rec, "lines": [2]}, "AssertionError: visible", blocks) == \
        "AssertionError: visible"
    # a failure the grader cannot place (no traceback) is treated as hidden
    assert grading._hidden_safe({**rec, "lines": []}, "AssertionError at `x`", blocks) == \
        "a hidden check failed"
    # the grader's own words hold no source and stay
    for msg in ("timed out: the cell ran past the per-cell limit of 10 s",
                "the kernel died (exit code 3) while running this cell"):
        assert grading._hidden_safe({"lines": [4]}, msg, blocks) == msg
    # a message cut inside a hidden line (the plugin keeps 2,000 characters) loses its start too
    assert grading._uncut("RuntimeError: ... assert hypotenuse(5, 1", [HIDDEN_2]) == \
        "RuntimeError: ... [hidden]"
    # the plugin places an exception at the cell's own line, chained exceptions too
    tb = ["---", "KeyError   Traceback (most recent call last)", "Cell In[4], line 2\n----> 2 d[k]\n",
          "During handling of the above exception, another exception occurred:",
          "AssertionError   Traceback (most recent call last)",
          "Cell In[4], line 4\n----> 4 assert ok\n", "Cell In[1], line 9, in f\n----> 9 x\n"]
    assert grading_plugin._top_lines(tb) == [2, 4]


def test_out_of_memory_names_the_limit():
    run = grading._RunResult({}, 0.0, False, 0, "", False, memory_limit_gib=2.0)
    torch_oom = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 4294967296 bytes. Error code 12 (Cannot "
                 "allocate memory)")
    assert grading._with_limits(torch_oom, run).startswith(
        "used more than the 2 GiB memory limit (RuntimeError: [enforce fail")
    assert grading._with_limits("MemoryError", run) == "used more than the 2 GiB memory limit (MemoryError)"
    assert grading._with_limits("OutOfMemoryError: CUDA out of memory. Tried to allocate 8 GiB",
                                run).startswith("used more than the GPU's memory (")
    assert grading._with_limits("ValueError: bad size", run) == "ValueError: bad size"
    assert 4 <= grading.default_memory_limit_gib(16) <= grading.default_memory_limit_gib(1) <= 16


def test_a_cells_output_is_capped_as_it_arrives():
    out = grading_plugin._Output()
    flood = "".join(f"{i}\n" for i in range(300_000))  # 1.9 MB in one message
    msg = {"msg_type": "stream", "content": {"name": "stdout", "text": flood}}
    kept = grading_plugin._cap_message(msg, out)["content"]["text"]
    assert kept == flood[:grading_plugin.TEXT_HEAD_CHARS]
    later = grading_plugin._cap_message({"msg_type": "stream", "content": {
        "name": "stdout", "text": "the end\n"}}, out)
    assert later["msg_type"].startswith("comm")  # nbval skips it; its text went to the tail
    outputs = [{"output_type": "stream", "name": "stdout", "text": kept}]
    grading_plugin._finish_outputs(outputs, out)
    text = outputs[0]["text"]
    assert len(text) < grading_plugin.TEXT_HEAD_CHARS + grading_plugin.TEXT_TAIL_CHARS + 300
    assert text.endswith("299999\nthe end\n") and "[... the grader cut " in text
    assert out.flooded and grading_plugin._flood_message(out).startswith(
        f"printed {len(flood) + 8:,} characters of output")
    big = {"msg_type": "display_data", "content": {"data": {
        "image/png": "x" * (grading_plugin.RICH_KEEP_CHARS + 1)}, "metadata": {}}}
    small = grading_plugin._Output()
    assert grading_plugin._cap_message(big, small)["msg_type"].startswith("comm") and small.flooded
    assert not grading_plugin._Output().flooded


def test_the_log_keeps_its_first_and_last_lines(tmp_path):
    read_end, write_end = os.pipe()
    log = grading._CappedLog(read_end, tmp_path / "run.log", keep=100_000)
    log.start()
    with os.fdopen(write_end, "wb") as w:
        w.write(b"first\n" + b"x" * 3_000_000 + b"\nlast\n")
    log.join(timeout=30)
    text = (tmp_path / "run.log").read_text()
    assert text.startswith("first\n") and text.endswith("\nlast\n") and len(text) < 100_100
    assert "[... the grader cut 2,900,012 bytes of this log here ...]" in text


def test_one_notebook_per_gpu_at_a_time(tmp_path, monkeypatch):
    """With GPUs in view, each kernel gets one GPU to itself; --hide-gpus gives them none."""
    for hidden in ("", "-1"):  # the grader's own CUDA_VISIBLE_DEVICES hides them too
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert grading._visible_gpus() == []
    monkeypatch.setattr(grading, "_visible_gpus", lambda: ["0", "1"])  # a node with two GPUs
    runs, lock = [], threading.Lock()

    def fake_run(graded, name, template, hidden, timeout_s, wall_s, log_path,
                 memory_limit_gib=0.0, gpu=None, compile_threads=None):
        start = time.monotonic()
        time.sleep(0.3)
        with lock:
            runs.append((gpu, start, time.monotonic(), memory_limit_gib))
            threads.append(compile_threads)
        return grading._RunResult({}, 0.3, False, 0, "", False)

    threads: list[int | None] = []
    monkeypatch.delenv(sizes.COMPILE_THREADS_ENV_VAR, raising=False)

    monkeypatch.setattr(grading, "_run_nbval", fake_run)
    subs = tmp_path / "subs"
    _write_class(subs, {f"s{k}": released() for k in range(6)})
    grading.grade(sorted(subs.iterdir()), tmp_path / "g1", course_root=COURSE, jobs=6,
                  progress=False)
    assert sorted(r[0] for r in runs) == ["0", "0", "0", "1", "1", "1"]
    for gpu in ("0", "1"):  # never two notebooks on one GPU at once
        spans = sorted((a, b) for g, a, b, _ in runs if g == gpu)
        assert all(spans[k][1] <= spans[k + 1][0] for k in range(len(spans) - 1)), spans
    assert all(limit == 0 for *_, limit in runs)  # a GPU is the kernel's own; no RLIMIT_DATA
    assert grading._kernel_env(tmp_path, tmp_path, [], "1")["CUDA_VISIBLE_DEVICES"] == "1"
    # two at a time (one per GPU): each kernel's compile workers are half the cores
    assert threads == [sizes.compile_threads_per_job(sizes.usable_cpu_count(), 2)] * 6

    runs.clear()
    grading.grade(sorted(subs.iterdir()), tmp_path / "g2", course_root=COURSE, jobs=6,
                  progress=False, hide_gpus=True, memory_limit_gib=3)
    assert [r[0] for r in runs] == [""] * 6 and all(r[3] == 3 for r in runs)
    starts, ends = [r[1] for r in runs], [r[2] for r in runs]
    assert max(starts) < min(ends), "hidden GPUs: the notebooks ran side by side"
    assert grading._kernel_env(tmp_path, tmp_path, [], "")["CUDA_VISIBLE_DEVICES"] == ""
    assert threads[6:] == [max(1, sizes.usable_cpu_count() // 6)] * 6


def test_kernels_graded_side_by_side_share_the_compile_workers(tmp_path, monkeypatch):
    """Inductor gives each kernel min(32, cores) compile workers, each a process that imports
    torch: a grader running 16 kernels on 16 cores would start 256. The grader sets each
    kernel's share, and keeps a value the instructor set."""
    var = sizes.COMPILE_THREADS_ENV_VAR
    monkeypatch.delenv(var, raising=False)
    assert grading._kernel_env(tmp_path, tmp_path, [], None, 3)[var] == "3"
    assert var not in grading._kernel_env(tmp_path, tmp_path, [], None, None)
    monkeypatch.setenv(var, "5")
    assert grading._kernel_env(tmp_path, tmp_path, [], None, 3)[var] == "5"


def test_reports_can_be_sent_as_they_are(tmp_path):
    """A report names the student's file as they know it, and only their own grades; two names
    that make the same file name get two files."""
    def g(student, reason, label):
        sub = grading.Submission(student, tmp_path / "submissions" / student / "01_double.ipynb",
                                 label, "01_double.ipynb")
        row = grading.GradeRow(student, TINY_NAME, "exercise-1", False, 0.0, reason)
        return grading.NotebookGrade(student, sub.label, TINY_NAME, (row,),
                                     (("exercise-1", "Exercise 1"),), executed="/srv/x.ipynb",
                                     file=sub.file)
    label = str(tmp_path / "submissions" / "a b" / "01_double.ipynb")
    written = grading._write_reports([g("a b", "check: mine", label),
                                      g("a_b", "check: theirs", label.replace("a b", "a_b"))],
                                     tmp_path / "out")
    assert sorted(p.name for p in written.values()) == ["a_b-2.md", "a_b.md"]
    mine = written["a b"].read_text()
    assert "check: mine" in mine and "theirs" not in mine
    assert str(tmp_path) not in mine and "/srv/" not in mine
    assert "Submitted file: `01_double.ipynb`" in mine


def test_bad_resource_options_are_refused_in_one_line(capsys, tmp_path):
    from utils.__main__ import main

    for value, message in (("-1", "error: memory limit must be a number of GiB"),
                           ("nan", "error: memory limit must be a number of GiB"),
                           ("0.1", "error: a memory limit of 0.1 GiB leaves a Python kernel no room")):
        assert main(["grade", str(TINY), "--memory-limit", value, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and "Traceback" not in err and err.count("\n") == 1


def _hog(gib):
    return f"hog = bytearray(int({gib} * 2**30))  # just above the limit\n" + SOLUTIONS["exercise-1"]


FLOOD = SOLUTIONS["exercise-1"] + """import os, sys
print("\\n".join(map(str, range(1_000_000))))  # a million lines
os.write(1, b"fd-level\\n" * 200_000)
sys.__stdout__.write("past the kernel's streams\\n" * 100_000)
sys.__stdout__.flush()
"""

LINGER = SOLUTIONS["exercise-2"] + """import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
with open(PIDS, "a") as f:
    f.write(f"{child.pid}\\n")
first = os.fork()
if first == 0:  # a daemon: a double fork in a session of its own, re-parented at once
    os.setsid()
    if os.fork() == 0:
        with open(PIDS, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)
    os._exit(0)
os.waitpid(first, 0)
"""

# Exercise 2 records every cell the kernel runs after it (checks included, hidden ones too),
# and exercise 3 puts them in its error message, which the report quotes.
RECORD = SOLUTIONS["exercise-2"] + (
    'seen = []\nget_ipython().events.register("pre_run_cell", lambda info: seen.append(info.raw_cell))\n')
ECHO = ('# Exercise 3: the mean\nimport os\n'
        'raise RuntimeError(os.getcwd() + " ran: " + " | ".join(seen))\n')


@pytest.mark.notebook
def test_a_class_with_hidden_checks_and_submissions_that_abuse_resources(tmp_path, monkeypatch):
    """A memory hog, an output flood, processes left running and an echo of the cells run
    each fail their own exercise with a reason; everyone else, and the other exercises of the
    same notebook, grade normally; nothing a student receives holds a hidden check or a path
    of the grader's."""
    monkeypatch.setattr(grading, "LINGER_GRACE_S", 1.0)
    course = _course_with_hidden_checks(tmp_path / "course")
    base = release_notebook(read(course / TINY_NAME), TINY_NAME)
    pids = tmp_path / "finn.pids"
    subs = tmp_path / "submissions"
    _write_class(subs, {
        "alice": solved(base),
        "hank": solved(base, exercise_1=SOLUTIONS["exercise-1"] + (
                            "import os\nprint('GPUS', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n"),
                        exercise_2="# Exercise 2\nimport math\ndef hypotenuse(a, b):\n"
                                   "    return 5 if (a, b) == (3, 4) else math.sqrt(a * a + b * b) "
                                   "if a == b else 0\n",
                        exercise_3="# Exercise 3\ndef mean(xs):\n    return sorted(xs)[len(xs) // 2]\n"),
        "mona": solved(base, exercise_1=_hog(1.5), exercise_2=RECORD, exercise_3=ECHO),
        "finn": solved(base, exercise_1=FLOOD, exercise_2=LINGER.replace("PIDS", repr(str(pids)))),
    })
    with pytest.raises(ValueError, match="looks like a class"):  # the slip of item 1
        grading.collect_submissions([subs])
    out = tmp_path / "grades"
    t0 = time.monotonic()
    grading.grade(sorted(subs.iterdir()), out, course_root=course, timeout_s=30, jobs=2,
                  progress=False, memory_limit_gib=1, hide_gpus=True)
    assert time.monotonic() - t0 < 120
    rows = gradebook(out)
    full = {"exercise-1": True, "exercise-2": True, "exercise-3": True}
    # the hidden checks are back when grading: a correct answer passes them...
    assert _passed(rows, "alice") == full
    # ...and an answer fitted to the visible checks fails them, without their source
    hank = by_student(rows, "hank")
    assert _passed(rows, "hank") == {"exercise-1": True, "exercise-2": False, "exercise-3": False}
    assert hank["exercise-2"]["reason"] == "check: a hidden check failed"
    assert hank["exercise-3"]["reason"] == \
        "check: a hidden check failed: the mean of two values is their midpoint"
    # the memory hog fails its exercise with the limit named; the kernel goes on
    mona = by_student(rows, "mona")
    assert _passed(rows, "mona") == {"exercise-1": False, "exercise-2": True, "exercise-3": False}
    assert mona["exercise-1"]["reason"] == \
        "exercise cell: used more than the 1 GiB memory limit (MemoryError)"
    # an exercise that echoes the cells run before it (recorded by an IPython hook) gets no
    # hidden line and no path out
    assert mona["exercise-3"]["reason"].startswith("exercise cell: RuntimeError: <course>/01-tiny ran: ")
    assert "[hidden]" in mona["exercise-3"]["reason"]
    assert "review by hand: the exercise cell uses the IPython shell" in mona["exercise-2"]["reason"]
    # the flood fails its exercise; the grader's files stay small
    finn = by_student(rows, "finn")
    assert _passed(rows, "finn") == {"exercise-1": False, "exercise-2": False, "exercise-3": True}
    assert re.fullmatch(r"exercise cell: printed [\d,]{9,} characters of output, more than the "
                        r"1,000,000 a cell may print \(the executed copy keeps its first and last "
                        r"lines\)", by_student(rows, "finn")["exercise-1"]["reason"])
    executed = out / "executed" / "finn" / TINY_NAME
    assert executed.stat().st_size < 400_000
    assert "[... the grader cut " in executed.read_text()
    assert (out / "logs" / "finn" / "01-tiny" / "01_double.log").stat().st_size < 1_100_000
    # processes left running are killed, a daemon in a session of its own too, and fail the
    # exercise that started them
    assert re.match(r"exercise cell: left a process running after the notebook ended "
                    r"\(`python\S* -c import time; time.sleep\(600\)` and 1 more\); the "
                    r"grader killed it; review by hand", finn["exercise-2"]["reason"])
    import psutil

    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    assert not [p for p in left if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    # the kernels saw no GPU (--hide-gpus)
    hank_nb = read(out / "executed" / "hank" / TINY_NAME)
    assert "GPUS ''" in "".join(o.get("text", "") for c in hank_nb.cells if c.cell_type == "code"
                                for o in c.outputs)
    # what students receive: the reports and the released notebooks hold no hidden source and
    # no path of the grader's machine
    release(None, tmp_path / "released", course_root=course)
    sent = [p.read_text() for p in (out / "reports").glob("*.md")]
    sent += [p.read_text() for p in (tmp_path / "released").rglob("*.ipynb")]
    assert len(sent) == 5
    for text in sent:
        assert not any(secret in text for secret in SECRETS)
        assert str(tmp_path) not in text and "course-grade-" not in text
    report = (out / "reports" / "hank.md").read_text()
    assert "- **Exercise 2: the hypotenuse of a right triangle** (`exercise-2`): check: a hidden " \
           "check failed" in report and "Submitted file: `01_double.ipynb`" in report


# --- grading a course notebook for real -----------------------------------------------------

def _course_submissions(nb_path, folder):
    """The instructor's copy, the released copy, and a wrong answer behind a tampered check."""
    name = nb_path.relative_to(REPO).as_posix()
    stud = release_notebook(read(nb_path), name)
    for who in ("instructor", "released"):
        (folder / who).mkdir(parents=True)
    (folder / "instructor" / nb_path.name).write_bytes(nb_path.read_bytes())
    nbformat.write(stud, folder / "released" / nb_path.name)
    return name, stud


def _check_instructor_and_released(rows, name, exercises):
    ids = [e.id for e in exercises]
    inst = by_student(rows, "instructor")
    assert {k: r["passed"] for k, r in inst.items()} == {i: "true" for i in ids}, inst
    rel = by_student(rows, "released")
    # zero, failing exactly at its exercises: no row for a failure anywhere else (a stub can
    # also fail further away, in a worker process a check launches, so any reason will do)
    assert set(rel) == set(ids), rel
    assert all(r["passed"] == "false" for r in rel.values()), rel


@pytest.mark.notebook
def test_a_course_notebook_graded_for_real(tmp_path):
    folder = tmp_path / "subs"
    name, stud = _course_submissions(REPRESENTATIVE, folder)
    exercises = find_exercises(read(REPRESENTATIVE))
    first = exercises[0]
    wrong = copy.deepcopy(release_notebook(read(REPRESENTATIVE), name))
    inst = read(REPRESENTATIVE)
    for ex in exercises:  # every exercise solved...
        wrong.cells[ex.cell_index].source = inst.cells[ex.cell_index].source
    # ...but the first one wrongly (every predicted dtype fp32), behind a check made harmless
    wrong.cells[first.cell_index].source = re.sub(r"torch\.bfloat16", "torch.float32",
                                                  inst.cells[first.cell_index].source)
    wrong.cells[first.check_index].source = "pass  # checked by hand, promise"
    (folder / "wrong").mkdir()
    nbformat.write(wrong, folder / "wrong" / REPRESENTATIVE.name)

    out = tmp_path / "grades"
    grading.grade(sorted(folder.iterdir()), out, jobs=2, timeout_s=300, progress=False)
    rows = gradebook(out)
    _check_instructor_and_released(rows, name, exercises)
    assert all(r["reason"].startswith("not done: the exercise still raises the released stub")
               for r in by_student(rows, "released").values())
    got = {k: r["passed"] for k, r in by_student(rows, "wrong").items()}
    assert got == {e.id: ("false" if e is first else "true") for e in exercises}
    assert by_student(rows, "wrong")[first.id]["reason"].startswith(
        "check: AssertionError: (your prediction, actual) for the ones you missed")


@pytest.mark.grading
@pytest.mark.notebook
@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=IDS)
def test_every_course_notebook_grades_full_and_zero(nb_path, tmp_path, request):
    if "grading" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in (executes every course notebook twice): pytest -m grading")
    folder = tmp_path / "subs"
    name, _ = _course_submissions(nb_path, folder)
    out = tmp_path / "grades"
    grading.grade(sorted(folder.iterdir()), out, jobs=2, progress=False)
    _check_instructor_and_released(gradebook(out), name, find_exercises(read(nb_path)))


# --- the instructor's review: broken setup, bad files, the gradebook, release metadata -------

def _broken_setup_course(folder):
    """The fixture course, copied, with a setup cell (before any exercise) that cannot run."""
    shutil.copytree(COURSE, folder)
    path = folder / TINY_NAME
    nb = read(path)
    nb.cells[1].source = "import not_installed_pkg_for_the_grading_test\n" + nb.cells[1].source
    nbformat.write(nb, path)
    return folder


@pytest.mark.notebook
def test_a_failed_instructor_cell_leaves_the_exercises_after_it_not_graded(tmp_path, capsys):
    """A setup cell that fails (a broken grading environment) is no student's fault: the
    exercises it broke are "not graded", in every output, and the command exits 3."""
    from utils.__main__ import main

    course = _broken_setup_course(tmp_path / "course")
    subs = tmp_path / "submissions"
    _write_class(subs, {"alice": solved(released()), "bob": released()})
    out = tmp_path / "grades"
    code = main(["grade", *map(str, sorted(subs.iterdir())), "--course", str(course),
                 "--out", str(out), "--jobs", "2", "--timeout", "30"])
    captured = capsys.readouterr()
    assert code == 3, captured.out + captured.err
    rows = gradebook(out)
    alice, bob = by_student(rows, "alice"), by_student(rows, "bob")
    said = ("not graded: the instructor's cell 2 of 11 (`import not_installed_pkg_for_the_grading_test`) "
            "failed before this exercise: ModuleNotFoundError: No module named "
            "'not_installed_pkg_for_the_grading_test'")
    # checks 1 and 2 need the setup's names: not graded, neither passed nor failed, no points
    for ex in ("exercise-1", "exercise-2"):
        assert (alice[ex]["passed"], alice[ex]["points"], alice[ex]["reason"]) == ("", "", said)
    # check 3 does not: a pass stays a pass
    assert (alice["exercise-3"]["passed"], alice["exercise-3"]["points"]) == ("true", "1")
    # the file's own row says what happened, and counts against nobody either
    assert alice[""]["passed"] == "" and alice[""]["reason"].startswith(
        "the instructor's cell 2 of 11 (`import not_installed_pkg_for_the_grading_test`) failed")
    # the released stub is not done, broken setup or not
    assert all(bob[e]["passed"] == "false" and bob[e]["reason"].startswith("not done")
               for e in ("exercise-1", "exercise-2", "exercise-3"))
    # the console: a warning per file, and the totals leave out what was not graded
    assert "WARNING alice: 01-tiny/01_double.ipynb: 2 exercise(s) not graded: the instructor's " \
           "cell 2 of 11" in captured.out
    assert "1 of 4 exercises passed; 2 not graded" in captured.out
    assert captured.err.startswith("WARNING: 2 exercise(s) in 1 file(s) could not be graded")
    # the summary and the report: 1 of 1 points for alice, the two exercises not graded
    summary = (out / "summary.md").read_text()
    assert "| alice | 01-tiny/01_double.ipynb | 1 | 1 |  | exercise-1, exercise-2 |" in summary
    report = (out / "reports" / "alice.md").read_text()
    assert "**1 of 1 points**" in report and "2 exercise(s) could not be graded" in report
    assert "| Exercise 1: return twice the input | not graded | - | not graded: " in report
    assert "Failed:" not in report and "Not graded:" in report
    assert str(tmp_path) not in report


def _scored(records, between=True):
    """_score on the fixture notebook with an instructor cell between exercises 1 and 2.

    ``records``: code cell ordinal -> (status, message); any other code cell passed. The code
    cells are 0 setup, 1 exercise 1, 2 check 1, 3 the instructor's cell, 4 exercise 2, 5 check
    2, 6 exercise 3, 7 check 3, 8 the last cell.
    """
    nb = read(TINY)
    nb.cells.insert(5, nbformat.v4.new_code_cell("# the instructor's demo\nprint(double(2))"))
    exercises = find_exercises(nb)
    sub = grading.Submission("sam", TINY, "sam/01_double.ipynb")
    prep = grading._Prepared(sub, TINY_NAME, exercises, nb)
    cells = {n: {"cell": n, "status": "passed", "message": ""} for n in range(9)}
    for n, (status, message) in records.items():
        cells[n] = {"cell": n, "status": status, "message": message}
    run = grading._RunResult(cells, 1.0, False, 1, "", False)
    rows, _ = grading._score(prep, run, 60)
    return {r.exercise: r for r in rows}


def test_an_instructor_cell_the_students_code_may_have_broken_leaves_the_grades_alone():
    """Exercises after a failed instructor cell are "not graded" only when no failed answer
    of the student's ran before it (which could have broken it)."""
    failed = ("failed", "NameError: name 'x' is not defined")
    # every exercise before the instructor's cell passed: the exercises after it are not graded
    rows = _scored({3: failed, 4: failed})
    assert rows["exercise-1"].passed and rows["exercise-1"].graded
    assert not rows["exercise-2"].graded and rows["exercise-2"].reason.startswith(
        "not graded: the instructor's cell 6 of 12 (`# the instructor's demo`) failed")
    assert rows["exercise-3"].passed
    # exercise 1 failed before it: the failure may be the student's doing, so it is graded
    rows = _scored({1: failed, 3: failed, 4: failed})
    assert [rows[e].graded for e in ("exercise-1", "exercise-2", "exercise-3", "")] == [True] * 4
    assert rows["exercise-2"].reason == "exercise cell: NameError: name 'x' is not defined"
    assert rows[""].reason.endswith("exercises after it may have failed because of it")
    # the released stub and an empty cell are the student's, whatever failed before them
    rows = _scored({0: failed, 2: failed, 4: ("failed", grading.STUB_MESSAGE + ": Exercise 2")})
    assert not rows["exercise-1"].graded and rows["exercise-2"].graded
    assert rows["exercise-2"].reason.startswith("not done")


def test_an_invalid_file_named_like_a_course_notebook_scores_zero_under_it(tmp_path):
    """An invalid notebook named like a course notebook counts 0 of N under it, like a valid
    one, not 0 of 0 under its own path; a valid copy of the same student's is preferred."""
    (tmp_path / "eve").mkdir()
    (tmp_path / "eve" / "01_double.ipynb").write_text("{not json")
    grades = grading.grade([tmp_path / "eve"], tmp_path / "grades", course_root=COURSE,
                           progress=False)
    [g] = grades
    assert (g.notebook, g.points, g.max_points) == (TINY_NAME, 0, 3)
    rows = by_student(gradebook(tmp_path / "grades"), "eve")
    assert set(rows) == {"exercise-1", "exercise-2", "exercise-3"}
    assert all(r["notebook"] == TINY_NAME and r["passed"] == "false"
               and r["reason"].startswith("not a valid notebook (NotJSONError") for r in rows.values())
    assert f"| eve | {TINY_NAME} | 0 | 3 | exercise-1, exercise-2, exercise-3 |" in \
        (tmp_path / "grades" / "summary.md").read_text()


def test_a_second_copy_of_a_notebook_is_set_aside_not_failed(tmp_path, monkeypatch):
    """One file per student and notebook is graded; the others are "not graded" file rows,
    with no line of their own in the summary."""
    def fake_run(graded, name, *args, **kwargs):
        cells = {n: {"cell": n, "status": "passed", "message": ""} for n in range(8)}
        return grading._RunResult(cells, 0.1, False, 0, "", False)

    monkeypatch.setattr(grading, "_run_nbval", fake_run)
    eve = tmp_path / "eve"
    (eve / "old").mkdir(parents=True)
    nbformat.write(solved(released()), eve / "01_double.ipynb")
    nbformat.write(solved(released()), eve / "01_double (1).ipynb")
    (eve / "old" / "01_double.ipynb").write_text("{not json")  # an invalid copy too
    grades = grading.grade([eve], tmp_path / "grades", course_root=COURSE, progress=False)
    assert sorted((g.submission.split("eve/")[1], g.points, g.max_points) for g in grades) == [
        ("01_double (1).ipynb", 0, 0), ("01_double.ipynb", 3, 3), ("old/01_double.ipynb", 0, 0)]
    rows = [r for r in gradebook(tmp_path / "grades") if not r["exercise"]]
    assert len(rows) == 2 and all(r["passed"] == r["points"] == "" and r["reason"].startswith(
        "not graded: another file of this student for 01-tiny/01_double.ipynb was graded")
        for r in rows)
    summary = (tmp_path / "grades" / "summary.md").read_text()
    assert summary.count("| eve |") == 1 and f"| eve | {TINY_NAME} | 3 | 3 |" in summary


def test_the_gradebook_reason_is_one_line():
    """A multi-line reason (a torch.testing message) is one line in the CSV, cut to 300
    characters, keeping the grader's notes at its end; the report keeps it whole."""
    message = ("check: AssertionError: Tensor-likes are not close!\n\nMismatched elements: 3 / 4 "
               "(75.0%)\nGreatest absolute difference: 0.5 at index (1,)\n" + "x" * 400)
    note = "review by hand: the exercise cell uses subprocesses or sockets"
    row = grading.GradeRow("carol", TINY_NAME, "exercise-1", False, 0.0, f"{message}; {note}")
    reason = row.as_csv()[-1]
    assert "\n" not in reason and len(reason) <= 300
    assert reason.startswith("check: AssertionError: Tensor-likes are not close! / Mismatched "
                             "elements: 3 / 4 (75.0%) / Greatest absolute difference")
    assert reason.endswith("xxx...; " + note)
    short = grading.GradeRow("carol", TINY_NAME, "exercise-1", False, 0.0, "one\ntwo")
    assert short.as_csv()[-1] == "one / two"
    grade = grading.NotebookGrade("carol", "carol/01_double.ipynb", TINY_NAME, (row,),
                                  (("exercise-1", "Exercise 1"),))
    assert "x" * 400 in grading.student_report("carol", [grade])


def test_student_help_names_the_command_typed(capsys):
    from utils.__main__ import build_parser

    for command in ("release", "student"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert capsys.readouterr().out.startswith(f"usage: python -m utils {command} ")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["grade", "--help"])
    assert "3: " in capsys.readouterr().out  # the exit codes are documented


def test_release_keeps_only_the_metadata_a_student_notebook_needs():
    """Widget state, stray cell metadata and unused attachments stay with the instructor."""
    nb = read(TINY)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"SECRET_WIDGET": 1}}
    nb.metadata["papermill"] = {"parameters": {}}
    nb.cells[3].metadata.update({"note": "SECRET_CELLMETA", "tags": ["parameters"],
                                 "ExecuteTime": {"end_time": "now"}})
    picture = {"image/png": "iVBORw0KGgo="}
    nb.cells[0].attachments = {"secret.png": picture}
    nb.cells[9].source += "\n\n![plot](attachment:plot.png)"
    nb.cells[9].attachments = {"plot.png": picture, "solution.png": picture}
    stud = release_notebook(nb, TINY_NAME)
    assert "SECRET_" not in json.dumps(stud)
    assert set(stud.metadata) == {"kernelspec", "language_info", "course"}
    assert stud.cells[3].metadata == {"tags": ["parameters"],
                                      "course": {"id": "exercise-1", "role": "exercise"}}
    assert "attachments" not in stud.cells[0]
    assert stud.cells[9].attachments == {"plot.png": picture}  # the one the text shows
    nbformat.validate(stud)


def test_probing_the_installed_package_is_flagged_for_review():
    frank = ('# Exercise 1: return twice the input\nimport importlib.metadata, json\n'
             'url = json.loads(importlib.metadata.distribution("pytorch-optimization-track")'
             '.read_text("direct_url.json"))["url"]\n'
             'src = open(url[7:] + "/01-tiny/01_double." + "ipy" + "nb").read()\nexec(src)\n')
    notes = grading._review_notes(frank)
    assert any("installed packages" in n for n in notes), notes
    assert any("exec" in n for n in notes), notes
    for probe in ("import site\nsite.getsitepackages()", "p = '/usr/lib/python3/site-packages'",
                  "from importlib_metadata import files", "import __editable___x_finder",
                  "sys.meta_path"):
        assert grading._review_notes(probe), probe
    # honest exercise code is not flagged
    for honest in ("model.eval()\nfuse_conv_bn_eval(conv, bn)", "torch.save(m.state_dict(), 'm.pth')",
                   "import importlib.util\nspec = importlib.util.find_spec('triton')"):
        assert not grading._review_notes(honest), honest
