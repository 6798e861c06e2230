"""00-foundations/03_input_pipeline and 06_feeding_the_accelerator: their machine-derived sizes
hold on 1 to 128 cores.

The first GPU run failed 03's Exercise 3 (now 06's Exercise 1) on a 16-core node: the check
accepted up to ``cpu_count - 1`` loader workers while the dataset held batches for 2 (smoke) or
32 (full). Here each notebook's sizes cell runs for each core count, as that machine would run
it, and every worker count the notebook uses, or its exercise check accepts, must fit the dataset.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import utils
from conftest import REPO

INPUT_PIPELINE = REPO / "00-foundations" / "03_input_pipeline.ipynb"
FEEDING = REPO / "00-foundations" / "06_feeding_the_accelerator.ipynb"
#: Each notebook, and the name of its most loader workers (the bound of its exercise check in 06).
MOST_WORKERS = {INPUT_PIPELINE: "MAX_WORKERS", FEEDING: "NW"}


def _cells(notebook):
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _cell(notebook, marker: str) -> str:
    hits = [src for src in _cells(notebook) if marker in src]
    assert len(hits) == 1, f"{len(hits)} code cells contain {marker!r}"
    return hits[0]


class _Ledger:
    def __init__(self, *args, **kwargs):
        pass

    def set_sizes(self, tier, sizes):
        pass


@pytest.mark.parametrize("notebook", list(MOST_WORKERS), ids=lambda p: p.stem)
@pytest.mark.parametrize("cores", [1, 2, 4, 16, 64, 128])
@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("cuda", [False, True])
def test_dataset_holds_every_worker_count_the_notebook_or_its_check_allows(
        notebook, cores, smoke, cuda, monkeypatch):
    monkeypatch.setattr(utils, "Ledger", _Ledger)  # the sizes cell must not write results
    threads = torch.get_num_threads()
    env = SimpleNamespace(device="cuda:0" if cuda else "cpu", is_cuda=cuda, cpu_count=cores,
                          cpu_threads=cores)
    ns = {"utils": utils, "torch": torch, "ENV": env, "SMOKE": smoke}
    try:
        exec(_cell(notebook, "SMOKE = utils.resolve_smoke(SMOKE)"), ns)
    finally:
        torch.set_num_threads(threads)
    S = ns["S"]
    assert S.tier == ("smoke" if smoke else ("gpu" if cuda else "cpu"))
    batches = ns["N_ITEMS"] // S.batch
    most = ns[MOST_WORKERS[notebook]]
    allowed = set(ns.get("WORKER_COUNTS", [])) | set(range(1, most + 1))
    for k in allowed:
        need = utils.sizes.loader_batches_needed(k, S.min_timed)
        assert need <= batches, f"{cores} cores, smoke={smoke}: {k} workers need {need} batches"
    assert most == utils.sizes.loader_workers(cores, smoke=smoke)
    if "prefetch_batches" in S:  # 06's prefetcher section takes that many batches for an epoch
        assert S.prefetch_batches <= batches
    assert 1 <= ns["MAIN_THREADS"] <= max(cores, 1)


def test_fast_loader_check_is_bounded_by_the_sizes_the_dataset_holds():
    check = _cell(FEEDING, "# Check Exercise 1")
    assert "ex_loader.num_workers <= NW" in check
    assert "CPU_COUNT - 1" not in check
    solution = _cell(FEEDING, "# Exercise 1: the loader")
    assert "utils.sizes.loader_workers(" in solution


@pytest.mark.parametrize("notebook", list(MOST_WORKERS), ids=lambda p: p.stem)
def test_time_loader_says_how_to_size_a_short_loader(notebook):
    # The notebooks time their loaders with utils.time_loader, with the table's min_timed ...
    src = _cell(notebook, "utils.time_loader")
    assert "min_timed=S.min_timed" in src
    # ... which sizes its run with utils.sizes.loader_batches_needed, and says so when a loader
    # holds too few batches for its workers.
    from torch.utils.data import DataLoader
    need = utils.sizes.loader_batches_needed(2, 4)
    short = DataLoader(list(range(need - 1)), batch_size=1, num_workers=2)
    with pytest.raises(ValueError, match=r"utils\.sizes\.loader_batches_needed\(workers, 4\)"):
        utils.time_loader(short, min_timed=4, device="cpu")
