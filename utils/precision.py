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
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["TF32State", "tf32_state", "set_tf32", "tf32", "fp32_matmul_precision",
           "fp32_matmul_precision_state", "matmul_precision_label"]


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
