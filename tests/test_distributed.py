"""utils.distributed: real torchrun launches of a tiny gloo worker on 2 CPU processes."""

from __future__ import annotations

import math
import os
import shlex
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


# --- live output --------------------------------------------------------------------------

def test_launch_streams_output_while_the_ranks_run(tmp_path):
    """Each line reaches the notebook when a rank prints it, not when the launch ends."""
    seen = []
    res = launch(WORKER, nproc=2, args=["--out", tmp_path, "--ticks", "3", "--tick-s", "1.5"],
                 timeout_s=120, env={"CUDA_VISIBLE_DEVICES": ""},
                 echo=lambda line: seen.append((time.perf_counter(), line)))
    end = time.perf_counter()
    ticks = [(t, line) for t, line in seen if line.startswith("tick ")]
    assert [line for _, line in ticks] == ["tick 0", "tick 1", "tick 2"]
    assert end - ticks[0][0] > 2.5, "the first line only arrived at the end of the launch"
    assert "tick 2" in res.output  # and the output is still kept whole


def test_launch_echo_prints_lines_live(tmp_path, capsys):
    launch(WORKER, nproc=1, args=["--out", tmp_path, "--ticks", "1", "--tick-s", "0"],
           timeout_s=120, env={"CUDA_VISIBLE_DEVICES": ""})
    out = capsys.readouterr().out
    assert out.startswith("$ torchrun") and "tick 0" in out


def test_launch_rejects_a_bad_echo():
    with pytest.raises(TypeError, match="echo"):
        launch(WORKER, echo="yes")


# --- worker set-up ------------------------------------------------------------------------

def test_nccl_groups_are_bound_to_their_gpu_where_torch_allows():
    from utils.distributed import _device_id_kwargs
    gpu = torch.device("cuda", 3)
    assert _device_id_kwargs("gloo", torch.device("cpu")) == {}
    assert _device_id_kwargs("nccl", gpu) == {"device_id": gpu}  # torch >= 2.3 takes it


def test_no_device_id_where_init_process_group_lacks_it(monkeypatch):
    import torch.distributed as dist
    from utils.distributed import _device_id_kwargs

    def old_init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                               rank=-1, store=None, group_name="", pg_options=None):
        pass

    monkeypatch.setattr(dist, "init_process_group", old_init_process_group)
    assert _device_id_kwargs("nccl", torch.device("cuda", 0)) == {}


def test_single_process_group_runs_ddp_and_cleans_up():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils.distributed import single_process_group
    with single_process_group():
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0] and dist.get_world_size() == 1
        model = DDP(torch.nn.Linear(4, 2))
        model(torch.randn(3, 4)).sum().backward()
        assert model.module.weight.grad is not None
        with pytest.raises(RuntimeError, match="already has a process group"):
            with single_process_group():
                pass
        del model
    assert not dist.is_initialized()


# --- shared script options ----------------------------------------------------------------

def test_gpt_args_give_a_config():
    import argparse

    from utils.distributed import add_gpt_args, gpt_config
    p = argparse.ArgumentParser()
    add_gpt_args(p, vocab=256, n_embd=64)
    a = p.parse_args(["--n-layer", "3", "--seq-len", "16"])
    cfg = gpt_config(a)
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (256, 16, 3, 4, 64)
    assert gpt_config(a, n_embd=128).n_embd == 128
    with pytest.raises(ValueError, match="unknown GPTConfig"):
        gpt_config(a, width=3)
    with pytest.raises(TypeError):
        add_gpt_args(object())


# --- checking an all-reduce at any scale --------------------------------------------------

def _ring_sum(contribs):
    """fp32 sums the way a ring all-reduce forms them: chunk i starts at rank i, goes round."""
    n, numel = contribs.shape
    out = torch.empty(numel, dtype=contribs.dtype)
    for i, idx in enumerate(torch.arange(numel).chunk(n)):
        acc = contribs[i % n, idx].clone()
        for s in range(1, n):
            acc = acc + contribs[(i + s) % n, idx]
        out[idx] = acc
    return out


def _tree_sum(contribs):
    """fp32 sums formed pairwise, as a reduction tree would."""
    while contribs.shape[0] > 1:
        if contribs.shape[0] % 2:
            contribs = torch.cat([contribs[:-2], (contribs[-2] + contribs[-1])[None]])
        else:
            contribs = contribs[0::2] + contribs[1::2]
    return contribs[0]


def test_fixed_tolerance_fails_at_hundreds_of_ranks_and_the_bound_holds():
    """The bug of the old all-reduce check: fine at 2 ranks, wrong at 512, with nothing broken."""
    from utils.distributed import sum_error_bound
    n = 512
    contribs = torch.stack([torch.randn(4096, generator=torch.Generator().manual_seed(1000 + r))
                            for r in range(n)])
    rank_order = contribs.sum(0) * 0
    for r in range(n):
        rank_order = rank_order + contribs[r]          # the old reference: a plain loop in fp32
    exact = contribs.double().sum(0)
    bound = sum_error_bound(contribs.double().abs().sum(0), n)
    for got in (_ring_sum(contribs), _tree_sum(contribs)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, rank_order, rtol=1e-5, atol=1e-5)
        assert ((got.double() - exact).abs() <= bound).all()
    two = contribs[:2]
    torch.testing.assert_close(_ring_sum(two), two[0] + two[1], rtol=1e-5, atol=1e-5)


def test_sum_error_bound_grows_with_ranks():
    from utils.distributed import sum_error_bound
    one = torch.tensor(1.0, dtype=torch.float64)
    assert sum_error_bound(one, 1).item() == 0.0
    assert math.isclose(sum_error_bound(one, 2).item(), 2**-24, rel_tol=1e-6)
    assert sum_error_bound(one, 512).item() > 500 * sum_error_bound(one, 2).item()
    assert sum_error_bound(one, 4, torch.bfloat16).item() > sum_error_bound(one, 4).item()
    with pytest.raises(ValueError):
        sum_error_bound(one, 0)


@pytest.mark.parametrize("world", [2, 512, 4096])
def test_exactly_summable_data_sums_exactly_in_any_order(world):
    from utils.distributed import exactly_summable
    n = min(world, 512)  # summing 4096 rows is slow; their magnitude bound is what matters
    contribs = torch.stack([exactly_summable(257, 1000 + r, world) for r in range(n)])
    exact = contribs.double().sum(0)
    assert contribs.dtype == torch.float32 and contribs.abs().max() > 1  # not all tiny
    for got in (_ring_sum(contribs), _tree_sum(contribs), contribs.flip(0).sum(0)):
        assert torch.equal(got.double(), exact)
    # the largest possible |partial sum| of `world` values is exactly representable
    k_max = contribs.abs().max().item() * 2**8
    assert world * k_max < 2**24


def test_exactly_summable_checks_its_arguments():
    from utils.distributed import exactly_summable
    assert torch.equal(exactly_summable(5, 1, 8), exactly_summable(5, 1, 8))
    assert exactly_summable(5, 1, 8, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot sum"):
        exactly_summable(5, 1, 2**15, torch.float16)
    for bad in ((-1, 0, 2), (5, 0, 0)):
        with pytest.raises(ValueError):
            exactly_summable(*bad)
    with pytest.raises(ValueError):
        exactly_summable(5, 0, 2, torch.int32)


# --- the cluster templates of 05-distributed ----------------------------------------------

CLUSTER = REPO / "05-distributed" / "cluster"


def _dry_run(template, nodes, gpus, cpus, job_id):
    r = subprocess.run(["bash", str(CLUSTER / "dry_run.sh"), str(CLUSTER / template), str(nodes),
                        str(gpus), str(cpus), str(job_id)], cwd=REPO, capture_output=True,
                       text=True, timeout=60, check=True)
    lines = r.stdout.splitlines()
    runs = [shlex.split(ln)[1:] for ln in lines if ln.startswith("DRYRUN ")]
    envs = [dict(kv.split("=", 1) for kv in shlex.split(ln)[1:])
            for ln in lines if ln.startswith("DRYENV")]
    return runs, envs, r.stderr


def _ports(runs):
    return [int(next(a for a in argv if a.startswith("--rdzv-endpoint=")).rsplit(":", 1)[1])
            for argv in runs]


@pytest.mark.parametrize("template", ["train.sbatch", "notebooks.sbatch", "dry_run.sh"])
def test_cluster_scripts_parse(template):
    assert subprocess.run(["bash", "-n", str(CLUSTER / template)]).returncode == 0


def test_train_sbatch_ports_come_from_the_job_id():
    runs_a, _, _ = _dry_run("train.sbatch", 2, 8, 32, 12345)
    runs_b, _, _ = _dry_run("train.sbatch", 2, 8, 32, 12346)
    a, b = _ports(runs_a), _ports(runs_b)
    assert len(a) == 2 and len(set(a)) == 2, a            # each step its own port
    assert not set(a) & set(b), (a, b)                     # two jobs on one head node
    assert all(1024 <= p < 32768 for p in a + b)           # below the ephemeral range


def test_train_sbatch_gives_every_rank_a_thread_and_srun_its_cpus():
    runs, envs, err = _dry_run("train.sbatch", 4, 8, 4, 777)   # fewer cores than GPUs
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["1", "1"]
    assert "ranks share cores" in err
    assert all("--cpus-per-task=4" in argv for argv in runs)
    assert all(e["SRUN_CPUS_PER_TASK"] == "4" for e in envs)
    _, envs, _ = _dry_run("train.sbatch", 2, 8, 32, 777)
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["4", "4"]


def test_notebooks_sbatch_gives_srun_the_jobs_cpus():
    runs, envs, _ = _dry_run("notebooks.sbatch", 1, 8, 24, 777)
    assert runs and all("--cpus-per-task=24" in argv for argv in runs)
    assert all(e.get("SRUN_CPUS_PER_TASK") == "24" for e in envs)


def test_notebooks_sbatch_writes_the_report_when_a_notebook_failed_and_keeps_the_exit_code(
        tmp_path):
    """`set -e` used to end the job at the failed run, before the report (a cluster user's
    review): the report is written, and the job still exits with the run's code."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text('#!/bin/bash\necho "srun $*" >> "$STEPS"\n'
                                'if [[ " $* " == *" run "* ]]; then exit 1; fi\n')
    (stubs / "srun").chmod(0o755)
    steps = tmp_path / "steps"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STEPS": str(steps),
           "SLURM_JOB_ID": "42", "SLURM_CPUS_PER_TASK": "8", "SLURM_SUBMIT_DIR": str(REPO)}
    r = subprocess.run(["bash", str(CLUSTER / "notebooks.sbatch")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    ran = steps.read_text().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert len(ran) == 2 and " run 05-distributed " in ran[0] and " report " in ran[1], ran
    assert "--timeout" in ran[0]


_DDP_THEN_ALL_GATHER = """
import sys, torch, torch.distributed as dist, torch.nn as nn
import utils.distributed as ud


def one_round():
    with ud.single_process_group():
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        t = torch.ones(3)
        dist.all_reduce(t)
        model(torch.randn(2, 4)).sum().backward()
        out = torch.empty(2)
        dist.all_gather_into_tensor(out, torch.ones(2))
    # the group is gone; the DDP model, which still holds it, is freed on return, at once


for i in range(int(sys.argv[1])):
    one_round()
print("rounds done")
"""


def test_single_process_group_does_not_hang_when_a_ddp_model_outlives_it():
    """torch 2.11: a gloo group freed with the DDP model that outlived it, right after an
    all-gather, deadlocked on the GIL within a few hundred rounds (the CI's torch 2.11 pass hung
    in tests/test_collectives.py). single_process_group lets gloo's workers settle first; a
    hang here is stopped by the timeout and fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        r = subprocess.run([sys.executable, "-c", _DDP_THEN_ALL_GATHER, "300"], env=env,
                           capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("300 rounds of DDP in a one-rank gloo group did not end in 90 s: a hang")
    assert r.returncode == 0 and "rounds done" in r.stdout, r.stderr[-2000:]
