"""TF32 on and off, with the current API where the installed torch has it.

Since torch 2.9 the documented controls are per backend and operation:
``torch.backends.cuda.matmul.fp32_precision`` and
``torch.backends.cudnn.conv.fp32_precision``, each ``"tf32"`` or ``"ieee"``
(``"none"`` inherits from the level above). The old spelling,
``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32``,
is deprecated there. The two must agree: torch keeps the old global setting
(``torch.get_float32_matmul_precision()``) beside the per-backend ones, and reading
the old one while they disagree raises "you have used mix of the legacy and new
APIs". Setting only ``torch.backends.cuda.matmul.fp32_precision`` leaves them
disagreeing, and torch itself still reads the old setting in places (Inductor's
bmm templates read ``torch.backends.cuda.matmul.allow_tf32`` in torch 2.15; others
have hit it inside ``torch.compile`` on 2.9-2.10: pytorch/pytorch#166387, #179445). cuDNN is the same story one
level down: torch keeps one combined cuDNN flag beside the per-operator ones (conv,
RNN), reads it (``torch.export`` does), and raises unless all of them agree. So this
module sets matmul precision with ``torch.set_float32_matmul_precision``, which
moves the old setting and the per-backend ones (CUDA and oneDNN matmuls) together,
and cuDNN with ``torch.backends.cudnn.allow_tf32``, which sets the combined flag and
the conv and RNN ones together (measured on torch 2.14 and 2.15: no warning, and
every setting readable afterwards). It never sets one per-backend switch alone.

TF32 changes only fp32 matmuls and convolutions on NVIDIA GPUs from Ampere (sm80)
on; elsewhere the settings are recorded but change no result.

:func:`fp32_matmul_precision` sets what fp32 *matmuls* may use on every backend at
once, with the same per-backend API: ``"ieee"`` (full fp32), ``"tf32"`` or ``"bf16"``
(oneDNN on a CPU may then compute fp32 matmuls with bf16 inside; CUDA has no
such mode and uses TF32). On torch before 2.9 it falls back to the global
``torch.set_float32_matmul_precision`` ("highest", "high", "medium").
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["TF32State", "tf32_state", "set_tf32", "tf32", "fp32_matmul_precision",
           "fp32_matmul_precision_state", "matmul_precision_label", "TF32_OVERRIDE_VARS",
           "tf32_overrides", "describe_tf32_overrides", "tf32_in_effect", "Tolerance",
           "arithmetic", "tolerance", "loosest_tolerance", "UNIT_ROUNDOFF", "loss_tolerance",
           "check_close", "worst_excess", "max_rel_diff"]


def _new_api() -> bool:
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018 - attribute probe
        torch.backends.cudnn.conv.fp32_precision  # noqa: B018
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class TF32State:
    """Whether fp32 matmuls and cuDNN convolutions may use TF32, and through which API."""

    matmul: bool
    conv: bool
    api: str  # "fp32_precision" (torch >= 2.9) or "allow_tf32"

    def __str__(self) -> str:
        on = {True: "on", False: "off"}
        if self.api == "fp32_precision":
            how = (f"torch.backends.cuda.matmul.fp32_precision={'tf32' if self.matmul else 'ieee'!r}, "
                   f"torch.backends.cudnn.conv.fp32_precision={'tf32' if self.conv else 'ieee'!r}")
        else:
            how = (f"torch.backends.cuda.matmul.allow_tf32={self.matmul}, "
                   f"torch.backends.cudnn.allow_tf32={self.conv}")
        return f"TF32: matmul {on[self.matmul]}, cuDNN conv {on[self.conv]} ({how})"


def _effective(value: str, parent: str) -> bool:
    """A backend setting of 'none' inherits its parent's."""
    return (parent if value == "none" else value) == "tf32"


def tf32_state() -> TF32State:
    """What the installed torch will do with fp32 matmuls and convolutions on an sm80+ GPU."""
    if _new_api():
        b = torch.backends
        generic = getattr(b, "fp32_precision", "none")
        cudnn_all = getattr(b.cudnn, "fp32_precision", "none")
        matmul = _effective(b.cuda.matmul.fp32_precision, generic)
        conv_parent = cudnn_all if cudnn_all != "none" else generic
        conv = _effective(b.cudnn.conv.fp32_precision, conv_parent)
        return TF32State(matmul, conv, "fp32_precision")
    return TF32State(bool(torch.backends.cuda.matmul.allow_tf32),
                     bool(torch.backends.cudnn.allow_tf32), "allow_tf32")


def set_tf32(matmul: bool, conv: bool | None = None) -> TF32State:
    """Allow (``True``) or forbid TF32 for fp32 matmuls and cuDNN convolutions.

    Args:
        matmul: TF32 for matmuls (cuBLAS).
        conv: TF32 for cuDNN convolutions, and with them cuDNN's RNNs (torch keeps the two
            in one combined flag that must agree with them); default: the same as ``matmul``.

    Returns:
        The state before the change.

    Raises:
        TypeError: a setting that is not a bool.
    """
    conv = matmul if conv is None else conv
    for name, value in (("matmul", matmul), ("conv", conv)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    before = tf32_state()
    # "high" lets fp32 matmuls use TF32 (and keeps the old and new settings in step);
    # "highest" is full fp32.
    torch.set_float32_matmul_precision("high" if matmul else "highest")
    torch.backends.cudnn.allow_tf32 = conv  # the combined flag, conv and RNN, in step
    return before


def _legacy_matmul_setting() -> str | None:
    """The old global matmul setting, or None where the settings already disagree."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _legacy_cudnn_flag() -> bool | None:
    """The combined cuDNN flag, or None where it already disagrees with conv or RNN."""
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return None


def _raw() -> tuple:
    """Everything :func:`set_tf32` and :func:`fp32_matmul_precision` touch, as it is now."""
    if _new_api():
        mk = _mkldnn_matmul()
        return (_legacy_matmul_setting(), torch.backends.cuda.matmul.fp32_precision,
                mk.fp32_precision if mk is not None else None, _legacy_cudnn_flag(),
                torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision)
    return (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)


def _restore(raw: tuple) -> None:
    if _new_api():
        legacy, cuda_matmul, mkldnn_matmul, legacy_cudnn, conv, rnn = raw
        # First the combined settings (each moves the per-backend ones with it), then the
        # per-backend ones exactly as they were.
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        if legacy_cudnn is not None:
            torch.backends.cudnn.allow_tf32 = legacy_cudnn
        torch.backends.cuda.matmul.fp32_precision = cuda_matmul
        mk = _mkldnn_matmul()
        if mk is not None and mkldnn_matmul is not None:
            mk.fp32_precision = mkldnn_matmul
        torch.backends.cudnn.conv.fp32_precision = conv
        torch.backends.cudnn.rnn.fp32_precision = rnn
    else:
        torch.set_float32_matmul_precision(raw[0])
        torch.backends.cudnn.allow_tf32 = raw[1]


@contextlib.contextmanager
def tf32(matmul: bool = True, conv: bool | None = None) -> Iterator[TF32State]:
    """Run a block with TF32 on (or off) for matmuls and convolutions, then restore
    the settings exactly as they were (``"none"``, inherit, included).

    Example::

        with utils.tf32(False):       # full fp32 for a reference result
            ref = model(x)
    """
    raw = _raw()
    set_tf32(matmul, conv)
    try:
        yield tf32_state()
    finally:
        _restore(raw)


_LEGACY_SETTING = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def _mkldnn_matmul() -> object | None:
    mk = getattr(torch.backends, "mkldnn", None)
    matmul = getattr(mk, "matmul", None)
    try:
        matmul.fp32_precision  # noqa: B018 - attribute probe
    except (AttributeError, RuntimeError):
        return None
    return matmul


def fp32_matmul_precision_state() -> dict[str, str]:
    """What fp32 matmuls may use, per backend (``{"cuda": ..., "mkldnn": ...}`` with the
    current API; ``{"global": ...}`` with ``torch.get_float32_matmul_precision()`` before it)."""
    if _new_api():
        state = {"cuda": torch.backends.cuda.matmul.fp32_precision}
        mk = _mkldnn_matmul()
        if mk is not None:
            state["mkldnn"] = mk.fp32_precision
        return state
    return {"global": torch.get_float32_matmul_precision()}


@contextlib.contextmanager
def fp32_matmul_precision(setting: str) -> Iterator[dict[str, str]]:
    """Run a block with fp32 matmuls allowed to use ``setting`` internally, then restore.

    Args:
        setting: ``"ieee"`` (full fp32, PyTorch's default), ``"tf32"`` (TF32 tensor
            cores on CUDA sm80+; oneDNN's TF32 where a CPU has it) or ``"bf16"``
            (oneDNN may use bf16 inside fp32 matmuls on a CPU; CUDA uses TF32).

    Yields:
        The per-backend state inside the block (:func:`fp32_matmul_precision_state`).

    Raises:
        ValueError: an unknown setting.

    Example::

        with utils.fp32_matmul_precision("tf32"):
            y = a @ b          # TF32 on an sm80+ GPU
    """
    if setting not in _LEGACY_SETTING:
        raise ValueError(f"setting must be one of {sorted(_LEGACY_SETTING)}, got {setting!r}")
    raw = _raw()
    # One call sets the old global setting and, on torch >= 2.9, the per-backend ones
    # (CUDA: tf32 for "high" and "medium"; oneDNN: tf32 / bf16) in step with it.
    torch.set_float32_matmul_precision(_LEGACY_SETTING[setting])
    try:
        yield fp32_matmul_precision_state()
    finally:
        _restore(raw)


def matmul_precision_label() -> str:
    """How fp32 matmuls run, for a report: ``torch.get_float32_matmul_precision()``
    where it can be read, else the per-backend settings.

    Reading the global setting raises on torch >= 2.9 when code set a per-backend
    matmul switch alone (the settings then disagree); a report must not fail on that.
    """
    legacy = _legacy_matmul_setting()
    if legacy is not None:
        return legacy
    return ", ".join(f"{k}={v}" for k, v in fp32_matmul_precision_state().items())


# -- what is really in effect: environment overrides --------------------------------------

#: Environment variables that change TF32 behind torch's settings. ``NVIDIA_TF32_OVERRIDE=0``
#: makes NVIDIA's libraries (cuBLAS, cuDNN) compute fp32 in full precision whatever a program
#: asks for (other values change nothing); ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` makes torch
#: let cuBLAS use TF32 for fp32 matmuls whatever ``set_float32_matmul_precision`` says (torch
#: reads it once, at start-up). Cluster images and job scripts set them; a tolerance chosen
#: for fp32 then meets TF32 results without any line of the notebook saying so.
TF32_OVERRIDE_VARS = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")


def tf32_overrides(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The TF32 override variables set in ``environ`` (default: this process's), name to value."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in TF32_OVERRIDE_VARS if env.get(k, "").strip() != ""}


def describe_tf32_overrides(overrides: dict[str, str]) -> str:
    """One line for a report: what each set override does, or ``""`` when none is set."""
    parts = []
    for name, value in overrides.items():
        v = value.strip()
        if name == "NVIDIA_TF32_OVERRIDE":
            effect = ("NVIDIA's libraries compute fp32 matmuls and convolutions in full fp32, "
                      "whatever torch's settings say" if v == "0"
                      else "no effect (only 0 changes anything)")
        else:
            effect = ("cuBLAS may use TF32 for fp32 matmuls whatever torch's settings say"
                      if v.lower() in ("1", "true", "yes", "on") else "no effect")
        parts.append(f"{name}={v} ({effect})")
    return "; ".join(parts)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def tf32_in_effect(device: str | torch.device | None = None, *, matmul: bool | None = None,
                   capability: tuple[int, int] | None = None,
                   environ: dict[str, str] | None = None, op: str = "matmul") -> bool:
    """Whether fp32 matmuls (or cuDNN convolutions) on ``device`` really run with TF32 inputs.

    TF32 needs an NVIDIA GPU of compute capability 8.0 or newer, a setting that allows it
    (``matmul``, default: the current :func:`tf32_state`, its matmul or its cuDNN conv setting)
    or, for matmuls, ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, and no ``NVIDIA_TF32_OVERRIDE=0``.
    On a CPU (or MPS) it is never in effect.

    Args:
        device: the device the fp32 work runs on (default: :func:`utils.pick_device`).
        matmul: the TF32 setting to assume for ``op`` (default: the current one).
        capability: the GPU's compute capability (default: read from ``device``).
        environ: the environment to read the overrides from (default: this process's).
        op: ``"matmul"`` (cuBLAS) or ``"conv"`` (cuDNN convolutions, TF32 by default in torch).

    Raises:
        ValueError: an unknown ``op``.
    """
    if op not in ("matmul", "conv"):
        raise ValueError(f"op must be 'matmul' or 'conv', got {op!r}")
    dev = None if device is None else torch.device(device)
    if dev is None or (dev.type == "cuda" and dev.index is None and capability is None):
        from .env import pick_device  # env imports this module

        dev = pick_device(dev)  # the index: CUDA APIs may refuse a device without one
    if dev.type != "cuda":
        return False
    cc = capability if capability is not None else torch.cuda.get_device_capability(dev)
    if tuple(cc) < (8, 0):
        return False
    env = os.environ if environ is None else environ
    if env.get("NVIDIA_TF32_OVERRIDE", "").strip() == "0":
        return False
    state = tf32_state()
    allowed = (state.matmul if op == "matmul" else state.conv) if matmul is None else matmul
    if op == "conv":
        return bool(allowed)  # the cuBLAS override does not reach cuDNN
    return bool(allowed or _truthy(env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")))


# -- tolerances ------------------------------------------------------------------------------

#: Unit roundoff (half the gap between 1 and the next number) of each arithmetic a result
#: can come from. TF32 keeps fp32's range with fp16's 10 explicit mantissa bits.
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11,
                 "bf16": 2.0**-8}

#: Relative tolerance of each arithmetic, for two computations of the same function that
#: differ in order and kernels (eager vs compiled, one fused kernel vs several, one rank vs
#: several). Reduced precision: 8 unit roundoffs (inputs rounded once, sums in fp32).
#: fp32 and fp64: 2^-13 and 2^-40, room for long sums added up in another order through a
#: few layers (the error of a reordered fp32 sum of n terms grows like n x 2^-24 at worst).
_RTOL = {"fp64": 2.0**-40, "fp32": 2.0**-13, "tf32": 8 * 2.0**-11, "fp16": 8 * 2.0**-11,
         "bf16": 8 * 2.0**-8}
_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16",
                torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Tolerance:
    """How far two results of the same function may be apart, for one arithmetic.

    An element passes when ``|actual - expected| <= atol + rtol * |expected|``, the rule of
    :func:`torch.testing.assert_close`. ``atol`` is ``rtol`` times the scale of the values
    (their root mean square, when :func:`tolerance` was given the expected tensor), so that
    a small output is held to the same relative standard as a large one.

    Attributes:
        rtol: relative tolerance.
        atol: absolute tolerance, in the units of the values.
        arithmetic: what the tolerance is for: ``"fp32"``, ``"tf32"``, ``"bf16"``, ...
        scale: the magnitude ``atol`` was scaled to.
    """

    rtol: float
    atol: float
    arithmetic: str
    scale: float = 1.0

    def kwargs(self) -> dict[str, float]:
        """``dict(rtol=..., atol=...)`` for :func:`torch.testing.assert_close`."""
        return {"rtol": self.rtol, "atol": self.atol}

    def excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """The worst element's error in units of what this tolerance allows it.

        Below 1 passes; a negative control should reach 10 or more, so that the check
        it must fail does not pass it by luck.
        """
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64).to(a.device)
        if a.shape != e.shape:
            raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
        if a.numel() == 0:
            return 0.0
        allowed = self.atol + self.rtol * e.abs()
        return float(((a - e).abs() / allowed).max())

    def norm_excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """The whole tensor's relative error ``||actual - expected|| / ||expected||`` (L2) in
        units of ``rtol``. Below 1 passes.

        For gradients of deep models compared across kernels that sum in another order (eager
        against compiled, under TF32 or 16-bit arithmetic): a gradient element that is a sum
        of terms cancelling each other keeps the rounding of the terms, not of the small sum,
        so an elementwise rule fails where the tensor as a whole agrees to the arithmetic's
        rounding. Use it where the comparison is about the tensor, and say so.
        """
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64).to(a.device)
        if a.shape != e.shape:
            raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
        ref = float(e.norm())
        diff = float((a - e).norm())
        if ref == 0.0:
            return 0.0 if diff == 0.0 else float("inf")
        return diff / ref / self.rtol

    def __str__(self) -> str:
        return (f"rtol {self.rtol:.1e}, atol {self.atol:.1e} ({self.arithmetic}"
                + (f", values of scale {self.scale:.3g}" if self.scale != 1.0 else "") + ")")


def arithmetic(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
               *, tf32: bool | None = None, op: str = "matmul") -> str:
    """The arithmetic matmuls in ``dtype`` on ``device`` really use: ``"fp32"``, ``"tf32"``,
    ``"bf16"``, ``"fp16"`` or ``"fp64"``.

    ``tf32`` forces the answer for fp32 (``True``: as if TF32 were on, for a check that
    must hold on a GPU node too); ``None`` reads the device, the settings and the override
    variables (:func:`tf32_in_effect`).

    Raises:
        ValueError: a dtype that is not a floating-point type the course uses.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"no tolerance for dtype {dtype}: use one of "
                         f"{', '.join(str(d) for d in _DTYPE_NAMES)}")
    name = _DTYPE_NAMES[dtype]
    if name != "fp32":
        return name
    if tf32 is None:
        tf32 = tf32_in_effect(device, op=op)
    return "tf32" if tf32 else "fp32"


def tolerance(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, *,
              tf32: bool | None = None, scale: float | torch.Tensor = 1.0,
              factor: float = 1.0, op: str = "matmul") -> Tolerance:
    """The tolerance for comparing two computations of one function in ``dtype``.

    The one place the course derives a tolerance: from the dtype, the device and the TF32
    state in effect there (settings and override variables), so a check written for fp32
    does not fail, or pass too easily, when the same cell runs with TF32 on a GPU.

    Args:
        dtype: the dtype the compared results were computed in.
        device: where they were computed (default: :func:`utils.pick_device`).
        tf32: force TF32 on or off for fp32 instead of reading the device (``True`` gives
            the loosest fp32 tolerance any GPU node could use).
        scale: the magnitude of the values: a number, or the expected tensor, whose root
            mean square is used. ``atol = rtol * scale``.
        factor: widen (or narrow) both tolerances, for a comparison known to differ more
            (say why beside it).
        op: what the fp32 results went through: ``"matmul"`` (the default) or ``"conv"``
            (cuDNN convolutions, whose TF32 setting is their own and on by default in torch).

    Raises:
        ValueError: an unknown dtype, a scale or factor that is not positive and finite.
    """
    name = arithmetic(dtype, device, tf32=tf32, op=op)
    if isinstance(scale, torch.Tensor):
        scale = float(scale.detach().to(torch.float64).pow(2).mean().sqrt()) if scale.numel() else 1.0
        scale = scale if scale > 0 else 1.0
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive finite number or a tensor, got {scale!r}")
    if not (isinstance(factor, (int, float)) and 0 < factor < float("inf")):
        raise ValueError(f"factor must be a positive finite number, got {factor!r}")
    rtol = _RTOL[name] * factor
    return Tolerance(rtol=rtol, atol=rtol * float(scale), arithmetic=name, scale=float(scale))


def loosest_tolerance(dtype: torch.dtype = torch.float32, *,
                      scale: float | torch.Tensor = 1.0, factor: float = 1.0) -> Tolerance:
    """The loosest tolerance :func:`tolerance` gives ``dtype`` on any device: TF32's for fp32.

    A negative control must break *this* one by 10x or more, so that it is caught on a
    GPU node with TF32 on as well as on the CPU where CI runs it.
    """
    return tolerance(dtype, "cpu", tf32=True, scale=scale, factor=factor)


def _pairs(actual: torch.Tensor | Sequence[torch.Tensor],
           expected: torch.Tensor | Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        return [(actual, expected)]
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        raise TypeError("give two tensors or two sequences of tensors, not one of each")
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} tensors against {len(expected)} expected")
    if not actual:
        raise ValueError("nothing to compare")
    return list(zip(actual, expected))


def check_close(actual: torch.Tensor | Sequence[torch.Tensor],
                expected: torch.Tensor | Sequence[torch.Tensor],
                dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, *,
                factor: float = 1.0, op: str = "matmul") -> float:
    """``torch.testing.assert_close`` of each tensor against its expected one, with the
    tolerance of :func:`tolerance` for ``dtype`` on ``device``, scaled to *that* expected
    tensor (``scale=expected``). Returns the worst element's error in units of its
    tolerance (below 1, or it raised).

    A shortcut for ``assert_close(a, e, **utils.tolerance(dtype, device, scale=e).kwargs())``
    over a list of tensors (the gradients of a model, say).

    Raises:
        AssertionError: a tensor is not within its tolerance (torch's message).
        ValueError, TypeError: the two sides do not pair up.
    """
    worst = 0.0
    for a, e in _pairs(actual, expected):
        tol = tolerance(dtype, device, scale=e, factor=factor, op=op)
        torch.testing.assert_close(a, e, **tol.kwargs())
        worst = max(worst, tol.excess(a, e))
    return worst


def worst_excess(actual: torch.Tensor | Sequence[torch.Tensor],
                 expected: torch.Tensor | Sequence[torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, *,
                 factor: float = 1.0, loosest: bool = False, op: str = "matmul") -> float:
    """The worst element's error over all the tensors, in units of the tolerance for ``dtype``
    (each scaled to its expected tensor, as :func:`check_close` does). Below 1 passes.

    With ``loosest=True`` the tolerance is :func:`loosest_tolerance` (TF32's for fp32): a
    negative control must reach 10 or more on it, so that it is caught on any device.

    Raises:
        ValueError, TypeError: the two sides do not pair up.
    """
    worst = 0.0
    for a, e in _pairs(actual, expected):
        tol = (loosest_tolerance(dtype, scale=e, factor=factor) if loosest
               else tolerance(dtype, device, scale=e, factor=factor, op=op))
        worst = max(worst, tol.excess(a, e))
    return worst


def max_rel_diff(actual: torch.Tensor | Sequence[torch.Tensor],
                 expected: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """The largest ``|actual - expected|`` of each tensor over the largest ``|expected|`` of
    that tensor, worst over all the tensors (in fp64): how far apart two sets of weights or
    gradients are, on a scale that needs no tolerance (0 is bit for bit, 1 is as large as the
    values themselves). An all-zero expected tensor gives 0 against an all-zero actual one and
    infinity otherwise; a NaN in ``actual`` gives NaN, never a smaller number.

    Raises:
        ValueError, TypeError: the two sides do not pair up, or a pair's shapes differ.
    """
    worst = 0.0
    for a, e in _pairs(actual, expected):
        if a.shape != e.shape:
            raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
        if a.numel() == 0:
            continue
        a = a.detach().to(torch.float64)
        e = e.detach().to(torch.float64).to(a.device)
        diff, scale = float((a - e).abs().max()), float(e.abs().max())
        if math.isnan(diff):
            return math.nan
        if scale > 0:
            worst = max(worst, diff / scale)
        elif diff > 0:
            worst = math.inf
    return worst


#: Relative tolerance for a mean loss (a scalar over thousands of tokens) computed twice from
#: the same weights and batch in the arithmetic named: fp32 only reorders sums; TF32 and the
#: 16-bit formats round every product, but a mean over many tokens averages those roundings
#: (elementwise errors of 8 unit roundoffs, see :func:`tolerance`, shrink to about 1e-4 of the
#: loss). The capstone checks every rung's first loss against fp32 eager's with these.
_LOSS_RTOL = {"fp64": 1e-12, "fp32": 1e-6, "tf32": 1e-4, "bf16": 1e-4, "fp16": 1e-4}


def loss_tolerance(arithmetic_name: str) -> float:
    """The relative tolerance of a mean loss computed in ``arithmetic_name`` against the same
    loss in fp32 (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or ``"fp64"``; see
    :func:`arithmetic`).

    Raises:
        ValueError: an unknown arithmetic.
    """
    if arithmetic_name not in _LOSS_RTOL:
        raise ValueError(f"unknown arithmetic {arithmetic_name!r}: one of {', '.join(_LOSS_RTOL)}")
    return _LOSS_RTOL[arithmetic_name]
