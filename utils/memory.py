"""Peak memory, on CUDA and on CPU, and where a training step's memory goes.

On CUDA the caching allocator keeps exact counters: we reset its peak, run the
work and read the peak back. The CPU has no such counters, and process RSS is
blurred by the system allocator, so on the CPU we count tensor storage
directly: a ``TorchDispatchMode`` sees every tensor an operator returns,
tracks its storage, and notices when the last tensor using it dies. Each
result says which method produced it.
"""

from __future__ import annotations

import copy
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
    "TensorMemoryTracker",
    "measure_peak_memory",
    "memory_breakdown",
    "tensor_bytes",
    "format_bytes",
]


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


def _storage_key(t: torch.Tensor) -> tuple[Any, int, int] | None:
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if st.nbytes() == 0:
        return None
    return (t.device, st.data_ptr(), st.nbytes())


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
    by the tracked work.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[Any, int, int], int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0

    def _release(self, key: tuple[Any, int, int]) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current_bytes -= nbytes

    def _track_new(self, t: torch.Tensor, inputs: set[tuple[Any, int, int]]) -> None:
        key = _storage_key(t)
        if key is None or key in self._live or key in inputs:
            return
        self._live[key] = key[2]
        self.current_bytes += key[2]
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(t.untyped_storage(), self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {k for a in flat_in if isinstance(a, torch.Tensor)
                  and (k := _storage_key(a)) is not None}
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._track_new(t, inputs)
        return out


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
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        out = fn(*args, **kwargs)
        synchronize(dev)
        peak_alloc = torch.cuda.max_memory_allocated(dev)
        peak_res = torch.cuda.max_memory_reserved(dev)
        if not keep_result:
            out = None
        retained = torch.cuda.memory_allocated(dev) - start
        return MemoryResult(
            peak_bytes=peak_alloc - start,
            retained_bytes=retained,
            allocator_peak_allocated_bytes=peak_alloc,
            allocator_peak_reserved_bytes=peak_res,
            device=str(dev),
            method="CUDA caching allocator (max_memory_allocated)",
            result=out,
        )
    tracker = TensorMemoryTracker()
    with tracker:
        out = fn(*args, **kwargs)
    if not keep_result:
        out = None
    return MemoryResult(
        peak_bytes=tracker.peak_bytes,
        retained_bytes=tracker.current_bytes,
        allocator_peak_allocated_bytes=None,
        allocator_peak_reserved_bytes=None,
        device=str(dev),
        method="tensor storage tracked with TorchDispatchMode",
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
