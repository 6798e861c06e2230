"""Counting kernels and reading the code a compiler generated.

"Fewer, bigger kernels" is a claim you can check: :func:`count_kernels` runs a
function under :mod:`torch.profiler` and counts what it launched.

* On a **CUDA** device the profiler (through CUPTI) records every kernel, memset
  and memcpy the GPU ran; each is one launch, and we count them all.
* On a **CPU** nothing is launched, but each ATen operator that has a kernel of
  its own makes one pass over its data, which is what a GPU kernel would do. We
  count those operators, skipping composites that only call other operators
  (``aten::dropout`` calls ``bernoulli_``, ``div_`` and ``mul``; the three are
  counted), views and allocations, and anything nested inside an operator
  already counted. Kernels that ``torch.compile`` generated in C++ are visible
  to the profiler only when ``torch._inductor.config.cpp.enable_kernel_profile``
  was on while compiling; :func:`enable_cpu_kernel_profile` turns it on.

:func:`kernel_names`, :func:`kernel_source`, :func:`kernel_excerpt` and
:func:`library_calls` read the module that Inductor writes
(``torch._inductor.utils.run_and_get_code`` returns it), on either device.
:func:`kernels_and_times` counts and times several versions of one function.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .profiling import check_count, gpu_kernel_events, profile_calls
from .timing import Timing, benchmark

__all__ = [
    "ByteCount",
    "KernelCount",
    "count_bytes",
    "count_kernels",
    "enable_cpu_kernel_profile",
    "kernel_excerpt",
    "kernel_names",
    "kernel_source",
    "kernels_and_times",
    "library_calls",
]

# Operators that allocate or re-describe memory without reading or writing data.
_NO_DATA_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "resize_as_", "set_", "lift_fresh", "result_type", "is_nonzero", "size", "stride",
    "contiguous",  # a composite: its copy (if any) is counted as clone/copy_
    "detach", "detach_", "_local_scalar_dense", "_unsafe_view",  # aliasing, one scalar
    "scalar_tensor",  # a 0-d tensor made from a Python number
})
# Inductor's C++ kernels, as the profiler names them with enable_kernel_profile on,
# e.g. "graph_0_cpp_fused_add_gelu_native_dropout_0".
_INDUCTOR_CPU_KERNEL = re.compile(r"(^|_)cpp_(fused|kernel|CppMicro)")
_COMPILED_REGION = "Torch-Compiled Region"


@dataclass(frozen=True)
class KernelCount:
    """What one profiled function launched (GPU) or ran as separate passes (CPU).

    ``kernels`` is the total over ``calls`` profiled calls; ``by_name`` maps each
    kernel (GPU) or operator (CPU) name to its count over those calls.
    """

    kernels: int
    by_name: dict[str, int]
    calls: int
    device: str
    method: str

    @property
    def per_call(self) -> float:
        """Kernels per call of the profiled function."""
        return self.kernels / self.calls

    def ledger_fields(self) -> dict[str, tuple[float, str]]:
        """What ``Ledger.record(name, count)`` records: ``name_per_call``, kernels per call."""
        return {"per_call": (self.per_call, "kernels")}

    def top(self, n: int = 8) -> list[tuple[str, int]]:
        """The ``n`` most frequent names, most frequent first."""
        return Counter(self.by_name).most_common(n)

    def __str__(self) -> str:
        per = f"{self.per_call:g}"
        names = ", ".join(f"{_short(k)} x{v}" for k, v in self.top(6))
        more = len(self.by_name) - min(6, len(self.by_name))
        return (f"{per} kernel(s) per call on {self.device}: {names or 'none'}"
                + (f", and {more} more" if more > 0 else ""))


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


@functools.lru_cache(maxsize=None)
def _aten_op_kind(qualified: str, overload: str = "") -> str:
    """'compute', 'composite', 'view', 'no-data' or 'unknown' for an ``aten::name`` event.

    ``overload`` is the overload the profiler recorded (``"Tensor"`` for
    ``aten::add.Tensor``); without it the default overload, or else every
    overload that is not an ``out=`` variant, decides.
    """
    base = qualified.split("::", 1)[1]
    if base in _NO_DATA_OPS:
        return "no-data"
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return "unknown"
    try:
        names = list(packet.overloads())
    except (AttributeError, RuntimeError):
        return "unknown"
    if overload and overload in names:
        names = [overload]
    elif "default" in names:
        names = ["default"]
    else:
        names = [n for n in names if not n.startswith("out")] or names
    ops = [getattr(packet, n) for n in names]
    if not ops:
        return "unknown"
    if any(getattr(op, "is_view", False) for op in ops):
        return "view"
    has = torch._C._dispatch_has_kernel_for_dispatch_key

    def implicit(op: Any) -> bool:
        try:  # op.name(): "aten::add.Tensor", or "aten::dropout" for the default overload
            return bool(has(op.name(), "CompositeImplicitAutograd"))
        except RuntimeError:
            return False

    if all(implicit(op) for op in ops):
        return "composite"
    return "compute"


def _counts_cpu(events: Any) -> tuple[Counter, bool]:
    """Count compute operators and Inductor kernels in a CPU trace; flag unseen compiled code."""
    counted: set[int] = set()
    counts: Counter = Counter()
    compiled_regions = 0
    inductor_kernels = 0
    for evt in sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end)):
        name = evt.name
        if name.startswith(_COMPILED_REGION):
            compiled_regions += 1
            continue
        is_kernel = bool(_INDUCTOR_CPU_KERNEL.search(name)) and not name.startswith("aten::")
        is_op = name.startswith("aten::") and _aten_op_kind(
            name, getattr(evt, "overload_name", "") or "") in ("compute", "unknown")
        if not (is_kernel or is_op):
            continue
        parent, nested = evt.cpu_parent, False
        while parent is not None:
            if id(parent) in counted:
                nested = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        counted.add(id(evt))
        counts[name] += 1
        inductor_kernels += is_kernel
    return counts, compiled_regions > 0 and inductor_kernels == 0


def count_kernels(fn: Callable[..., Any], *args: Any, device: str | torch.device | None = None,
                  calls: int = 1, warmup: int = 1, **kwargs: Any) -> KernelCount:
    """Profile ``fn(*args, **kwargs)`` and count the kernels it runs.

    Warm-up calls run first and are not profiled: a first call may compile,
    autotune or initialise libraries, which launches work a steady-state call
    does not.

    Args:
        fn: the work to profile.
        device: where ``fn`` runs (default: :func:`utils.pick_device`). On CUDA
            the GPU's kernels are counted, on a CPU the operators that make a
            pass over data (see the module docstring).
        calls: profiled calls (>= 1); ``per_call`` divides by it.
        warmup: unprofiled calls first (>= 0).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``calls`` or ``warmup`` is out of range.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable to profile, got {type(fn).__name__}; pass the "
                        "function itself (f), not its result (f())")
    check_count("calls", calls, 1)
    check_count("warmup", warmup, 0)
    for _ in range(warmup):  # outside the warning filter below: the function's warnings show
        fn(*args, **kwargs)
    with warnings.catch_warnings():
        # The profiler may warn about unsupported activities or its own setup; the count is
        # what matters here, and a missing device trace is reported below.
        warnings.simplefilter("ignore")
        traced = profile_calls(lambda: fn(*args, **kwargs), device=device, calls=calls)
    dev, events = traced.device, traced.events
    if dev.type == "cuda":
        counts = Counter(e.name for e in gpu_kernel_events(events))
        if not counts:
            # No device activity. Either the function launched nothing (fine: zero kernels),
            # or the GPU side of the trace is missing, or the work ran on the CPU.
            launches = sum(1 for e in events if "LaunchKernel" in e.name or "cuLaunch" in e.name)
            if launches:
                raise RuntimeError(
                    f"the trace shows {launches} kernel launch call(s) but no kernel on the GPU: "
                    "the profiler cannot see GPU activity here (CUPTI unavailable or not "
                    "permitted). Run a CUDA profiler trace by hand to check.")
            cpu_compute = sum(1 for e in events if e.name.startswith("aten::")
                              and _aten_op_kind(e.name) == "compute")
            if cpu_compute:
                raise RuntimeError(
                    f"the function ran {cpu_compute} CPU operator(s) and launched no CUDA kernel: "
                    f"its tensors are on the CPU, not on {dev}. Move them, or pass device='cpu' "
                    "to count CPU operators.")
        method = "CUDA kernels, memsets and memcpys in a torch.profiler trace"
    else:
        counts, hidden = _counts_cpu(events)
        if hidden:
            warnings.warn(
                "a torch.compile'd region ran but none of its generated C++ kernels is visible "
                "to the profiler, so they are not counted. Call "
                "utils.kernels.enable_cpu_kernel_profile() (or set "
                "torch._inductor.config.cpp.enable_kernel_profile = True) before compiling.",
                UserWarning, stacklevel=2)
        method = ("ATen operators with a kernel of their own (no composites, views, "
                  "allocations) and Inductor C++ kernels, in a torch.profiler trace")
    return KernelCount(kernels=sum(counts.values()), by_name=dict(counts), calls=calls,
                       device=str(dev), method=method)


def enable_cpu_kernel_profile() -> bool:
    """Make Inductor's C++ kernels visible to the profiler (for code compiled from now on).

    Returns ``True`` when this torch has the setting
    (``torch._inductor.config.cpp.enable_kernel_profile``), ``False`` otherwise.
    It changes only what the profiler sees, not the kernels' arithmetic; it adds a
    little bookkeeping per kernel call.
    """
    import torch._inductor.config as inductor_config

    cpp = getattr(inductor_config, "cpp", None)
    if cpp is None or not hasattr(cpp, "enable_kernel_profile"):
        return False
    cpp.enable_kernel_profile = True
    return True


@dataclass(frozen=True)
class ByteCount:
    """Bytes the operators of one call read and write, as eager mode runs them.

    ``bytes_touched`` sums, over every operator that is not a view, the sizes of
    its tensor inputs and outputs: the memory traffic of eager execution, where
    each operator reads its inputs from memory and writes its outputs back.
    """

    bytes_touched: int
    ops: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.bytes_touched:,} bytes in {len(self.ops)} ops ({', '.join(self.ops)})"


def count_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ByteCount:
    """Run ``fn`` once and add up the bytes its ATen operators read and write.

    A ``TorchDispatchMode`` sees each operator with its arguments and results;
    views (``view``, ``transpose``, ``expand``...) and allocations move no data
    and are skipped.
    A tensor that an op reads twice is counted twice, as a kernel would read it.
    This is the traffic of eager mode; a fused kernel moves only its inputs and
    outputs.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = 0
    ops: list[str] = []

    class _Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            nonlocal total
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if not getattr(func, "is_view", False) and name not in _NO_DATA_OPS:
                flat = tree_flatten((args, kwargs or {}, out))[0]
                total += sum(t.numel() * t.element_size() for t in flat
                             if isinstance(t, torch.Tensor))
                ops.append(name)
            return out

    with _Bytes():
        fn(*args, **kwargs)
    return ByteCount(bytes_touched=total, ops=tuple(ops))


_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.M)


def kernel_names(source: str) -> list[str]:
    """Names of the kernels defined in a module that Inductor generated, in order.

    Works for Triton kernels (``async_compile.triton``) and C++ kernels
    (``async_compile.cpp_pybinding``, ``async_compile.cpp``) alike.

    Raises:
        TypeError: ``source`` is not a string.
    """
    if not isinstance(source, str):
        raise TypeError(f"expected the generated source as a string, got {type(source).__name__}")
    return [m.group(1) for m in _KERNEL_DEF.finditer(source)]


def kernel_source(source: str, name: str) -> str:
    """The source text of kernel ``name`` (the string passed to ``async_compile``).

    Raises:
        TypeError: ``source`` is not a string.
        ValueError: no kernel of that name, or its text cannot be delimited.
    """
    names = kernel_names(source)
    if name not in names:
        raise ValueError(f"no kernel {name!r} in this source; its kernels are {names}")
    start = re.search(rf"^{re.escape(name)} = async_compile\.\w+\(", source, re.M)
    assert start is not None  # kernel_names found it
    rest = source[start.end():]
    quote = re.search(r"'''|\"\"\"", rest)
    if quote is None:
        raise ValueError(f"cannot find the text of kernel {name!r}: no triple-quoted string")
    body_start = quote.end()
    end = rest.find(quote.group(0), body_start)
    if end < 0:
        raise ValueError(f"cannot find the end of kernel {name!r}'s text")
    return rest[body_start:end].strip("\n")


def kernel_excerpt(source: str, name: str, max_lines: int = 40, width: int = 110) -> str:
    """The start of kernel ``name``'s code, to print and read.

    It begins at the kernel's signature (``def triton_...`` or ``extern "C"``), past the imports
    and decorators before it, and keeps at most ``max_lines`` lines of at most ``width``
    characters each.

    Raises:
        TypeError: ``source`` is not a string.
        ValueError: no kernel of that name (see :func:`kernel_source`), or ``max_lines`` or
            ``width`` below 1.
    """
    if max_lines < 1 or width < 1:
        raise ValueError(f"max_lines and width must be >= 1, got {max_lines} and {width}")
    lines = kernel_source(source, name).splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r'\s*(def \w|extern "C")', ln)), 0)
    return "\n".join(ln[:width] for ln in lines[start:start + max_lines])


def library_calls(source: str) -> list[str]:
    """The library kernels a module that Inductor generated calls, in order.

    Inductor hands some ops (by default a matmul) to the vendor library (cuBLAS, oneDNN, MKL)
    instead of generating a kernel; the module calls them as ``extern_kernels.mm(...)``,
    ``extern_kernels.addmm(...)`` ..., and this returns ``["mm", "addmm", ...]``. Fusion stops
    at such a call.

    Raises:
        TypeError: ``source`` is not a string.
    """
    if not isinstance(source, str):
        raise TypeError(f"expected the generated source as a string, got {type(source).__name__}")
    return re.findall(r"extern_kernels\.(\w+)\(", source)


def kernels_and_times(versions: Mapping[str, Callable[..., Any]], *args: Any,
                      device: str | torch.device | None = None,
                      min_run_time_s: float = 0.5) -> tuple[dict[str, KernelCount], dict[str, Timing]]:
    """Count the kernels of each version of a function and time it, on the same arguments.

    Each ``fn`` in ``versions`` (label -> callable) is called as ``fn(*args)``: first under
    :func:`count_kernels`, then under :func:`utils.benchmark` with its label. Wrap the call in
    ``torch.no_grad()`` to measure inference.

    Returns:
        ``(kernels, times)``: two dicts keyed by the labels, in the order of ``versions``, of
        :class:`KernelCount` and :class:`utils.Timing`; ``utils.compare(*times.values())`` makes
        the speedup table.

    Raises:
        ValueError: ``versions`` is empty.
    """
    if not versions:
        raise ValueError("kernels_and_times needs at least one version")
    kernels = {name: count_kernels(fn, *args, device=device) for name, fn in versions.items()}
    with warnings.catch_warnings(record=True) as caught:
        times = {name: benchmark(fn, *args, label=name, device=device, min_run_time_s=min_run_time_s)
                 for name, fn in versions.items()}
    for w in caught:  # warned again from the caller's line (a noisy timing), not from this one
        warnings.warn(w.message, w.category, stacklevel=2)
    return kernels, times
