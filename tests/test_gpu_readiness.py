"""The kinds of failure the first GPU run showed, caught in the course's source on a CPU.

Each test reads every notebook's code cells and every module script for one kind of code that
works on a 2-core CPU and breaks on a GPU node: an index-less CUDA device, a tolerance typed
in by hand (fp32's under TF32, or one so loose that a 10% error passes), a size computed from
the core count. The utils functions that replace each are tested in test_devices.py,
test_precision.py and test_sizes.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, course_notebooks


def _module_scripts() -> list[Path]:
    return sorted(p for p in REPO.glob("[0-9][0-9]-*/**/*.py"))


def _code_lines():
    """(where, line) for every line of course code outside utils/."""
    for nb in course_notebooks():
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            for n, line in enumerate("".join(cell["source"]).splitlines(), 1):
                yield f"{nb.relative_to(REPO)} cell {i} line {n}", line
    for script in _module_scripts():
        for n, line in enumerate(script.read_text(encoding="utf-8").splitlines(), 1):
            yield f"{script.relative_to(REPO)}:{n}", line


def _code(line: str) -> str:
    """The line without its comment and string contents that only describe (docstrings aside)."""
    return line.split("#", 1)[0]


INDEXLESS = re.compile(r"""torch\.device\(\s*["']cuda["']\s*(\)|if)""")


def test_no_index_less_cuda_device():
    """torch.device("cuda") has no index, and CUDA APIs such as
    get_per_process_memory_fraction refuse it: use utils.pick_device() (cuda:<current>)."""
    bad = [f"{where}: {line.strip()}" for where, line in _code_lines() if INDEXLESS.search(_code(line))]
    for path in sorted((REPO / "utils").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if INDEXLESS.search(_code(line)):
                bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bad, "index-less CUDA devices:\n" + "\n".join(bad)


# a tolerance keyword given a bare number (a derivation such as atol=10 * eps is not one)
TOL_LITERAL = re.compile(r"\b(rtol|atol)\s*=\s*(\d[\d.]*(?:e-?\d+)?)(?=\s*[,)}\]]|\s*$)")


def _nonzero_literal(match: re.Match) -> bool:
    return float(match.group(2)) != 0.0


def test_tolerances_come_from_utils_tolerance():
    """A comparison's tolerance comes from utils.tolerance (dtype, device, TF32 state, scale):
    an fp32 tolerance typed in fails under TF32 on a GPU (01/03), and a loose one typed in
    passes a 10% error on small values (module 01's atol=1e-2). Exact checks (0) stay."""
    bad = [f"{where}: {line.strip()}" for where, line in _code_lines()
           if any(_nonzero_literal(m) for m in TOL_LITERAL.finditer(_code(line)))]
    assert not bad, ("tolerances typed in by hand (use utils.tolerance(dtype, device, "
                     "scale=expected)):\n" + "\n".join(bad))


CORE_ARITHMETIC = re.compile(r"(cpu_count\s*(//|-|\*|/|\+)|//\s*\w*(NPROC|nproc)\b|"
                             r"os\.cpu_count\(|sched_getaffinity)", re.IGNORECASE)


# A line that reads the core count for something other than a size (the machine-wide load
# average is compared with the machine's CPUs) says so with this comment.
NOT_A_SIZE = "# machine-wide, as the load average is: not a size"


def test_sizes_are_not_computed_from_the_core_count():
    """Workers, threads, ranks and dataset lengths that hold from 1 to 128 cores come from
    utils.sizes; arithmetic on the core count in a notebook gave 00/03 a dataset sized for 2
    workers on a 16-core node, and 05/01's ranks 8 threads each on a shared one."""
    bad = [f"{where}: {line.strip()}" for where, line in _code_lines()
           if CORE_ARITHMETIC.search(_code(line)) and NOT_A_SIZE not in line]
    assert not bad, "sizes computed from the core count (use utils.sizes):\n" + "\n".join(bad)


def test_comm_debug_mode_is_not_used():
    """CommDebugMode's module tracker crashes under FSDP2's hooks on torch 2.11: the course
    counts collectives with utils.collectives.CollectiveCounter."""
    bad = [f"{where}: {line.strip()}" for where, line in _code_lines()
           if "CommDebugMode(" in _code(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pattern, fixed", [
    ('DEVICE = torch.device("cuda")', False),
    ('x.to(torch.device("cuda" if USE else "cpu"))', False),
    ('DEVICE = utils.pick_device()', True),
    ("TOL = dict(rtol=1e-4, atol=1e-4)", False),
    ("return dict(atol=10 * (eps_in / 2) * math.sqrt(k), rtol=eps_out / 2)", True),
    ("torch.testing.assert_close(a, b, rtol=0, atol=0)", True),
    ("workers = max(1, ENV.cpu_count - 1)", False),
    ("THREADS = max(1, ENV.cpu_count // NPROC)", False),
    ("WORKERS = utils.sizes.loader_workers(ENV.cpu_count, smoke=SMOKE)", True),
    ("MODEL_THREADS = max(1, CPU_COUNT - NW)", False),
])
def test_the_patterns_catch_what_they_are_for(pattern, fixed):
    line = _code(pattern)
    caught = bool(INDEXLESS.search(line)) or any(_nonzero_literal(m) for m in TOL_LITERAL.finditer(line)) \
        or bool(CORE_ARITHMETIC.search(line))
    assert caught is not fixed
