"""The command line, end to end: env, run (papermill), report and release (alias student)."""

import json
import os
import subprocess
import sys

import nbformat
import pytest

import utils
from conftest import FIXTURES, REPO

TINY = FIXTURES / "tiny_module"


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "utils", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


def test_env_command():
    r = cli("env")
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "compute capability" in r.stdout


def test_unknown_device_is_a_clear_error():
    r = cli("env", "--device", "warp-drive")
    assert r.returncode == 2
    assert "error: unknown device 'warp-drive'" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_notebook_is_a_clear_error(tmp_path):
    r = cli("run", "no/such/notebook.ipynb", "--out", str(tmp_path))
    assert r.returncode == 2
    assert "no such notebook or module folder: no/such/notebook.ipynb" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.notebook
def test_run_a_notebook_then_report(tmp_path):
    out = tmp_path / "run"
    r = cli("run", str(TINY / "01_tiny.ipynb"), "--smoke", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    executed = nbformat.read(out / "tests/fixtures/tiny_module/01_tiny.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "SMOKE is True" in text  # the --smoke flag reached the parameters cell
    ledger = json.loads((out / "results/fixtures__01_tiny.json").read_text())
    assert ledger["smoke"] is True and ledger["measurements"][0]["value"] == 42.0
    summary = json.loads((out / "run.json").read_text())
    assert [x["status"] for x in summary["runs"]] == ["ok"]

    rep = cli("report", str(out), "--out", str(tmp_path / "report.md"))
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "report.md").read_text()
    assert "fixtures/01_tiny" in md and "| answer | 42 | things |" in md
    assert (tmp_path / "fixtures__01_tiny.png").exists()  # the speedup plot


@pytest.mark.notebook
def test_a_failing_notebook_loses_nothing(tmp_path):
    out = tmp_path / "run"
    r = cli("run", str(TINY), "--out", str(out), "--no-progress")  # the whole folder
    assert r.returncode == 1
    assert "1 of 2 notebooks ran cleanly" in r.stdout
    summary = json.loads((out / "run.json").read_text())
    assert [x["status"] for x in summary["runs"]] == ["ok", "failed"]
    assert "deliberate failure" in summary["runs"][1]["error"]
    # the executed copy with the traceback, and what was measured before it, are kept
    failed = nbformat.read(out / "tests/fixtures/tiny_module/02_fails.ipynb", as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in failed.cells if c.cell_type == "code"
               for o in c.outputs)
    assert json.loads((out / "results/fixtures__02_fails.json").read_text())["measurements"]


@pytest.mark.notebook
def test_log_output_streams_cell_output_for_batch_logs(tmp_path):
    r = cli("run", str(TINY / "01_tiny.ipynb"), "--smoke", "--log-output", "--no-progress",
            "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "SMOKE is True" in r.stdout + r.stderr  # the cell's print reached the job log


def test_report_skips_files_that_are_not_ledgers(tmp_path, results_tmp):
    import utils

    utils.Ledger("m/01_x", smoke=True, env=utils.get_env("cpu")).save(tmp_path / "m__01_x.json")
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [{"ph": "X"}]}))
    (tmp_path / "other.json").write_text(json.dumps([1, 2, 3]))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "run.json").write_text(json.dumps({"runs": []}))  # the runner's own file
    r = cli("report", str(tmp_path), "--no-plots")
    assert r.returncode == 0, r.stderr
    assert "## m/01_x" in r.stdout
    skipped = r.stdout.split("## Files skipped", 1)[1]
    assert "trace.json`: not a ledger: a Chrome/profiler trace" in skipped
    assert "other.json`: not a ledger" in skipped and "broken.json`: not JSON" in skipped
    assert "run.json" not in skipped


def test_report_without_results_is_a_clear_error(tmp_path):
    r = cli("report", str(tmp_path))
    assert r.returncode == 2 and "no ledgers" in r.stderr


def test_release_strips_solutions_keeps_checks_and_student_is_its_alias(tmp_path):
    r = cli("release", str(TINY / "01_tiny.ipynb"), "--out", str(tmp_path / "release"))
    assert r.returncode == 0, r.stderr
    released = tmp_path / "release/tests/fixtures/tiny_module/01_tiny.ipynb"
    nb = nbformat.read(released, as_version=4)
    src = "\n".join(c.source for c in nb.cells)
    assert "BEGIN SOLUTION" not in src and "return 2 * x" not in src
    assert 'raise NotImplementedError("Student exercise: Exercise 1: return twice the input")' in src
    assert "assert double(21) == 42" in src
    assert [c.metadata.get("course") for c in nb.cells if "course" in c.metadata] == [
        {"id": "exercise-1", "role": "exercise"},
        {"id": "exercise-1-check", "role": "check", "exercise": "exercise-1"}]
    # the old name of the command writes the same file
    r = cli("student", str(TINY / "01_tiny.ipynb"), "--out", str(tmp_path / "student"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "student/tests/fixtures/tiny_module/01_tiny.ipynb").read_bytes() == \
        released.read_bytes()


# The commands that handle notebooks, ledgers and submissions do not need PyTorch: an
# instructor's laptop releases a course and a grading node's front end grades it without paying
# torch's import (seconds) per command. The kernels that run notebooks import it themselves.
_NO_TORCH = """
import runpy, sys
codes = []
for args in [a.split("|") for a in sys.argv[1:]]:
    sys.argv = ["utils"] + args
    try:
        runpy.run_module("utils", run_name="__main__")
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code or 0)
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH", *codes)
"""


def test_the_course_commands_start_without_importing_torch(tmp_path, results_tmp):
    commands = [["release", str(TINY / "01_tiny.ipynb"), "--out", str(tmp_path / "rel")],
                ["report", str(results_tmp), "--out", str(tmp_path / "r.md"), "--no-plots"],
                ["grade", "--help"], ["run", "--help"]]
    utils.Ledger("00-x/01_y", smoke=True, env={"device_name": "cpu"}).save(results_tmp / "a.json")
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, *("|".join(c) for c in commands)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-3000:]
    assert last == "NO-TORCH 0 0 0 0", last
    assert list((tmp_path / "rel").rglob("01_tiny.ipynb")) and (tmp_path / "r.md").is_file()


def test_utils_reads_its_names_when_first_used():
    r = subprocess.run([sys.executable, "-c",
                        "import sys, utils; a = 'torch' in sys.modules; utils.benchmark; "
                        "import utils.sizes; print(a, 'torch' in sys.modules, "
                        "set(utils.__all__) <= set(dir(utils)))"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["False", "True", "True"], r.stderr[-2000:]


def test_every_submodule_is_an_attribute_of_utils():
    # utils imports its names lazily: a module left out of _SUBMODULES is reachable as
    # utils.<name> only after something else imported it, which breaks a notebook at random
    modules = {p.stem for p in (REPO / "utils").glob("*.py")} - {"__init__", "__main__"}
    packages = {p.parent.name for p in (REPO / "utils").glob("*/__init__.py")}
    assert set(utils._SUBMODULES) == modules | packages
    assert all(utils._WHERE[name] in modules for name in utils.__all__)
