"""Execute every course notebook: smoke size here, full size on a GPU node.

CI (no GPU) runs each notebook through papermill at smoke size and one through
nbval in lax mode, the way an instructor grades; a hardware-independent claim
(``in_smoke=True``) that misses fails the smoke run. On a GPU (``pytest -m gpu``)
every notebook runs at full size through both, and any applicable expectation
that misses fails the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, course_notebooks
from utils.course.runner import run_notebooks

NOTEBOOKS = course_notebooks()
IDS = [str(p.relative_to(REPO)) for p in NOTEBOOKS]
# The notebook CI also runs through nbval (lax), the path instructors use.
NBVAL_ON_CPU = REPO / "00-foundations" / "01_measuring_performance.ipynb"

# Per-cell limits: one stuck cell fails its test in minutes, with the cell named,
# instead of running into pytest's limit for the whole test. The slowest smoke
# cells (a cold torch.compile on a loaded 2-core machine) take well under a minute.
SMOKE_CELL_TIMEOUT_S = 300
FULL_CELL_TIMEOUT_S = 900
# pytest's own limit for one full-size test must outlast the slowest notebook's cells,
# and the nbval subprocess's limit, so that the notebook's own message is what fails.
NBVAL_FULL_TIMEOUT_S = 3600


def _execute(nb, tmp_path, smoke, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "0" if smoke else "1")
    out = tmp_path / "out"
    [run] = run_notebooks([nb], out_dir=out, smoke=smoke, progress=False,
                          timeout_s=SMOKE_CELL_TIMEOUT_S if smoke else FULL_CELL_TIMEOUT_S)
    assert run.status == "ok", f"{run.notebook}: {run.summary}\nexecuted copy: {run.executed}"
    ledger_file = out / "results" / f"{nb.parent.name}__{nb.stem}.json"
    ledger = json.loads(ledger_file.read_text())
    assert ledger["smoke"] is smoke and ledger["measurements"], "the notebook recorded results"
    # A claim that applies here and missed fails the run at either size. At smoke size
    # only the hardware-independent claims (in_smoke=True) apply: equal gradients, bytes
    # within a formula, compile counts, memory ratios.
    missed = [f"{e['name']}: {e['value']} (expected {e['op']} {e['threshold']})"
              for e in ledger["expectations"] if e["status"] == "not met"]
    assert not missed, f"{run.notebook} missed: " + "; ".join(missed)
    return ledger


def _nbval(nb, tmp_path, smoke):
    env = {**os.environ, "COURSE_SMOKE": "1" if smoke else "0",
           "COURSE_RESULTS_DIR": str(tmp_path / "nbval-results"),
           "COURSE_STRICT": "0" if smoke else "1"}
    cell_s = SMOKE_CELL_TIMEOUT_S if smoke else FULL_CELL_TIMEOUT_S
    r = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", str(nb), "-q",
                        f"--nbval-cell-timeout={cell_s}", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "-o", "addopts=", "-o", "timeout=0"],
                       cwd=nb.parent, env=env, capture_output=True, text=True,
                       timeout=NBVAL_FULL_TIMEOUT_S - 60)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


@pytest.mark.notebook
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_smoke(nb, tmp_path, monkeypatch):
    _execute(nb, tmp_path, smoke=True, monkeypatch=monkeypatch)


@pytest.mark.notebook
def test_nbval_lax_smoke(tmp_path):
    _nbval(NBVAL_ON_CPU, tmp_path, smoke=True)


@pytest.mark.gpu
@pytest.mark.notebook
@pytest.mark.timeout(NBVAL_FULL_TIMEOUT_S)
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_full_size_on_gpu(nb, tmp_path, monkeypatch):
    _execute(nb, tmp_path, smoke=False, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.notebook
@pytest.mark.timeout(NBVAL_FULL_TIMEOUT_S)
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=IDS)
def test_nbval_lax_full_size_on_gpu(nb, tmp_path):
    _nbval(nb, tmp_path, smoke=False)
