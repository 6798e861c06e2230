"""Sizes a notebook derives from the machine: loader workers, threads, ranks, dataset lengths.

A notebook that reads the core count and does its own arithmetic works on the machine it was
written on and breaks on the next one: the first GPU run had a dataset sized for 2 loader
workers meet 15 on a 16-core node, and two CPU ranks take 8 threads each while other notebooks
shared the cores. Every such size comes from a function here, and ``tests/test_sizes.py`` runs
each one for 1, 2, 4, 16, 64 and 128 cores and 0, 1, 2 and 8 GPUs.

All functions take the counts as arguments (``utils.get_env()`` has ``cpu_count``, the cores
this process may use, and ``gpu_count``), so a test or a reader can ask "what would a 128-core
node do" without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "WORKERS_CAP_SMOKE",
    "WORKERS_CAP_FULL",
    "THREADS_CAP_SMOKE",
    "THREADS_CAP_FULL",
    "loader_workers",
    "worker_sweep",
    "loader_batches_needed",
    "threads_per_process",
    "threads_beside_workers",
    "RankPlan",
    "rank_plan",
]

#: Most DataLoader workers a notebook starts at smoke size (CI's machine has 2 cores) and at
#: full size. Past a few dozen workers, start-up and memory grow while throughput has long
#: stopped growing for the course's datasets.
WORKERS_CAP_SMOKE = 2
WORKERS_CAP_FULL = 32
#: Most intra-op threads a CPU process (a rank, a probe) takes at smoke size and at full size.
#: At smoke size the work is tiny: a thread or two is plenty, and more only adds waiting when
#: other processes share the cores.
THREADS_CAP_SMOKE = 2
THREADS_CAP_FULL = 32


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def loader_workers(cpu_count: int, *, smoke: bool, reserve: int = 1) -> int:
    """DataLoader workers to use: the cores left after ``reserve`` for the main process, at
    least 1, at most :data:`WORKERS_CAP_SMOKE` / :data:`WORKERS_CAP_FULL`.

    Args:
        cpu_count: cores this process may use (``utils.get_env().cpu_count``).
        smoke: the notebook's size.
        reserve: cores kept for the main process (it iterates the loader and launches work).

    Raises:
        ValueError: a count that is not a positive int (``reserve`` may be 0).
    """
    _count("cpu_count", cpu_count, 1)
    _count("reserve", reserve, 0)
    cap = WORKERS_CAP_SMOKE if smoke else WORKERS_CAP_FULL
    return max(1, min(cpu_count - reserve, cap))


def worker_sweep(cpu_count: int, *, smoke: bool) -> list[int]:
    """The ``num_workers`` values a loader sweep measures: 0, then powers of two up to the
    capped core count, then the capped core count itself.

    Raises:
        ValueError: ``cpu_count`` is not a positive int.
    """
    _count("cpu_count", cpu_count, 1)
    cap = min(cpu_count, WORKERS_CAP_SMOKE if smoke else WORKERS_CAP_FULL)
    ks = [0] + [2**i for i in range(16) if 2**i <= cap]
    if ks[-1] != cap:
        ks.append(cap)
    return ks


def loader_batches_needed(workers: int, min_timed: int) -> int:
    """Batches a loader must hold to be timed in steady state with ``workers`` workers.

    One warm-up batch per worker (each worker's start-up), then at least ``min_timed`` timed
    batches and at least 3 per worker, so every worker delivers several. Size a dataset with
    the largest worker count any cell (or any accepted answer to an exercise) may use.

    Raises:
        ValueError: ``workers`` negative or ``min_timed`` below 1.
    """
    _count("workers", workers, 0)
    _count("min_timed", min_timed, 1)
    return max(1, workers) + max(min_timed, 3 * workers)


def threads_per_process(cpu_count: int, nproc: int, *, smoke: bool) -> int:
    """Intra-op threads for each of ``nproc`` CPU processes sharing ``cpu_count`` cores.

    An equal share of the cores, at least 1, at most :data:`THREADS_CAP_SMOKE` at smoke size
    and :data:`THREADS_CAP_FULL` at full size. Oversubscribed threads (more threads than cores
    in all) stall at every parallel barrier while another process holds a core.

    Raises:
        ValueError: a count that is not a positive int.
    """
    _count("cpu_count", cpu_count, 1)
    _count("nproc", nproc, 1)
    cap = THREADS_CAP_SMOKE if smoke else THREADS_CAP_FULL
    return max(1, min(cpu_count // nproc, cap))


def threads_beside_workers(cpu_count: int, workers: int, *, smoke: bool) -> int:
    """Intra-op threads for the main process while ``workers`` DataLoader workers (one thread
    each) share the ``cpu_count`` cores with it: the cores they leave, at least 1, capped as in
    :func:`threads_per_process`.

    Raises:
        ValueError: a count that is not an int of the right range.
    """
    _count("cpu_count", cpu_count, 1)
    _count("workers", workers, 0)
    return threads_per_process(max(1, cpu_count - workers), 1, smoke=smoke)


@dataclass(frozen=True)
class RankPlan:
    """Who runs the ranks of a distributed lesson, and how.

    Attributes:
        backend: ``"nccl"`` (one process per GPU) or ``"gloo"`` (CPU processes).
        nproc: processes to start.
        device_type: ``"cuda"`` or ``"cpu"``: where each rank computes.
        threads: intra-op threads per rank (``OMP_NUM_THREADS``).
        env: environment for the ranks (threads; a GPU hidden from CPU ranks).
        why: one sentence for the notebook's printout.
    """

    backend: str
    nproc: int
    device_type: str
    threads: int
    env: dict[str, str] = field(default_factory=dict)
    why: str = ""


def rank_plan(gpu_count: int, cpu_count: int, *, smoke: bool, min_ranks: int = 2,
              max_ranks: int | None = None, power_of_two: bool = False) -> RankPlan:
    """NCCL with one process per GPU where there are at least ``min_ranks`` GPUs, else gloo
    on ``min_ranks`` CPU processes with the cores shared between them.

    Args:
        gpu_count: GPUs visible (``utils.get_env().gpu_count``).
        cpu_count: cores this process may use.
        smoke: the notebook's size (threads per CPU rank are capped lower at smoke size).
        min_ranks: ranks the lesson needs.
        max_ranks: use at most this many GPUs (``None``: all of them).
        power_of_two: round the GPU count down to a power of two (a tensor-parallel size
            must divide the head count).

    Raises:
        ValueError: a count that is not an int of the right range.
    """
    _count("gpu_count", gpu_count, 0)
    _count("cpu_count", cpu_count, 1)
    _count("min_ranks", min_ranks, 1)
    if max_ranks is not None:
        _count("max_ranks", max_ranks, min_ranks)
    if gpu_count >= min_ranks:
        n = gpu_count if max_ranks is None else min(gpu_count, max_ranks)
        if power_of_two:
            n = 1 << (n.bit_length() - 1)
        # A GPU rank's CPU threads only launch work; an equal share of the cores still keeps
        # the CPU-side parts (data, optimizer bookkeeping) from oversubscribing the node.
        threads = threads_per_process(cpu_count, n, smoke=smoke)
        return RankPlan("nccl", n, "cuda", threads, {"OMP_NUM_THREADS": str(threads)},
                        f"{n} NCCL ranks, one per GPU")
    threads = threads_per_process(cpu_count, min_ranks, smoke=smoke)
    env = {"OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    have = ("no GPU" if gpu_count == 0 else
            f"{gpu_count} GPU{'s' if gpu_count > 1 else ''}, and NCCL needs one GPU per rank")
    return RankPlan("gloo", min_ranks, "cpu", threads, env,
                    f"{min_ranks} gloo CPU processes with {threads} thread(s) each: "
                    f"this machine has {have}")
