"""utils.sizes: what notebooks derive from the machine holds from 1 to 128 cores and 0 to 8 GPUs.

The first GPU run (16 cores) failed where a notebook did its own arithmetic with the core
count: a dataset sized for 2 loader workers met an exercise answer with 15, and two CPU ranks
took 8 threads each while other notebooks shared the node.
"""

from __future__ import annotations

import pytest

from utils import sizes

CORES = [1, 2, 4, 16, 64, 128]
GPUS = [0, 1, 2, 8]


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("cores", CORES)
def test_loader_workers_leave_a_core_and_stay_capped(cores, smoke):
    k = sizes.loader_workers(cores, smoke=smoke)
    cap = sizes.WORKERS_CAP_SMOKE if smoke else sizes.WORKERS_CAP_FULL
    assert 1 <= k <= cap
    assert k <= max(1, cores - 1), "the main process keeps a core"
    if cores >= cap + 1:
        assert k == cap


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("cores", CORES)
def test_worker_sweep(cores, smoke):
    ks = sizes.worker_sweep(cores, smoke=smoke)
    assert ks[0] == 0 and ks == sorted(set(ks))
    assert max(ks) == min(cores, sizes.WORKERS_CAP_SMOKE if smoke else sizes.WORKERS_CAP_FULL)


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("cores", CORES)
def test_a_dataset_sized_for_the_largest_answer_holds_every_worker_count(cores, smoke):
    # 00/03's failure: items for the sweep's largest k, an answer with cpu_count - 1 workers.
    k_max = max(max(sizes.worker_sweep(cores, smoke=smoke)), sizes.loader_workers(cores, smoke=smoke))
    batches = sizes.loader_batches_needed(k_max, 6)
    for k in range(0, k_max + 1):
        assert sizes.loader_batches_needed(k, 6) <= batches


def test_loader_batches_needed_counts_warmup_and_timed():
    assert sizes.loader_batches_needed(0, 6) == 1 + 6
    assert sizes.loader_batches_needed(15, 6) == 15 + 45


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("nproc", [1, 2, 4, 8])
@pytest.mark.parametrize("cores", CORES)
def test_threads_never_oversubscribe(cores, nproc, smoke):
    t = sizes.threads_per_process(cores, nproc, smoke=smoke)
    assert t >= 1
    assert t * nproc <= max(cores, nproc), "more threads than cores in all"
    assert t <= (sizes.THREADS_CAP_SMOKE if smoke else sizes.THREADS_CAP_FULL)


def test_smoke_threads_are_a_thread_or_two_on_a_big_node():
    # 05/01 on the 16-core node: 8 threads per rank at smoke size, while others shared it.
    assert sizes.threads_per_process(16, 2, smoke=True) == 2
    assert sizes.threads_per_process(16, 2, smoke=False) == 8


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("cores", CORES)
def test_rank_plan(cores, gpus, smoke):
    plan = sizes.rank_plan(gpus, cores, smoke=smoke)
    if gpus >= 2:
        assert (plan.backend, plan.nproc, plan.device_type) == ("nccl", gpus, "cuda")
        assert "CUDA_VISIBLE_DEVICES" not in plan.env
    else:
        assert (plan.backend, plan.nproc, plan.device_type) == ("gloo", 2, "cpu")
        assert plan.env["CUDA_VISIBLE_DEVICES"] == "", "CPU ranks stay off a lone GPU"
    assert plan.env["OMP_NUM_THREADS"] == str(plan.threads)
    assert plan.threads * plan.nproc <= max(cores, plan.nproc)
    assert plan.why


@pytest.mark.parametrize("gpus, expected", [(0, 2), (1, 2), (2, 2), (3, 2), (8, 8)])
def test_rank_plan_power_of_two(gpus, expected):
    assert sizes.rank_plan(gpus, 16, smoke=False, power_of_two=True).nproc == expected


def test_rank_plan_with_more_ranks_needed():
    plan = sizes.rank_plan(2, 16, smoke=True, min_ranks=4)
    assert (plan.backend, plan.nproc) == ("gloo", 4)
    assert sizes.rank_plan(8, 16, smoke=True, min_ranks=4).nproc == 8
    assert sizes.rank_plan(8, 16, smoke=True, max_ranks=4).nproc == 4


@pytest.mark.parametrize("call", [
    lambda: sizes.loader_workers(0, smoke=True),
    lambda: sizes.loader_workers(True, smoke=True),
    lambda: sizes.worker_sweep(-1, smoke=False),
    lambda: sizes.loader_batches_needed(2, 0),
    lambda: sizes.threads_per_process(4, 0, smoke=True),
    lambda: sizes.rank_plan(-1, 4, smoke=True),
    lambda: sizes.rank_plan(2, 4, smoke=True, max_ranks=1),
])
def test_bad_counts_are_clear_errors(call):
    with pytest.raises(ValueError, match="must be an int"):
        call()


@pytest.mark.parametrize("smoke", [True, False])
@pytest.mark.parametrize("cores", CORES)
def test_threads_beside_workers(cores, smoke):
    workers = sizes.loader_workers(cores, smoke=smoke)
    t = sizes.threads_beside_workers(cores, workers, smoke=smoke)
    assert t >= 1 and (t + workers <= cores or t == 1)
