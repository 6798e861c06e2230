"""results/: the recorded GPU runs and the page rendered from them."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from utils.course.report import parse_train_log, scan_results

RESULTS = REPO / "results"
H100 = RESULTS / "2026-11-26-h100"


def test_train_log_is_read_into_a_ledger():
    led = parse_train_log(H100 / "train.log")
    assert led.notebook == "06-capstone/train" and led.commit == "58a3b41"
    assert led.env["device_name"] == "NVIDIA H100 80GB HBM3"
    assert led.env["torch_version"] == "2.11.0+cu130"
    assert led["tokens_per_s [fp32 eager]"] == 48956
    assert led["tokens_per_s [CUDA graphs]"] == 571978
    assert led["mfu_vs_measured_ceiling [CUDA graphs]"] == pytest.approx(0.526)
    assert led["mfu_vs_datasheet [CUDA graphs]"] == pytest.approx(0.382)
    assert led["speedup [CUDA graphs over fp32 eager]"] == pytest.approx(571978 / 48956)


def test_a_log_without_a_run_is_skipped_with_a_reason(tmp_path):
    (tmp_path / "train.log").write_text("nothing useful\n")
    ledgers, skipped = scan_results([tmp_path])
    assert not ledgers and "not train.py's" in skipped[0][1]


def test_every_recorded_run_has_its_provenance():
    for run in (p for p in RESULTS.iterdir() if p.is_dir() and p.name not in ("local", "figures")):
        prov = json.loads((run / "provenance.json").read_text())
        for key in ("date", "gpu", "torch", "commit", "how"):
            assert prov.get(key), f"{run.name}: provenance.json lacks {key}"


def test_the_results_page_shows_every_recorded_claim():
    """RESULTS.md is rendered from the ledgers (python -m utils report results ...): each
    recorded notebook, device and claim is on it, with its value and verdict."""
    page = (RESULTS / "RESULTS.md").read_text()
    ledgers, _ = scan_results([RESULTS])
    assert ledgers, "no recorded ledgers"
    for led in ledgers:
        assert f"## {led.notebook}" in page
        for e in led.expectations.values():
            value = "-" if e.value is None else format(e.value, ".3g")
            row = f"| {e.description} | {value} | {e.op} {e.threshold:g} | {e.status}"
            assert row in page, f"{led.notebook}: {e.name} is not on the page as recorded"
        for m in led.measurements.values():
            assert f"| {m.name} |" in page, f"{led.notebook}: {m.name} missing from the page"
    assert "results/local" not in page and "## Files skipped" not in page


def test_every_ledger_of_train_py_is_dated_against_train_py():
    """--benchmark and --fp8-sweep write ledgers of their own names; whether train.py changed
    since they ran is read from train.py, not from a notebook of that name (there is none)."""
    from utils.course.report import _version_note
    from utils.ledger import Ledger

    for name in ("06-capstone/train", "06-capstone/train_benchmark", "06-capstone/train_fp8_sweep"):
        led = Ledger(name, smoke=False, env={}, strict=False)
        led.commit = "58a3b41"  # the first H100 run's commit; train.py has changed since
        assert _version_note(led) == "changed since", name
