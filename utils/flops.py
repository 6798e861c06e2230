"""FLOPs, achieved throughput, and the ceilings of the machine we run on.

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode`, which
counts the matmul-like operators (matmul, convolution, attention) exactly and
ignores the cheap elementwise ones. Ceilings are *measured* here: a large
matmul, in the dtype the work uses, for compute, and a large copy for memory
bandwidth. MFU is a ratio to a ceiling, and which ceiling matters:
:func:`mfu_report` gives it against the ceiling measured on this machine and,
for the GPUs in :data:`DATASHEET_TFLOPS`, against the vendor's datasheet peak,
each labelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from .env import pick_device
from .precision import matmul_precision_label
from .timing import benchmark

__all__ = [
    "FlopCount",
    "Ceilings",
    "RooflinePoint",
    "OpCost",
    "op_cost",
    "count_flops",
    "measure_matmul_tflops",
    "measure_bandwidth_gbs",
    "measure_ceilings",
    "achieved_tflops",
    "achieved_gbs",
    "mfu",
    "MFUReport",
    "mfu_report",
    "datasheet_peak_tflops",
    "DATASHEET_TFLOPS",
    "plot_roofline",
    "GPT_FLOP_CONVENTIONS",
    "GPTFlops",
    "gpt_flops",
]


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one call, in total and per operator (``aten.mm`` and so on)."""

    total_flops: int
    by_operator: dict[str, int]

    def __int__(self) -> int:
        return self.total_flops


def _missing_attention_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for the CPU attention kernel, where torch's counter has none.

    ``F.scaled_dot_product_attention`` on a CPU runs
    ``aten._scaled_dot_product_flash_attention_for_cpu``; torch registers a FLOP
    formula for it only from 2.15 on, and before that the counter silently counts
    attention as zero FLOPs. We supply the same formula torch uses for its GPU
    attention kernels (two matmuls forward, their gradients backward).
    """
    from torch.utils import flop_counter as fc

    extra: dict[Any, Callable[..., int]] = {}
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in fc.flop_registry:
        def forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(q, k, v)

        extra[fwd] = forward
    if bwd is not None and bwd not in fc.flop_registry:
        def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out, q, k, v)

        extra[bwd] = backward
    return extra


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
    """Count the FLOPs of ``fn(*args, **kwargs)`` (forward, and backward if it runs one).

    A multiply-add counts as two FLOPs, so an ``(M, K) @ (K, N)`` matmul is
    ``2 * M * N * K``. Attention counts its two matmuls in full, on every device
    and torch version (see :func:`_missing_attention_formulas`), causal or not:
    torch's convention, although a causal kernel can skip about half that work.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    counter = FlopCounterMode(display=False, custom_mapping=_missing_attention_formulas())
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
    """Achieved TFLOP/s as a fraction of ``ceiling``: whatever ceiling you pass.

    The course passes the matmul ceiling *measured* on this machine, which is
    below the datasheet peak; say which when you print it, or use
    :func:`mfu_report`, which gives both, labelled.
    """
    _positive("ceiling", ceiling)
    return achieved / ceiling


#: Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's datasheets, per matmul
#: precision, for the GPUs the course is run on. The datasheets print the
#: Tensor Core figures "with sparsity"; dense is half of that. Keys are matched
#: against ``torch.cuda.get_device_name()``, most specific first; PCIe and NVL
#: variants (lower clocks and power) are deliberately absent rather than guessed.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    # H100 SXM5 (80 GB HBM3) and H200 SXM share the GH100 compute: 66.9 FP32,
    # 494.7 TF32, 989.4 BF16/FP16 dense.
    "H100 80GB HBM3": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # A100 (SXM4 and PCIe): 19.5 FP32, 156 TF32, 312 BF16/FP16 dense.
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
}
_NOT_IN_TABLE = ("PCIe", "PCIE", "NVL")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def datasheet_peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet's dense peak for a GPU name and matmul precision, or ``None``.

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()`` ("NVIDIA H100 80GB HBM3").
        precision: ``"fp32"``, ``"tf32"`` (fp32 matmuls on TF32 Tensor Cores),
            ``"bf16"`` or ``"fp16"``.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if any(word in device_name for word in _NOT_IN_TABLE):
        return None
    for key, peaks in DATASHEET_TFLOPS.items():
        if key in device_name:
            return peaks[precision]
    return None


@dataclass(frozen=True)
class MFUReport:
    """MFU against the measured ceiling and, where known, the datasheet peak."""

    achieved_tflops: float
    measured_ceiling_tflops: float
    datasheet_peak_tflops: float | None
    precision: str
    device_name: str

    @property
    def vs_measured(self) -> float:
        return self.achieved_tflops / self.measured_ceiling_tflops

    @property
    def vs_datasheet(self) -> float | None:
        if self.datasheet_peak_tflops is None:
            return None
        return self.achieved_tflops / self.datasheet_peak_tflops

    def __str__(self) -> str:
        text = (f"{self.achieved_tflops:.3g} TFLOP/s = {self.vs_measured:.1%} of the {self.precision} "
                f"matmul ceiling measured here ({self.measured_ceiling_tflops:.3g} TFLOP/s)")
        if self.datasheet_peak_tflops is None:
            return text + f"; no datasheet peak in the course's table for {self.device_name}"
        return text + (f", {self.vs_datasheet:.1%} of the datasheet peak "
                       f"({self.datasheet_peak_tflops:.4g} TFLOP/s dense, {self.device_name})")


def mfu_report(flops: float, seconds: float, measured_ceiling_tflops: float, precision: str,
               device: str | torch.device | None = None) -> MFUReport:
    """MFU of ``flops`` done in ``seconds``, against both ceilings, labelled.

    Args:
        flops: FLOPs of the work (e.g. from :func:`count_flops`).
        seconds: its time.
        measured_ceiling_tflops: the matmul ceiling measured on this machine in the
            precision the work's matmuls use (:func:`measure_matmul_tflops`).
        precision: that precision: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.
        device: the device the work ran on (default: :func:`utils.pick_device`).
    """
    _positive("measured_ceiling_tflops", measured_ceiling_tflops)
    dev = pick_device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"the {dev.type.upper()}"
    peak = datasheet_peak_tflops(name, precision) if dev.type == "cuda" else None
    return MFUReport(achieved_tflops(flops, seconds), measured_ceiling_tflops, peak, precision, name)


def _default_sizes(dev: torch.device, dtype: torch.dtype) -> tuple[int, ...]:
    """Matmul sizes whose best run is the ceiling: a GPU needs big ones to fill every
    SM, 2-byte dtypes most of all (a 4096 bf16 matmul is short of a Hopper's best)."""
    if dev.type == "cuda":
        return (8192, 16384) if torch.finfo(dtype).bits <= 16 else (8192,)
    return (2048,)


def measure_matmul_tflops(
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    n: int | None = None,
    min_run_time_s: float = 0.5,
) -> float:
    """Measured TFLOP/s of square matmuls: the compute ceiling for ``dtype``.

    Args:
        device: where to measure (default: :func:`utils.pick_device`).
        dtype: the matmul dtype; for fp32 on a GPU, TF32 applies if it is on
            (see :func:`utils.tf32_state`): measure the ceiling your work uses.
        n: one size ``n x n @ n x n``; default: the best of a few sizes large
            enough for the device (8192 and 16384 for 2-byte dtypes on a GPU,
            8192 for fp32 there, 2048 on a CPU).
        min_run_time_s: time spent per size.
    """
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive int, got {n!r}")
    dev = pick_device(device)
    return _best_matmul(dev, dtype, (n,) if n is not None else _default_sizes(dev, dtype),
                        min_run_time_s)[0]


def _best_matmul(dev: torch.device, dtype: torch.dtype, sizes: Sequence[int],
                 min_run_time_s: float) -> tuple[float, int]:
    """(best TFLOP/s, the size that reached it) over square matmuls of ``sizes``."""
    best, best_size = 0.0, sizes[0]
    for size in sizes:
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        t = benchmark(torch.mm, a, b, label=f"mm {size} {dtype}", device=dev,
                      min_run_time_s=min_run_time_s, warn_if_noisy=False)
        tflops = achieved_tflops(2 * size**3, t.median_s)
        if tflops > best:
            best, best_size = tflops, size
        del a, b
    return best, best_size


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
    matmul_precision: str = ""  # utils.matmul_precision_label() at the time

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the roofline turns from memory- to compute-bound."""
        return self.matmul_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


def measure_ceilings(
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    smoke: bool = False,
) -> Ceilings:
    """Measure the matmul and copy ceilings (small sizes when ``smoke``).

    ``dtype`` is the matmul dtype of the work you will compare against it; the
    default fp32 suits fp32 work only (bf16 work needs the bf16 ceiling).
    """
    dev = pick_device(device)
    if smoke:
        sizes, nbytes, rt = (1024,), 64 << 20, 0.2
    elif dev.type == "cuda":
        sizes, nbytes, rt = _default_sizes(dev, dtype), 2 << 30, 0.5
    else:
        sizes, nbytes, rt = (2048,), 512 << 20, 0.5
    tflops, size = _best_matmul(dev, dtype, sizes, rt)
    return Ceilings(
        device=str(dev),
        dtype=str(dtype).replace("torch.", ""),
        matmul_tflops=tflops,
        bandwidth_gbs=measure_bandwidth_gbs(dev, nbytes, rt),
        matmul_size=size,
        copy_bytes=nbytes,
        num_threads=torch.get_num_threads(),
        matmul_precision=matmul_precision_label(),
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


@dataclass(frozen=True)
class OpCost:
    """One operation to place on a roofline, before it is timed.

    Attributes:
        label: its name in tables and plots.
        call: runs the operation once, with no arguments.
        flops: FLOPs of one call.
        bytes_moved: the minimum memory traffic of one call: every input read once and the
            output written once (a real kernel can move more, never less).
        source: where ``flops`` came from: ``"FlopCounterMode"`` or ``"analytic"``.
    """

    label: str
    call: Callable[[], Any]
    flops: int
    bytes_moved: int
    source: str

    @property
    def intensity(self) -> float:
        """FLOPs per byte of minimum traffic."""
        return self.flops / self.bytes_moved


def op_cost(label: str, call: Callable[[], Any], inputs: Sequence[torch.Tensor],
            analytic_flops_per_output: int | None = None) -> OpCost:
    """Run ``call`` once (which also warms it up) and count its FLOPs and minimum bytes.

    FLOPs come from :func:`count_flops`, which counts only matmul-like operators. For an op
    it counts as zero (elementwise, softmax, normalisation) pass ``analytic_flops_per_output``:
    the FLOPs are then that many per element of the output.

    Args:
        label: the op's name.
        call: a no-argument callable returning one tensor.
        inputs: the tensors it reads (each counted once in ``bytes_moved``).
        analytic_flops_per_output: FLOPs per output element, for an op the counter ignores.

    Raises:
        TypeError: ``call`` is not callable or does not return a tensor.
        ValueError: no inputs; a non-positive analytic count; the counter counts nothing and
            no analytic count is given, or counts something although one is given (then the
            analytic count would replace a real one).
    """
    if not callable(call):
        raise TypeError(f"call must be a no-argument callable, got {type(call).__name__}")
    if not inputs:
        raise ValueError(f"{label}: give the input tensors, their bytes are part of the cost")
    if analytic_flops_per_output is not None and analytic_flops_per_output <= 0:
        raise ValueError(f"{label}: analytic_flops_per_output must be positive, "
                         f"got {analytic_flops_per_output!r}")
    out = call()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{label}: call returned a {type(out).__name__}, not a tensor")
    bytes_moved = sum(t.nbytes for t in inputs) + out.nbytes
    counted = count_flops(call).total_flops
    if analytic_flops_per_output is None:
        if counted <= 0:
            raise ValueError(f"{label}: FlopCounterMode counted no FLOPs; pass "
                             "analytic_flops_per_output")
        return OpCost(label, call, counted, bytes_moved, "FlopCounterMode")
    if counted != 0:
        raise ValueError(f"{label}: FlopCounterMode counted {counted} FLOPs: use them, not an "
                         "analytic count")
    return OpCost(label, call, analytic_flops_per_output * out.numel(), bytes_moved, "analytic")


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


# -- a GPT's FLOPs by formula: the conventions MFU figures are quoted in -------------------------

#: The conventions a GPT's "model FLOPs" are quoted in, per token of a training step.
GPT_FLOP_CONVENTIONS = {
    "6N": "6 x N: forward and backward matmuls of the parameters, no attention scores",
    "6N+attn": "6 x N + 12 x L x d x T: with the full T x T attention matmuls (nanoGPT, PaLM)",
    "6N+causal": "6 x N + 6 x L x d x T: attention counted causally, half of T x T (llm.c)",
}


@dataclass(frozen=True)
class GPTFlops:
    """FLOPs per token of one training step (forward and backward) of a GPT, by formula.

    Attributes:
        n_params: N, every parameter but the position embeddings (with a tied head the token
            embedding counts once: the head's matmul uses it, the lookup does no arithmetic).
        n_layer, n_embd, seq_len: L, d, T.
        vocab_size: the real vocabulary (model FLOPs count only its rows).
        padded_vocab: the vocabulary the head's matmul really computes (padded rows are
            hardware FLOPs, never model FLOPs).
    """

    n_params: int
    n_layer: int
    n_embd: int
    seq_len: int
    vocab_size: int
    padded_vocab: int

    @property
    def attention_full(self) -> float:
        """The attention matmuls (Q K^T and the weighted sum of V) over the full T x T square,
        forward and backward: 12 L d T per token."""
        return 12.0 * self.n_layer * self.n_embd * self.seq_len

    @property
    def attention_causal(self) -> float:
        """The same over the causal half (what a causal kernel needs): 6 L d T per token."""
        return self.attention_full / 2

    def per_token(self, convention: str = "6N+attn") -> float:
        """Model FLOPs per token in one of :data:`GPT_FLOP_CONVENTIONS`.

        Raises:
            ValueError: an unknown convention.
        """
        base = 6.0 * self.n_params
        if convention == "6N":
            return base
        if convention == "6N+attn":
            return base + self.attention_full
        if convention == "6N+causal":
            return base + self.attention_causal
        raise ValueError(f"unknown convention {convention!r}: one of "
                         f"{', '.join(GPT_FLOP_CONVENTIONS)}")

    def hardware_per_token(self, *, causal_kernel: bool = True, attention_recompute: bool = False,
                           full_recompute: bool = False) -> float:
        """FLOPs the hardware executes per token, which MFU does not credit.

        Args:
            causal_kernel: the attention kernel skips the masked half (flash-style kernels do;
                a dense masked matmul does not).
            attention_recompute: the backward pass recomputes the attention scores (Q K^T) instead
                of reading them (FlashAttention does): one more score matmul.
            full_recompute: activation checkpointing re-runs every block's forward in backward.
        """
        attn = self.attention_causal if causal_kernel else self.attention_full
        head_pad = 6.0 * (self.padded_vocab - self.vocab_size) * self.n_embd
        total = 6.0 * self.n_params + attn + head_pad
        if attention_recompute:
            total += attn / 6  # the forward score matmul (2 L d T of the 12 L d T) once more
        if full_recompute:
            total += (2.0 * self.n_params + attn / 3)  # one more forward, attention included
        return total

    def __str__(self) -> str:
        return (f"N = {self.n_params / 1e6:.1f} M, L = {self.n_layer}, d = {self.n_embd}, "
                f"T = {self.seq_len}: " + ", ".join(
                    f"{c} {self.per_token(c) / 1e9:.3f} GFLOP/token" for c in GPT_FLOP_CONVENTIONS))


def gpt_flops(cfg: Any, seq_len: int | None = None, padded_vocab: int | None = None) -> GPTFlops:
    """:class:`GPTFlops` of a :class:`utils.TinyGPT` configuration (GPT-2's layout: tied head,
    learned position embeddings, biases and LayerNorms, a 4x MLP).

    Args:
        cfg: a :class:`utils.GPTConfig`.
        seq_len: tokens per sequence (default: ``cfg.block_size``).
        padded_vocab: the head's rows as computed (default: ``cfg.vocab_size``).

    Raises:
        ValueError: a sequence longer than the context, or a padded vocabulary below the real one.
    """
    t = cfg.block_size if seq_len is None else seq_len
    if not isinstance(t, int) or not 1 <= t <= cfg.block_size:
        raise ValueError(f"seq_len must be an int in [1, {cfg.block_size}], got {t!r}")
    pv = cfg.vocab_size if padded_vocab is None else padded_vocab
    if not isinstance(pv, int) or pv < cfg.vocab_size:
        raise ValueError(f"padded_vocab ({pv!r}) must be an int >= vocab_size ({cfg.vocab_size})")
    d, layers, v = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    per_layer = (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (2 * d) \
        + (d * 4 * d + 4 * d) + (4 * d * d + d)
    n = v * d + layers * per_layer + 2 * d   # token embedding (= the head), blocks, final norm
    return GPTFlops(n_params=n, n_layer=layers, n_embd=d, seq_len=t, vocab_size=v,
                    padded_vocab=pv)
