"""Timing a ``DataLoader`` (or any loop over one), as notebook 00/03 does.

A loader iterator is consumed once and its start-up is part of what we want to see, so
:func:`utils.benchmark`, which calls a function many times, is the wrong tool for it.
:func:`time_loader` reads the wall clock around one pass instead, synchronising the device
before every reading, and reports two numbers (a :class:`LoaderTiming`):

* the **first batch**: from ``iter(loader)`` to the first batch (worker start-up plus one batch);
* the **steady state**: time per batch after one warm-up batch per worker. With ``k`` workers
  the first ``k`` batches are produced in parallel and arrive together; counting them would make
  the loader look ``k`` times faster than it is over a short run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .env import pick_device, synchronize
from .sizes import loader_batches_needed

__all__ = ["LoaderTiming", "time_loader"]


@dataclass(frozen=True)
class LoaderTiming:
    """One timed pass over a loader (see :func:`time_loader`).

    Attributes:
        first_batch_ms: ``iter()`` to the first batch (worker start-up plus one batch).
        ms_per_batch: steady state, after one warm-up batch per worker.
        samples_per_s: ``batch_size`` / ``ms_per_batch``.
        timed_batches: batches behind ``ms_per_batch``.
    """

    first_batch_ms: float
    ms_per_batch: float
    samples_per_s: float
    timed_batches: int

    def __str__(self) -> str:
        return (f"{self.ms_per_batch:.2f} ms per batch ({self.samples_per_s:.0f} samples/s, "
                f"{self.timed_batches} batches timed), first batch after "
                f"{self.first_batch_ms:.1f} ms")


def time_loader(loader: Any, *, min_timed: int, step: Callable[[Any], Any] | None = None,
                device: str | torch.device | None = None) -> LoaderTiming:
    """Time one pass over ``loader``; ``step(batch)``, if given, runs on every batch.

    After one warm-up batch per worker (at least one), times the batches that
    :func:`utils.sizes.loader_batches_needed` asks for: at least ``min_timed``, and at least 3
    per worker, so that every worker delivers several timed batches.

    Args:
        loader: a ``DataLoader`` (it needs ``num_workers``, ``batch_size`` and ``len()``).
        min_timed: the fewest timed batches (>= 1).
        step: what a training loop does with each batch (``None``: the loader alone).
        device: synchronised before every clock reading, so queued work is counted
            (default: the course's device).

    Raises:
        ValueError: ``min_timed`` is not a positive int, or the loader has too few batches to
            time its workers (the message says how to size it).
    """
    if isinstance(min_timed, bool) or not isinstance(min_timed, int) or min_timed < 1:
        raise ValueError(f"min_timed must be a positive int, got {min_timed!r}")
    dev = pick_device(device)
    k = int(loader.num_workers)
    warm = max(1, k)
    need = loader_batches_needed(k, min_timed)
    n_timed = need - warm
    if len(loader) < need:
        raise ValueError(
            f"this loader has {len(loader)} batches, too few to time {k} worker(s): it needs "
            f"{need} ({warm} warm-up, one per worker, then {n_timed} timed). Give the dataset "
            f"utils.sizes.loader_batches_needed(workers, {min_timed}) batches for the most "
            "workers any loader may use, or use fewer workers.")
    synchronize(dev)
    t0 = time.perf_counter()
    it = iter(loader)
    first_ms = 0.0
    for i in range(warm):
        batch = next(it)
        if step is not None:
            step(batch)
        if i == 0:
            synchronize(dev)
            first_ms = (time.perf_counter() - t0) * 1e3
    synchronize(dev)
    t1 = time.perf_counter()
    for _ in range(n_timed):
        batch = next(it)
        if step is not None:
            step(batch)
    synchronize(dev)
    ms = (time.perf_counter() - t1) * 1e3 / n_timed
    del it  # shuts the workers down (not timed)
    return LoaderTiming(first_ms, ms, loader.batch_size * 1e3 / ms, n_timed)
