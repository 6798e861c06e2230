"""Shared fixtures; tests marked ``gpu`` are skipped, with a reason, where CUDA is absent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def course_notebooks() -> list[Path]:
    """Every course notebook: ``NN-module/NN_name.ipynb``, in reading order."""
    return sorted(REPO.glob("[0-9][0-9]-*/[0-9][0-9]_*.ipynb"))


def code_cells(path: Path) -> dict[str, str]:
    """A notebook's code cells, their source by cell id, in order (the lesson-check tests run
    a notebook's own solution and check cells)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return {c["id"]: "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"}


def cell_starting(cells: Mapping[str, str] | Iterable[str], start: str) -> str:
    """The one code cell whose source starts with ``start`` (cells as from :func:`code_cells`,
    or their sources)."""
    sources = cells.values() if isinstance(cells, Mapping) else cells
    (found,) = [s for s in sources if s.startswith(start)]
    return found


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's default): the notebooks dominate the suite and
    run well side by side on a CPU (measured on the 2-core CI machine: 6.3 min with two
    workers against 9.1 min in one process). On a GPU node everything runs in one
    process: full-size timings must not share the GPU with another notebook."""
    if torch.cuda.is_available():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, 4) if (cpus or 1) > 1 else 0


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
