"""utils.sizes: what notebooks derive from the machine holds from 1 to 128 cores and 0 to 8 GPUs.

The first GPU run (16 cores) failed where a notebook did its own arithmetic with the core
count: a dataset sized for 2 loader workers met an exercise answer with 15, and two CPU ranks
took 8 threads each while other notebooks shared the node.
"""

from __future__ import annotations

import types

import pytest

import utils
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


# ----------------------------------------------------------------------------- size tables

def _cfg(**kw):
    base = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    base.update(kw)
    return utils.GPTConfig(**base)


TABLE = {
    "batch": (4, 16, 64),
    "run_s": (0.05, 0.2, 1.0),
    "lr": (1e-2, 1e-3, 6e-4),
    "gpt": (_cfg(), _cfg(n_layer=4), _cfg(n_layer=12, n_embd=512, n_head=8)),
    "workload": ("infer", "train", "train"),
    "seed": 0,
}


@pytest.mark.parametrize("smoke, is_cuda, tier, batch", [
    (True, False, "smoke", 4), (True, True, "smoke", 4),
    (False, False, "cpu", 16), (False, True, "gpu", 64)])
def test_size_table_reads_the_column_of_the_run(smoke, is_cuda, tier, batch, capsys):
    env = types.SimpleNamespace(is_cuda=is_cuda)
    S = utils.size_table(TABLE, smoke=smoke, env=env, unordered=["lr"])
    assert (S.tier, S.batch, S["batch"], S.seed) == (tier, batch, batch, 0)
    assert S.gpt.n_layer == {"smoke": 2, "cpu": 4, "gpu": 12}[tier]
    assert list(S) == list(TABLE)
    out = capsys.readouterr().out
    # one aligned table, the chosen column marked, a dataclass's fields on rows of their own
    marked = {"smoke": "smoke*", "cpu": "CPU full*", "gpu": "GPU full*"}[tier]
    header = out.splitlines()[1]
    assert marked in header and header.count("*") == 1
    lines = [ln for ln in out.splitlines() if ln.startswith("gpt.n_layer")]
    assert lines and lines[0].split()[1:] == ["2", "4", "12"]
    with pytest.raises(AttributeError, match="no row 'bach'"):
        S.bach
    with pytest.raises(AttributeError, match="change the table"):
        S.batch = 3


def test_a_smoke_size_larger_than_a_full_one_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'batch'.*smoke value 64.*CPU full value 16"):
        utils.size_table({"batch": (64, 16, 64)}, smoke=True, show=False)
    # inside a config, the field is named
    with pytest.raises(ValueError, match=r"'gpt.n_embd'"):
        utils.size_table({"gpt": (_cfg(n_embd=64), _cfg(n_embd=32), _cfg(n_embd=64))},
                         smoke=True, show=False)
    # numbers that are not sizes are exempt when named
    S = utils.size_table({"lr": (1e-2, 1e-3, 6e-4)}, smoke=True, show=False, unordered=["lr"])
    assert S.lr == 1e-2
    with pytest.raises(ValueError, match="unordered names rows the table does not have"):
        utils.size_table({"lr": 1e-3}, smoke=True, show=False, unordered=["lrr"])


@pytest.mark.parametrize("row, message", [
    ((4, 16), "has 2 values"), ((1, 2, 3, 4), "has 4 values")])
def test_every_row_has_a_value_per_tier(row, message):
    with pytest.raises(ValueError, match=message):
        utils.size_table({"batch": row}, smoke=True, show=False)


def test_the_tier_and_sizes_go_into_the_ledger(tmp_path):
    led = utils.Ledger("00-x/01_y", smoke=True, env={"device_name": "cpu"})
    utils.size_table(TABLE, smoke=True, env=types.SimpleNamespace(is_cuda=False),
                     unordered=["lr"], ledger=led, show=False)
    back = utils.Ledger.load(led.save(tmp_path / "l.json"))
    assert back.sizes["tier"] == "smoke"
    assert back.sizes["values"]["batch"] == "4" and "n_layer=2" in back.sizes["values"]["gpt"]


def test_format_table_aligns_numbers_right_and_words_left():
    text = utils.format_table([["variant", "ms", "speedup"], ["eager", 12.5, 1.0],
                               ["compiled (default)", 3.25, 3.846], ["none", None, 2.0]],
                              header_rule=True)
    lines = text.splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}
    widths = {len(ln) for ln in lines}
    assert len(widths) == 1                       # every line as wide: aligned
    assert lines[2].startswith("eager ") and lines[2].endswith("   1")
    assert lines[3].split() == ["compiled", "(default)", "3.25", "3.85"]
    assert lines[4].split()[1] == "-"


def test_a_gpu_at_smoke_size_reads_its_overrides_and_prints_them(capsys):
    table = {"mm_n": (256, 512, 8192), "batch": (1, 2, 4), "run_s": (0.05, 0.5, 0.5)}
    cpu = utils.size_table(table, smoke=True, env=types.SimpleNamespace(is_cuda=False),
                           gpu_smoke={"mm_n": 1024, "batch": 4})
    gpu = utils.size_table(table, smoke=True, env=types.SimpleNamespace(is_cuda=True),
                           gpu_smoke={"mm_n": 1024, "batch": 4})
    assert (cpu.tier, cpu.mm_n, cpu.batch) == ("smoke", 256, 1)
    assert (gpu.tier, gpu.mm_n, gpu.batch, gpu.run_s) == ("gpu-smoke", 1024, 4, 0.05)
    full = utils.size_table(table, smoke=False, env=types.SimpleNamespace(is_cuda=True),
                            gpu_smoke={"mm_n": 1024})
    assert (full.tier, full.mm_n) == ("gpu", 8192)
    out = capsys.readouterr().out.split("sizes: ")
    assert "GPU smoke*" in out[2] and out[2].splitlines()[3].split() == ["mm_n", "256", "1024",
                                                                         "512", "8192"]
    with pytest.raises(ValueError, match="GPU smoke value 16 is larger than the GPU full value 4"):
        utils.size_table(table, smoke=True, gpu_smoke={"batch": 16}, show=False)
    with pytest.raises(ValueError, match="gpu_smoke names rows"):
        utils.size_table(table, smoke=True, gpu_smoke={"bach": 1}, show=False)


@pytest.mark.parametrize("jobs", [1, 2, 3, 12, 16, 200])
@pytest.mark.parametrize("cores", CORES)
def test_compile_threads_share_the_cores_between_jobs(cores, jobs):
    k = sizes.compile_threads_per_job(cores, jobs)
    assert 1 <= k <= sizes.COMPILE_THREADS_CAP
    assert k * jobs <= max(cores, jobs), "more compile workers than cores, over all the jobs"
    assert k == max(1, min(cores // jobs, sizes.COMPILE_THREADS_CAP))  # no core left idle


def test_compile_threads_refuse_bad_counts():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            sizes.compile_threads_per_job(16, bad)
        with pytest.raises(ValueError):
            sizes.compile_threads_per_job(bad, 2)
