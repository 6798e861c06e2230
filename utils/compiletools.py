"""Tools the ``torch.compile`` module (01) uses in several notebooks.

* :func:`compile_settings` sets the global switches every notebook of the module
  runs under (TF32 through :func:`utils.set_tf32`, ``cudnn.benchmark``, one CPU
  thread on a CPU) and returns what it set, to print.
* :func:`fresh_cache` gives a block an empty Inductor cache, so a compile inside
  it is a cold compile.
* :func:`reset_compile_state` and :func:`compile_counts` count what the compiler
  did: graphs Dynamo captured, Dynamo's attempts (a *restart* is a second attempt
  for one frame), graphs AOTAutograd traced, graphs Inductor produced.
* :func:`compile_phase_seconds` reads ``torch._dynamo.utils.compile_times()``.
* :func:`profile_step` runs a callable under ``torch.profiler`` and sums up its
  kernels: how many, in which category (matmul, attention, optimizer, copies,
  everything else), how long the device was busy, and the gaps between kernels.
  On a CPU the "kernels" are the top-level compute operators (and Inductor's C++
  kernels, when :func:`compile_settings` turned their profiler records on).
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .env import EnvInfo
from .profiling import check_count, gpu_kernel_events, profile_calls
from .precision import TF32State, set_tf32, tf32_state

__all__ = [
    "CompileSettings",
    "compile_settings",
    "fresh_cache",
    "recompile_limit_name",
    "CompileCounts",
    "reset_compile_state",
    "compile_counts",
    "compile_phase_seconds",
    "KernelEvent",
    "StepProfile",
    "KERNEL_CATEGORIES",
    "classify_kernel",
    "kernel_base_name",
    "summarize_kernels",
    "profile_step",
    "profile_table",
    "capture_logs",
]


# -- settings ------------------------------------------------------------------------

@dataclass(frozen=True)
class CompileSettings:
    """The global switches a notebook runs under (see :func:`compile_settings`)."""

    tf32: TF32State
    cudnn_benchmark: bool
    cpu_threads: int
    cpu_kernel_records: bool  # Inductor's C++ kernels show up in the profiler

    def __str__(self) -> str:
        return (f"{self.tf32}; cudnn.benchmark={self.cudnn_benchmark}; "
                f"CPU threads={self.cpu_threads}"
                + ("; Inductor C++ kernels recorded for the profiler"
                   if self.cpu_kernel_records else ""))


def _set_cpu_kernel_records(on: bool) -> bool:
    """``torch._inductor.config.cpp.enable_kernel_profile``, where this torch has it."""
    import torch._inductor.config as inductor_config

    try:
        inductor_config.cpp.enable_kernel_profile = on
    except (AttributeError, KeyError):
        return False
    return bool(inductor_config.cpp.enable_kernel_profile)


def compile_settings(env: EnvInfo, *, tf32: bool | None = True,
                     cudnn_benchmark: bool | None = True,
                     cpu_threads: int | None = 1,
                     cpu_kernel_records: bool = False) -> CompileSettings:
    """Set the switches a training or serving script sets before it compiles.

    Args:
        env: the notebook's environment (``utils.print_env()``).
        tf32: allow TF32 for fp32 matmuls and cuDNN convolutions, through
            :func:`utils.set_tf32` (the ``fp32_precision`` API where torch has it);
            ``None`` leaves the settings as they are. TF32 changes results only on
            NVIDIA GPUs from Ampere on.
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` (``None``: leave it).
        cpu_threads: on a machine without CUDA, ``torch.set_num_threads`` (the
            module times one thread: on a busy machine, waiting for a second one
            to be scheduled buries the effects it measures); ``None`` leaves it.
        cpu_kernel_records: make Inductor's generated C++ kernels record
            themselves for ``torch.profiler`` (set it before compiling), so that
            :func:`profile_step` can count them on a CPU.

    Returns:
        What is now in force, to print.

    Raises:
        TypeError: ``env`` is not an :class:`utils.EnvInfo`, or a switch is not a bool.
        ValueError: ``cpu_threads`` below 1.
    """
    if not isinstance(env, EnvInfo):
        raise TypeError(f"env must be the EnvInfo from utils.print_env(), got {type(env).__name__}")
    if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive int or None, got {cpu_threads!r}")
    if not env.is_cuda and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    for name, value in (("tf32", tf32), ("cudnn_benchmark", cudnn_benchmark)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {value!r}")
    if tf32 is not None:
        set_tf32(tf32)
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    records = _set_cpu_kernel_records(bool(cpu_kernel_records))
    return CompileSettings(tf32=tf32_state(), cudnn_benchmark=torch.backends.cudnn.benchmark,
                           cpu_threads=torch.get_num_threads(), cpu_kernel_records=records)


# -- caches and limits -----------------------------------------------------------------

def fresh_cache(dir: str | None = None) -> contextlib.AbstractContextManager:
    """An empty Inductor cache (on disk and in memory) for the ``with`` block.

    A compile inside it is a first-ever (cold) compile, even if an earlier one built
    the same kernels. Wraps ``torch._inductor.utils.fresh_cache`` (called
    ``fresh_inductor_cache`` before torch 2.8), a private helper PyTorch's own tests use.

    Args:
        dir: the parent folder of the temporary cache (default: the system's temp folder).
    """
    import torch._inductor.utils as inductor_utils

    fn = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    return fn(dir=dir, delete=False) if dir is not None else fn()


def recompile_limit_name() -> str:
    """Dynamo's per-function recompile limit: ``recompile_limit`` since torch 2.7,
    ``cache_size_limit`` before (kept as an alias)."""
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


# -- counting what the compiler did ----------------------------------------------------

def _time_metrics() -> dict[str, list[float]]:
    """``torch._dynamo.utils.compile_times`` as {phase: [seconds of each call]}."""
    from torch._dynamo.utils import compile_times

    try:
        headers, values = compile_times(repr="csv", aggregate=False)
    except Exception:  # noqa: BLE001 - an internal helper; no metrics is an answer too
        return {}
    out: dict[str, list[float]] = {}
    for name, text in zip(headers, values):
        out[str(name)] = [float(v) for v in str(text).split(",") if v.strip()]
    return out


@dataclass(frozen=True)
class CompileCounts:
    """What the compiler did since the last :func:`reset_compile_state`.

    Attributes:
        graphs: graphs Dynamo captured and kept (``counters["stats"]["unique_graphs"]``).
        dynamo_attempts: Dynamo's tracing attempts, all frames together
            (``compile_attempt_N`` in ``compile_times()``); a restart adds one;
            ``None`` where this torch does not time attempts.
        aot_graphs: graphs AOTAutograd started on (``counters["aot_autograd"]["total"]``),
            including any abandoned by a restart.
        aot_graphs_ok: graphs AOTAutograd finished (``counters["aot_autograd"]["ok"]``).
        inductor_graphs: graphs Inductor produced: compiled, loaded from its FX graph
            cache, or compiled around the cache (the cache's hit, miss and bypass counters).
        inductor_lowerings: graphs Inductor lowered to kernels in this process
            (``GraphLowering.run`` in ``compile_times()``); ``None`` where not timed.
    """

    graphs: int
    dynamo_attempts: int | None
    aot_graphs: int
    aot_graphs_ok: int
    inductor_graphs: int
    inductor_lowerings: int | None

    @property
    def restarts(self) -> int | None:
        """Dynamo attempts beyond one per captured graph (``None`` if not timed)."""
        if self.dynamo_attempts is None:
            return None
        return max(self.dynamo_attempts - self.graphs, 0)


def reset_compile_state() -> None:
    """Forget every compiled graph (``torch._dynamo.reset()``), zero Dynamo's
    counters and clear the compile-time metrics, so counting starts from nothing."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()


def compile_counts() -> CompileCounts:
    """Read the counters now (see :class:`CompileCounts`)."""
    from torch._dynamo.utils import counters

    metrics = _time_metrics()
    attempts = [len(v) for k, v in metrics.items() if k.startswith("compile_attempt_")]
    ind = counters["inductor"]
    lowerings = len(metrics["GraphLowering.run"]) if "GraphLowering.run" in metrics else None
    return CompileCounts(
        graphs=int(counters["stats"]["unique_graphs"]),
        dynamo_attempts=sum(attempts) if attempts else None,
        aot_graphs=int(counters["aot_autograd"]["total"]),
        aot_graphs_ok=int(counters["aot_autograd"]["ok"]),
        inductor_graphs=int(ind["fxgraph_cache_miss"] + ind["fxgraph_cache_hit"]
                            + ind["fxgraph_cache_bypass"]),
        inductor_lowerings=lowerings,
    )


def compile_phase_seconds(phases: Sequence[str] | None = None) -> dict[str, float]:
    """Seconds spent in each timed compile phase, summed over calls.

    Reads ``torch._dynamo.utils.compile_times()``. Phase names are internal and move
    between releases (``_compile.compile_inner``: all of Dynamo's work per frame;
    ``bytecode_tracing``; ``create_aot_dispatcher_function``: AOTAutograd;
    ``GraphLowering.run`` / ``GraphLowering.compile_to_module``: Inductor's lowering and
    code generation; ``compile_file``: the C++ compiler; ``async_compile.wait``...).

    Args:
        phases: keep only these names (absent ones are left out); default: all.
    """
    metrics = _time_metrics()
    keep = metrics if phases is None else {k: metrics[k] for k in phases if k in metrics}
    return {k: float(sum(v)) for k, v in keep.items()}


# -- profiling a step ------------------------------------------------------------------

KERNEL_CATEGORIES = ("matmul", "attention", "optimizer", "copy", "other")

_MATMUL_WORDS = ("gemm", "cutlass", "nvjet", "cublas", "xmma", "wgmma", "gemv", "triton_tem",
                 "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                 "aten::linear", "aten::_scaled_mm", "aten::addmv", "aten::mv",
                 "aten::convolution", "aten::conv", "aten::cudnn_convolution",
                 "aten::mkldnn_convolution", "aten::_convolution", "aten::convolution_backward",
                 "conv2d", "implicit_gemm", "sgemm", "fprop", "dgrad", "wgrad", "winograd",
                 "convolve", "sm80_", "sm90_", "sm100_", "ampere_", "turing_", "volta_",
                 "fft2d_", "implicitgemm", "splitkreduce", "triton_mm", "triton_bmm")
_ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "scaled_dot_product")
_OPTIMIZER_WORDS = ("adam", "sgd", "_foreach_", "multi_tensor_apply", "adagrad")
# LAMB, as a word: "lamb" is also the start of every "{lambda" in a templated kernel name.
_LAMB = re.compile(r"(^|[^a-z])lamb([^a-z]|$)")
_FUSED_WORDS = ("triton_poi", "triton_red", "triton_per", "triton_for", "cpp_fused", "cpp_kernel")
# CPU operators that only relabel or allocate memory: no arithmetic, no kernel on a GPU.
_NO_COMPUTE = {"view", "_unsafe_view", "t", "transpose", "reshape", "_reshape_alias", "expand",
               "expand_as", "as_strided", "permute", "split", "split_with_sizes", "unbind",
               "unsqueeze", "squeeze", "slice", "select", "narrow", "detach", "detach_", "alias",
               "empty", "empty_strided", "empty_like", "resize_", "lift_fresh", "flatten",
               "unflatten", "contiguous", "view_as", "numpy_T", "chunk", "set_", "result_type",
               "_has_compatible_shallow_copy_type", "is_nonzero", "item", "_local_scalar_dense",
               "to", "_to_copy", "lift_fresh_copy", "dim", "size", "stride", "record_stream"}
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaLaunchCooperativeKernel", "cudaLaunchKernelEx")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def kernel_base_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameter list.

    ``void at::native::vectorized_elementwise_kernel<4, at::native::...{lambda(float)#1}...>
    (int, ...)`` becomes ``at::native::vectorized_elementwise_kernel``: what a kernel *is* sits
    before its first ``<`` or ``(``; what follows names the types and functors it was built
    with, and words in them ("lambda", "Adam" in a functor's namespace) say nothing about the
    kernel's kind.
    """
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    s = s.replace("(anonymous namespace)", "anonymous")
    for i, ch in enumerate(s):
        if ch in "<(":
            return s[:i].strip() or name
    return s


def classify_kernel(name: str) -> str:
    """The category of a kernel (GPU) or top-level operator (CPU), from its name.

    ``matmul`` (cuBLAS/CUTLASS GEMMs, Inductor's Triton matmul templates, convolutions),
    ``attention`` (flash/efficient/cuDNN attention kernels), ``optimizer`` (fused or foreach
    optimizer kernels), ``copy`` (device memcpy/memset) and ``other``: elementwise ops,
    reductions, norms, softmax, the loss, Inductor's fused pointwise/reduction kernels,
    the memory-bound work that fusion can shrink. Only the kernel's base name counts
    (:func:`kernel_base_name`): template and function arguments are ignored.
    """
    if not isinstance(name, str):
        raise TypeError(f"a kernel name is a str, got {type(name).__name__}")
    low = kernel_base_name(name).lower()
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copy"
    if any(w in low for w in _FUSED_WORDS) and "triton_tem" not in low:
        return "other"
    if any(w in low for w in _ATTENTION_WORDS):
        return "attention"
    if any(w in low for w in _OPTIMIZER_WORDS) or _LAMB.search(low):
        return "optimizer"
    if any(w in low for w in _MATMUL_WORDS):
        return "matmul"
    return "other"


@dataclass(frozen=True)
class KernelEvent:
    """One kernel (or top-level CPU operator) on its device's timeline, in microseconds."""

    name: str
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return max(self.end_us - self.start_us, 0.0)


@dataclass(frozen=True)
class StepProfile:
    """Kernels of one step, averaged over the profiled steps.

    Attributes:
        label: what was profiled.
        unit: ``"GPU kernels"`` or ``"CPU ops"`` (what a kernel is here).
        steps: steps profiled.
        kernels_per_step: kernels (or top-level compute ops) per step.
        kernels_by_category: the same, per :data:`KERNEL_CATEGORIES`.
        busy_ms_per_step: time the device ran kernels (union of their intervals).
        kernel_ms_by_category: summed kernel time per category, per step.
        wall_ms_per_step: wall-clock time of a step under the profiler (synchronised).
        median_gap_us: median idle gap between one kernel's end and the next one's start.
        launch_calls_per_step: CUDA kernel-launch API calls per step (``None`` on a CPU).
        graph_launches_per_step: CUDA-graph launches per step (``None`` on a CPU).
    """

    label: str
    unit: str
    steps: int
    kernels_per_step: float
    kernels_by_category: Mapping[str, float]
    busy_ms_per_step: float
    kernel_ms_by_category: Mapping[str, float]
    wall_ms_per_step: float
    median_gap_us: float
    launch_calls_per_step: float | None = None
    graph_launches_per_step: float | None = None
    top_kernels: tuple[tuple[str, float], ...] = field(default=(), repr=False)

    def share(self, category: str) -> float:
        """Fraction of the summed kernel time spent in ``category`` (0 if none ran)."""
        if category not in KERNEL_CATEGORIES:
            raise ValueError(f"unknown category {category!r}: one of {KERNEL_CATEGORIES}")
        total = sum(self.kernel_ms_by_category.values())
        return self.kernel_ms_by_category.get(category, 0.0) / total if total > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of the step's wall time with no kernel running (0 when unknown)."""
        if self.wall_ms_per_step <= 0:
            return 0.0
        return min(max(1.0 - self.busy_ms_per_step / self.wall_ms_per_step, 0.0), 1.0)

    def ledger_fields(self) -> dict[str, tuple[float, str]]:
        """What ``Ledger.record(name, profile)`` records: ``name_kernels_per_step`` (in
        :attr:`unit`), ``name_other_share`` (the memory-bound kind's share of the kernel time),
        ``name_idle_fraction`` and ``name_median_gap_us``."""
        return {"kernels_per_step": (self.kernels_per_step, self.unit),
                "other_share": (self.share("other"), "fraction"),
                "idle_fraction": (self.idle_fraction, "fraction"),
                "median_gap_us": (self.median_gap_us, "us")}

    def row(self) -> str:
        """One line for a table: counts, shares, busy and idle time."""
        shares = " ".join(f"{c} {self.share(c):4.0%}" for c in ("matmul", "attention", "other"))
        launches = ("" if self.launch_calls_per_step is None else
                    f" | launches {self.launch_calls_per_step:6.1f}"
                    f" + graphs {self.graph_launches_per_step or 0:4.1f}")
        return (f"{self.label:<30} {self.kernels_per_step:7.1f} {self.unit:<11} "
                f"(other {self.kernels_by_category.get('other', 0):6.1f}) | {shares} | "
                f"busy {self.busy_ms_per_step:8.3f} ms of {self.wall_ms_per_step:8.3f} ms "
                f"(idle {self.idle_fraction:4.0%}, median gap {self.median_gap_us:7.1f} us)"
                + launches)


def summarize_kernels(events: Sequence[KernelEvent], *, label: str, steps: int, wall_ms: float,
                      unit: str = "GPU kernels", launch_calls: int | None = None,
                      graph_launches: int | None = None) -> StepProfile:
    """Sum up kernels recorded over ``steps`` steps into a per-step :class:`StepProfile`.

    Args:
        events: the kernels, in any order.
        label: a name for the row.
        steps: how many steps the events cover (>= 1).
        wall_ms: wall-clock time of all the steps together.
        unit: what a kernel is here, for printing.
        launch_calls / graph_launches: CUDA launch API calls seen (GPU only).

    Raises:
        ValueError: ``steps`` below 1 or a negative ``wall_ms``.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if wall_ms < 0:
        raise ValueError(f"wall_ms must not be negative, got {wall_ms!r}")
    evs = sorted(events, key=lambda e: (e.start_us, e.end_us))
    counts = {c: 0.0 for c in KERNEL_CATEGORIES}
    times = {c: 0.0 for c in KERNEL_CATEGORIES}
    per_name: dict[str, float] = {}
    for e in evs:
        cat = classify_kernel(e.name)
        counts[cat] += 1
        times[cat] += e.duration_us / 1e3
        per_name[e.name] = per_name.get(e.name, 0.0) + e.duration_us / 1e3
    busy_us, gaps = 0.0, []
    cur_start = cur_end = None
    for e in evs:
        if cur_end is None:
            cur_start, cur_end = e.start_us, e.end_us
        elif e.start_us > cur_end:
            busy_us += cur_end - cur_start
            gaps.append(e.start_us - cur_end)
            cur_start, cur_end = e.start_us, e.end_us
        else:
            gaps.append(0.0)
            cur_end = max(cur_end, e.end_us)
    if cur_end is not None:
        busy_us += cur_end - cur_start
    top = tuple(sorted(((n, t / steps) for n, t in per_name.items()), key=lambda kv: -kv[1])[:40])
    return StepProfile(
        label=label, unit=unit, steps=steps,
        kernels_per_step=len(evs) / steps,
        kernels_by_category={c: v / steps for c, v in counts.items()},
        busy_ms_per_step=busy_us / 1e3 / steps,
        kernel_ms_by_category={c: v / steps for c, v in times.items()},
        wall_ms_per_step=wall_ms / steps,
        median_gap_us=statistics.median(gaps) if gaps else 0.0,
        launch_calls_per_step=None if launch_calls is None else launch_calls / steps,
        graph_launches_per_step=None if graph_launches is None else graph_launches / steps,
        top_kernels=top,
    )


def _is_cpu_compute(name: str) -> bool:
    if name.startswith("aten::"):
        return name[6:] not in _NO_COMPUTE
    low = name.lower()
    return "cpp_fused" in low or "cpp_kernel" in low


def _cpu_top_level_ops(events: Sequence[Any]) -> list[KernelEvent]:
    """Top-level compute operators among profiler events (none nested in another)."""
    out = []
    for e in events:
        if not _is_cpu_compute(e.name):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if _is_cpu_compute(parent.name):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            out.append(KernelEvent(e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def profile_step(fn: Callable[..., Any], *args: Any, steps: int = 3, warmup: int = 1,
                 label: str = "", device: str | torch.device | None = None,
                 **kwargs: Any) -> StepProfile:
    """Profile ``steps`` calls of ``fn(*args, **kwargs)`` and sum up their kernels.

    On CUDA the kernels are the GPU kernels the profiler saw (CUPTI), and the CUDA
    launch API calls on the CPU side are counted too: a CUDA-graph replay shows as one
    graph launch in place of many kernel launches. On a CPU the "kernels" are the
    top-level compute operators (views and allocations left out) and, where
    :func:`compile_settings` turned them on before compiling, Inductor's C++ kernels.

    Args:
        fn: the step (it must already be compiled: call it once before).
        steps: calls to profile (>= 1).
        warmup: unprofiled calls first.
        label: a name for the row.
        device: the device the step runs on (default: the course's device).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``steps`` below 1 or ``warmup`` below 0.
    """
    from torch.autograd import DeviceType

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_count("steps", steps, 1)
    traced = profile_calls(lambda: fn(*args, **kwargs), device=device, calls=steps, warmup=warmup)
    dev, wall_ms, events = traced.device, traced.wall_ms, list(traced.events)
    name = label or getattr(fn, "__name__", "step")
    if dev.type == "cuda":
        kernels = [KernelEvent(e.name, float(e.time_range.start), float(e.time_range.end))
                   for e in gpu_kernel_events(events)]
        launches = sum(1 for e in events if e.device_type == DeviceType.CPU
                       and e.name in _LAUNCH_CALLS)
        graphs = sum(1 for e in events if e.device_type == DeviceType.CPU
                     and e.name in _GRAPH_LAUNCHES)
        return summarize_kernels(kernels, label=name, steps=steps, wall_ms=wall_ms,
                                 unit="GPU kernels", launch_calls=launches,
                                 graph_launches=graphs)
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    return summarize_kernels(_cpu_top_level_ops(cpu), label=name, steps=steps, wall_ms=wall_ms,
                             unit="CPU ops")



def profile_table(profiles: Iterable[StepProfile], *, per: str = "step") -> str:
    """A legend line, then one :meth:`StepProfile.row` per profile: the table to print.

    Args:
        profiles: what :func:`profile_step` returned, all with the same unit.
        per: what one profiled call is ("step", "call"), for the legend.

    Raises:
        ValueError: no profiles, or profiles with different units (GPU kernels and CPU ops
            do not compare).
    """
    items = list(profiles)
    if not items:
        raise ValueError("profile_table needs at least one StepProfile")
    units = {p.unit for p in items}
    if len(units) != 1:
        raise ValueError(f"profiles count different things ({sorted(units)}): one table per unit")
    launches = (" | on a GPU, the CPU's kernel-launch calls + CUDA-graph launches"
                if items[0].launch_calls_per_step is not None else "")
    legend = (f"per {per}: {items[0].unit} (other: how many are neither matmul nor attention, "
              "the memory-bound kind) | share of kernel time in matmul, attention and 'other' "
              "kernels | busy (kernel) time of the wall time under the profiler, the idle share, "
              f"the median gap between two kernels{launches}")
    return "\n".join([legend, *(p.row() for p in items)])


@contextlib.contextmanager
def capture_logs(logger: str = "torch._dynamo", level: int = logging.NOTSET
                 ) -> Iterator[list[logging.LogRecord]]:
    """Keep the records a logger (and its children) emits inside the block.

    Yields the list the records are appended to; the handler is removed on exit, even when the
    block raises. What a logger emits at all is still up to its own level (for the compiler's
    logs, ``torch._logging.set_logs``); ``level`` only filters what is kept.

    Args:
        logger: the logger's name (``"torch._dynamo"`` holds Dynamo's logs, graph breaks and
            recompiles included).
        level: the lowest level kept (``logging.WARNING`` keeps warnings and errors).

    Raises:
        ValueError: an empty logger name or a negative level.
    """
    if not isinstance(logger, str) or not logger:
        raise ValueError(f"logger must be a logger's name, got {logger!r}")
    if not isinstance(level, int) or level < 0:
        raise ValueError(f"level must be a logging level (an int >= 0), got {level!r}")
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep(level)
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
