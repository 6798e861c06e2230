"""utils.distributed: real torchrun launches of a tiny gloo worker on 2 CPU processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from utils.distributed import (DistributedLaunchError, launch, read_rank_results,
                               torchrun_command, write_rank_result)

WORKER = REPO / "tests" / "fixtures" / "distributed" / "allreduce_worker.py"


def test_two_ranks_all_reduce(tmp_path):
    res = launch(WORKER, nproc=2, args=["--out", tmp_path], timeout_s=120, echo=False,
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0
    ranks = read_rank_results(tmp_path, 2)
    assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2 on both ranks
    assert {r["backend"] for r in ranks} == {"gloo"}


def test_failing_rank_fails_the_launch(tmp_path):
    with pytest.raises(DistributedLaunchError, match="rank 1 fails on purpose"):
        launch(WORKER, nproc=2, args=["--out", tmp_path, "--fail-rank", "1"], timeout_s=120,
               echo=False, env={"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(FileNotFoundError, match=r"rank\(s\) \[(0, )?1\]"):
        read_rank_results(tmp_path, 2)


def test_timeout_kills_every_rank(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(DistributedLaunchError, match="did not finish within"):
        launch(WORKER, nproc=2, args=["--out", tmp_path, "--hang"],
               timeout_s=12, echo=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert time.perf_counter() - t0 < 60
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"{WORKER.name}.*--hang"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"ranks left running: {left.stdout}"


def test_relative_script_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    launch(WORKER.relative_to(REPO), nproc=1, args=["--out", tmp_path], timeout_s=120,
           echo=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert read_rank_results(tmp_path, 1)[0]["sum"] == 1.0


def test_bad_input():
    with pytest.raises(FileNotFoundError):
        launch("no_such_script.py")
    with pytest.raises(ValueError):
        torchrun_command(WORKER, nproc=0)


def test_worker_outside_torchrun_says_how_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, str(WORKER), "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "start this script with torchrun" in r.stderr


def test_rank_results_round_trip(tmp_path):
    write_rank_result(tmp_path, 0, {"a": 1})
    assert read_rank_results(tmp_path, 1) == [{"a": 1}]


def test_step_times_ms_times_exactly_n_synchronised_calls():
    from utils.distributed import step_times_ms
    calls = []
    times = step_times_ms(lambda: (calls.append(1), time.sleep(0.01)), 4, torch.device("cpu"))
    assert len(calls) == len(times) == 4
    assert all(9 <= t < 200 for t in times), times
    assert step_times_ms(lambda: None, 0, torch.device("cpu")) == []
    with pytest.raises(ValueError):
        step_times_ms(lambda: None, -1, torch.device("cpu"))
