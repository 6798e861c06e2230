"""Tools the mixed-precision notebooks (module 02) share.

Each of these was written more than once in the notebooks before it moved here:

- :func:`dtype_name` and :func:`rel_error`: short dtype names for tables, and the
  relative (Frobenius-norm) error every correctness check prints.
- :func:`cpu_precision_support`: which low-precision instructions this CPU has
  (read from ``/proc/cpuinfo``), the reason a bf16 or fp16 matmul is fast or slow here.
- :class:`AtenOpCounter` / :func:`count_aten_ops`: the aten ops a call runs, by op and
  output dtype, seen from below autocast (so the casts it inserts are counted), and
  the host synchronisations (``.item()``, ``bool(tensor)``) among them.
- :class:`HostReadCounter`: the Python calls that hand a tensor's values to the host
  (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool()``, ...), which the aten ops
  do not all show.
- :func:`round_to_tf32` and :func:`fp8_quantize`: fp32 values rounded to TF32's 10 mantissa
  bits (what sm80+ tensor cores do to a matmul's inputs under ``"tf32"``), and a tensor
  stored as fp8 with a per-tensor scale (notebooks 1 and 5 of module 02).
- :func:`fp8_matmul`: a per-tensor-scaled fp8 matmul through the public
  ``torch.nn.functional.scaled_mm`` where the installed torch has it (2.10 and newer),
  else through the private ``torch._scaled_mm``.
- :func:`loss_gap`: how far a low-precision run's final loss ends from its fp32 twin's,
  as a share of the loss drop fp32 achieved.
- :func:`best_of_rounds`: interleaved timing rounds, keeping each variant's fastest.
- :func:`time_breakdown`: where a step's op time goes (matmuls, attention, casts,
  optimizer, the rest), measured with ``torch.profiler``.
"""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Hashable, Iterable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .env import pick_device
from .profiling import check_count, profile_calls
from .timing import Timing, benchmark

__all__ = [
    "dtype_name",
    "rel_error",
    "CPUPrecisionSupport",
    "cpu_precision_support",
    "AtenOpCounter",
    "count_aten_ops",
    "HOST_SYNC_OPS",
    "HOST_READ_METHODS",
    "HostReadCounter",
    "round_to_tf32",
    "fp8_quantize",
    "fp8_matmul_api",
    "fp8_matmul",
    "LossGap",
    "Applicability",
    "loss_gap",
    "amdahl_bound",
    "TimingJob",
    "best_of_rounds",
    "TimeBreakdown",
    "time_breakdown",
    "OP_CATEGORIES",
]

_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16",
          torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8 e4m3", torch.float8_e5m2: "fp8 e5m2"}


def dtype_name(dtype: torch.dtype | None) -> str:
    """``'bf16'``, ``'fp16'``, ``'fp32'``, ... for a dtype; ``'-'`` for ``None``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
    """
    if dtype is None:
        return "-"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {type(dtype).__name__} ({dtype!r})")
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius norms), computed in fp64.

    A norm over the whole tensor, because single elements near zero have
    meaningless relative errors.

    Raises:
        ValueError: the shapes differ, or ``expected`` is all zeros.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.detach().double()
    ref = expected.detach().to(a.device).double()
    denom = ref.norm().item()
    if denom == 0.0:
        raise ValueError("the reference is all zeros: a relative error is undefined")
    return (a - ref).norm().item() / denom


@dataclass(frozen=True)
class CPUPrecisionSupport:
    """The low-precision arithmetic this CPU has, as the OS reports it."""

    capability: str       # torch.backends.cpu.get_cpu_capability(), e.g. "AVX2", "AVX512"
    flags_readable: bool  # False where /proc/cpuinfo does not exist (macOS, Windows)
    avx512_bf16: bool
    amx_bf16: bool
    avx512_fp16: bool
    amx_fp16: bool

    @property
    def bf16_native(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX-BF16)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def fp16_native(self) -> bool:
        """fp16 arithmetic in hardware (AVX512-FP16 or AMX-FP16)."""
        return self.avx512_fp16 or self.amx_fp16

    def __str__(self) -> str:
        if not self.flags_readable:
            return (f"CPU vector capability used by PyTorch: {self.capability}; "
                    "CPU flags not readable on this OS")
        flags = {"avx512_bf16": self.avx512_bf16, "amx_bf16": self.amx_bf16,
                 "avx512_fp16": self.avx512_fp16, "amx_fp16": self.amx_fp16}
        have = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in flags.items())
        return f"CPU vector capability used by PyTorch: {self.capability}; {have}"


def cpu_precision_support(cpuinfo_path: str = "/proc/cpuinfo") -> CPUPrecisionSupport:
    """Read which bf16/fp16 instructions this CPU reports (Linux ``/proc/cpuinfo`` flags)."""
    flags: set[str] = set()
    readable = False
    with contextlib.suppress(OSError):
        with open(cpuinfo_path, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    readable = True
                    break
    get_cap = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    capability = get_cap() if get_cap is not None else "unknown"
    return CPUPrecisionSupport(capability=capability, flags_readable=readable,
                               avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags,
                               avx512_fp16="avx512_fp16" in flags, amx_fp16="amx_fp16" in flags)


# the ops a dtype conversion runs as (``to`` itself is seen under torch.inference_mode())
_CAST_OPS = frozenset({"_to_copy", "to"})

# aten ops that copy a tensor's value to the host and so wait for the device:
# Tensor.item(), bool(t), float(t), int(t), and Python control flow on a tensor.
HOST_SYNC_OPS = frozenset({"_local_scalar_dense"})


class AtenOpCounter(TorchDispatchMode):
    """Count the aten ops that run, by ``(op name, output dtype name)``.

    A dispatch mode sits below autocast in PyTorch's dispatcher, so it sees ops
    *after* autocast rewrote them: the casts autocast inserts show up as
    ``_to_copy``. (``TorchDispatchMode`` lives in ``torch.utils._python_dispatch``, the
    semi-private module ``FlopCounterMode`` and other torch tools build on.)

    Example::

        with utils.AtenOpCounter() as ops:
            model(x)
        ops.total("_to_copy")
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.dtype_changes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        dt = dtype_name(first.dtype) if isinstance(first, torch.Tensor) else "-"
        name = func.overloadpacket.__name__
        self.counts[(name, dt)] += 1
        if (name in _CAST_OPS and args and isinstance(args[0], torch.Tensor)
                and isinstance(first, torch.Tensor) and args[0].dtype != first.dtype):
            self.dtype_changes += 1
        return out

    def total(self, *ops: str) -> int:
        """How many times any of ``ops`` ran (all dtypes)."""
        return sum(n for (op, _), n in self.counts.items() if op in ops)

    @property
    def casts(self) -> int:
        """Dtype conversions: ``_to_copy`` (or, under ``torch.inference_mode()``, where the
        dispatcher does not decompose it, ``to``) calls whose output dtype differs from
        their input's."""
        return self.dtype_changes

    @property
    def host_syncs(self) -> int:
        """Reads of a tensor's value by the host (each one waits for a GPU)."""
        return self.total(*HOST_SYNC_OPS)


def count_aten_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, AtenOpCounter]:
    """Run ``fn(*args, **kwargs)`` under an :class:`AtenOpCounter`; return ``(result, counter)``."""
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    with AtenOpCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter


#: The ``torch.Tensor`` methods that hand a tensor's values to Python: on a GPU, each one
#: copies from the device and waits for it. ``to`` counts only when it moves to the CPU.
HOST_READ_METHODS = ("item", "tolist", "numpy", "cpu", "to", "__bool__", "__float__",
                     "__int__", "__index__")
_ABSENT = object()


def _moves_to_cpu(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as its device."""
    device = kwargs.get("device")
    if device is None and args and isinstance(args[0], (str, torch.device, int)) \
            and not isinstance(args[0], bool):
        device = args[0]
    if device is None or isinstance(device, int):
        return False  # a bare int is a CUDA index; no device: a dtype change only
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


class HostReadCounter:
    """Count the Python calls that hand a tensor's values to the host, by method name.

    :attr:`AtenOpCounter.host_syncs` sees ``.item()`` and ``bool(t)`` (the aten op
    ``_local_scalar_dense``), but ``.tolist()``, ``.numpy()`` and ``.cpu()`` read a tensor
    without that op: a loop that called ``.tolist()`` on every module's output would show no
    host synchronisation at all. This counter replaces the methods of
    :data:`HOST_READ_METHODS` on ``torch.Tensor`` for the ``with`` block (and restores them
    when it ends, also on an error), so it counts each such call made from Python on every
    device, where a CPU has no device-to-host copy to see. ``.to(...)`` counts only when it
    names the CPU. Not counted: reads from C++ (a ``copy_`` into a CPU tensor, printing a
    tensor).

    Example::

        with utils.amp.HostReadCounter() as reads:
            find_nonfinite_fast(model, x)
        assert reads.total <= 1, reads
    """

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if name != "to" or _moves_to_cpu(args, kwargs):
                self.calls[name] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = counted.__qualname__ = name
        counted.__doc__ = getattr(original, "__doc__", None)
        return counted

    def __enter__(self) -> "HostReadCounter":
        if self._saved:
            raise RuntimeError("this HostReadCounter is already counting")
        for name in HOST_READ_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name, _ABSENT)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, previous in self._saved.items():
            if previous is _ABSENT:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, previous)
        self._saved = {}

    @property
    def total(self) -> int:
        """All counted calls together."""
        return sum(self.calls.values())

    def __str__(self) -> str:
        listed = ", ".join(f"{name} {n}" for name, n in sorted(self.calls.items()))
        return f"{self.total} host read(s)" + (f": {listed}" if listed else "")


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32's 10 mantissa bits (to nearest, ties to even); still fp32.

    TF32 has no dtype: sm80+ tensor cores round each fp32 input of a matmul to it under
    ``"tf32"``. This emulates that rounding exactly, with integer operations on the bit
    pattern: add just under half of the 13 dropped bits' range (plus the lowest kept bit, so
    that a tie goes to the even neighbour), then clear the dropped bits.

    Raises:
        TypeError: ``x`` is not a float32 tensor.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def fp8_quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` stored as fp8 with one scale per tensor: ``(x_fp8, scale)``, ``x ~ x_fp8 * scale``.

    The scale maps the tensor's largest magnitude (amax) to the format's largest value, so
    the stored numbers ``x / scale`` fill the format's range instead of underflowing. The
    scale is a 0-dim float32 tensor, as :func:`fp8_matmul` takes it.

    Raises:
        TypeError: ``dtype`` is not ``float8_e4m3fn`` or ``float8_e5m2``.
        ValueError: ``x`` is all zeros (or not finite), so no scale fits it.
    """
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    amax = x.detach().abs().amax().float()
    if not (torch.isfinite(amax) and amax > 0):
        raise ValueError(f"cannot scale a tensor whose largest magnitude is {amax.item()}")
    scale = (amax / torch.finfo(dtype).max).reshape(())
    return (x / scale).to(dtype), scale


def _public_scaled_mm_usable() -> bool:
    """``torch.nn.functional.scaled_mm`` exists with the arguments :func:`fp8_matmul` passes."""
    F = torch.nn.functional
    fn, scaling = getattr(F, "scaled_mm", None), getattr(F, "ScalingType", None)
    if fn is None or scaling is None or not hasattr(scaling, "TensorWise"):
        return False
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "output_dtype" in params and len(params) >= 6


def fp8_matmul_api() -> str:
    """The scaled-matmul entry point this torch offers: the public one where it exists."""
    if _public_scaled_mm_usable():
        return "torch.nn.functional.scaled_mm"
    if hasattr(torch, "_scaled_mm"):
        return "torch._scaled_mm"
    return "none"


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for fp8 ``a``, ``b`` with one fp32 scale per tensor.

    Uses ``torch.nn.functional.scaled_mm`` (torch 2.10 and newer) with tensor-wise
    scaling, else the private ``torch._scaled_mm`` (which torch 2.4 and older
    returned as a tuple with an amax). ``b`` should be column-major
    (``b.t().contiguous().t()``), as cuBLASLt wants its second fp8 operand.

    Raises:
        TypeError: an input is not an fp8 tensor or a scale is not a 1-element fp32 tensor.
        RuntimeError: this torch has no scaled matmul at all.
    """
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in fp8:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.numel() == 1):
            raise TypeError(f"{name} must be a 1-element float32 tensor, got {s!r:.60}")
    api = fp8_matmul_api()
    if api == "torch.nn.functional.scaled_mm":
        F = torch.nn.functional
        return F.scaled_mm(a, b, scale_a.reshape(()), F.ScalingType.TensorWise,
                           scale_b.reshape(()), F.ScalingType.TensorWise, output_dtype=out_dtype)
    if api == "torch._scaled_mm":
        out = torch._scaled_mm(a, b, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                               out_dtype=out_dtype)
        return out[0] if isinstance(out, tuple) else out
    raise RuntimeError(f"torch {torch.__version__} has no scaled (fp8) matmul")


@dataclass(frozen=True)
class LossGap:
    """A run's final loss against its reference run's, as a share of the reference's drop.

    ``gap_of_drop`` is ``|final - ref_final| / (ref_first - ref_final)``: 0 when the run
    ends where the reference ends, 1 when it ends a whole drop away (for example,
    when it did not learn at all). With ``log=True`` all losses are compared as
    ``log(loss)``, the scale on which a regression loss that falls by orders of
    magnitude is judged.
    """

    final: float
    ref_first: float
    ref_final: float
    last: int
    log: bool

    @property
    def ref_drop(self) -> float:
        return self.ref_first - self.ref_final

    @property
    def gap_of_drop(self) -> float:
        return abs(self.final - self.ref_final) / self.ref_drop

    @property
    def ref_drop_share(self) -> float:
        """How much of its first loss the reference shed: ``ref_drop / |ref_first|``.

        A gap is measured against the reference's drop, so it means something only where
        that drop is a real share of the loss: at 0.01 (the reference hardly learned), any
        difference between two runs is a large "share of the drop".
        """
        return self.ref_drop / abs(self.ref_first) if self.ref_first else float("inf")

    def reference_learned(self, min_share: float) -> bool:
        """Whether the reference shed at least ``min_share`` of its first loss (say 0.2)."""
        if not 0 < min_share < 1:
            raise ValueError(f"min_share must be in (0, 1), got {min_share!r}")
        return self.ref_drop_share >= min_share

    def applicability(self, min_share: float, what: str = "loss",
                      reference: str = "fp32") -> "Applicability":
        """Whether a check on this gap means anything: did the reference learn enough?

        ``applies, reason = gap.applicability(0.1)`` gives what ``ledger.expect`` takes
        (``applies=applies, reason=reason or "<why the claim holds>"``: ``reason`` is empty
        where it applies); ``print(gap.applicability(0.1))`` says what was found in one line.

        Args:
            min_share: the share of its first loss the reference must have shed, in (0, 1).
            what: what the loss is called in the sentence (``"loss"``, ``"MSE"``).
            reference: what the reference run is called (``"fp32"``, ``"TinyGPT's fp32 run"``).

        Raises:
            ValueError: ``min_share`` not in (0, 1).
        """
        ok = self.reference_learned(min_share)
        found = (f"{reference} shed {self.ref_drop_share:.1%} of its first {what} "
                 f"(the check needs {min_share:.0%})")
        reason = "" if ok else f"{found}: a gap as a share of that drop means nothing"
        line = found + (": the check applies" if ok else ": too little, the check does NOT apply")
        return Applicability(applies=ok, reason=reason, line=line)


@dataclass(frozen=True)
class Applicability:
    """Whether a claim applies, and why not: unpacks as ``applies, reason``; prints as one line.

    Attributes:
        applies: the claim applies.
        reason: why it does not (empty where it applies).
        line: what was found, for a printout.
    """

    applies: bool
    reason: str
    line: str

    def __iter__(self):
        return iter((self.applies, self.reason))

    def __bool__(self) -> bool:
        return self.applies

    def __str__(self) -> str:
        return self.line


def _final(values: Sequence[float], last: int, log: bool) -> float:
    tail = [float(v) for v in values[-last:]]
    if log:
        if min(tail) <= 0:
            raise ValueError("log=True needs positive losses")
        return sum(math.log(v) for v in tail) / len(tail)
    return sum(tail) / len(tail)


def loss_gap(losses: Sequence[float] | torch.Tensor, ref_losses: Sequence[float] | torch.Tensor,
             last: int = 5, log: bool = False) -> LossGap:
    """Compare a training curve's final loss (mean of the last ``last`` steps) with a reference.

    Args:
        losses: the run under test, one loss per step.
        ref_losses: the reference run (fp32, same start, same batches).
        last: how many final steps to average (noise from batch to batch averages out).
        log: compare ``log(loss)`` (for losses that fall by orders of magnitude).

    Raises:
        ValueError: too few steps, a non-finite loss, or a reference that did not learn
            (its final loss is not below its first), which would make any gap meaningless.
    """
    losses = [float(v) for v in losses]
    ref = [float(v) for v in ref_losses]
    if not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be a positive int, got {last!r}")
    if len(ref) <= last or len(losses) < last:
        raise ValueError(f"need more than last={last} steps (got {len(losses)} and {len(ref)})")
    if not all(math.isfinite(v) for v in losses + ref):
        raise ValueError("a loss is not finite: the run diverged")
    first = math.log(ref[0]) if log else ref[0]
    gap = LossGap(final=_final(losses, last, log), ref_first=first,
                  ref_final=_final(ref, last, log), last=last, log=log)
    if gap.ref_drop <= 0:
        raise ValueError(f"the reference did not learn (first {ref[0]:.4g}, mean of its last "
                         f"{last} {math.exp(gap.ref_final) if log else gap.ref_final:.4g}): "
                         "train longer or with a larger learning rate before comparing")
    return gap


def amdahl_bound(share: float, speedup: float) -> float:
    """Amdahl's law: the whole's speedup when a part taking ``share`` of the time gets
    ``speedup`` times faster and the rest stays as it is: ``1 / ((1 - share) + share / speedup)``.

    Raises:
        ValueError: ``share`` outside [0, 1], or ``speedup`` not positive and finite.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    if not (0.0 < speedup < math.inf):
        raise ValueError(f"speedup must be positive and finite, got {speedup!r}")
    return 1.0 / ((1.0 - share) + share / speedup)


@dataclass(frozen=True)
class TimingJob:
    """One variant to time: ``fn(*args, **kwargs)`` under ``context()`` (a fresh one per round)."""

    label: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    context: Callable[[], ContextManager[Any]] | None = None


def best_of_rounds(jobs: Mapping[Hashable, TimingJob], rounds: int = 3,
                   device: str | torch.device | None = None, min_run_time_s: float = 0.3,
                   progress: str | None = None) -> dict[Hashable, Timing]:
    """Time every job with :func:`utils.benchmark` in interleaved rounds; keep each one's fastest.

    Other work on a shared machine only ever slows a measurement down, and
    interleaving spreads a busy spell over all variants instead of hitting one, so
    the fastest round of each is the fairest comparison.

    Args:
        jobs: ``{key: TimingJob}``; the result has the same keys.
        rounds: how many rounds (>= 1).
        device: the device the jobs run on (synchronised around every reading).
        min_run_time_s: per job and round.
        progress: a ``tqdm`` description, or ``None`` for no progress bar.

    Raises:
        ValueError: no jobs, or ``rounds`` < 1.
        TypeError: a job is not a :class:`TimingJob`.
    """
    if not jobs:
        raise ValueError("best_of_rounds needs at least one job")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    for key, job in jobs.items():
        if not isinstance(job, TimingJob):
            raise TypeError(f"job {key!r} must be a utils.TimingJob, got {type(job).__name__}")
    dev = pick_device(device)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm
        bar = tqdm(total=rounds * len(jobs), desc=progress)
    best: dict[Hashable, Timing] = {}
    try:
        for _ in range(rounds):
            for key, job in jobs.items():
                ctx = job.context() if job.context is not None else contextlib.nullcontext()
                with ctx:
                    t = benchmark(job.fn, *job.args, label=job.label, device=dev,
                                  min_run_time_s=min_run_time_s, warn_if_noisy=False,
                                  **dict(job.kwargs))
                if key not in best or t.median_ms < best[key].median_ms:
                    best[key] = t
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return best


# aten op names (without the "aten::" prefix) by category, for time_breakdown.
OP_CATEGORIES: dict[str, tuple[str, ...]] = {
    "matmul / conv": ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_addmm_activation",
                      "convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                      "mkldnn_convolution", "_mkldnn_convolution", "mkldnn_convolution_backward",
                      "_slow_conv2d_forward", "_slow_conv2d_backward", "_scaled_mm",
                      "_scaled_mm_v2"),
    "attention": ("_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_backward",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention_for_cpu_backward",
                  "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_efficient_attention_backward",
                  "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_cudnn_attention_backward",
                  "_flash_attention_forward", "_flash_attention_backward",
                  "_efficient_attention_forward", "_efficient_attention_backward"),
    "casts and copies": ("_to_copy", "copy_", "to", "clone", "contiguous"),
    "optimizer": ("_foreach_", "_fused_adam", "_fused_adamw", "_fused_sgd"),
}


@dataclass(frozen=True)
class TimeBreakdown:
    """Where a call's op time went: self time of aten ops per category, per call."""

    device: str
    clock: str                    # "CUDA kernel time" or "CPU op time"
    ms_by_category: tuple[tuple[str, float], ...]
    calls: int

    @property
    def total_ms(self) -> float:
        return sum(ms for _, ms in self.ms_by_category)

    def ms(self, category: str) -> float:
        """Milliseconds per call in ``category``.

        Raises:
            KeyError: no such category.
        """
        for name, ms in self.ms_by_category:
            if name == category:
                return ms
        raise KeyError(f"no category {category!r}; have {[n for n, _ in self.ms_by_category]}")

    def share(self, category: str) -> float:
        """``category``'s fraction of the total."""
        total = self.total_ms
        return self.ms(category) / total if total > 0 else 0.0

    def diff(self, other: "TimeBreakdown") -> tuple[tuple[str, float, float], ...]:
        """``(category, ms here, ms in other)`` for every category, the largest saving
        (``other`` faster) first and the largest addition last.

        Raises:
            TypeError: ``other`` is not a :class:`TimeBreakdown`.
            ValueError: the two were measured with different clocks or categories.
        """
        if not isinstance(other, TimeBreakdown):
            raise TypeError(f"expected a TimeBreakdown, got {type(other).__name__}")
        if other.clock != self.clock:
            raise ValueError(f"different clocks: {self.clock!r} against {other.clock!r}")
        mine = [name for name, _ in self.ms_by_category]
        if sorted(mine) != sorted(name for name, _ in other.ms_by_category):
            raise ValueError("the two breakdowns have different categories")
        return tuple(sorted(((c, self.ms(c), other.ms(c)) for c in mine),
                            key=lambda row: row[2] - row[1]))

    def diff_lines(self, other: "TimeBreakdown", indent: str = "   ") -> str:
        """Two printable lines: each category's ms here -> in ``other`` (largest saving first)
        and the totals, then the largest saving and the largest addition. A category counts as
        a saving only if its time fell, and as an addition only if it rose: when none fell the
        line says that nothing got faster (and, when none rose, that nothing got slower)."""
        rows = self.diff(other)
        (save, s0, s1), (add, a0, a1) = rows[0], rows[-1]
        saving = f"the largest saving: {save}" if s1 < s0 else "nothing got faster"
        addition = (f"the largest addition: {add} ({a1 - a0:+.2f} ms)" if a1 > a0
                    else "nothing got slower")
        return (f"{indent}breakdown, {self.clock}: "
                + "; ".join(f"{c} {m0:.2f} -> {m1:.2f} ms" for c, m0, m1 in rows)
                + f"; total {self.total_ms:.2f} -> {other.total_ms:.2f} ms"
                + f"\n{indent}{saving}; {addition}")

    def __str__(self) -> str:
        rows = [f"{name:<18} {ms:>10.3f} ms  {self.share(name):>6.1%}"
                for name, ms in self.ms_by_category]
        return "\n".join(rows + [f"{'total (' + self.clock + ')':<18} {self.total_ms:>10.3f} ms"])


def _category(op: str, categories: Mapping[str, Iterable[str]]) -> str:
    for cat, names in categories.items():
        for n in names:
            if op == n or (n.endswith("_") and op.startswith(n)):
                return cat
    return "other"


def _under_optimizer_step(evt: Any) -> bool:
    """Whether a profiled op ran inside ``optimizer.step()`` (torch labels that range
    ``Optimizer.step#<class>.step``), whatever ops the optimizer used."""
    parent = getattr(evt, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


def time_breakdown(fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None,
                   calls: int = 3, warmup: int = 1, rounds: int = 1,
                   categories: Mapping[str, Iterable[str]] | None = None,
                   **kwargs: Any) -> TimeBreakdown:
    """Profile ``fn(*args, **kwargs)`` and split its op time into categories.

    On CUDA the time is the GPU time of the kernels each aten op launched (each kernel
    counted once, with the innermost op that launched it); on a CPU it is the ops'
    own (self) CPU time. Python overhead between ops is not in either, so on a CPU
    the total is below the wall time of a call.

    Args:
        fn: the call to profile (e.g. ``utils.train_step``).
        device: where it runs.
        calls: profiled calls per round (the result is per call).
        warmup: untimed calls first.
        rounds: profile this many times and keep each category's smallest time: other
            work on a shared machine only ever adds time to an op, so the smallest is the
            fairest reading (as in :func:`best_of_rounds`).
        categories: ``{category: op names}``; a name ending in ``_`` matches as a
            prefix (``"_foreach_"``). Default :data:`OP_CATEGORIES`; the rest is ``"other"``.
            Every op inside ``optimizer.step()`` counts as ``"optimizer"`` when that
            category exists, whichever ops the optimizer used (foreach, fused or a loop).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``calls`` < 1 or ``warmup`` < 0.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    check_count("calls", calls, 1)
    check_count("warmup", warmup, 0)
    check_count("rounds", rounds, 1)
    cats = dict(OP_CATEGORIES if categories is None else categories)
    dev = pick_device(device)
    cuda = dev.type == "cuda"
    best: dict[str, float] = {}
    for r in range(rounds):
        traced = profile_calls(lambda: fn(*args, **kwargs), device=dev, calls=calls,
                               warmup=warmup if r == 0 else 0)
        totals = {name: 0.0 for name in [*cats, "other"]}
        for evt in traced.events:
            if not evt.name.startswith("aten::"):
                continue  # kernels, autograd and profiler ranges: their time is in the aten ops
            if cuda:
                us = getattr(evt, "self_device_time_total", None)
                if us is None:  # the spelling before torch 2.4
                    us = getattr(evt, "self_cuda_time_total", 0.0)
            else:
                us = evt.self_cpu_time_total
            cat = ("optimizer" if "optimizer" in totals and _under_optimizer_step(evt)
                   else _category(evt.name[len("aten::"):], cats))
            totals[cat] += us / 1e3 / calls
        best = totals if not best else {k: min(best[k], v) for k, v in totals.items()}
    return TimeBreakdown(device=str(dev), clock="CUDA kernel time" if cuda else "CPU op time",
                         ms_by_category=tuple(best.items()), calls=calls * rounds)
