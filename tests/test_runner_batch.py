"""The runner as a batch job uses it (a cluster user's review, 2026-11-27): a job stopped by
Ctrl-C or SIGTERM leaves a run.json that says so, an unusable --out is one line and exit 2, a
reused --out is pointed out, a batch log gets no progress bar, the report lists notebooks that
did not finish, and a --full run that found no GPU says so. The notebooks' runs are replaced by
stand-ins here (no kernel is started), except where a ledger must be written."""

from __future__ import annotations

import json
import os
import re

import pytest

import utils.__main__ as cli
from utils.course import runner
from utils.course.report import write_report
from utils.course.runner import NotebookRun, run_notebooks


def _notebooks(tmp_path, n=3):
    import nbformat

    folder = tmp_path / "m"
    folder.mkdir()
    paths = []
    for i in range(n):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("x = 1")]
        path = folder / f"0{i + 1}_nb.ipynb"
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def _stand_in(stop_at=None, tier="smoke"):
    """A `_run_one` that reports each notebook ok without running it, and raises
    KeyboardInterrupt (as Ctrl-C or the SIGTERM handler would) on notebook `stop_at`."""
    calls = []

    def run_one(nb, out, *args):
        calls.append(nb.name)
        if nb.name == stop_at:
            raise KeyboardInterrupt
        return NotebookRun(f"m/{nb.name}", str(out / "m" / nb.name), "ok", 0.1, device="cpu",
                           tier=tier)
    return run_one, calls


def test_a_stopped_run_records_what_finished_what_stopped_and_what_never_started(
        tmp_path, monkeypatch):
    paths = _notebooks(tmp_path)
    run_one, calls = _stand_in(stop_at="02_nb.ipynb")
    monkeypatch.setattr(runner, "_run_one", run_one)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_notebooks(paths, out_dir=out, progress=False)
    assert calls == ["01_nb.ipynb", "02_nb.ipynb"]
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert [(r["notebook"], r["status"]) for r in runs] == [
        ("m/01_nb.ipynb", "ok"), ("m/02_nb.ipynb", "interrupted"), ("m/03_nb.ipynb", "not run")]
    assert "stopped" in runs[1]["summary"] and "before it started" in runs[2]["summary"]
    assert os.path.isabs(json.loads((out / "run.json").read_text())["results_dir"])


@pytest.mark.parametrize("signal_text, code, word", [("", 130, "Ctrl-C"),
                                                     ("signal 15", 143, "SIGTERM")])
def test_the_cli_says_where_a_stopped_run_left_its_record(tmp_path, monkeypatch, capsys,
                                                          signal_text, code, word):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt(signal_text)

    monkeypatch.setattr(runner, "run_notebooks", stopped)
    monkeypatch.setattr(runner, "stop_on_sigterm", lambda: None)
    (nb,) = _notebooks(tmp_path, 1)
    assert cli.main(["run", str(nb), "--out", str(tmp_path / "o")]) == code
    err = capsys.readouterr().err
    assert f"stopped by {word}" in err and str(tmp_path / "o" / "run.json") in err


def test_sigterm_becomes_the_interrupt_that_records_the_run(monkeypatch):
    import signal

    saved = signal.getsignal(signal.SIGTERM)
    try:
        runner.stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert runner._STOPPING.is_set()
    finally:
        signal.signal(signal.SIGTERM, saved)
        runner._STOPPING.clear()


def test_an_output_folder_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, capsys):
    (nb,) = _notebooks(tmp_path, 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "out", blocker):
        assert cli.main(["run", str(nb), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(rf"error: cannot use {re.escape(str(out))} as the output folder: .+\n",
                            err), err


def test_a_reused_output_folder_is_pointed_out(tmp_path, monkeypatch, capsys):
    paths = _notebooks(tmp_path, 1)
    monkeypatch.setattr(runner, "_run_one", _stand_in()[0])
    out = tmp_path / "out"
    run_notebooks(paths, out_dir=out, progress=False)
    assert "earlier run" not in capsys.readouterr().out
    run_notebooks(paths, out_dir=out, progress=False)
    assert f"note: {out} holds an earlier run" in capsys.readouterr().out


def test_a_full_run_that_found_no_gpu_says_so_once(tmp_path, monkeypatch, capsys):
    paths = _notebooks(tmp_path, 2)
    monkeypatch.setattr(runner, "_run_one", _stand_in(tier="cpu")[0])
    run_notebooks(paths, out_dir=tmp_path / "out", smoke=False, progress=False)
    printed = capsys.readouterr().out
    assert printed.count("--full, but the kernel found no CUDA GPU") == 1
    assert "ok in 0.1 s on cpu, cpu column" in printed
    run_notebooks(paths, out_dir=tmp_path / "out2", smoke=None, progress=False)
    assert "found no CUDA GPU" not in capsys.readouterr().out


def test_the_cli_draws_no_progress_bar_into_a_log(tmp_path, monkeypatch):
    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(runner, "run_notebooks", record)
    monkeypatch.setattr(runner, "stop_on_sigterm", lambda: None)
    (nb,) = _notebooks(tmp_path, 1)
    for tty in (False, True):
        monkeypatch.setattr("sys.stderr.isatty", lambda tty=tty: tty)
        cli.main(["run", str(nb), "--out", str(tmp_path / "o")])
        assert seen["progress"] is tty


def test_two_default_output_folders_of_the_same_second_differ(monkeypatch):
    first = runner.default_out_dir()
    monkeypatch.setattr(os, "getpid", lambda: 1)
    assert runner.default_out_dir() != first and runner.default_out_dir().name.endswith("-1")


def test_the_report_lists_the_notebooks_that_did_not_finish(tmp_path):
    out = tmp_path / "run"
    (out / "results").mkdir(parents=True)
    ledger = {"schema": 1, "notebook": "m/01_nb", "smoke": True, "strict": False,
              "created": "2026-11-27T10:00:00+00:00", "commit": "", "shared_jobs": 1,
              "env": {"device": "cpu", "device_name": "cpu"}, "measurements": {},
              "expectations": {}}
    (out / "results" / "m__01_nb.json").write_text(json.dumps(ledger))
    (out / "run.json").write_text(json.dumps({"runs": [
        {"notebook": "m/01_nb.ipynb", "status": "ok", "summary": ""},
        {"notebook": "m/02_nb.ipynb", "status": "failed",
         "summary": "cell 3 of 9 (In [2]: `x`): CellTimeoutError: ..."}]}))
    text = write_report([out], plots=False).read_text()
    assert "**1 notebook(s) did not run cleanly**" in text
    assert "- m/02_nb.ipynb: FAILED: cell 3 of 9" in text and "m/01_nb.ipynb: OK" not in text


def test_the_device_and_column_come_from_the_ledger_this_run_wrote(tmp_path):
    import time

    results = tmp_path / "results"
    results.mkdir()
    ledger = results / "m__01_nb.json"
    ledger.write_text(json.dumps({"env": {"device": "cuda:0"}, "sizes": {"tier": "gpu"}}))
    assert runner._ledger_facts(results, "m/01_nb.ipynb", time.time() - 60) == ("cuda:0", "gpu")
    # an older ledger (from an earlier run into the same folder) says nothing about this one
    assert runner._ledger_facts(results, "m/01_nb.ipynb", time.time() + 60) == ("", "")
    ledger.write_text("not json")
    assert runner._ledger_facts(results, "m/01_nb.ipynb", 0) == ("", "")
    assert runner._ledger_facts(results, "m/02_nb.ipynb", 0) == ("", "")


@pytest.mark.parametrize("argv", [["run", "x.ipynb", "--smok"], ["run", "x.ipynb", "--time", "5"],
                                  ["grade", "x", "--hide"], ["report", "x", "--no-plot"]])
def test_a_mistyped_flag_is_refused_not_taken_for_another(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err
    assert err.startswith(f"usage: python -m utils {argv[0]} "), err  # the command's usage


def test_the_report_lists_failures_even_when_no_notebook_wrote_a_ledger(tmp_path):
    """A run whose every notebook failed before its ledger (a broken environment) used to end
    in "no ledgers found", without the failures."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"runs": [
        {"notebook": "m/01_nb.ipynb", "status": "failed",
         "summary": "cell 1 of 9 (In [1]: `import utils`): ModuleNotFoundError: ..."}]}))
    text = write_report([out], plots=False).read_text()
    assert "**1 notebook(s) did not run cleanly**" in text and "ModuleNotFoundError" in text
    assert "no ledgers (results JSON) found" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no ledgers"):
        write_report([empty], plots=False)
