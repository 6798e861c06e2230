"""Timing that is right on CPU and CUDA.

:func:`benchmark` is built on :mod:`torch.utils.benchmark`: its clock
synchronises the accelerator before every reading, its thread control fixes
the CPU thread count, and results carry its ``Measurement`` (so
``torch.utils.benchmark.Compare`` works on them). We add an explicit warm-up,
blocks sized from a timed call so that there are enough of them for a median
and an IQR, the number of CPU threads the notebook actually uses (the
``Timer``'s default is one), and a warning when the spread is too large to
trust the median.

:func:`cold_l2_benchmark` times single kernel calls on CUDA with their own
events after flushing the L2 cache, the way ``triton.testing.do_bench`` does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import threading
import time
import timeit
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

# Importing torch.utils.benchmark imports torch.utils.cpp_extension, which logs
# "No CUDA runtime is found" once on machines without a GPU. That is noise for a
# learner on a laptop (nothing here builds C++/CUDA extensions), so quiet that one
# logger for the duration of the import only.
_cpp_ext_log = logging.getLogger("torch.utils.cpp_extension")
_saved_level = _cpp_ext_log.level
_cpp_ext_log.setLevel(logging.ERROR)
try:
    import torch.utils.benchmark as tbench
    from torch.utils.benchmark.utils import common as _tb_common
finally:
    _cpp_ext_log.setLevel(_saved_level)

from .env import pick_device, synchronize

__all__ = [
    "NoisyMeasurementWarning",
    "SectionClock",
    "Timing",
    "SpeedupRow",
    "SpeedupTable",
    "benchmark",
    "cold_l2_benchmark",
    "compare",
    "first_call",
    "break_even",
    "torch_threads",
    "per_call_ms",
    "BackgroundLoad",
    "MachineLoad",
    "machine_load",
]

NOISE_THRESHOLD = 0.10  # IQR / median above which a measurement is called noisy


class NoisyMeasurementWarning(UserWarning):
    """The interquartile range is more than 10% of the median."""


@dataclass(frozen=True)
class Timing:
    """One timed callable: robust statistics over many timed blocks.

    All times are per call, in milliseconds.
    """

    label: str
    median_ms: float
    iqr_ms: float
    mean_ms: float
    min_ms: float
    n_blocks: int
    calls_per_block: int
    device: str
    method: str
    times_ms: tuple[float, ...] = field(repr=False)
    measurement: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_times(cls, label: str, times_ms: Sequence[float], calls_per_block: int,
                   device: str, method: str, measurement: Any = None) -> "Timing":
        """Statistics over per-call times, one value per timed block."""
        if not times_ms:
            raise ValueError(f"{label}: no timings to summarise")
        q1, med, q3 = _quantiles(times_ms)
        return cls(label=label, median_ms=med, iqr_ms=q3 - q1,
                   mean_ms=statistics.fmean(times_ms), min_ms=min(times_ms),
                   n_blocks=len(times_ms), calls_per_block=calls_per_block, device=device,
                   method=method, times_ms=tuple(times_ms), measurement=measurement)

    @property
    def iqr_fraction(self) -> float:
        """IQR as a fraction of the median: the relative spread."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else math.inf

    @property
    def noisy(self) -> bool:
        return self.iqr_fraction > NOISE_THRESHOLD

    @property
    def median_s(self) -> float:
        return self.median_ms / 1e3

    def ledger_fields(self) -> dict[str, tuple[float, str]]:
        """What ``Ledger.record(name, timing)`` records: ``name_ms`` (the median per call) and
        ``name_iqr_ms``."""
        return {"ms": (self.median_ms, "ms"), "iqr_ms": (self.iqr_ms, "ms")}

    def __str__(self) -> str:
        flag = "  (noisy)" if self.noisy else ""
        return (
            f"{self.label}: median {_fmt_ms(self.median_ms)}, IQR {_fmt_ms(self.iqr_ms)} "
            f"({self.iqr_fraction:.0%}), {self.n_blocks} blocks x {self.calls_per_block} "
            f"calls on {self.device}{flag}"
        )


def _fmt_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1e3:.3f} s"
    if ms >= 1:
        return f"{ms:.3f} ms"
    if ms >= 1e-3:
        return f"{ms * 1e3:.1f} us"
    return f"{ms * 1e6:.1f} ns"


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"expected a callable to time, got {type(fn).__name__} ({fn!r:.60}); "
            "pass the function itself (f), not its result (f())"
        )


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _device_clock(dev: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` read after the work queued on ``dev`` has finished.

    torch.utils.benchmark's own clock synchronises the *current* CUDA device,
    which is not the one being timed when ``dev`` is another GPU.
    """
    if dev.type == "cpu":
        return time.perf_counter

    def clock() -> float:
        synchronize(dev)
        return time.perf_counter()

    return clock


def _estimate_call_s(call: Callable[[], None], dev: torch.device, block_s: float) -> float:
    """Median wall time of up to 3 synchronised calls; one suffices when a call
    already outlasts a block (the block is then a single call anyway)."""
    samples = []
    for _ in range(3):
        synchronize(dev)
        t0 = time.perf_counter()
        call()
        synchronize(dev)
        samples.append(time.perf_counter() - t0)
        if samples[-1] >= block_s:
            break
    return statistics.median(samples)


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    label: str | None = None,
    device: str | torch.device | None = None,
    min_run_time_s: float = 0.5,
    warmup: int = 3,
    num_threads: int | None = None,
    warn_if_noisy: bool = True,
    min_blocks: int = 5,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)`` and return its per-call statistics.

    The callable is warmed up (first calls pay for allocation, autotuning and
    compilation), then timed in blocks of calls with a clock that synchronises
    ``device`` before every reading, under torch.utils.benchmark's thread-count
    control. Blocks are sized from a timed warm-up call so that about 20 of them
    fill ``min_run_time_s`` (at least ``min_blocks``); the median and IQR are
    over blocks.

    Args:
        fn: what to time.
        *args: positional arguments for ``fn``.
        label: a name for tables and plots (default: the function's name).
        device: where ``fn`` runs: this device is synchronised before every
            clock reading, and named in the record.
        min_run_time_s: total time to spend measuring, in seconds (> 0).
        warmup: untimed calls before measuring (>= 0).
        num_threads: CPU threads for the measurement (default: the current
            ``torch.get_num_threads()``; the Timer's own default is 1).
        warn_if_noisy: warn when IQR/median > 10%.
        min_blocks: the fewest timed blocks (>= 1), however long a call takes.
        **kwargs: keyword arguments for ``fn``.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``min_run_time_s`` is not positive or ``warmup`` is negative.
    """
    _check_callable(fn)
    if not (isinstance(min_run_time_s, (int, float)) and min_run_time_s > 0):
        raise ValueError(f"min_run_time_s must be a positive number of seconds, got {min_run_time_s!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    if not isinstance(min_blocks, int) or min_blocks < 1:
        raise ValueError(f"min_blocks must be a positive int, got {min_blocks!r}")
    dev = pick_device(device)
    name = label or getattr(fn, "__name__", "fn")

    def call() -> None:
        fn(*args, **kwargs)

    threads = num_threads or torch.get_num_threads()
    # torch's Timer.timeit() adds max(number // 100, 2) untimed calls to every
    # block, which triples the cost of timing a slow step one call at a time,
    # and its clock synchronises the current CUDA device, not necessarily `dev`.
    # So we drive blocks ourselves with timeit and a clock of our own.
    clock = timeit.Timer(stmt="__course_call()", globals={"__course_call": call},
                         timer=_device_clock(dev))
    with _tb_common.set_torch_threads(threads):
        for _ in range(warmup):
            call()
        # Estimate one call (these calls warm up too), then size the blocks so
        # that ~20 of them fill min_run_time_s and each lasts >= 1 ms, which
        # keeps the clock's own overhead (about a microsecond) negligible.
        target_block_s = max(min_run_time_s / 20, 1e-3)
        estimate_s = _estimate_call_s(call, dev, target_block_s)
        number = max(1, round(target_block_s / max(estimate_s, 1e-9)))
        raw_s: list[float] = []
        while sum(raw_s) < min_run_time_s or len(raw_s) < min_blocks:
            raw_s.append(clock.timeit(number))
    task = _tb_common.TaskSpec(stmt=name, setup="", label=name, description=str(dev),
                               num_threads=threads)
    m = tbench.Measurement(number_per_run=number, raw_times=raw_s, task_spec=task)
    times_ms = tuple(t / number * 1e3 for t in raw_s)  # per call, one value per block
    result = Timing.from_times(name, times_ms, number, str(dev),
                               f"timeit blocks, {dev} synchronised at every clock reading", m)
    if warn_if_noisy and result.noisy:
        warnings.warn(
            f"{name}: IQR is {result.iqr_fraction:.0%} of the median "
            f"({_fmt_ms(result.iqr_ms)} of {_fmt_ms(result.median_ms)}); the machine is "
            "busy or the work is too short. Close other work, or raise min_run_time_s.",
            NoisyMeasurementWarning,
            stacklevel=2,
        )
    return result


def cold_l2_benchmark(
    fn: Callable[..., Any],
    *args: Any,
    label: str | None = None,
    device: str | torch.device | None = "cuda",
    n_iter: int = 50,
    warmup: int = 5,
    flush_bytes: int | None = None,
    flush_l2: bool = True,
    **kwargs: Any,
) -> Timing:
    """Time single CUDA calls with a cold L2 cache, each with its own CUDA events.

    Before every call a buffer larger than the L2 cache is zeroed, so the
    kernel reads its inputs from HBM the way it would inside a big model.
    With ``flush_l2=False`` a tiny buffer is zeroed instead: the same launches,
    the same clock, but a warm L2. Compare those two to see what the L2 did;
    comparing with :func:`benchmark` (blocks of back-to-back calls on the host
    clock) mixes in a different measurement method.

    Args:
        fn: the kernel launch to time.
        n_iter: timed calls (>= 1).
        warmup: untimed calls first (>= 0).
        flush_bytes: size of the flush buffer (default: 4 x L2, at least 64 MiB).
        flush_l2: ``False`` for the warm-L2 control (a 4 KiB buffer is zeroed).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: bad counts, or no CUDA GPU (this method needs CUDA events).
    """
    _check_callable(fn)
    if not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"n_iter must be a positive int, got {n_iter!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    dev = pick_device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"cold_l2_benchmark needs a CUDA device (got {str(dev)!r}): it uses CUDA "
            "events and flushes the GPU's L2 cache. Use benchmark() on the CPU."
        )
    if not flush_l2:
        flush_bytes = 4096
    elif flush_bytes is None:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 0
        flush_bytes = max(4 * l2, 64 * 1024**2)
    # Events record on the current stream of the current device: make that `dev`.
    with torch.cuda.device(dev):
        flush = torch.empty(int(flush_bytes) // 4, dtype=torch.int32, device=dev)
        for _ in range(warmup):
            fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_iter)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_iter)]
        for i in range(n_iter):
            flush.zero_()
            starts[i].record()
            fn(*args, **kwargs)
            ends[i].record()
        torch.cuda.synchronize(dev)
    times_ms = tuple(s.elapsed_time(e) for s, e in zip(starts, ends))
    how = "L2 flushed" if flush_l2 else "L2 warm (4 KiB zeroed)"
    return Timing.from_times(label or getattr(fn, "__name__", "fn"), times_ms, 1, str(dev),
                             f"CUDA events per call, {how} before each call")


def _key(label: str) -> str:
    """A label as part of a ledger key: lower case, runs of other characters turned into ``_``."""
    import re

    return re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_") or "row"


@dataclass(frozen=True)
class SpeedupRow:
    label: str
    median_ms: float
    iqr_ms: float
    speedup: float  # baseline median / this median; > 1 is faster
    noisy: bool


@dataclass(frozen=True)
class SpeedupTable:
    """A baseline and its candidates, with speedups measured in one run."""

    baseline: str
    rows: tuple[SpeedupRow, ...]

    def speedup(self, label: str) -> float:
        """The speedup of the row called ``label``."""
        for row in self.rows:
            if row.label == label:
                return row.speedup
        raise KeyError(f"no row {label!r}; rows are {[r.label for r in self.rows]}")

    def ledger_fields(self) -> dict[str, tuple[float, str]]:
        """What ``Ledger.record(name, table)`` records: each candidate's speedup over the
        baseline as ``name_<label>`` (the label in lower case, words joined by ``_``)."""
        return {_key(r.label): (r.speedup, "x") for r in self.rows[1:]}

    def to_markdown(self) -> str:
        lines = [
            "| variant | median | IQR | speedup vs " + self.baseline + " |",
            "|---|---:|---:|---:|",
        ]
        for r in self.rows:
            noisy = " (noisy)" if r.noisy else ""
            lines.append(
                f"| {r.label} | {_fmt_ms(r.median_ms)} | {_fmt_ms(r.iqr_ms)}{noisy} | {r.speedup:.2f}x |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        width = max(len(r.label) for r in self.rows)
        out = [f"{'variant':<{width}}  {'median':>11}  {'IQR':>11}  speedup vs {self.baseline}"]
        for r in self.rows:
            noisy = "  (noisy)" if r.noisy else ""
            out.append(
                f"{r.label:<{width}}  {_fmt_ms(r.median_ms):>11}  {_fmt_ms(r.iqr_ms):>11}  "
                f"{r.speedup:6.2f}x{noisy}"
            )
        return "\n".join(out)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def compare(baseline: Timing, *candidates: Timing) -> SpeedupTable:
    """Turn a baseline and candidates into a speedup table (baseline first, 1.00x).

    Raises:
        TypeError: an argument is not a :class:`Timing`.
        ValueError: no candidates, or a duplicate label.
    """
    timings = (baseline, *candidates)
    for t in timings:
        if not isinstance(t, Timing):
            raise TypeError(f"compare() takes Timing results, got {type(t).__name__}")
    if not candidates:
        raise ValueError("compare() needs at least one candidate besides the baseline")
    labels = [t.label for t in timings]
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must be unique to compare, got {labels}")
    rows = tuple(
        SpeedupRow(t.label, t.median_ms, t.iqr_ms, baseline.median_ms / t.median_ms, t.noisy)
        for t in timings
    )
    return SpeedupTable(baseline=baseline.label, rows=rows)


def first_call(fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None,
               **kwargs: Any) -> tuple[float, Any]:
    """Seconds of one synchronised call of ``fn(*args, **kwargs)``, and what it returned.

    :func:`utils.first_call_s` for when the result is needed too (to check a compiled
    function's first output against eager's): one call, so a first (compiling) call is timed
    once and its output is not computed a second time.

    Args:
        fn: what to call.
        *args: positional arguments for ``fn``.
        device: synchronised before and after the call (default: the course's device).
        **kwargs: keyword arguments for ``fn``.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    _check_callable(fn)
    dev = pick_device(device)
    synchronize(dev)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    synchronize(dev)
    return time.perf_counter() - start, result


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` intra-op CPU threads in this process, then restore the old count.

    Yields ``n``. The old count comes back even when the block raises.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (threads), got {n!r}")
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


def per_call_ms(fn: Callable[[], Any], n: int, *, device: str | torch.device | None = None,
                desc: str | None = None) -> list[float]:
    """Time ``n`` calls of ``fn()`` one by one, synchronising ``device`` around each: ms per call.

    Each call is its own measurement (first calls included, nothing warmed up), which is what
    a look at first calls or at the spread of single calls needs; for a steady-state time use
    :func:`benchmark`.

    Args:
        fn: what to call (no arguments).
        n: calls to time (>= 0).
        device: synchronised before and after every call (default: the course's device).
        desc: a progress bar's title (no bar when ``None``).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``n`` is not a non-negative int.
    """
    _check_callable(fn)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    dev = pick_device(device)
    calls: Any = range(n)
    if desc is not None:
        from tqdm.auto import tqdm

        calls = tqdm(calls, desc=desc, leave=False)
    out = []
    for _ in calls:
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


class BackgroundLoad:
    """A thread that keeps a device busy with ``n x n`` matmuls while the ``with`` block runs.

    On for ``on_s`` seconds, then idle for ``off_s``, repeated (the default: on all the time).
    It disturbs measurements on purpose, to show what noise does to a mean, a median and an IQR.

    Raises:
        ValueError: ``n`` below 1, or a negative ``on_s`` / ``off_s``.
    """

    def __init__(self, device: str | torch.device | None, n: int, on_s: float = 1e9,
                 off_s: float = 0.0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (matrix size), got {n!r}")
        if on_s < 0 or off_s < 0:
            raise ValueError(f"on_s and off_s must not be negative, got {on_s!r}, {off_s!r}")
        self.device, self.n, self.on_s, self.off_s = pick_device(device), n, on_s, off_s
        self.matmuls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a = torch.randn(self.n, self.n, device=self.device)
        b = torch.randn(self.n, self.n, device=self.device)
        while not self._stop.is_set():
            t_end = time.perf_counter() + self.on_s
            while time.perf_counter() < t_end and not self._stop.is_set():
                a @ b
                synchronize(self.device)
                self.matmuls += 1
            self._stop.wait(self.off_s)

    def __enter__(self) -> "BackgroundLoad":
        if self._thread.ident is not None:
            raise RuntimeError("a BackgroundLoad runs once: make a new one for the next block")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class MachineLoad:
    """The machine's 1-minute load average against its logical CPUs (``nan``: no load average
    on this OS). Machine-wide, as the load average is: not a size to compute with."""

    load_1min: float
    cpus: int

    @property
    def oversubscribed(self) -> bool:
        """More runnable processes than CPUs: some waited for a core."""
        return self.load_1min > self.cpus

    def __str__(self) -> str:
        if self.load_1min != self.load_1min:  # NaN
            return "(this OS reports no load average)"
        verdict = ("more runnable processes than CPUs: some waited for a core"
                   if self.oversubscribed else "no more runnable processes than CPUs")
        return f"load average over the last minute {self.load_1min:.1f} on {self.cpus} CPUs: {verdict}"


def machine_load() -> MachineLoad:
    """The load now: runnable processes on the whole machine (1-minute average) and its CPUs."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return MachineLoad(load, os.cpu_count() or 1)


def break_even(one_off_s: float, before: Timing | float, after: Timing | float) -> float:
    """How many calls it takes for a one-off cost (a compile, say) to pay for itself.

    The one-off seconds divided by what each call saves: ``before`` minus ``after``, each a
    :class:`Timing` (its median) or milliseconds per call.

    Args:
        one_off_s: the cost paid once, in seconds (a first, compiling call).
        before: the time per call without it (eager), a ``Timing`` or ms.
        after: the time per call with it (compiled), a ``Timing`` or ms.

    Returns:
        The number of calls, not rounded; ``math.inf`` when ``after`` is not faster than
        ``before`` (the cost never pays).

    Raises:
        ValueError: a negative or non-finite ``one_off_s``, or a time per call that is not a
            positive finite number.
    """
    if not math.isfinite(one_off_s) or one_off_s < 0:
        raise ValueError(f"one_off_s must be a finite number of seconds >= 0, got {one_off_s!r}")
    per_call = [t.median_ms if isinstance(t, Timing) else float(t) for t in (before, after)]
    for name, ms in zip(("before", "after"), per_call):
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"{name} must be a positive time per call (ms), got {ms!r}")
    saved_ms = per_call[0] - per_call[1]
    return one_off_s * 1e3 / saved_ms if saved_ms > 0 else math.inf


class SectionClock:
    """Wall time per section of a notebook, for a run that has a time budget.

    ``lap(section)`` books the time since the previous lap (or since the clock started) to
    ``section``; booking the same section twice adds up. Example::

        CLOCK = utils.SectionClock()
        ...                              # section 1
        CLOCK.lap("1. data")
        ...
        print(CLOCK.report(budget_s=600))
        CLOCK.record(ledger)             # section_wall_s_1_data, ..., notebook_wall_s
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._last = self.start
        self.seconds: dict[str, float] = {}

    def lap(self, section: str) -> float:
        """Book the wall time since the last lap to ``section``; returns the seconds booked."""
        if not section or not isinstance(section, str):
            raise ValueError(f"a section needs a name, got {section!r}")
        now = time.perf_counter()
        booked = now - self._last
        self.seconds[section] = self.seconds.get(section, 0.0) + booked
        self._last = now
        return booked

    @property
    def total_s(self) -> float:
        """Seconds from the clock's start to the last lap."""
        return self._last - self.start

    def report(self, budget_s: float | None = None) -> str:
        """Each section's seconds, the total, and (with ``budget_s``) whether it is within it."""
        text = ("wall time per section: "
                + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
                + f"\nin all {self.total_s:.0f} s from the clock's start to the last lap")
        if budget_s is not None:
            text += (f", against a budget of {budget_s:g} s "
                     f"({'within' if self.total_s <= budget_s else 'OVER'} it)")
        return text

    def record(self, ledger: Any, prefix: str = "section_wall_s_",
               total: str = "notebook_wall_s") -> None:
        """Record each section as ``<prefix><key>`` (the section's name in lower case, each run of
        other characters one ``_``) and the total as ``total``, in seconds."""
        from .ledger import ledger_key

        for section, seconds in self.seconds.items():
            ledger.record(f"{prefix}{ledger_key(section)}", seconds, "s", note=section)
        ledger.record(total, self.total_s, "s", note="from the clock's start to the last lap")
