"""Shared fixtures; tests marked ``gpu`` are skipped, with a reason, where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def course_notebooks() -> list[Path]:
    """Every course notebook: ``NN-module/NN_name.ipynb``, in reading order."""
    return sorted(REPO.glob("[0-9][0-9]-*/[0-9][0-9]_*.ipynb"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (full-size checks run on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def results_tmp(tmp_path, monkeypatch):
    """Send ledgers to a temporary folder instead of results/local/."""
    out = tmp_path / "results"
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(out))
    return out
