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

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    "usable_cpu_count",
    "COMPILE_THREADS_CAP",
    "COMPILE_THREADS_ENV_VAR",
    "compile_threads_per_job",
    "RankPlan",
    "rank_plan",
    "TIERS",
    "tier_of",
    "Sizes",
    "size_table",
    "format_table",
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


def usable_cpu_count() -> int:
    """Cores this process may run on (the CPU affinity set, which honours a
    cluster job's allocation), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: Inductor's own cap on its compile workers (``torch._inductor.config.decide_compile_threads``
#: takes ``min(32, cores)`` when nothing sets it).
COMPILE_THREADS_CAP = 32
#: The variable Inductor reads for its number of compile workers (torch 2.11 and newer).
COMPILE_THREADS_ENV_VAR = "TORCHINDUCTOR_COMPILE_THREADS"


def compile_threads_per_job(cpu_count: int, jobs: int) -> int:
    """Inductor compile workers for each of ``jobs`` notebooks run at once on ``cpu_count``
    cores: an equal share of the cores, at least 1, at most :data:`COMPILE_THREADS_CAP`.

    Left to itself, every kernel that compiles starts a pool of ``min(32, cores)`` worker
    processes, each of which imports torch: 12 notebooks at once on a 16-core GPU node would
    start nearly 200 of them. With 1, Inductor compiles in the kernel's own process, with no
    pool.

    Raises:
        ValueError: a count that is not a positive int.
    """
    _count("cpu_count", cpu_count, 1)
    _count("jobs", jobs, 1)
    return max(1, min(cpu_count // jobs, COMPILE_THREADS_CAP))


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


# ----------------------------------------------------------------------------- size tables

#: The columns of a notebook's size table, in order: smoke size (CI, about a minute on a 2-core
#: CPU), full size on a machine without a GPU (it runs, slowly; the GPU claims do not apply), and
#: full size on one GPU (where the claims are checked).
TIERS = ("smoke", "cpu", "gpu")
_TIER_LABELS = {"smoke": "smoke", "gpu-smoke": "GPU smoke", "cpu": "CPU full", "gpu": "GPU full"}


def tier_of(smoke: bool, is_cuda: bool) -> str:
    """The column of a size table this run reads: ``"smoke"``, ``"cpu"`` or ``"gpu"``."""
    return "smoke" if smoke else ("gpu" if is_cuda else "cpu")


def _numeric_fields(value: Any) -> dict[str, float] | None:
    """The numbers a value is made of, for the smoke-never-larger check: the value itself, or
    a dataclass's numeric fields; ``None`` for anything else (words, switches, functions)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return {"": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {k: v for k, v in out.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)} or None
    return None


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, torch_dtype_types()):
        return str(value).replace("torch.", "")
    return str(value)


def torch_dtype_types() -> tuple[type, ...]:
    try:
        import torch
    except ImportError:  # pragma: no cover - the course always has torch
        return ()
    return (torch.dtype,)


class Sizes(Mapping[str, Any]):
    """The sizes one run uses: the chosen column of a notebook's size table.

    Read a size as an attribute (``S.batch``) or an item (``S["batch"]``); ``S.tier`` is the
    column (``"smoke"``, ``"cpu"`` or ``"gpu"``) and ``S.table`` the whole table, for printing.
    """

    def __init__(self, tier: str, values: dict[str, Any], table: dict[str, tuple[Any, ...]],
                 gpu_smoke: Mapping[str, Any] | None = None):
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "gpu_smoke", dict(gpu_smoke or {}))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"the size table has no row {name!r}; its rows are "
                                 f"{', '.join(values)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("sizes are read from the table: change the table, not the result")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Sizes(tier={self.tier!r}, {', '.join(f'{k}={v!r}' for k, v in self.items())})"

    def describe(self) -> str:
        """The table as aligned text: one row per size (a dataclass's fields on rows of their
        own), a column per tier (and a GPU-smoke column where the table has overrides for a GPU
        at smoke size), the column this run reads marked with ``*``."""
        tiers = list(TIERS)
        columns = {key: list(values) for key, values in self.table.items()}
        if self.gpu_smoke:
            tiers.insert(1, "gpu-smoke")
            for key, values in columns.items():
                values.insert(1, self.gpu_smoke.get(key, values[0]))
        rows: list[list[str]] = []
        for key, values in columns.items():
            if all(dataclasses.is_dataclass(v) and not isinstance(v, type) for v in values):
                names = [f.name for f in dataclasses.fields(values[0])]
                for name in names:
                    rows.append([f"{key}.{name}"] + [_cell(getattr(v, name, "-"))
                                                      for v in values])
            else:
                rows.append([key] + [_cell(v) for v in values])
        header = ["size"] + [_TIER_LABELS[t] + ("*" if t == self.tier else "") for t in tiers]
        return format_table([header] + rows, header_rule=True)

    def __str__(self) -> str:
        return self.describe()


def size_table(table: Mapping[str, Any], *, smoke: bool, env: Any = None,
               tier: str | None = None, unordered: Iterable[str] = (), ledger: Any = None,
               show: bool = True, gpu_smoke: Mapping[str, Any] | None = None) -> Sizes:
    """Pick this run's sizes from a notebook's size table and print the table.

    Args:
        table: ``{"name": (smoke, cpu_full, gpu_full), ...}``: a row per size, a column per
            tier (:data:`TIERS`). A row that is the same in every tier may be a single value.
        smoke: whether this is a smoke run (``utils.resolve_smoke(SMOKE)``).
        env: ``utils.get_env()`` (its ``is_cuda`` picks the GPU column at full size).
        tier: ask for a column by name instead (a test asking what a GPU run would use).
        unordered: rows exempt from "smoke is never larger than full" (a learning rate, a
            tolerance): numbers that are not sizes.
        ledger: a :class:`utils.Ledger` to record the tier and the chosen sizes in.
        show: print the table.
        gpu_smoke: values some rows take on a GPU at smoke size instead of the smoke column's
            (``{"batch": 4}``), where the CPU's smoke sizes would time only launch overhead on
            a GPU. They are never larger than the GPU-full values; a GPU smoke run reads the
            tier ``"gpu-smoke"``, printed as a column of its own.

    Raises:
        ValueError: a row has the wrong number of columns, or a smoke size is larger than a full
            size (the message names the row).
    """
    if tier is None:
        if env is None:
            from .env import get_env
            env = get_env()
        tier = tier_of(bool(smoke), bool(getattr(env, "is_cuda", False)))
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if not table:
        raise ValueError("the size table is empty")
    exempt = set(unordered)
    unknown = exempt - set(table)
    if unknown:
        raise ValueError(f"unordered names rows the table does not have: {sorted(unknown)}")
    full: dict[str, tuple[Any, ...]] = {}
    for key, row in table.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"size names must be identifiers (read as S.name), got {key!r}")
        if isinstance(row, tuple):
            if len(row) != len(TIERS):
                raise ValueError(f"size {key!r} has {len(row)} values; every row has one per "
                                 f"tier {TIERS} (or one value for all)")
        else:
            row = (row,) * len(TIERS)
        full[key] = row
        if key in exempt:
            continue
        nums = [_numeric_fields(v) for v in row]
        if nums[0] is None:
            continue
        for t, other in zip(TIERS[1:], nums[1:]):
            for field_name, small in nums[0].items():
                big = None if other is None else other.get(field_name)
                if big is not None and small > big:
                    where = f"{key}.{field_name}" if field_name else key
                    raise ValueError(
                        f"size {where!r}: the smoke value {small!r} is larger than the "
                        f"{_TIER_LABELS[t]} value {big!r}; a smoke run must not be bigger than a "
                        "full one (list the row in unordered= if it is not a size)")
    overrides = dict(gpu_smoke or {})
    unknown = set(overrides) - set(full)
    if unknown:
        raise ValueError(f"gpu_smoke names rows the table does not have: {sorted(unknown)}")
    for key, value in overrides.items():
        small, big = _numeric_fields(value), _numeric_fields(full[key][-1])
        for field_name, v in (small or {}).items():
            limit = None if big is None else big.get(field_name)
            if key not in exempt and limit is not None and v > limit:
                where = f"{key}.{field_name}" if field_name else key
                raise ValueError(f"size {where!r}: the GPU smoke value {v!r} is larger than the "
                                 f"GPU full value {limit!r}")
    column = TIERS.index(tier)
    values = {k: v[column] for k, v in full.items()}
    if tier == "smoke" and overrides and bool(getattr(env, "is_cuda", False)):
        tier = "gpu-smoke"
        values.update(overrides)
    sizes = Sizes(tier, values, full, overrides)
    if ledger is not None:
        ledger.set_sizes(tier, {k: _cell(v) for k, v in sizes.items()})
    if show:
        print(f"sizes: this run uses the {_TIER_LABELS[tier]} column (marked *)")
        print(sizes.describe())
    return sizes


def format_table(rows: Sequence[Sequence[Any]], *, header_rule: bool = False,
                 floatfmt: str = ".3g", gap: int = 2) -> str:
    """Rows of cells as aligned text: numbers right-aligned, words left-aligned.

    The first row is the header when ``header_rule`` is true (a rule of dashes goes under it).
    Floats use ``floatfmt``; ``None`` prints as ``-``.
    """
    def text(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    cells = [[text(v) for v in row] for row in rows]
    if not cells:
        return ""
    ncol = max(len(r) for r in cells)
    cells = [r + [""] * (ncol - len(r)) for r in cells]
    numeric = [all(isinstance(row[c], (int, float)) and not isinstance(row[c], bool)
                   for row in rows[1 if header_rule else 0:] if c < len(row) and row[c] is not None)
               for c in range(ncol)]
    widths = [max(len(r[c]) for r in cells) for c in range(ncol)]
    lines = []
    for i, r in enumerate(cells):
        parts = [r[c].rjust(widths[c]) if numeric[c] and c > 0 else r[c].ljust(widths[c])
                 for c in range(ncol)]
        lines.append((" " * gap).join(parts).rstrip())
        if header_rule and i == 0:
            lines.append((" " * gap).join("-" * w for w in widths))
    return "\n".join(lines)
