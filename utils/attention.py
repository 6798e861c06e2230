"""Which ``scaled_dot_product_attention`` backends can run a given call, and why not.

:func:`torch.nn.functional.scaled_dot_product_attention` (SDPA) picks one of
several kernels for each call: the plain ``MATH`` composition of matmuls and a
softmax, FlashAttention, memory-efficient attention, cuDNN attention. Which
ones can run depends on the device, dtype, head size, mask and the build.
:func:`sdpa_backend_status` forces each backend in turn with
:func:`torch.nn.attention.sdpa_kernel` and reports, per backend, whether the
call ran and, if not, the reason PyTorch gave.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BackendStatus", "sdpa_backends", "sdpa_backend_status", "SDPA_BACKEND_OPS",
           "backend_of_kernel", "SDPARun", "sdpa_backend_used", "random_qkv", "attention_step"]

# SDPBackend members that are not kernels one can force.
_NOT_KERNELS = ("ERROR", "OVERRIDEABLE")


@dataclass(frozen=True)
class BackendStatus:
    """Whether one SDPA backend ran a call, and the reason when it did not."""

    backend: str
    available: bool
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.backend:<20} " + ("runs" if self.available else f"cannot run: {self.reason}")


def sdpa_backends() -> dict[str, Any]:
    """The SDPA backends this torch defines, by name (``MATH``, ``FLASH_ATTENTION``, ...).

    ``CUDNN_ATTENTION`` is listed only where this torch has it.
    """
    from torch.nn.attention import SDPBackend

    members = getattr(SDPBackend, "__members__", None)
    if members is None:  # an ordinary Enum
        members = {m.name: m for m in SDPBackend}
    return {name: member for name, member in members.items() if name not in _NOT_KERNELS}


#: SDPA backends with kernels on CUDA only (FLASH_ATTENTION and MATH also run on a CPU).
_CUDA_ONLY = frozenset({"EFFICIENT_ATTENTION", "CUDNN_ATTENTION"})


def _reason(exc: BaseException, caught: list[warnings.WarningMessage], name: str,
            device: torch.device) -> str:
    """PyTorch explains a refused backend in UserWarnings (on CUDA, once per process for
    some of them); the error itself is generic."""
    lines = []
    for w in caught:
        text = " ".join(str(w.message).split())
        if text and text not in lines:
            lines.append(text)
    if lines:
        return "; ".join(lines)
    if device.type == "cpu" and name in _CUDA_ONLY:
        # PyTorch's own message ("... turning off both the math kernel and the fused kernels")
        # reads as if something were misconfigured: on a CPU there is simply no such kernel
        return f"a CUDA-only backend: no {name} kernel exists for cpu"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (f"no {name} kernel accepted this call on {device.type} in this build "
            f"(PyTorch says: {first})")


def sdpa_backend_status(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                        attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                        dropout_p: float = 0.0, backends: list[str] | None = None,
                        ) -> dict[str, BackendStatus]:
    """Try each SDPA backend on this call and say which ones run.

    The call runs once per backend, forward only and without autograd, so pass
    small tensors with the dtype, device, head size and mask of the real call.

    Args:
        query, key, value: ``(batch, heads, seq, head_dim)`` tensors.
        attn_mask / is_causal / dropout_p: as for ``scaled_dot_product_attention``.
        backends: names to try (default: all of :func:`sdpa_backends`).

    Raises:
        TypeError: an input is not a tensor.
        ValueError: an unknown backend name, or inputs that are not 4-D.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim), got shape "
                             f"{tuple(t.shape)}")
    from torch.nn.attention import sdpa_kernel

    known = sdpa_backends()
    names = list(known) if backends is None else list(backends)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {unknown}; this torch has {list(known)}")
    status: dict[str, BackendStatus] = {}
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.no_grad(), sdpa_kernel([known[name]]):
                    F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                   is_causal=is_causal, dropout_p=dropout_p)
                status[name] = BackendStatus(name, True)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                status[name] = BackendStatus(name, False,
                                             _reason(exc, caught, name, query.device))
    return status


# -- which backend a call really ran ---------------------------------------------------------

#: The ATen operator each SDPA backend dispatches to (what the profiler records on the CPU side,
#: eager or compiled): the name says which backend ran, on any device.
SDPA_BACKEND_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
    "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
    "aten::_scaled_dot_product_attention_math": "MATH",
    "aten::_scaled_dot_product_fused_attention_overrideable": "OVERRIDEABLE",
}


def backend_of_kernel(name: str) -> str | None:
    """The SDPA backend a GPU kernel belongs to, from its name, or ``None``.

    For traces with no CPU-side operator to read (a CUDA-graph replay): cuDNN's attention
    kernels are generated (``cudnn_generated_fort_native_sdpa_sm90_flash_...`` on an H100: the
    "flash" in it is cuDNN's algorithm, not the FlashAttention backend), FlashAttention's are
    ``flash_fwd_kernel`` / ``flash_bwd_...``, memory-efficient attention's ``fmha_cutlass...``.
    """
    low = name.lower()
    if "cudnn" in low and ("sdpa" in low or "attention" in low or "fmha" in low):
        return "CUDNN_ATTENTION"
    if "fmha_cutlass" in low or "mem_eff" in low or "efficient_attention" in low:
        return "EFFICIENT_ATTENTION"
    if "flash_fwd" in low or "flash_bwd" in low or "pytorch_flash" in low:
        return "FLASH_ATTENTION"
    return None


@dataclass(frozen=True)
class SDPARun:
    """The SDPA backend(s) one call ran, read from a profiler trace.

    Attributes:
        backends: the backends seen, in the order they first ran (forward and backward of one
            backend count once).
        kernels: the GPU kernels of those backends (CUDA only), full names.
        device: where the call ran.
    """

    backends: tuple[str, ...]
    kernels: tuple[str, ...]
    device: str

    @property
    def backend(self) -> str:
        """The one backend that ran, ``"none"`` when no SDPA ran, ``"mixed"`` for several."""
        if not self.backends:
            return "none"
        return self.backends[0] if len(self.backends) == 1 else "mixed"

    def __str__(self) -> str:
        kernels = f" (kernels: {', '.join(sorted(set(self.kernels)))})" if self.kernels else ""
        return f"SDPA on {self.device} ran {' and '.join(self.backends) or 'no attention'}{kernels}"


def sdpa_backend_used(fn: Any, *args: Any, device: str | torch.device | None = None,
                      **kwargs: Any) -> SDPARun:
    """Run ``fn(*args, **kwargs)`` once under the profiler and say which SDPA backend(s) ran.

    ``fn`` can be a whole model's forward (or forward and backward): every SDPA call in it is
    found. Warm it up first if it compiles. The answer comes from the ATen operator each
    backend dispatches to, so it holds eager and compiled, on a CPU and on a GPU; on a GPU the
    attention kernels are listed too (and name the backend when no operator was recorded,
    as in a CUDA-graph replay).

    Raises:
        TypeError: ``fn`` is not callable.
    """
    from .profiling import gpu_kernel_events, profile_calls

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    traced = profile_calls(lambda: fn(*args, **kwargs), device=device, calls=1)
    seen: list[str] = []
    for e in traced.events:
        backend = SDPA_BACKEND_OPS.get(e.name)
        if backend is None and e.name.endswith("_backward"):
            backend = SDPA_BACKEND_OPS.get(e.name[: -len("_backward")])
        if backend is not None and backend not in seen:
            seen.append(backend)
    kernels = []
    if traced.device.type == "cuda":
        for e in gpu_kernel_events(traced.events):
            backend = backend_of_kernel(e.name)
            if backend is not None:
                kernels.append(e.name)
                if backend not in seen:
                    seen.append(backend)
    return SDPARun(tuple(seen), tuple(kernels), str(traced.device))


def random_qkv(batch: int, heads: int, seq: int, head_dim: int, *,
               device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
               requires_grad: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """Queries, keys and values of shape ``(batch, heads, seq, head_dim)``: drawn in float32 on
    the CPU from ``seed`` (the same values on every device and in every dtype, up to rounding),
    then moved to ``device`` (default :func:`utils.pick_device`) and ``dtype``, as leaves that
    need a gradient when ``requires_grad``."""
    from .env import pick_device

    dev = pick_device(device)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    return [torch.randn(shape, generator=gen).to(dev, dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def attention_step(attn: Any) -> Any:
    """A training step of attention alone, to time or measure: ``run(q, k, v, grad_out)``
    clears the three inputs' gradients, runs ``attn(q, k, v)`` forward, then backward from
    ``grad_out``. The gradients stay for the caller to read. To measure its memory, clear
    them before the meter starts: ``run`` frees an earlier call's inside it otherwise, and the
    count drops by their size (on CUDA, and with the course's CPU meter)."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor) -> None:
        for t in (q, k, v):
            t.grad = None
        attn(q, k, v).backward(grad_out)
    return run
