"""Peak memory, on CUDA and on CPU, and where a training step's memory goes.

On CUDA the caching allocator keeps exact counters: we reset its peak, run the
work and read the peak back. The CPU has no such counters, and process RSS is
blurred by the system allocator, so on the CPU we count tensor storage
directly: a ``TorchDispatchMode`` (:class:`TensorMemoryTracker`) sees every
tensor an operator returns, tracks its storage, and notices when the storage
is freed. The same tracker can keep a list of allocation events with the line
of code behind each (``record_events=True``, for ``utils.memtools``'s
timelines) and enforce a memory budget (``limit_bytes``, raising
``torch.OutOfMemoryError`` as a device would). Each result says which method
produced it.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .env import pick_device, synchronize

__all__ = [
    "MemoryResult",
    "MemoryBreakdown",
    "MemoryEvent",
    "MemoryMeter",
    "OutOfMemoryError",
    "TensorMemoryTracker",
    "measure_peak_memory",
    "memory_breakdown",
    "tensor_bytes",
    "format_bytes",
]

#: The out-of-memory exception: ``torch.OutOfMemoryError`` (torch 2.5+); its old
#: spelling, ``torch.cuda.OutOfMemoryError``, is the same class (a ``RuntimeError``).
OutOfMemoryError: type[RuntimeError] = getattr(torch, "OutOfMemoryError",
                                               torch.cuda.OutOfMemoryError)

#: The site of memory allocated by the autograd engine with no user code in between.
BACKWARD_SITE = "backward pass (autograd engine)"

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
#: Frames that never name an allocation site: this module, utils.memtools (which builds
#: on it), contextlib's wrappers and frozen import machinery.
_OWN_FILES = frozenset(os.path.join(_HERE, f) for f in ("memory.py", "memtools.py"))
_SKIP_PARTS = (os.sep + "contextlib.py", "<frozen")


def format_bytes(n: float | None) -> str:
    """Human-readable binary units: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _storage_key(t: Any) -> tuple[Any, int, int] | None:
    """``(device, data pointer, bytes)`` of a tensor's storage (or of an
    ``UntypedStorage``); ``None`` for anything without memory of its own (meta,
    sparse, empty, not a tensor)."""
    if isinstance(t, torch.UntypedStorage):
        st = t
    elif isinstance(t, torch.Tensor) and not t.is_meta and t.layout == torch.strided:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
    else:
        return None
    if st.device.type == "meta" or st.nbytes() == 0:
        return None
    return (st.device, st.data_ptr(), st.nbytes())


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: set[tuple[Any, int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += key[2]
    return total


@dataclass(frozen=True)
class MemoryEvent:
    """One allocator event.

    ``action`` is ``"alloc"`` or ``"free"`` for tensor memory, and on CUDA also
    ``"segment_alloc"`` / ``"segment_free"`` (the caching allocator asking the
    driver for memory or giving it back) and ``"oom"``. ``site`` names the
    line of code that allocated the block (``"models.py:108 forward"``), or
    :data:`BACKWARD_SITE` for memory the backward pass allocated.
    """

    action: str
    address: int
    size_bytes: int
    site: str
    op: str = ""


def _site_from_stack() -> str:
    """The innermost Python frame outside torch and this package's memory tools, or
    :data:`BACKWARD_SITE` when the call comes from the autograd engine with no user
    code in between (user code inside a backward pass, such as a checkpointed forward
    being recomputed, keeps its own line)."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_TORCH_DIR):
            if (f.f_code.co_name == "_engine_run_backward"
                    or (f.f_code.co_name == "backward" and os.sep + "autograd" + os.sep in fn)):
                return BACKWARD_SITE
        elif fn not in _OWN_FILES and not any(s in fn for s in _SKIP_PARTS):
            return f"{os.path.basename(fn)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "<no Python frame>"


def _release_existing(tracker_ref: "weakref.ref[TensorMemoryTracker]",
                      key: tuple[Any, int, int]) -> None:
    tracker = tracker_ref()
    if tracker is not None:
        tracker._release_existing_key(key)


def _detach_all(handles: list) -> None:
    for h in handles:
        h.detach()


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storage allocated while active, and their peak.

    An operator's output counts as new memory only when its storage is new: not
    the storage of one of the operator's inputs (a view such as ``x.t()``, or the
    result of an in-place op such as ``x.add_(1)``), and not one already counted.
    Each counted storage is released when the storage itself is freed (a
    finaliser on the storage, whose Python object lives exactly as long as the
    storage does), not when the last Python tensor using it goes: autograd keeps
    saved activations alive through tensors of its own. Storages that existed
    before the tracker started are never counted: the figures are memory *added*
    by the tracked work. Releases keep being counted after the tracker exits, so
    ``current_bytes`` read later is what the tracked work still holds.

    The tracker can be entered again after it exits (each ``with`` block adds to
    the same counts); :meth:`reset_peak` restarts the peak at the current level.

    With ``count_existing_frees``, the tracker counts like CUDA's allocator counters
    read as ``memory_allocated() - start``: on first entry it finds every CPU tensor
    Python can reach (the garbage collector's objects, and the gradients of leaf
    tensors), and when one of their storages is freed afterwards, ``current_bytes``
    falls by its size, below zero if the work freed more than it kept. Without it,
    clearing gradients that existed before the block goes unseen on a CPU and shows
    only on a GPU. Storages only C++ holds (an autograd graph's saved tensors) are
    not found.

    Args:
        limit_bytes: a memory budget. When an operator takes the counted bytes
            above it, the tracker raises ``torch.OutOfMemoryError`` (the error a
            device raises at its limit), so that code written for a GPU's limit
            can be exercised on a CPU, whose own out-of-memory is the operating
            system ending the process.
        record_events: keep :attr:`events`, a list of :class:`MemoryEvent`
            (each allocation with the line of code behind it, and each release)
            until :meth:`stop_recording`.
        count_existing_frees: count the release of storages that existed before the
            first entry (above).

    Raises:
        ValueError: ``limit_bytes`` is not a positive int.
    """

    def __init__(self, *, limit_bytes: int | None = None, record_events: bool = False,
                 count_existing_frees: bool = False) -> None:
        if limit_bytes is not None and (isinstance(limit_bytes, bool)
                                        or not isinstance(limit_bytes, int) or limit_bytes <= 0):
            raise ValueError(f"limit_bytes must be a positive int of bytes, got {limit_bytes!r}")
        super().__init__()
        self._live: dict[tuple[Any, int, int], MemoryEvent | int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        self.limit_bytes = limit_bytes
        self.events: list[MemoryEvent] | None = [] if record_events else None
        self._recording = record_events
        self._count_existing = count_existing_frees
        self._existing: set[tuple[Any, int, int]] | None = None

    def __enter__(self) -> "TensorMemoryTracker":
        if self._count_existing and self._existing is None:
            self._watch_existing()
        return super().__enter__()

    def _watch_existing(self) -> None:
        """Watch the storages of the CPU tensors that exist now, for their release."""
        self._existing = set()
        me = weakref.ref(self)
        handles: list[weakref.finalize] = []
        objects = gc.get_objects()
        # The tensor types among the objects' types, then the tensors, filtered in C: a
        # Python loop over a notebook's few hundred thousand objects costs tens of ms.
        # type(), not isinstance(): no __class__ lookups on objects that warn when asked.
        tensor_types = {t for t in set(map(type, objects)) if issubclass(t, torch.Tensor)}
        tensors = list(itertools.compress(objects, map(tensor_types.__contains__,
                                                        map(type, objects))))
        del objects
        for obj in tensors:
            try:
                found = [obj]
                if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                    found.append(obj.grad)
            except Exception:  # noqa: BLE001 - a subclass whose attributes fail
                continue
            for t in found:
                # a storage offloading hooks swapped out has no data pointer, and a lazy
                # module's uninitialized parameter no storage: neither is memory to watch
                try:
                    key = _storage_key(t)
                    if key is None or key[0].type != "cpu" or key in self._existing:
                        continue
                    handles.append(weakref.finalize(t.untyped_storage(), _release_existing, me,
                                                    key))
                except Exception:  # noqa: BLE001
                    continue
                self._existing.add(key)
        # the watchers go with the tracker: tensors that outlive it keep no callback of it
        weakref.finalize(self, _detach_all, handles)

    def _release_existing_key(self, key: tuple[Any, int, int]) -> None:
        if self._existing is not None and key in self._existing:
            self._existing.discard(key)
            self.current_bytes -= key[2]

    def stop_recording(self) -> None:
        """Add no more events (the counts go on: ``current_bytes`` still falls as
        storages are freed)."""
        self._recording = False

    def reset_peak(self) -> None:
        """Restart the peak at the bytes counted now."""
        self.peak_bytes = self.current_bytes

    def _release(self, key: tuple[Any, int, int]) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        self.current_bytes -= key[2]
        if self._recording and self.events is not None and isinstance(entry, MemoryEvent):
            self.events.append(MemoryEvent("free", entry.address, entry.size_bytes, entry.site,
                                           entry.op))

    def _track_new(self, t: torch.Tensor, inputs: set[tuple[Any, int, int]], func: Any) -> int:
        key = _storage_key(t)
        if key is None or key in self._live or key in inputs or \
                (self._existing is not None and key in self._existing):
            return 0
        if self._recording and self.events is not None:
            ev = MemoryEvent("alloc", key[1], key[2], _site_from_stack(), str(func))
            self.events.append(ev)
            self._live[key] = ev
        else:
            self._live[key] = key[2]
        self.current_bytes += key[2]
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(t.untyped_storage(), self._release, key)
        return key[2]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {k for a in flat_in if (k := _storage_key(a)) is not None}
        new_bytes = 0
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                new_bytes += self._track_new(t, inputs, func)
        if (self.limit_bytes is not None and new_bytes
                and self.current_bytes > self.limit_bytes):
            raise OutOfMemoryError(
                f"out of memory (CPU budget): {func} needed {format_bytes(new_bytes)}, which took "
                f"live tensor memory to {format_bytes(self.current_bytes)}, over the "
                f"{format_bytes(self.limit_bytes)} budget that stands in for a device's limit")
        return out


class MemoryMeter:
    """Tensor memory added by a block of code, on CUDA or a CPU: ``with MemoryMeter() as m:``.

    ``m.held_bytes`` is the tensor memory added since the start (readable inside
    the block and after it; below zero where the block freed tensors that existed
    before it, more than it kept), ``m.peak_bytes`` the highest it reached. On
    CUDA these come from the caching allocator's counters
    (``memory_allocated``, ``max_memory_allocated``, whose peak is reset at the
    start); elsewhere from a :class:`TensorMemoryTracker` that counts the release
    of tensors found at the start too (``count_existing_frees``), and ignores views
    and in-place results. Automatic garbage collection is paused inside the block (an
    explicit ``gc.collect()`` still runs): a collection there could free garbage made
    before the block and lower its count by memory it never held.

    Args:
        device: where the work allocates (default: :func:`utils.pick_device`).

    Raises:
        ValueError: the device is unknown or absent.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = pick_device(device)
        self._tracker: TensorMemoryTracker | None = None
        self._start = 0
        self._peak: int | None = None

    @property
    def method(self) -> str:
        """How the numbers are measured on this device."""
        if self.device.type == "cuda":
            return "CUDA caching allocator (max_memory_allocated)"
        return "tensor storage tracked with TorchDispatchMode"

    def __enter__(self) -> "MemoryMeter":
        self._peak = None
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = TensorMemoryTracker(count_existing_frees=True)
            self._tracker.__enter__()
        # No automatic garbage collection inside the block: one could free garbage made before
        # it (reference cycles, such as a sharded model's) and lower the count by memory the
        # block never held. An explicit gc.collect() in the block still runs.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._tracker is not None:
                self._tracker.__exit__(*exc)
                self._peak = self._tracker.peak_bytes
            else:
                synchronize(self.device)
                self._peak = torch.cuda.max_memory_allocated(self.device) - self._start
        finally:
            if self._gc_was_enabled:
                gc.enable()

    @property
    def held_bytes(self) -> int:
        """Tensor bytes added since the start: what new tensors still hold, less what
        the tensors that existed at the start have released."""
        if self._tracker is not None:
            return self._tracker.current_bytes
        synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - self._start

    @property
    def peak_bytes(self) -> int:
        """The highest :attr:`held_bytes` reached inside the block (so far, if read inside)."""
        if self._peak is not None:
            return self._peak
        if self._tracker is not None:
            return self._tracker.peak_bytes
        synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._start


@dataclass(frozen=True)
class MemoryResult:
    """Memory used by one call of a function.

    ``peak_bytes`` is the peak of memory added by the call above what was
    allocated when it started, on every device. On CUDA the allocator's own
    absolute peaks are given too; on CPU they are ``None``.
    """

    peak_bytes: int
    retained_bytes: int
    allocator_peak_allocated_bytes: int | None
    allocator_peak_reserved_bytes: int | None
    device: str
    method: str
    result: Any = None

    def ledger_fields(self) -> dict[str, tuple[float | None, str]]:
        """What ``Ledger.record(name, result)`` records: ``name_peak_bytes`` and
        ``name_retained_bytes`` (and the allocator's peaks on CUDA)."""
        return {"peak_bytes": (self.peak_bytes, "bytes"),
                "retained_bytes": (self.retained_bytes, "bytes"),
                "allocator_peak_reserved_bytes": (self.allocator_peak_reserved_bytes, "bytes")}

    def __str__(self) -> str:
        text = (
            f"peak {format_bytes(self.peak_bytes)} above the start, "
            f"{format_bytes(self.retained_bytes)} still held after the call "
            f"[{self.device}, {self.method}]"
        )
        if self.allocator_peak_reserved_bytes is not None:
            text += (
                f"; allocator peak allocated {format_bytes(self.allocator_peak_allocated_bytes)},"
                f" reserved {format_bytes(self.allocator_peak_reserved_bytes)}"
            )
        return text


def measure_peak_memory(
    fn: Callable[..., Any],
    *args: Any,
    device: str | torch.device | None = None,
    keep_result: bool = False,
    **kwargs: Any,
) -> MemoryResult:
    """Run ``fn(*args, **kwargs)`` once and measure its peak memory.

    Args:
        fn: the work to measure.
        device: where the work allocates (default: :func:`utils.pick_device`).
        keep_result: store ``fn``'s return value in the result (it then stays
            alive, and counts in ``retained_bytes``).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: the device is unknown or absent.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable to measure, got {type(fn).__name__}")
    dev = pick_device(device)
    meter = MemoryMeter(dev)
    with meter:
        out = fn(*args, **kwargs)
    peak_alloc = peak_res = None
    if dev.type == "cuda":
        peak_alloc = torch.cuda.max_memory_allocated(dev)
        peak_res = torch.cuda.max_memory_reserved(dev)
    if not keep_result:
        out = None
    return MemoryResult(
        peak_bytes=meter.peak_bytes,
        retained_bytes=meter.held_bytes,
        allocator_peak_allocated_bytes=peak_alloc,
        allocator_peak_reserved_bytes=peak_res,
        device=str(dev),
        method=meter.method,
        result=out,
    )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where one training step's memory goes, in bytes."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    method: str

    @property
    def total_bytes(self) -> int:
        return (
            self.parameters_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.activations_bytes
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": self.optimizer_state_bytes,
            "activations": self.activations_bytes,
        }

    def __str__(self) -> str:
        rows = [f"{k:<16} {format_bytes(v):>12}" for k, v in self.as_dict().items()]
        rows.append(f"{'total':<16} {format_bytes(self.total_bytes):>12}")
        return "\n".join(rows)


def memory_breakdown(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **optimizer_kwargs: Any,
) -> MemoryBreakdown:
    """Measure parameters, gradients, optimizer state and saved activations.

    One real training step runs on a deep copy of ``model`` (the model you pass
    is untouched). Activations are the distinct tensors autograd saves for the
    backward pass, seen through ``torch.autograd.graph.saved_tensors_hooks``;
    parameters themselves are not counted twice.

    Args:
        model: the model.
        batch: ``(inputs, targets)``; inputs are passed to the model.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        optimizer_cls: the optimizer to build over the copy's parameters.
        **optimizer_kwargs: its arguments.

    Raises:
        ValueError: ``batch`` is not an ``(inputs, targets)`` pair.
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("batch must be an (inputs, targets) pair")
    work = copy.deepcopy(model)
    work.train()
    params = [p for p in work.parameters() if p.requires_grad]
    param_keys = {_storage_key(p) for p in work.parameters()}
    opt = optimizer_cls(params, **optimizer_kwargs)
    saved: dict[tuple[Any, int, int], None] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in param_keys:
            saved[key] = None
        return t

    inputs, targets = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(work(inputs), targets)
    activations = sum(k[2] for k in saved)
    loss.backward()
    opt.step()
    state_tensors = [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]
    return MemoryBreakdown(
        parameters_bytes=tensor_bytes(work.parameters()),
        gradients_bytes=tensor_bytes(p.grad for p in params),
        optimizer_state_bytes=tensor_bytes(state_tensors),
        activations_bytes=activations,
        method="tensor sizes; activations = storages saved for backward",
    )
