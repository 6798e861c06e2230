"""Make student versions of notebooks: solutions out, checks kept.

Instructor notebooks are the single source of truth. A solution sits between
``### BEGIN SOLUTION`` and ``### END SOLUTION``; the student version replaces
it with a ``NotImplementedError`` naming the exercise, and keeps the check cell
that follows, so a submission passes ``pytest --nbval-lax`` only when it works.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import nbformat

__all__ = ["strip_solutions", "make_student_versions"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*(\n|$)",
                     re.S | re.M)


def strip_solutions(source: str, exercise: str = "exercise") -> str:
    """Replace each solution region in a cell's source with a student stub.

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


def make_student_versions(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> list[Path]:
    """Write student versions of notebooks (files or module folders) to ``out_dir``."""
    from .runner import _relative_name, find_notebooks

    written = []
    for nb_path in find_notebooks(paths):
        nb = nbformat.read(nb_path, as_version=4)
        n = 0
        for cell in nb.cells:
            if cell.cell_type == "code" and BEGIN in cell.source:
                n += 1
                title = re.search(r"#\s*(Exercise[^\n]*)", cell.source)
                cell.source = strip_solutions(
                    cell.source, title.group(1).strip() if title else f"exercise {n}")
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        target = Path(out_dir) / _relative_name(nb_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
        written.append(target)
    return written
