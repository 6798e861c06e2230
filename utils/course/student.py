"""Release student versions of notebooks: solutions out, checks kept, cells tagged.

Instructor notebooks are the single source of truth. A solution sits between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` in an *exercise cell* (a code
cell with a ``# Exercise N: ...`` comment); the code cell after it is its
*check cell*, which asserts. The student version replaces each solution with
``raise NotImplementedError("Student exercise: ...")`` naming the exercise,
removes each *hidden check* (a block between ``### BEGIN HIDDEN TESTS`` and
``### END HIDDEN TESTS`` in a check cell, the markers nbgrader uses; a comment
says where it was), keeps every other cell as it is, clears the outputs, and
writes a stable id into the metadata of each exercise and check cell::

    {"course": {"id": "exercise-1", "role": "exercise"}}
    {"course": {"id": "exercise-1-check", "role": "check", "exercise": "exercise-1"}}

and into the notebook's metadata the instructor notebook it came from
(``{"course": {"notebook": "00-foundations/01_measuring_performance.ipynb", ...}}``).
:mod:`utils.course.grading` matches a submission to its instructor notebook, and its
exercise cells to the instructor's, with these ids. An id comes from the
exercise's number (``# Exercise 2`` -> ``exercise-2``), so it survives edits to
the solution, the prose and the cells around it; renumbering the exercises
during a term breaks the match of submissions released before.

Hidden checks are for the grader: :mod:`utils.course.grading` builds the notebook it
runs from the instructor's, so they are back in place when a submission is
graded, and reports a failed one without its source.

Releasing is deterministic: the same instructor notebooks give byte-identical
student files.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import nbformat

__all__ = [
    "BEGIN",
    "END",
    "HIDDEN_BEGIN",
    "HIDDEN_END",
    "METADATA_KEY",
    "Exercise",
    "course_notebooks",
    "find_exercises",
    "strip_solutions",
    "strip_hidden",
    "hidden_blocks",
    "release_notebook",
    "release",
    "make_student_versions",
]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
#: What a student version holds where a hidden check was.
HIDDEN_NOTE = "# (hidden checks run here when your notebook is graded)"
#: The metadata key (of cells and of the notebook) that holds the grading ids.
METADATA_KEY = "course"
#: Version of the metadata layout written by :func:`release_notebook`.
RELEASE_FORMAT = 1
#: The notebook metadata a student version keeps (with :data:`METADATA_KEY`): what Jupyter and
#: nbval need to start the kernel. Widget state, papermill's record and the rest stay behind.
NOTEBOOK_METADATA_KEPT = ("kernelspec", "language_info")
#: The cell metadata a student version keeps (with :data:`METADATA_KEY`): tags (the course's
#: ``parameters``, nbval's markers) and how Jupyter shows a cell and lets it be edited.
CELL_METADATA_KEPT = ("tags", "editable", "deletable", "jupyter")
_ATTACHMENT = re.compile(r"attachment:([^\s)\"'>]+)")
NOTEBOOK_GLOB = "[0-9][0-9]-*/[0-9][0-9]_*.ipynb"
_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*(\n|$)",
                     re.S | re.M)
_TITLE = re.compile(r"^[ \t]*#\s*(Exercise\b[^\n]*)", re.M)
_NUMBER = re.compile(r"Exercise\s+(\d+)")
# Files of a module folder that a student version (and a grading sandbox) leaves out.
_MODULE_DIR = re.compile(r"^\d\d-")
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}


@dataclass(frozen=True)
class Exercise:
    """One exercise of an instructor notebook.

    Attributes:
        id: stable id, ``exercise-N`` from the ``# Exercise N`` comment (the
            ordinal when the comment has no number; a repeated id gets ``-2``, ``-3``).
        title: the comment's text, ``"Exercise 1: a correct timer"``.
        cell_index: index of the exercise cell in ``nb.cells``.
        check_index: index of its check cell (the next code cell), or ``None``
            when the next code cell is another exercise or there is none.
    """

    id: str
    title: str
    cell_index: int
    check_index: int | None

    @property
    def check_id(self) -> str:
        return f"{self.id}-check"


def course_notebooks(root: str | os.PathLike) -> list[Path]:
    """The course notebooks under ``root``: ``NN-module/NN_name.ipynb``, in reading order."""
    return sorted(Path(root).glob(NOTEBOOK_GLOB))


def strip_solutions(source: str, exercise: str = "exercise") -> str:
    """Replace each solution region in a cell's source with a student stub.

    The stub keeps the indentation of the ``### BEGIN SOLUTION`` line, so a
    solution inside a function body becomes a ``raise`` in that body.

    Raises:
        ValueError: unbalanced BEGIN/END markers.
    """
    if source.count(BEGIN) != source.count(END):
        raise ValueError(f"unbalanced solution markers in {exercise}: "
                         f"{source.count(BEGIN)} BEGIN vs {source.count(END)} END")

    def stub(match: re.Match[str]) -> str:
        indent = match.group(1)
        return f'{indent}raise NotImplementedError("Student exercise: {exercise}")\n'

    return _REGION.sub(stub, source)


def hidden_blocks(source: str, where: str = "cell") -> list[tuple[int, int]]:
    """The hidden checks of a cell: ``(first, last)`` line numbers (1-based, markers included).

    A block starts at a line that begins (after indentation) with
    ``### BEGIN HIDDEN TESTS`` and ends at the next ``### END HIDDEN TESTS``.

    Raises:
        ValueError: a block that is not closed, an END without a BEGIN, or nested blocks.
    """
    blocks: list[tuple[int, int]] = []
    start = None
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        if text.startswith(HIDDEN_BEGIN):
            if start is not None:
                raise ValueError(f"{where}: line {number} opens a hidden block inside the one "
                                 f"opened at line {start}")
            start = number
        elif text.startswith(HIDDEN_END):
            if start is None:
                raise ValueError(f"{where}: line {number} closes a hidden block that was never "
                                 f"opened ({HIDDEN_END} without {HIDDEN_BEGIN})")
            blocks.append((start, number))
            start = None
    if start is not None:
        raise ValueError(f"{where}: the hidden block opened at line {start} is never closed "
                         f"({HIDDEN_BEGIN} without {HIDDEN_END})")
    return blocks


def strip_hidden(source: str, where: str = "cell") -> str:
    """A cell's source without its hidden checks, a comment standing where each one was.

    The comment keeps the indentation of the ``### BEGIN HIDDEN TESTS`` line; an
    indented block (inside a loop, say) becomes ``pass`` with the comment, so the
    body it sat in stays valid Python.

    Raises:
        ValueError: unbalanced or nested markers (see :func:`hidden_blocks`).
    """
    blocks = hidden_blocks(source, where)
    if not blocks:
        return source
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    k = 0
    for first, last in blocks:
        out += lines[k:first - 1]
        opening = lines[first - 1]
        indent = opening[:len(opening) - len(opening.lstrip())]
        ending = "\n" if lines[last - 1].endswith("\n") else ""
        out.append(f"{indent}pass  {HIDDEN_NOTE}{ending}" if indent else f"{HIDDEN_NOTE}{ending}")
        k = last
    out += lines[k:]
    return "".join(out)


def _is_exercise(cell: Any) -> bool:
    return cell.get("cell_type") == "code" and BEGIN in cell.get("source", "")


def find_exercises(nb: Any) -> list[Exercise]:
    """The exercises of an instructor notebook, in order, with their stable ids.

    Raises:
        ValueError: a cell with unbalanced solution markers.
    """
    code = [i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"]
    found: list[Exercise] = []
    seen: dict[str, int] = {}
    for ordinal, i in enumerate((i for i in code if _is_exercise(nb.cells[i])), start=1):
        src = nb.cells[i].source
        if src.count(BEGIN) != src.count(END):
            raise ValueError(f"cell {i + 1}: unbalanced solution markers "
                             f"({src.count(BEGIN)} BEGIN vs {src.count(END)} END)")
        title_match = _TITLE.search(src)
        title = title_match.group(1).strip() if title_match else f"Exercise {ordinal}"
        number = _NUMBER.match(title)
        base = f"exercise-{number.group(1) if number else ordinal}"
        seen[base] = seen.get(base, 0) + 1
        ex_id = base if seen[base] == 1 else f"{base}-{seen[base]}"
        nxt = next((j for j in code if j > i), None)
        check = nxt if nxt is not None and not _is_exercise(nb.cells[nxt]) else None
        found.append(Exercise(ex_id, title, i, check))
    return found


def _relative_to(path: Path, root: Path) -> Path | None:
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return None


def notebook_name(path: str | os.PathLike, course_root: str | os.PathLike | None = None) -> str:
    """The name a notebook is known by: its path relative to the course root.

    Outside the course root: relative to the repository, else ``folder/file``.
    """
    from ..ledger import REPO_ROOT

    p = Path(path)
    for root in ([Path(course_root)] if course_root is not None else []) + [REPO_ROOT]:
        rel = _relative_to(p, root)
        if rel is not None:
            return rel.as_posix()
    return f"{p.resolve().parent.name}/{p.name}"


def release_notebook(nb: Any, name: str) -> Any:
    """The student version of an instructor notebook (a new notebook; ``nb`` is unchanged).

    It keeps only the metadata a student notebook needs (:data:`NOTEBOOK_METADATA_KEPT`,
    :data:`CELL_METADATA_KEPT`), and of a cell's attachments only those its text shows
    (``attachment:NAME``): anything else the instructor's copy picked up (widget state, notes
    in cell metadata, pasted images) could hold a solution.

    Args:
        nb: the instructor notebook (nbformat v4).
        name: what the instructor notebook is called, written into the
            notebook's metadata (``course.notebook``) for the grader.
    """
    student = copy.deepcopy(nb)
    exercises = find_exercises(student)
    for k, cell in enumerate(student.cells):
        if not cell.get("id"):
            cell["id"] = f"cell-{k}"  # deterministic where nbformat would invent one
        for key in [key for key in cell.metadata if key not in CELL_METADATA_KEPT]:
            del cell.metadata[key]  # the grading ids (METADATA_KEY) are written again below
        if "attachments" in cell:
            shown = set(_ATTACHMENT.findall(cell.get("source", "")))
            kept = {n: a for n, a in cell.attachments.items() if n in shown}
            if kept:
                cell.attachments = kept
            else:
                del cell["attachments"]
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    exercise_cells = {ex.cell_index: ex for ex in exercises}
    for k, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        if k in exercise_cells:
            if hidden_blocks(cell.source, f"cell {k + 1}"):
                raise ValueError(f"cell {k + 1} ({exercise_cells[k].title}): hidden checks belong "
                                 "in the check cell after the exercise: the grader takes the "
                                 "exercise cell from the submission, so a hidden block there "
                                 "would never run")
            continue
        cell.source = strip_hidden(cell.source, f"cell {k + 1}")
    for ex in exercises:
        cell = student.cells[ex.cell_index]
        cell.source = strip_solutions(cell.source, ex.title)
        cell.metadata[METADATA_KEY] = {"id": ex.id, "role": "exercise"}
        if ex.check_index is not None:
            student.cells[ex.check_index].metadata[METADATA_KEY] = {
                "id": ex.check_id, "role": "check", "exercise": ex.id}
    for key in [key for key in student.metadata if key not in NOTEBOOK_METADATA_KEPT]:
        del student.metadata[key]
    student.metadata[METADATA_KEY] = {
        "notebook": name,
        "exercises": [ex.id for ex in exercises],
        "format": RELEASE_FORMAT,
    }
    return student


def _find(paths: Sequence[str | os.PathLike] | None, course_root: Path) -> list[Path]:
    from .runner import find_notebooks

    if not paths:
        found = course_notebooks(course_root)
        if not found:
            raise FileNotFoundError(f"{course_root} holds no course notebooks ({NOTEBOOK_GLOB})")
        return [p.resolve() for p in found]
    return find_notebooks(paths)


def copy_module_files(module: Path, target: Path) -> None:
    """Copy a module folder's files except notebooks (helper modules, scripts, README).

    Caches (``__pycache__``, checkpoints) and hidden files stay behind.
    """
    for src in sorted(module.rglob("*")):
        rel = src.relative_to(module)
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if src.is_file() and src.suffix != ".ipynb":
            dst = target / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)  # with its mode: a script may be run as ./script.sh


def release(paths: Sequence[str | os.PathLike] | None, out_dir: str | os.PathLike,
            course_root: str | os.PathLike | None = None, module_files: bool = True) -> list[Path]:
    """Write student versions of notebooks to ``out_dir``; returns the files written.

    Args:
        paths: notebooks and/or module folders; ``None`` or empty: every
            course notebook under ``course_root``.
        out_dir: where the student versions go, at their paths relative to
            the course root (``out_dir/00-foundations/01_...ipynb``).
        course_root: the folder holding the instructor modules (default: this
            repository).
        module_files: copy each released module's other files (helper
            modules, worker scripts, README) beside its notebooks.

    Raises:
        FileNotFoundError: a path does not exist, or nothing to release.
        ValueError: a path is not a notebook, or has unbalanced solution markers.
    """
    from ..ledger import REPO_ROOT

    root = Path(course_root) if course_root is not None else REPO_ROOT
    out = Path(out_dir)
    written: list[Path] = []
    modules: dict[Path, Path] = {}
    for nb_path in _find(paths, root):
        name = notebook_name(nb_path, root)
        nb = nbformat.read(nb_path, as_version=4)
        try:
            student = release_notebook(nb, name)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(student, target)
        written.append(target)
        modules.setdefault(nb_path.parent, target.parent)
    if module_files:
        for module, target in modules.items():
            if _MODULE_DIR.match(module.name):  # a course module, not any folder
                copy_module_files(module, target)
    return written


def make_student_versions(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> list[Path]:
    """Write student versions of notebooks (files or module folders) to ``out_dir``.

    The older name of :func:`release`, kept for scripts that call it.
    """
    return release(paths, out_dir)
