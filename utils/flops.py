"""FLOPs, achieved throughput, and the ceilings of the machine we run on.

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode`, which
counts the matmul-like operators (matmul, convolution, attention) exactly and
ignores the cheap elementwise ones. Ceilings are *measured* here, not taken
from a datasheet: a large matmul for compute and a large copy for memory
bandwidth. MFU is achieved FLOP/s over the measured matmul ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from .env import pick_device
from .timing import benchmark

__all__ = [
    "FlopCount",
    "Ceilings",
    "RooflinePoint",
    "count_flops",
    "measure_matmul_tflops",
    "measure_bandwidth_gbs",
    "measure_ceilings",
    "achieved_tflops",
    "achieved_gbs",
    "mfu",
    "plot_roofline",
]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one call, in total and per operator (``aten.mm`` and so on)."""

    total_flops: int
    by_operator: dict[str, int]

    def __int__(self) -> int:
        return self.total_flops


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
    """Count the FLOPs of ``fn(*args, **kwargs)`` (forward, and backward if it runs one).

    A multiply-add counts as two FLOPs, so an ``(M, K) @ (K, N)`` matmul is
    ``2 * M * N * K``.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args, **kwargs)
    by_op: dict[str, int] = {}
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        by_op[str(op)] = by_op.get(str(op), 0) + int(n)
    return FlopCount(total_flops=int(counter.get_total_flops()), by_operator=by_op)


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be positive, got {value!r}")


def achieved_tflops(flops: float, seconds: float) -> float:
    """TFLOP/s for ``flops`` done in ``seconds``."""
    _positive("seconds", seconds)
    return flops / seconds / 1e12


def achieved_gbs(nbytes: float, seconds: float) -> float:
    """GB/s (10^9 bytes per second) for ``nbytes`` moved in ``seconds``."""
    _positive("seconds", seconds)
    return nbytes / seconds / 1e9


def mfu(achieved: float, ceiling: float) -> float:
    """Model FLOPs utilisation: achieved TFLOP/s as a fraction of the ceiling."""
    _positive("ceiling", ceiling)
    return achieved / ceiling


def measure_matmul_tflops(
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    n: int = 4096,
    min_run_time_s: float = 0.5,
) -> float:
    """Measured TFLOP/s of an ``n x n`` by ``n x n`` matmul: the compute ceiling."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    dev = pick_device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = benchmark(torch.mm, a, b, label=f"mm {n} {dtype}", device=dev,
                  min_run_time_s=min_run_time_s, warn_if_noisy=False)
    return achieved_tflops(2 * n**3, t.median_s)


def measure_bandwidth_gbs(
    device: str | torch.device | None = None,
    nbytes: int = 1 << 30,
    min_run_time_s: float = 0.5,
) -> float:
    """Measured GB/s of a large device-to-device copy (bytes read + written)."""
    if not isinstance(nbytes, int) or nbytes < 1024:
        raise ValueError(f"nbytes must be an int >= 1024, got {nbytes!r}")
    dev = pick_device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    t = benchmark(dst.copy_, src, label="copy", device=dev,
                  min_run_time_s=min_run_time_s, warn_if_noisy=False)
    return achieved_gbs(2 * src.numel() * src.element_size(), t.median_s)


@dataclass(frozen=True)
class Ceilings:
    """Measured compute and bandwidth ceilings of one device."""

    device: str
    dtype: str
    matmul_tflops: float
    bandwidth_gbs: float
    matmul_size: int
    copy_bytes: int
    num_threads: int = 0  # CPU threads used when measuring (a CPU ceiling depends on it)
    matmul_precision: str = ""  # torch.get_float32_matmul_precision() at the time

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the roofline turns from memory- to compute-bound."""
        return self.matmul_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


def measure_ceilings(
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    smoke: bool = False,
) -> Ceilings:
    """Measure the matmul and copy ceilings (small sizes when ``smoke``)."""
    dev = pick_device(device)
    if smoke:
        n, nbytes, rt = 1024, 64 << 20, 0.2
    elif dev.type == "cuda":
        n, nbytes, rt = 8192, 2 << 30, 0.5
    else:
        n, nbytes, rt = 2048, 512 << 20, 0.5
    return Ceilings(
        device=str(dev),
        dtype=str(dtype).replace("torch.", ""),
        matmul_tflops=measure_matmul_tflops(dev, dtype, n, rt),
        bandwidth_gbs=measure_bandwidth_gbs(dev, nbytes, rt),
        matmul_size=n,
        copy_bytes=nbytes,
        num_threads=torch.get_num_threads(),
        matmul_precision=torch.get_float32_matmul_precision(),
    )


@dataclass(frozen=True)
class RooflinePoint:
    """One measured operation: its FLOPs, bytes moved and time."""

    label: str
    flops: float
    bytes_moved: float
    seconds: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes_moved

    @property
    def tflops(self) -> float:
        return achieved_tflops(self.flops, self.seconds)


def plot_roofline(
    points: Sequence[RooflinePoint],
    ceilings: Ceilings,
    ax: Any = None,
    title: str | None = None,
    figsize: tuple[float, float] = (7, 4.5),
) -> Any:
    """Draw the measured roofline and place ``points`` on it; returns the Axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    from .plots import use_style

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    if not points:
        raise ValueError("plot_roofline needs at least one point")
    peak = ceilings.matmul_tflops
    bw_tb = ceilings.bandwidth_gbs / 1e3  # TB/s: TFLOP/s per (FLOP/byte)
    lo = min(min(p.intensity for p in points) / 4, 0.1)
    hi = max(max(p.intensity for p in points) * 4, ceilings.ridge_flops_per_byte * 8)
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(peak, bw_tb * x), color="black", lw=2, label="measured roofline")
    ax.axvline(ceilings.ridge_flops_per_byte, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {ceilings.ridge_flops_per_byte:.1f} FLOP/B",
                (ceilings.ridge_flops_per_byte, peak), textcoords="offset points",
                xytext=(4, -14), fontsize=8, color="grey")
    for p in points:
        ax.scatter(p.intensity, p.tflops, s=40, zorder=3)
        ax.annotate(p.label, (p.intensity, p.tflops), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title or f"Roofline on {ceilings.device} ({ceilings.dtype})")
    ax.legend(loc="lower right")
    return ax
