"""Tools for the memory-efficiency module: where memory goes over time, and getting it back.

- :class:`record_memory` records every allocation and free of a piece of work.
  On CUDA it switches on the caching allocator's own history
  (``torch.cuda.memory._record_memory_history``) and reads the snapshot back;
  on a CPU, which has no such allocator, :class:`utils.memory.TensorMemoryTracker`
  (a dispatch mode) watches the storage of every tensor an operator returns.
  Both give a :class:`MemoryTimeline`,
  which :func:`plot_memory_timeline` draws offline (no website needed), split
  by the line of code that allocated each tensor. A CPU timeline can also
  enforce a memory budget that raises ``torch.OutOfMemoryError``, a stand-in
  for a device's limit.
- :class:`MemoryMeter` (defined in :mod:`utils.memory`, re-exported here) reads the tensor
  memory a block of code adds, and its peak, on either device (the allocator's counters on
  CUDA, the same storage tracker on a CPU).
- :func:`find_max_batch` finds the largest batch that fits: it grows the batch
  until a trial raises ``torch.OutOfMemoryError``, then bisects, and leaves
  the allocator as it found it (gradients freed, no exception kept alive,
  cached blocks returned).
- :func:`batch_finder_faults` runs a batch-size finder of one's own on steps that fail on
  purpose and lists what it gets wrong (a message read instead of the error's class, no
  bisection, no cleanup, a live exception during the cleanup).
- :class:`SavedTensorCompression` keeps the tensors autograd saves for
  backward in bf16 or int8 (``torch.autograd.graph.saved_tensors_hooks``)
  and counts the bytes before and after; :func:`saved_tensor_hook_faults` runs a pair of
  hooks of one's own on probe tensors and lists what they get wrong.
- :func:`optimizer_state_bytes` counts an optimizer's state from its tensors (a quantized state's
  codes, scales and maps too), on one device or all, torchao's offloading optimizer included.
- :func:`host_memory` reads this process's resident and peak resident memory
  from the operating system's own accounting (``/proc/self/status``), and
  :func:`reset_peak_host_memory` restarts the peak, for fresh-process probes.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import pickle
import resource
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch

from .env import pick_device, synchronize
from .memory import (
    _TORCH_DIR,
    BACKWARD_SITE,
    MemoryEvent,
    MemoryMeter,
    OutOfMemoryError,
    TensorMemoryTracker,
    _storage_key,
    format_bytes,
)

__all__ = [
    "OutOfMemoryError",
    "MemoryEvent",
    "MemoryTimeline",
    "record_memory",
    "MemoryMeter",
    "timeline_from_snapshot",
    "plot_memory_timeline",
    "BatchTrial",
    "BatchSearch",
    "find_max_batch",
    "batch_finder_faults",
    "memory_budget",
    "SavedTensorCompression",
    "saved_tensor_hook_faults",
    "optimizer_state_bytes",
    "HostMemory",
    "host_memory",
    "reset_peak_host_memory",
]

#: Frames of a CUDA snapshot's stacks that never name an allocation site.
_SKIP_FILES = (_TORCH_DIR, os.path.abspath(__file__), os.sep + "contextlib.py", "<frozen")


# --------------------------------------------------------------------------------------
# Timelines
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryTimeline:
    """The allocations and frees of one recorded piece of work, in order.

    ``start_bytes`` is what was allocated before recording began (CUDA) or 0
    (CPU: only memory created by the recorded work is seen). Frees of blocks
    allocated before recording are dropped: the timeline is memory *added*.
    """

    events: tuple[MemoryEvent, ...]
    device: str
    method: str
    start_bytes: int = 0
    dropped_frees: int = 0

    def live_bytes(self) -> list[int]:
        """Tensor bytes alive after each event, above the start."""
        out, live = [], 0
        for e in self.events:
            if e.action == "alloc":
                live += e.size_bytes
            elif e.action == "free":
                live -= e.size_bytes
            out.append(live)
        return out

    def reserved_bytes(self) -> list[int] | None:
        """Bytes the allocator reserved (segments) after each event, above the
        start; ``None`` where there are no segment events (a CPU timeline)."""
        if not any(e.action.startswith("segment") for e in self.events):
            return None
        out, res = [], 0
        for e in self.events:
            if e.action == "segment_alloc":
                res += e.size_bytes
            elif e.action == "segment_free":
                res -= e.size_bytes
            out.append(res)
        return out

    @property
    def peak_bytes(self) -> int:
        """The highest live tensor memory above the start."""
        return max(self.live_bytes(), default=0)

    @property
    def allocations(self) -> int:
        return sum(e.action == "alloc" for e in self.events)

    def by_site(self, at_peak: bool = True) -> dict[str, int]:
        """Bytes per allocation site alive at the peak (or allocated in total),
        largest first."""
        live: dict[int, MemoryEvent] = {}
        best: dict[str, int] = {}
        peak = -1
        current = 0
        totals: Counter[str] = Counter()
        for e in self.events:
            if e.action == "alloc":
                live[e.address] = e
                current += e.size_bytes
                totals[e.site] += e.size_bytes
            elif e.action == "free" and e.address in live:
                current -= live.pop(e.address).size_bytes
            if at_peak and current > peak:
                peak = current
                snap: Counter[str] = Counter()
                for a in live.values():
                    snap[a.site] += a.size_bytes
                best = dict(snap)
        result = best if at_peak else dict(totals)
        return dict(sorted(result.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        return (f"{self.allocations} allocations, peak {format_bytes(self.peak_bytes)} above the "
                f"start [{self.device}, {self.method}]")


class record_memory:
    """Record the allocations of a piece of work: ``with record_memory() as rec: ...``.

    On CUDA this turns on the caching allocator's history
    (``torch.cuda.memory._record_memory_history``, Python stacks) and reads its
    snapshot at exit; :meth:`dump_snapshot` writes that snapshot for the
    PyTorch memory visualizer (https://pytorch.org/memory_viz). On a CPU a
    :class:`utils.memory.TensorMemoryTracker` records tensor storages instead
    (the same events, without the allocator's segments). Either way
    ``rec.timeline`` is a :class:`MemoryTimeline`.

    Args:
        device: where the work allocates (default: :func:`utils.pick_device`).
        max_entries: CUDA only: the most events the allocator keeps.
        limit_bytes: CPU only: raise ``torch.OutOfMemoryError`` when live tensor
            memory created inside the block exceeds this budget (a stand-in for
            a device's memory limit; on CUDA use
            ``torch.cuda.set_per_process_memory_fraction``).

    Raises:
        ValueError: a bad ``max_entries`` or ``limit_bytes``, or ``limit_bytes``
            on CUDA.
    """

    def __init__(self, device: str | torch.device | None = None, *, max_entries: int = 200_000,
                 limit_bytes: int | None = None) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or limit_bytes <= 0):
            raise ValueError(f"limit_bytes must be a positive int of bytes, got {limit_bytes!r}")
        self.device = pick_device(device)
        if limit_bytes is not None and self.device.type == "cuda":
            raise ValueError("limit_bytes is the CPU stand-in for a device limit; on CUDA use "
                             "torch.cuda.set_per_process_memory_fraction (find_max_batch does)")
        self.max_entries = max_entries
        self.limit_bytes = limit_bytes
        self.snapshot: dict[str, Any] | None = None
        self._timeline: MemoryTimeline | None = None
        self._recorder: TensorMemoryTracker | None = None

    def __enter__(self) -> "record_memory":
        if self.device.type == "cuda":
            synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            kwargs: dict[str, Any] = dict(context="all", stacks="python",
                                          max_entries=self.max_entries)
            if "clear_history" in inspect.signature(
                    torch.cuda.memory._record_memory_history).parameters:
                kwargs["clear_history"] = True
            torch.cuda.memory._record_memory_history("all", **kwargs)
            # Where clear_history is missing, skip whatever an earlier recording left.
            self._skip = len(self._trace(torch.cuda.memory._snapshot()))
        else:
            self._recorder = TensorMemoryTracker(limit_bytes=self.limit_bytes,
                                                 record_events=True)
            self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            try:
                self.snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(None)
            trace = self._trace(self.snapshot)
            del trace[:self._skip]
            self._timeline = timeline_from_snapshot(self.snapshot, self.device,
                                                    start_bytes=self._start)
        else:
            rec = self._recorder
            assert rec is not None
            rec.__exit__(*exc)
            rec.stop_recording()  # frees after the block are no longer part of the timeline
            self._timeline = MemoryTimeline(
                events=tuple(rec.events or ()), device=str(self.device),
                method="tensor storages recorded with TorchDispatchMode")

    def _trace(self, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return snapshot["device_traces"][index]

    @property
    def live_bytes_now(self) -> int:
        """CPU: tensor bytes created inside the block and still alive (even after it)."""
        if self._recorder is None:
            raise ValueError("live_bytes_now is for CPU recordings; on CUDA read "
                             "torch.cuda.memory_allocated()")
        return self._recorder.current_bytes

    @property
    def timeline(self) -> MemoryTimeline:
        if self._timeline is None:
            raise ValueError("the recording is not finished: read .timeline after the with block")
        return self._timeline

    def dump_snapshot(self, path: str | os.PathLike) -> Path | None:
        """Write the CUDA snapshot as a pickle for https://pytorch.org/memory_viz
        (drag the file onto the page). Returns ``None`` on a CPU, which has none."""
        if self.snapshot is None:
            return None
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as fh:
            pickle.dump(self.snapshot, fh)
        return p


def _site_from_frames(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost frame of a snapshot's stack that is outside torch."""
    for fr in frames:  # innermost first
        fn = str(fr.get("filename", ""))
        unix = fn.replace("\\", "/")
        if (not fn or fn.startswith("??") or any(s in fn for s in _SKIP_FILES)
                or "/torch/" in unix or unix.endswith("/memtools.py")):
            continue  # torch's own frames (also from another machine's install)
        if not fn.endswith(".py"):
            continue
        return f"{os.path.basename(fn)}:{fr.get('line', 0)} {fr.get('name', '?')}"
    return BACKWARD_SITE if not frames else "<inside torch>"


def timeline_from_snapshot(snapshot: Mapping[str, Any] | str | os.PathLike,
                           device: int | str | torch.device | None = None, *,
                           start_bytes: int = 0) -> MemoryTimeline:
    """A :class:`MemoryTimeline` from a CUDA memory snapshot (a dict, or a pickle
    written by ``torch.cuda.memory._dump_snapshot``).

    A block counts as freed at its first ``free_requested`` or
    ``free_completed`` event. Unpickling runs code from the file: open only
    snapshots you wrote yourself.

    Raises:
        ValueError: the object has no ``device_traces`` (not a snapshot), or
            there is no trace for ``device``.
    """
    if isinstance(snapshot, (str, os.PathLike)):
        with open(snapshot, "rb") as fh:
            snapshot = pickle.load(fh)  # noqa: S301 - the caller's own file, documented above
    if not isinstance(snapshot, Mapping) or "device_traces" not in snapshot:
        raise ValueError("not a CUDA memory snapshot: expected a dict with 'device_traces' "
                         "(from torch.cuda.memory._snapshot() or _dump_snapshot)")
    if device is None:
        index = 0
    elif isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        index = dev.index if dev.index is not None else (
            torch.cuda.current_device() if torch.cuda.is_available() else 0)
    traces = snapshot["device_traces"]
    if index >= len(traces):
        raise ValueError(f"the snapshot has traces for {len(traces)} device(s), not device {index}")
    events: list[MemoryEvent] = []
    live: dict[int, MemoryEvent] = {}
    dropped = 0
    for te in traces[index]:
        action = te.get("action")
        addr, size = int(te.get("addr", 0) or 0), int(te.get("size", 0) or 0)
        if action == "alloc":
            ev = MemoryEvent("alloc", addr, size, _site_from_frames(te.get("frames", [])))
            live[addr] = ev
            events.append(ev)
        elif action in ("free_requested", "free_completed"):
            a = live.pop(addr, None)
            if a is not None:
                events.append(MemoryEvent("free", addr, a.size_bytes, a.site))
            elif action == "free_requested":
                dropped += 1
        elif action in ("segment_alloc", "segment_free", "oom"):
            events.append(MemoryEvent(action, addr, size, _site_from_frames(te.get("frames", []))))
    return MemoryTimeline(events=tuple(events), device=f"cuda:{index}",
                          method="CUDA caching allocator history (_record_memory_history)",
                          start_bytes=start_bytes, dropped_frees=dropped)


def plot_memory_timeline(timeline: MemoryTimeline, ax: Any = None, top: int = 8,
                         title: str = "", marks: Mapping[str, int] | None = None) -> Any:
    """Live tensor memory over the recorded events, stacked by allocation site.

    The ``top`` sites that hold the most memory at the peak get their own
    colour; the rest are grouped as "other". On CUDA the reserved memory
    (segments) is drawn as a dashed line above the stack.

    Args:
        timeline: from :class:`record_memory` or :func:`timeline_from_snapshot`.
        ax: a matplotlib Axes (default: a new figure).
        top: how many sites get their own band (>= 1).
        title: the plot title.
        marks: optional ``{label: event index}`` drawn as vertical lines
            (e.g. where the backward pass starts).

    Raises:
        ValueError: an empty timeline or a bad ``top``.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from .plots import use_style

    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}")
    if not timeline.events:
        raise ValueError("the timeline has no events: was anything allocated while recording?")
    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    ranked = list(timeline.by_site(at_peak=True))
    if not ranked:
        ranked = list(timeline.by_site(at_peak=False))
    keep = ranked[:top]
    bands = keep + (["other"] if len(ranked) > top or len(ranked) == 0 else [])
    index = {s: i for i, s in enumerate(keep)}
    n = len(timeline.events)
    stack = np.zeros((len(bands), n + 1))
    current = np.zeros(len(bands))
    live: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(timeline.events):
        if e.action == "alloc":
            b = index.get(e.site, len(bands) - 1)
            live[e.address] = (b, e.size_bytes)
            current[b] += e.size_bytes
        elif e.action == "free" and e.address in live:
            b, size = live.pop(e.address)
            current[b] -= size
        stack[:, i + 1] = current
    x = np.arange(n + 1)
    ax.stackplot(x, stack / 2**20, labels=bands, step="post", alpha=0.85)
    reserved = timeline.reserved_bytes()
    if reserved is not None:
        ax.step(x, np.array([0, *reserved]) / 2**20, where="post", color="black", ls="--", lw=1,
                label="reserved by the allocator (segments)")
    for label, pos in (marks or {}).items():
        ax.axvline(pos, color="grey", lw=1, ls=":")
        ax.annotate(label, (pos, ax.get_ylim()[1] * 0.97), xytext=(3, 0),
                    textcoords="offset points", va="top", fontsize=8, color="dimgray")
    ax.set_xlabel("allocator event (allocations and frees, in order)")
    ax.set_ylabel("memory above the start (MiB)")
    ax.set_title(title or f"memory timeline: peak {format_bytes(timeline.peak_bytes)}")
    ax.legend(loc="upper left", fontsize=7, bbox_to_anchor=(1.01, 1.0))
    ax.set_xlim(0, n)
    return ax


# --------------------------------------------------------------------------------------
# Batch-size search
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchTrial:
    """One try of :func:`find_max_batch`: did ``batch`` fit, and its peak memory
    above the start (``None`` when it ran out)."""

    batch: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str = ""


@dataclass(frozen=True)
class BatchSearch:
    """The answer of :func:`find_max_batch`.

    ``max_batch`` fits and ``first_failing`` (the smallest batch seen to run out
    of memory, ``None`` if none did) bounds the true largest batch from above.
    The ``*_before_bytes`` / ``*_after_bytes`` pairs show that the search left
    memory as it found it (on a CPU, "allocated" counts live tensors created by
    the trials and "reserved" is ``None``).
    """

    max_batch: int
    first_failing: int | None
    trials: tuple[BatchTrial, ...]
    budget_bytes: int | None
    allocated_before_bytes: int
    allocated_after_bytes: int
    reserved_before_bytes: int | None
    reserved_after_bytes: int | None
    device: str

    @property
    def gap(self) -> float:
        """Upper bound on (largest batch that fits) / ``max_batch``: 1.0 when the
        next batch up was seen to fail."""
        if self.first_failing is None:
            return math.inf
        return (self.first_failing - 1) / self.max_batch

    def __str__(self) -> str:
        tried = ", ".join(f"{t.batch}{'' if t.fits else ' (OOM)'}" for t in self.trials)
        return (f"largest batch that fits: {self.max_batch} (smallest that failed: "
                f"{self.first_failing}); {len(self.trials)} trials: {tried}")


def _clean_after_oom(dev: torch.device) -> None:
    gc.collect()  # a traceback's frames can sit in reference cycles with the tensors they hold
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _limit_cuda_memory(dev: torch.device, reserved_bytes: int, budget_bytes: int) -> float:
    """Limit the caching allocator on ``dev`` to ``budget_bytes`` above ``reserved_bytes``
    (``torch.cuda.set_per_process_memory_fraction``); returns the fraction to put back."""
    total = torch.cuda.get_device_properties(dev).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old_fraction = float(getter(dev)) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved_bytes + budget_bytes) / total),
                                               dev)
    return old_fraction


def find_max_batch(trial: Callable[[int], Any], *, start: int = 1, max_batch: int = 1 << 20,
                   budget_bytes: int | None = None, cleanup: Callable[[], None] | None = None,
                   device: str | torch.device | None = None, rel_tol: float = 0.0,
                   progress: Callable[[BatchTrial], None] | None = None) -> BatchSearch:
    """Largest batch for which ``trial(batch)`` does not run out of memory.

    The batch doubles from ``start`` until a trial raises
    ``torch.OutOfMemoryError`` (or reaches ``max_batch``), then the search
    bisects between the last batch that fit and the first that did not, until
    they are adjacent (or within ``rel_tol``). Only the out-of-memory error is
    caught; any other error propagates. After every trial the exception is
    dropped (its traceback holds the trial's tensors), ``cleanup`` runs (free
    the gradients there), and after an out-of-memory the garbage collector
    runs and, on CUDA, cached blocks go back to the driver. The garbage
    collector also runs before the first trial, so that garbage left by
    earlier work is not freed inside the search, where it would be counted.

    Args:
        trial: runs the work at one batch size (e.g. one training step); its
            result is discarded.
        start: the first batch to try (>= 1).
        max_batch: never try beyond this.
        budget_bytes: memory the trials may use above what is allocated when
            the search starts. Required on a CPU (a real CPU out-of-memory
            kills the process instead of raising); optional on CUDA, where it
            is enforced by the caching allocator itself
            (``torch.cuda.set_per_process_memory_fraction``) and otherwise the
            device's limit applies.
        cleanup: called after every trial, e.g. ``lambda: model.zero_grad(set_to_none=True)``.
        device: where the trials allocate (default: :func:`utils.pick_device`).
        rel_tol: stop bisecting when the gap is within this fraction of the
            batch (0 = exact).
        progress: called with each :class:`BatchTrial` as it finishes.

    Raises:
        ValueError: bad arguments, a missing CPU budget, or ``start`` itself
            does not fit.
    """
    if not callable(trial):
        raise TypeError(f"trial must be a callable taking a batch size, got {type(trial).__name__}")
    for name, v in (("start", start), ("max_batch", max_batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if start > max_batch:
        raise ValueError(f"start ({start}) is above max_batch ({max_batch})")
    if not (isinstance(rel_tol, (int, float)) and 0 <= rel_tol < 1):
        raise ValueError(f"rel_tol must be in [0, 1), got {rel_tol!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    dev = pick_device(device)
    if dev.type != "cuda" and budget_bytes is None:
        raise ValueError("on a CPU give budget_bytes: running out of host memory gets the "
                         "process killed by the operating system, not an exception to catch")
    recorder: TensorMemoryTracker | None = None
    old_fraction: float | None = None
    if dev.type == "cuda":
        synchronize(dev)
        _clean_after_oom(dev)
        alloc0 = torch.cuda.memory_allocated(dev)
        res0: int | None = torch.cuda.memory_reserved(dev)
        if budget_bytes is not None:
            old_fraction = _limit_cuda_memory(dev, res0, budget_bytes)
    else:
        _clean_after_oom(dev)  # as on CUDA: garbage of earlier work is not freed inside the search
        alloc0, res0 = 0, None
        recorder = TensorMemoryTracker(limit_bytes=budget_bytes, count_existing_frees=True)

    trials: list[BatchTrial] = []

    def attempt(batch: int) -> bool:
        if dev.type == "cuda":
            # Every trial starts from the same allocator state: blocks cached by the last
            # trial would otherwise serve (or fragment) this one, and a borderline batch
            # could fit in one search and not in the next.
            synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        elif recorder is not None:
            recorder.reset_peak()
        t0 = time.perf_counter()
        error = ""
        try:
            if recorder is not None:
                with recorder:
                    trial(batch)
            else:
                trial(batch)
                synchronize(dev)
            fits = True
        except OutOfMemoryError as exc:
            fits = False
            error = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "out of memory"
            del exc
        seconds = time.perf_counter() - t0
        if fits:
            peak = (torch.cuda.max_memory_allocated(dev) - alloc0 if dev.type == "cuda"
                    else recorder.peak_bytes if recorder is not None else None)
        else:
            peak = None
        if cleanup is not None:
            cleanup()
        if not fits:
            _clean_after_oom(dev)
        t = BatchTrial(batch, fits, peak, seconds, error)
        trials.append(t)
        if progress is not None:
            progress(t)
        return fits

    try:
        if not attempt(start):
            raise ValueError(f"even the first batch ({start}) runs out of memory: "
                             f"{trials[-1].error}")
        lo, hi = start, None
        b = start
        while hi is None and b < max_batch:
            b = min(2 * b, max_batch)
            if attempt(b):
                lo = b
            else:
                hi = b
        while hi is not None and hi - lo > max(1, int(lo * rel_tol)):
            mid = (lo + hi) // 2
            if attempt(mid):
                lo = mid
            else:
                hi = mid
    except BaseException as first:
        # Put the allocator's limit back, but never let a failure to do so replace the error
        # that stopped the search: that one is what the reader needs to see.
        if old_fraction is not None:
            try:
                torch.cuda.set_per_process_memory_fraction(old_fraction, dev)
            except Exception as restore_error:  # noqa: BLE001 - reported on the first error
                if hasattr(first, "add_note"):  # Python 3.11+
                    first.add_note(f"(and restoring the memory fraction failed: {restore_error})")
            old_fraction = None
        raise
    finally:
        if old_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(old_fraction, dev)
        if dev.type == "cuda":
            synchronize(dev)
            _clean_after_oom(dev)
            alloc1 = torch.cuda.memory_allocated(dev)
            res1: int | None = torch.cuda.memory_reserved(dev)
        else:
            gc.collect()
            alloc1 = recorder.current_bytes if recorder is not None else 0
            res1 = None
    return BatchSearch(max_batch=lo, first_failing=hi, trials=tuple(trials),
                       budget_bytes=budget_bytes, allocated_before_bytes=alloc0,
                       allocated_after_bytes=alloc1, reserved_before_bytes=res0,
                       reserved_after_bytes=res1, device=str(dev))



class _ProbeOutOfMemory(OutOfMemoryError):
    """The out-of-memory error of :func:`batch_finder_faults`' step: its message does not say
    "out of memory", and it records a weak reference to itself (an exception held by a local
    name of the frame that raised it would sit in a cycle with its own traceback)."""

    def __init__(self, message: str, refs: list[weakref.ref]) -> None:
        super().__init__(message)
        refs.append(weakref.ref(self))


def batch_finder_faults(finder: Callable[[Callable[[int], Any], Callable[[], Any]], int], *,
                        fits_up_to: int = 5) -> list[str]:
    """The faults of a batch-size finder, found by running it on steps that fail on purpose.

    ``finder(step, cleanup)`` should return the largest batch for which ``step(batch)`` does
    not raise ``torch.OutOfMemoryError``, as :func:`find_max_batch` does. Two runs, with
    steps that allocate nothing:

    1. ``step`` raises ``torch.OutOfMemoryError`` for every batch above ``fits_up_to``, with a
       message that does not say "out of memory" (a memory budget's error need not). The
       finder must return ``fits_up_to`` (5 by default, not a power of two: a finder that
       only doubles returns 4), call ``cleanup()`` after every call of ``step``, and have
       dropped the exception by then (a live exception holds the failed step's frames, and
       they its tensors).
    2. ``step`` raises a plain ``RuntimeError`` whose message says "out of memory" for every
       batch above ``fits_up_to``. It is not an out-of-memory error, and must propagate.

    Args:
        finder: the finder to check, called as ``finder(step, cleanup)``.
        fits_up_to: the largest batch the steps let through (>= 2).

    Returns:
        One sentence per fault found; an empty list when there is none.

    Raises:
        TypeError: ``finder`` is not callable.
        ValueError: ``fits_up_to`` is not an int of at least 2.
    """
    if not callable(finder):
        raise TypeError(f"finder must be callable as finder(step, cleanup), got "
                        f"{type(finder).__name__}")
    if isinstance(fits_up_to, bool) or not isinstance(fits_up_to, int) or fits_up_to < 2:
        raise ValueError(f"fits_up_to must be an int of at least 2, got {fits_up_to!r}")
    faults: list[str] = []
    refs: list[weakref.ref] = []
    pending = [False]  # a step ran and no cleanup() has followed it yet
    missed, held = [False], [False]

    def step(batch: int) -> None:
        missed[0] |= pending[0]
        pending[0] = True
        if batch > fits_up_to:
            raise _ProbeOutOfMemory(f"the probe's step refuses batch {batch}", refs)

    def cleanup() -> None:
        pending[0] = False
        held[0] |= any(r() is not None for r in refs)

    found: Any = None
    try:
        found = finder(step, cleanup)
    except OutOfMemoryError:
        faults.append("an OutOfMemoryError whose message does not say 'out of memory' escaped "
                      "the finder: catch torch.OutOfMemoryError by its class, not by its message")
    if found is not None and found != fits_up_to:
        faults.append(f"it returned {found!r}, where batches up to {fits_up_to} fit and "
                      f"{fits_up_to + 1} does not: after the first failure, bisect")
    if missed[0] or (pending[0] and found is not None):  # an escaped error skips the last one
        faults.append("cleanup() did not run after every try")
    if held[0]:
        faults.append("cleanup() ran while the OutOfMemoryError was still alive (its traceback "
                      "holds the failed step's frames and their tensors): drop it first")

    def other_step(batch: int) -> None:
        if batch > fits_up_to:
            raise RuntimeError("not an OutOfMemoryError, though this message says out of memory")

    try:
        finder(other_step, lambda: None)
    except Exception:  # noqa: BLE001 - any error that reaches the caller is not swallowed
        pass
    else:
        faults.append("it swallowed a RuntimeError that is not an OutOfMemoryError (its "
                      "message said 'out of memory'): catch torch.OutOfMemoryError only")
    return faults

class memory_budget:
    """Run a block against a memory budget, as :func:`find_max_batch` runs its trials.

    ``with memory_budget(budget_bytes) as budget: search()`` lets the block use
    ``budget_bytes`` of tensor memory and raises ``torch.OutOfMemoryError`` past it: on
    CUDA the caching allocator itself is limited to the budget above what it has reserved
    on entry (``torch.cuda.set_per_process_memory_fraction``, put back on exit), on a CPU
    a :class:`utils.memory.TensorMemoryTracker` counts the tensor bytes created inside
    the block (a real CPU out-of-memory kills the process instead of raising). On entry
    the garbage collector runs and, on CUDA, cached blocks go back to the driver, so the
    starting point is what is really in use. After the block, ``allocated_left_bytes``
    is the tensor memory it left allocated, and ``reserved_left_bytes`` (CUDA; ``None``
    on a CPU) what it left reserved, both above where it started.

    Args:
        budget_bytes: memory the block may use (a positive int).
        device: where the block allocates (default: :func:`utils.pick_device`).

    Raises:
        ValueError: a budget that is not a positive int.
    """

    def __init__(self, budget_bytes: int, device: str | torch.device | None = None) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.device = pick_device(device)
        self.allocated_left_bytes: int | None = None
        self.reserved_left_bytes: int | None = None
        self._recorder: TensorMemoryTracker | None = None
        self._old_fraction: float | None = None

    def __enter__(self) -> "memory_budget":
        gc.collect()  # a dropped exception's frames can sit in reference cycles
        dev = self.device
        if dev.type == "cuda":
            synchronize(dev)
            torch.cuda.empty_cache()
            self._alloc0 = torch.cuda.memory_allocated(dev)
            self._res0 = torch.cuda.memory_reserved(dev)
            self._old_fraction = _limit_cuda_memory(dev, self._res0, self.budget_bytes)
        else:
            self._recorder = TensorMemoryTracker(limit_bytes=self.budget_bytes,
                                                 count_existing_frees=True)
            self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(self._old_fraction, dev)
            synchronize(dev)
            self.allocated_left_bytes = torch.cuda.memory_allocated(dev) - self._alloc0
            self.reserved_left_bytes = torch.cuda.memory_reserved(dev) - self._res0
        else:
            assert self._recorder is not None
            self._recorder.__exit__(*exc)
            self.allocated_left_bytes = self._recorder.current_bytes


# --------------------------------------------------------------------------------------
# Compressing saved activations
# --------------------------------------------------------------------------------------
class SavedTensorCompression(torch.autograd.graph.saved_tensors_hooks):
    """Keep the tensors autograd saves for backward in a smaller format.

    ``with SavedTensorCompression("bf16", keep=model.parameters()) as comp:``
    around the forward pass: every floating-point tensor saved for backward
    (except those in ``keep`` and tiny ones) is stored as bfloat16, or as int8
    with one float32 scale per block of 256 values (absmax), and turned back
    into its dtype when backward needs it. The original then dies with the
    forward pass, unless something else still holds it.

    A storage saved more than once through views that cover all of it (an
    attention output saved by the attention op and, reshaped, by the next
    Linear) is compressed once and shared. Counters: ``original_bytes`` (what
    the saved tensors occupy, each view counted), ``packed_bytes`` (what is
    stored instead), ``kept_bytes`` (tensors in ``keep``, saved as they are).

    Args:
        mode: ``"bf16"``, ``"int8"`` or ``"none"`` (count only).
        keep: tensors saved as they are: pass the model's parameters, which
            live anyway (a compressed copy of a weight *adds* memory).
        min_numel: tensors with fewer elements are saved as they are.

    Raises:
        ValueError: an unknown mode or a negative ``min_numel``.
    """

    MODES = ("none", "bf16", "int8")
    INT8_BLOCK = 256

    def __init__(self, mode: Literal["none", "bf16", "int8"] = "bf16",
                 keep: Iterable[torch.Tensor] = (), min_numel: int = 1024) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
        self.mode = mode
        self.min_numel = min_numel
        self._keep = {k for t in keep if (k := _storage_key(t)) is not None}
        self._shared: dict[tuple[Any, ...], tuple[weakref.ref, Any]] = {}
        self.saved_tensors = 0
        self.compressed_tensors = 0
        self.shared_tensors = 0
        self.original_bytes = 0
        self.packed_bytes = 0
        self.kept_bytes = 0
        super().__init__(self._pack, self._unpack)
        self.pack_hook = self.unpack_hook = None  # set on entering: see __enter__

    def __enter__(self) -> "SavedTensorCompression":
        # The base class keeps the two bound methods on the object, and each holds the object:
        # a reference cycle, which only the garbage collector frees (possibly inside a later
        # memory measurement). They are set on entering and dropped on leaving; the graph's
        # saved tensors hold the unpack hook, and with it the object, until backward is done.
        self.pack_hook, self.unpack_hook = self._pack, self._unpack
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.pack_hook = self.unpack_hook = None

    def _compress(self, flat: torch.Tensor) -> tuple[Any, ...]:
        if self.mode == "bf16":
            packed = flat.to(torch.bfloat16)
            self.packed_bytes += packed.numel() * 2
            return ("bf16", packed)
        n, b = flat.numel(), self.INT8_BLOCK
        blocks = torch.nn.functional.pad(flat.float(), (0, (-n) % b)).view(-1, b)
        scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
        q = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
        self.packed_bytes += q.numel() + scale.numel() * 4
        return ("int8", q, scale, n)

    @staticmethod
    def _decompress(packed: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        if packed[0] == "bf16":
            return packed[1].to(dtype)
        _, q, scale, n = packed
        return (q.float() * scale).view(-1)[:n].to(dtype)

    def _pack(self, t: torch.Tensor) -> Any:
        self.saved_tensors += 1
        nbytes = t.numel() * t.element_size()
        key = _storage_key(t)
        if key is not None and key in self._keep:
            self.kept_bytes += nbytes
            return ("raw", t)
        self.original_bytes += nbytes
        if (self.mode == "none" or key is None or not t.is_floating_point()
                or t.numel() < self.min_numel
                or (self.mode == "bf16" and t.dtype in (torch.bfloat16, torch.float16))):
            self.packed_bytes += nbytes
            return ("raw", t)
        self.compressed_tensors += 1
        if nbytes == key[2]:  # the view covers its whole storage: compress the storage once
            share_key = (*key, t.dtype, t._version)
            hit = self._shared.get(share_key)
            if hit is not None and hit[0]() is not None:
                self.shared_tensors += 1
                packed = hit[1]
            else:
                flat = t.detach().as_strided((key[2] // t.element_size(),), (1,), 0)
                packed = self._compress(flat)
                shared = self._shared

                def forget(_: Any, k: tuple[Any, ...] = share_key) -> None:
                    shared.pop(k, None)

                shared[share_key] = (weakref.ref(t, forget), packed)
            return ("storage", packed, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        return ("view", self._compress(t.detach().reshape(-1)), t.dtype, tuple(t.shape))

    def _unpack(self, packed: Any) -> torch.Tensor:
        kind = packed[0]
        if kind == "raw":
            return packed[1]
        flat = self._decompress(packed[1], packed[2])
        if kind == "storage":
            return flat.as_strided(packed[3], packed[4], packed[5])
        return flat.view(packed[3])

    @property
    def ratio(self) -> float:
        """original / packed bytes: how many times smaller the saved activations are."""
        return self.original_bytes / self.packed_bytes if self.packed_bytes else math.nan


def saved_tensor_hook_faults(pack: Callable[[torch.Tensor], Any],
                             unpack: Callable[[Any], torch.Tensor], *,
                             keep: Iterable[torch.Tensor] = (), min_numel: int = 1024,
                             max_rel_error: float, device: str | torch.device | None = None,
                             amax: float = 1e-3) -> list[str]:
    """What a pair of ``saved_tensors_hooks`` gets wrong, found on probe tensors, with no model.

    ``unpack(pack(t))`` is called directly on:

    - every tensor in ``keep`` (a model's parameters, which live anyway), and the transpose of
      each 2-D one (a Linear saves its weight as ``weight.t()``, a view of the parameter's
      storage), a non-floating-point tensor and a floating-point one of ``min_numel - 1``
      elements: each must come back sharing the storage it was given (saved as it is);
    - a floating-point tensor of ``max(min_numel, 4096)`` values drawn uniformly from
      ``[-amax, amax]`` (``amax`` 1e-3: below the smallest value of e4m3, 2^-9, so a format
      without a scale loses them): it must come back with its dtype and shape, and every value
      within 1/16 of the largest magnitude within ``max_rel_error`` of itself, relative. Those
      values stay in an 8-bit float's normal range when the tensor is scaled to the format's
      largest value, where the relative error is at most the format's unit roundoff (2^-4 for
      e4m3, 2^-3 for e5m2).

    Args:
        pack, unpack: the hooks, as given to ``torch.autograd.graph.saved_tensors_hooks``.
        keep: tensors the hooks must save as they are.
        min_numel: tensors with fewer elements must be saved as they are (0 or 1: none).
        max_rel_error: the largest relative error allowed on the probe's large values.
        device: where the probe tensors are made (default: :func:`utils.pick_device`).
        amax: the probe's largest magnitude.

    Returns:
        One sentence per fault found; an empty list when there is none.

    Raises:
        ValueError: a negative ``min_numel``, or a ``max_rel_error`` or ``amax`` that is not
            a positive number.
    """
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
    for name, v in (("max_rel_error", max_rel_error), ("amax", amax)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    dev = pick_device(device)
    gen = torch.Generator().manual_seed(0)

    def kept_as_is(t: torch.Tensor) -> bool:
        with torch.no_grad():
            back = unpack(pack(t))
        return (isinstance(back, torch.Tensor) and back.shape == t.shape
                and _storage_key(back) is not None and _storage_key(back) == _storage_key(t))

    keep = list(keep)
    keep += [t.t() for t in keep if t.dim() == 2]
    faults = []
    copied = sum(not kept_as_is(t) for t in keep)
    if copied:
        faults.append(f"{copied} of {len(keep)} tensors to keep (and the transposes a Linear "
                      "saves of its weight) came back as new tensors: save them as they are")
    if not kept_as_is(torch.arange(max(min_numel, 2), device=dev)):
        faults.append("a tensor of integers came back as a new tensor: save it as it is")
    if min_numel > 1 and not kept_as_is(torch.randn(min_numel - 1, generator=gen).to(dev)):
        faults.append(f"a float tensor of {min_numel - 1} elements (fewer than min_numel) came "
                      "back as a new tensor: save it as it is")
    x = ((torch.rand(max(min_numel, 4096), generator=gen) * 2 - 1) * amax).to(dev)
    with torch.no_grad():
        back = unpack(pack(x))
    if not isinstance(back, torch.Tensor) or back.dtype != x.dtype or back.shape != x.shape:
        got = (f"{back.dtype} {tuple(back.shape)}" if isinstance(back, torch.Tensor)
               else type(back).__name__)
        faults.append(f"a {x.dtype} tensor of shape {tuple(x.shape)} came back as {got}")
    else:
        large = x.abs() >= x.abs().max() / 16
        err = ((back.double() - x.double()).abs() / x.double().abs())[large].max().item()
        if not err <= max_rel_error:  # a NaN fails too
            faults.append(f"values around {amax:g} came back with a relative error of "
                          f"{err:.3g}, more than {max_rel_error:.3g}: lost to the format's "
                          "range (no scale?) or to too few significant bits")
    return faults

# --------------------------------------------------------------------------------------
# Host memory from the operating system
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostMemory:
    """This process's resident memory and its peak, from the operating system."""

    rss_bytes: int | None
    peak_rss_bytes: int
    method: str


def host_memory() -> HostMemory:
    """Resident set size now and at its peak.

    On Linux from ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the kernel's
    accounting of every resident page, file-backed ``mmap`` pages included);
    elsewhere the peak comes from ``resource.getrusage`` (``ru_maxrss``) and the
    current value is unknown.
    """
    try:
        fields: dict[str, int] = {}
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    fields[name] = int(value.split()[0]) * 1024  # kB
        if "VmHWM" in fields:
            return HostMemory(fields.get("VmRSS"), fields["VmHWM"], "/proc/self/status VmRSS/VmHWM")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return HostMemory(None, int(peak) * scale, "resource.getrusage ru_maxrss")


def reset_peak_host_memory() -> bool:
    """Restart the peak (``VmHWM``) at the current resident size; Linux only.

    Returns ``False`` where that is not possible: then subtract a baseline
    taken with :func:`host_memory` instead.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------
# Optimizer state
# --------------------------------------------------------------------------------------
def _tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``; a traceable tensor subclass (torchao's ``OptimState8bit``): its inner tensors."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: Any, device_type: str | None = None) -> int:
    """Bytes of an optimizer's per-parameter state, read from the state tensors themselves.

    Counts every tensor in ``optimizer.state`` except 0-dim ones (the step counters). A
    tensor subclass that flattens into inner tensors (torchao's 8-bit and 4-bit states: codes,
    block scales and a code map) counts as the sum of those. An optimizer that holds others,
    as torchao's ``CPUOffloadOptimizer`` holds one per offloaded parameter (``optim_dict``) and
    one on the device for the small ones (``d_opt``), counts theirs.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or torchao's ``CPUOffloadOptimizer``.
        device_type: count only state on this kind of device (``"cuda"``, ``"cpu"``);
            ``None`` counts all of it.

    Raises:
        ValueError: ``optimizer`` has no ``state`` to read.
    """
    if hasattr(optimizer, "optim_dict"):  # torchao.optim.CPUOffloadOptimizer
        parts = [*optimizer.optim_dict.values()]
        if getattr(optimizer, "d_opt", None) is not None:
            parts.append(optimizer.d_opt)
        return sum(optimizer_state_bytes(o, device_type) for o in parts)
    if not hasattr(optimizer, "state"):
        raise ValueError(f"{type(optimizer).__name__} has no .state to read")
    return sum(_tensor_nbytes(v) for per_param in optimizer.state.values()
               for v in per_param.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0
               and (device_type is None or v.device.type == device_type))
