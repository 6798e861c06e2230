"""Every course notebook keeps the contract in CONTRIBUTING.md."""

from __future__ import annotations

import json
import re
import statistics

import nbformat
import papermill
import pytest

from conftest import REPO, course_notebooks
from utils.course.student import strip_solutions

NOTEBOOKS = course_notebooks()
IDS = [str(p.relative_to(REPO)) for p in NOTEBOOKS]
MODULES = ["00-foundations", "01-torch-compile", "02-mixed-precision", "03-fused-operations",
           "04-memory-efficiency", "05-distributed", "06-capstone"]


def test_every_module_has_a_readme():
    for module in MODULES:
        assert (REPO / module / "README.md").is_file(), module


def test_foundations_has_at_least_three_notebooks():
    assert len([p for p in NOTEBOOKS if p.parent.name == "00-foundations"]) >= 3


def _md(nb, pattern):
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "markdown" and re.search(pattern, c.source, re.M)]


def _code(nb):
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]


@pytest.fixture(params=NOTEBOOKS, ids=IDS)
def nb_path(request):
    return request.param


def test_clean_and_python3(nb_path):
    # every cell has an id of its own, as nbformat 4.5 asks (nbformat.read would make up the
    # missing ones, differently on each read: the student release keeps them)
    raw = json.loads(nb_path.read_text())
    ids = [c.get("id") for c in raw["cells"]]
    assert None not in ids, f"cell {ids.index(None)} has no id"
    assert len(set(ids)) == len(ids), "cell ids repeat"
    nb = nbformat.read(nb_path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, "commit notebooks without outputs"


def test_contract(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    cells = nb.cells
    name = f"{nb_path.parent.name}/{nb_path.stem}"
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# "), "title first"
    assert len(cells[0].source.strip().splitlines()) >= 2, "a one-line promise under the title"

    objectives = _md(nb, r"^## Learning objectives")
    assert objectives, "a Learning objectives section"
    bullets = [ln for ln in cells[objectives[0]].source.splitlines()
               if re.match(r"\s*([-*]|\d+\.)\s", ln)]
    assert 3 <= len(bullets) <= 5, f"3-5 learning objectives, found {len(bullets)}"

    assert _md(nb, r"^## Setup"), "a Setup section"
    assert any("utils.print_env(" in cells[i].source for i in _code(nb)), "environment printout"

    params = [i for i in _code(nb) if "parameters" in cells[i].metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    assert re.search(r"^SMOKE\s*=\s*None", cells[params[0]].source, re.M)
    # papermill must understand the cell, or it warns and cannot list the parameter
    assert "SMOKE" in papermill.inspect_notebook(str(nb_path)), "papermill cannot parse SMOKE"
    after = [i for i in _code(nb) if i > params[0]][0]
    sizes = cells[after].source
    assert "utils.resolve_smoke(SMOKE)" in sizes, "sizes cell resolves the smoke switch"
    assert f'utils.Ledger("{name}"' in sizes, f"ledger named {name!r} in the sizes cell"

    assert _md(nb, r"^## 1\. ") and _md(nb, r"^## 2\. "), "numbered sections"

    exercises = _md(nb, r"^## Exercises")
    assert exercises, "an Exercises section"
    sol = [i for i in _code(nb) if i > exercises[0] and "### BEGIN SOLUTION" in cells[i].source]
    assert sol, "at least one exercise with a solution block"
    for i in sol:
        assert "### END SOLUTION" in cells[i].source
        assert re.search(r"#\s*Exercise \d+", cells[i].source), "name the exercise"
        check = [j for j in _code(nb) if j > i][0]
        assert "assert" in cells[check].source, "a check cell that asserts follows each exercise"
        stub = strip_solutions(cells[i].source)
        assert "NotImplementedError" in stub and "BEGIN SOLUTION" not in stub

    summary = _md(nb, r"^## Summary")
    assert summary and summary[0] > exercises[0], "a Summary after the exercises"
    assert "ledger.finish()" in cells[_code(nb)[-1]].source, "the last code cell saves the ledger"


def test_no_output_widgets(nb_path):
    """interactive()/interact() hold an Output widget, which headless runners imitate and
    which can make them wait for a cell's timeout (see utils/widgets.py): use utils.explorer."""
    nb = nbformat.read(nb_path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            found = re.findall(r"\binteract(?:ive)?\(|\binteract_manual\(|\bOutput\(", c.source)
            assert not found, f"{found[0]} in a cell: build explorers with utils.explorer"


def test_correctness_is_checked_before_timing(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    timed = [i for i, src in enumerate(code) if re.search(r"\bbenchmark\(", src)]
    if not timed:
        pytest.skip("this notebook times nothing with utils.benchmark")
    before = "\n".join(code[: timed[0] + 1])
    assert re.search(r"\bassert\b|assert_close", before), "check correctness before the first timing"


# ----------------------------------------------------------------------------- the size table

#: Global switches: they sit in a cell of their own, not in the size table's cell.
SWITCHES = re.compile(r"set_float32_matmul_precision|allow_tf32\s*=|utils\.set_tf32\(|"
                      r"set_num_threads\(|cudnn\.benchmark\s*=")


def _size_table_call(source: str):
    """The ``utils.size_table(...)`` call of a cell, parsed, or ``None``."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "size_table"):
            return node
    return None


def check_size_table(source: str) -> list[str]:
    """What is wrong with a sizes cell's table, read without running it: a literal table (a
    dict, a row per size), a value per tier in every row, smoke never larger than full among
    literal numbers (rows named in ``unordered=`` aside), no global switch in the same cell."""
    import ast

    call = _size_table_call(source)
    if call is None:
        return ["no utils.size_table(...) call in the sizes cell"]
    problems = []
    if not call.args or not isinstance(call.args[0], ast.Dict):
        return ["the size table is not a literal dict {'name': (smoke, cpu, gpu), ...}"]
    exempt = set()
    for kw in call.keywords:
        if kw.arg == "unordered":
            exempt = set(ast.literal_eval(kw.value))
    for key, value in zip(call.args[0].keys, call.args[0].values):
        name = ast.literal_eval(key) if key is not None else "**"
        if isinstance(value, ast.Tuple):
            if len(value.elts) != 3:
                problems.append(f"row {name!r} has {len(value.elts)} values, not 3 "
                                "(smoke, CPU full, GPU full)")
                continue
            try:
                nums = [ast.literal_eval(e) for e in value.elts]
            except ValueError:
                continue
            if (name not in exempt and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in nums)
                    and nums[0] > min(nums[1:])):
                problems.append(f"row {name!r}: smoke {nums[0]} is larger than a full size")
    if SWITCHES.search(source):
        problems.append("a global switch (TF32, threads, cudnn.benchmark) in the sizes cell: "
                        "give the switches a cell of their own")
    return problems


def test_the_size_table_check_fails_on_bad_tables():
    good = ('S = utils.size_table({"batch": (4, 16, 64), "lr": (1e-2, 1e-3, 1e-3), "seed": 0},'
            ' smoke=SMOKE, env=ENV, unordered=["lr"])')
    assert check_size_table(good) == []
    assert "not 3" in check_size_table(good.replace("(4, 16, 64)", "(4, 16)"))[0]
    assert "larger than a full size" in check_size_table(good.replace("(4, 16, 64)", "(32, 16, 64)"))[0]
    assert "larger" in check_size_table(good.replace('unordered=["lr"]', ""))[0]
    assert "not a literal dict" in check_size_table("S = utils.size_table(TABLE, smoke=SMOKE)")[0]
    assert "no utils.size_table" in check_size_table("BATCH = 4 if SMOKE else 64")[0]
    assert "switch" in check_size_table(good + "\ntorch.set_num_threads(1)")[0]


def test_sizes_come_from_one_size_table(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    name = f"{nb_path.parent.name}/{nb_path.stem}"
    params = [i for i in _code(nb) if "parameters" in nb.cells[i].metadata.get("tags", [])][0]
    sizes = nb.cells[[i for i in _code(nb) if i > params][0]].source
    problems = check_size_table(sizes)
    assert not problems, f"{name}: " + "; ".join(problems)
    assert "ledger=ledger" in sizes, "the table's tier goes into the ledger (ledger=ledger)"


#: A notebook's code stays within this many characters (CONTRIBUTING: "Code habits").
CODE_LIMIT = 30_000
#: ... and the median notebook's within this many: most notebooks are one focused lesson.
MEDIAN_CODE_LIMIT = 18_000
#: Notebooks still above the limit, each with what stands in the way (issue 26). A notebook
#: leaves this list when it fits; the test fails if one here fits already, or grows.
ABOVE_THE_LIMIT: dict[str, tuple[int, str]] = {}


def _code_characters(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    return sum(len(c.source) for c in nb.cells if c.cell_type == "code")


def test_a_notebooks_code_fits_the_limit(nb_path):
    name = f"{nb_path.parent.name}/{nb_path.stem}"
    size = _code_characters(nb_path)
    if name in ABOVE_THE_LIMIT:
        ceiling, why = ABOVE_THE_LIMIT[name]
        assert size > CODE_LIMIT, f"{name} fits {CODE_LIMIT:,} characters now: take it off the list"
        assert size <= ceiling, f"{name} grew to {size:,} characters of code ({why})"
    else:
        assert size <= CODE_LIMIT, (f"{name} has {size:,} characters of code, more than "
                                    f"{CODE_LIMIT:,}: move machinery to utils or split it")


def test_the_median_notebooks_code_fits_its_limit():
    sizes = {str(p.relative_to(REPO)): _code_characters(p) for p in NOTEBOOKS}
    median = statistics.median(sizes.values())
    above = sorted((n for n, s in sizes.items() if s > MEDIAN_CODE_LIMIT), key=sizes.get)
    assert median <= MEDIAN_CODE_LIMIT, (
        f"the median notebook has {median:,.0f} characters of code, more than "
        f"{MEDIAN_CODE_LIMIT:,}; the smallest of the {len(above)} notebooks above it: "
        + ", ".join(f"{n} ({sizes[n]:,})" for n in above[:5]))
