"""Notebooks that rebuild another notebook's objects at the same sizes keep their size tables in
step: a split notebook that re-creates what its first half measured (00/05 times the ops of
00/02, section 3, again) must not drift from it when one table is edited."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

# (notebook, notebook, {row in the first: row in the second}); every tier must agree.
SHARED = [
    ("00-foundations/02_bottlenecks.ipynb", "00-foundations/05_rooflines_and_mfu.ipynb",
     {r: r for r in ("run_s", "mm_big", "mm_small", "w_dim", "rows_cols", "ln_shape",
                     "conv_batch")}),
]


def size_rows(nb: nbformat.NotebookNode) -> dict[str, object]:
    """The values of a notebook's ``utils.size_table({...})`` rows that are plain arithmetic
    on literals (rows that call something, such as a config, are left out)."""
    for cell in nb.cells:
        if cell.cell_type != "code" or "size_table(" not in cell.source:
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "size_table"
                    and node.args and isinstance(node.args[0], ast.Dict)):
                table = node.args[0]
                return {ast.literal_eval(k): eval(compile(ast.Expression(v), "<size>", "eval"),
                                                  {"__builtins__": {}})
                        for k, v in zip(table.keys, table.values)
                        if not any(isinstance(n, ast.Call) for n in ast.walk(v))}
    raise AssertionError("the notebook has no utils.size_table({...}) literal")


def read(relpath: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / relpath, as_version=4)


def differing(first: dict, second: dict, rows: dict[str, str]) -> list[str]:
    """The rows whose values differ between the two tables (a missing row differs)."""
    return [a for a, b in rows.items() if a not in first or b not in second
            or first[a] != second[b]]


@pytest.mark.parametrize(("first", "second", "rows"), SHARED,
                         ids=[a.split("/")[-1][:2] + "-" + b.split("/")[-1][:2]
                              for a, b, _ in SHARED])
def test_shared_rows_are_equal_in_every_tier(first, second, rows):
    bad = differing(size_rows(read(first)), size_rows(read(second)), rows)
    assert not bad, f"{first} and {second} differ in {bad}: the second rebuilds the first's objects"


def test_the_add_is_the_largest_of_the_overhead_sweep():
    # 00/05 times the add of 00/02's sweep at its largest size, 4**sweep_top elements.
    top = size_rows(read("00-foundations/02_bottlenecks.ipynb"))["sweep_top"]
    add_n = size_rows(read("00-foundations/05_rooflines_and_mfu.ipynb"))["add_n"]
    assert [4 ** k for k in top] == list(add_n)


def test_a_changed_row_is_caught():
    first, second, rows = SHARED[0]
    nb = read(second)
    for cell in nb.cells:
        if cell.cell_type == "code" and "size_table(" in cell.source:
            assert '"mm_big":      (1024,          1024,          4096)' in cell.source
            cell.source = cell.source.replace('"mm_big":      (1024,          1024,          4096)',
                                              '"mm_big":      (1024,          1024,          2048)')
    assert differing(size_rows(read(first)), size_rows(nb), rows) == ["mm_big"]
