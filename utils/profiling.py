"""The one profiling loop behind the course's profiler helpers.

:func:`utils.count_kernels`, :func:`utils.time_breakdown` and
``utils.compiletools.profile_step`` each read something different out of a
``torch.profiler`` trace, but take it the same way: warm up unprofiled, start
the profiler, run the calls, wait for the device, stop. :func:`profile_calls`
is that loop. The profiler library's own start/stop lines on file descriptor 2
are kept out of the notebook (:func:`utils.env.quiet_native_stderr`); the
profiled code's output is left alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .env import pick_device, quiet_native_stderr, synchronize

__all__ = ["ProfiledCalls", "check_count", "profile_calls", "new_profiler", "gpu_kernel_events"]


def check_count(name: str, value: Any, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum``.

    Args:
        name: the argument's name, as the caller spells it.
        value: what was passed.
        minimum: the smallest value allowed (1 for counts of calls, 0 for warm-up calls).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def new_profiler(activities: Any, **kwargs: Any) -> Any:
    """A ``torch.profiler.profile`` for one start/stop cycle, as the course takes its traces.

    ``acc_events=True`` keeps the events of a cycle after it ends. With one cycle it changes
    nothing but this: without it, torch 2.11 warns once per process that the profiler "clears
    events at the end of each cycle", a line a learner reads as a fault.
    """
    from torch.profiler import profile

    return profile(activities=activities, acc_events=True, **kwargs)


def gpu_kernel_events(events: Any) -> list[Any]:
    """The events of a trace that are work on a GPU: kernels, memcpys and memsets.

    The GPU timeline also carries the ranges of ``torch.profiler.record_function`` labels
    (user annotations, ``gpu_user_annotation`` in the trace): they span kernels, they are not
    kernels, and counting them would count a labelled step once more per label.
    """
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events
            if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


@dataclass(frozen=True)
class ProfiledCalls:
    """What :func:`profile_calls` returns.

    Attributes:
        events: ``prof.events()`` of the trace (a ``torch.profiler`` event list).
        wall_ms: wall-clock milliseconds from the first profiled call to the device
            finishing the last one (profiler overhead included).
        device: the device the calls ran on.
    """

    events: Any
    wall_ms: float
    device: torch.device


def profile_calls(run: Callable[[], Any], *, device: str | torch.device | None = None,
                  calls: int = 1, warmup: int = 0) -> ProfiledCalls:
    """Call ``run()`` ``warmup`` times, then profile ``calls`` calls of it.

    The CPU is always traced; on a CUDA device the GPU's kernels too. The device
    is synchronised after the warm-up and after the profiled calls, so the trace
    holds all the work the calls launched.

    Args:
        run: the work, as a function of no arguments (``lambda: fn(*args)``).
        device: where it runs (default: :func:`utils.pick_device`).
        calls: profiled calls (>= 1).
        warmup: unprofiled calls first (>= 0).

    Raises:
        TypeError: ``run`` is not callable.
        ValueError: ``calls`` or ``warmup`` out of range.
    """
    if not callable(run):
        raise TypeError(f"expected a callable to profile, got {type(run).__name__}; pass the "
                        "function itself (f), not its result (f())")
    check_count("calls", calls, 1)
    check_count("warmup", warmup, 0)
    from torch.profiler import ProfilerActivity

    dev = pick_device(device)
    for _ in range(warmup):
        run()
    synchronize(dev)
    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = new_profiler(activities)
    with quiet_native_stderr():
        prof.start()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            run()
        synchronize(dev)
        wall_ms = (time.perf_counter() - start) * 1e3
    finally:
        with quiet_native_stderr():
            prof.stop()
    with quiet_native_stderr():
        events = prof.events()
    return ProfiledCalls(events, wall_ms, dev)
