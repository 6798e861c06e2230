"""What a notebook runs on: device choice, environment report, capability gates.

Every notebook starts with :func:`print_env` so that its numbers can be read
against the hardware and software they came from, and guards GPU-only cells
with :func:`needs`, which skips loudly instead of failing deep inside.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from .precision import describe_tf32_overrides, matmul_precision_label, tf32_overrides
from .sizes import usable_cpu_count

__all__ = [
    "EnvInfo",
    "Gate",
    "get_env",
    "print_env",
    "pick_device",
    "needs",
    "resolve_smoke",
    "synchronize",
    "quiet_native_stderr",
]

_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "mps")

# The profiler's Kineto library reports "gpuGetDeviceCount failed" as an ERROR on every profile
# taken on a machine without a GPU: noise that reads like a failure in a learner's output. Where
# there is no CUDA GPU, show only its fatal messages (it reads the level when it logs; an
# explicit KINETO_LOG_LEVEL wins). On a GPU its errors stay visible.
if not torch.cuda.is_available():
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Send what native code writes straight to file descriptor 2 to ``/dev/null`` for a moment.

    Some torch builds' profiler library prints a line to fd 2 each time the profiler starts
    or stops (``profiler_start``/``profiler_stop`` stage lines, at any log level); in a
    notebook those lines land between the results. Wrap only the profiler's start, stop and
    event collection in this, never the profiled code, so that no warning of the user's code
    is lost. Python-level errors still propagate as exceptions. Where there is no real fd 2
    (some embedded interpreters) it does nothing.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, AttributeError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w", encoding="utf-8") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """Return the device to run on.

    A CUDA device always carries its index: ``None`` and ``"cuda"`` give the current
    CUDA device (``cuda:0`` unless code chose another with ``torch.cuda.set_device``),
    so that every CUDA API the result is passed to accepts it.

    Args:
        device: ``None`` picks CUDA when available, else CPU. A string such as
            ``"cpu"``, ``"cuda"`` or ``"cuda:1"`` or a ``torch.device`` is
            validated and returned.

    Raises:
        ValueError: the device type is unknown, or it names hardware this
            machine does not have.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"unknown device {device!r}: use one of {', '.join(_KNOWN_DEVICE_TYPES)}"
            " (optionally with an index, e.g. 'cuda:0')"
        ) from exc
    if dev.type not in _KNOWN_DEVICE_TYPES:
        raise ValueError(
            f"unsupported device type {dev.type!r}: the course supports "
            f"{', '.join(_KNOWN_DEVICE_TYPES)}"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(dev)!r} was asked for, but this machine has no CUDA GPU "
                "(torch.cuda.is_available() is False); use 'cpu' or run on a GPU node"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(dev)!r} was asked for, but only "
                f"{torch.cuda.device_count()} CUDA device(s) exist"
            )
        if dev.index is None:
            # Some CUDA APIs refuse a device without an index (get/set_per_process_memory_
            # fraction, set_device: "Expected a torch.device with a specified index"); 'cuda'
            # means the current device, so name it.
            dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "mps" and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    ):
        raise ValueError("device 'mps' was asked for, but MPS is not available here")
    return dev


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for all queued work on ``device`` to finish (no-op on CPU)."""
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class EnvInfo:
    """A snapshot of the hardware and software a measurement ran on."""

    device: str
    device_name: str
    compute_capability: tuple[int, int] | None
    total_memory_bytes: int | None
    gpu_count: int
    torch_version: str
    cuda_version: str | None
    cudnn_version: int | None
    bf16_supported: bool
    tf32_supported: bool
    flash_attention_supported: bool
    float32_matmul_precision: str
    cpu_threads: int
    cpu_count: int  # cores this process may use (its affinity set)
    python_version: str
    platform: str
    # TF32 override variables set in the environment (NVIDIA_TF32_OVERRIDE,
    # TORCH_ALLOW_TF32_CUBLAS_OVERRIDE), name to value; empty when none is set.
    tf32_overrides: dict[str, str] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-ready dict of this snapshot, stored beside every result."""
        d = asdict(self)
        if d["compute_capability"] is not None:
            d["compute_capability"] = list(d["compute_capability"])
        return d

    def summary(self) -> str:
        """One line naming the device and the software, for plot titles and tables."""
        cc = (
            f" (sm{self.compute_capability[0]}{self.compute_capability[1]})"
            if self.compute_capability
            else ""
        )
        return f"{self.device_name}{cc}, torch {self.torch_version}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _flash_attention_supported(dev: torch.device) -> bool:
    if dev.type != "cuda":
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if available is not None and not available():
        return False
    # FlashAttention kernels in PyTorch need sm80 or newer.
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def get_env(device: str | torch.device | None = None) -> EnvInfo:
    """Collect an :class:`EnvInfo` for ``device`` (default: :func:`pick_device`)."""
    dev = pick_device(device)
    cuda = dev.type == "cuda"
    if cuda:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        name = props.name
        cc: tuple[int, int] | None = (props.major, props.minor)
        mem: int | None = int(props.total_memory)
        bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        tf32 = cc >= (8, 0)
    else:
        name = _cpu_name() if dev.type == "cpu" else "Apple GPU (MPS)"
        cc, mem, tf32 = None, None, False
        # CPU autocast supports bfloat16 everywhere; fast bf16 needs AVX512-BF16/AMX.
        bf16 = True
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return EnvInfo(
        device=str(dev),
        device_name=name,
        compute_capability=cc,
        total_memory_bytes=mem,
        gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        cudnn_version=cudnn if cuda else None,
        bf16_supported=bf16,
        tf32_supported=tf32,
        flash_attention_supported=_flash_attention_supported(dev),
        float32_matmul_precision=matmul_precision_label(),
        cpu_threads=torch.get_num_threads(),
        cpu_count=usable_cpu_count(),
        python_version=sys.version.split()[0],
        platform=platform.platform(terse=True),
        tf32_overrides=tf32_overrides(),
    )


def print_env(device: str | torch.device | None = None) -> EnvInfo:
    """Print what this notebook runs on and return it as an :class:`EnvInfo`."""
    env = get_env(device)
    gib = 1024**3
    rows = [
        ("device", f"{env.device}  ({env.device_name})"),
        (
            "compute capability",
            f"sm{env.compute_capability[0]}{env.compute_capability[1]}"
            if env.compute_capability
            else "n/a (not a CUDA device)",
        ),
        (
            "device memory",
            f"{env.total_memory_bytes / gib:.1f} GiB" if env.total_memory_bytes else "n/a",
        ),
        ("GPUs visible", str(env.gpu_count)),
        ("torch", env.torch_version),
        ("CUDA (torch build)", env.cuda_version or "none (CPU-only build)"),
        ("cuDNN", str(env.cudnn_version) if env.cudnn_version else "n/a"),
        ("bf16", "yes" if env.bf16_supported else "no"),
        ("TF32 tensor cores", "yes" if env.tf32_supported else "no"),
        ("fp32 matmul precision", env.float32_matmul_precision),
        ("FlashAttention", "yes" if env.flash_attention_supported else "no"),
        ("CPU threads (torch)", f"{env.cpu_threads} of {env.cpu_count} cores"),
        ("python", f"{env.python_version} on {env.platform}"),
    ]
    if env.tf32_overrides:
        # Set behind the notebook's back (a cluster image, a job script): name them, since
        # they decide whether fp32 results carry TF32 rounding.
        rows.insert(10, ("TF32 override (env)", describe_tf32_overrides(env.tf32_overrides)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}} : {value}")
    return env


class Gate:
    """The answer of :func:`needs`: truthy when the cell may run.

    ``reason`` says what is missing when it is falsy.
    """

    def __init__(self, ok: bool, reason: str = "") -> None:
        self.ok = ok
        self.reason = reason

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Gate(ok={self.ok}, reason={self.reason!r})"


def needs(
    *,
    cuda: bool = False,
    min_capability: tuple[int, int] | None = None,
    min_gpus: int = 0,
    bf16: bool = False,
    flash_attention: bool = False,
    what: str = "this cell",
    quiet: bool = False,
) -> Gate:
    """Check that this machine has what a cell needs; print why not if it lacks it.

    Use it as ``if needs(cuda=True, what="CUDA events"): ...``. A missing
    capability never raises: the gate is falsy and a ``SKIPPED`` line names
    the missing piece, so headless runs go on.

    Args:
        cuda: a CUDA GPU is needed.
        min_capability: the lowest compute capability, e.g. ``(8, 0)`` for sm80.
        min_gpus: how many GPUs are needed.
        bf16: bfloat16 support on the GPU is needed (implies ``cuda``).
        flash_attention: PyTorch's FlashAttention kernel is needed (implies ``cuda``).
        what: a name for the guarded work, used in the message.
        quiet: do not print the ``SKIPPED`` line.

    Raises:
        ValueError: ``min_gpus`` is negative or ``min_capability`` is malformed.
    """
    if min_gpus < 0:
        raise ValueError(f"min_gpus must be >= 0, got {min_gpus}")
    if min_capability is not None and (
        len(min_capability) != 2 or not all(isinstance(x, int) for x in min_capability)
    ):
        raise ValueError(f"min_capability must be a (major, minor) pair, got {min_capability!r}")
    need_cuda = cuda or bf16 or flash_attention or min_capability is not None or min_gpus > 0
    missing: list[str] = []
    have_cuda = torch.cuda.is_available()
    if need_cuda and not have_cuda:
        missing.append("a CUDA GPU (none found)")
    if have_cuda:
        cc = torch.cuda.get_device_capability()
        if min_capability is not None and cc < tuple(min_capability):
            missing.append(
                f"compute capability sm{min_capability[0]}{min_capability[1]}+ "
                f"(this GPU is sm{cc[0]}{cc[1]})"
            )
        if bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            missing.append("bfloat16 support on the GPU")
        if flash_attention and not _flash_attention_supported(pick_device("cuda")):
            missing.append("FlashAttention (needs sm80+ and a build that has it)")
    n_gpus = torch.cuda.device_count() if have_cuda else 0
    if min_gpus > 1 and n_gpus < min_gpus:
        missing.append(f"{min_gpus} GPUs ({n_gpus} visible)")
    if missing:
        reason = f"SKIPPED {what}: needs " + "; ".join(missing) + "."
        if not quiet:
            print(reason)
        return Gate(False, reason)
    return Gate(True)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
from .ledger import SMOKE_ENV_VAR  # noqa: E402  (the course's environment variables live there)


def resolve_smoke(smoke: bool | str | None = None) -> bool:
    """Decide whether a notebook runs at smoke size.

    Precedence: an explicit value (the papermill ``parameters`` cell), then the
    ``COURSE_SMOKE`` environment variable (``1``/``0``, picked up by nbval runs
    too), then the default: smoke on a CPU, full size on a GPU.

    Raises:
        ValueError: the value or the environment variable is not a boolean word.
    """
    if smoke is None:
        smoke = os.environ.get(SMOKE_ENV_VAR)
        if smoke is None or smoke.strip() == "":
            return not torch.cuda.is_available()
    if isinstance(smoke, bool):
        return smoke
    word = str(smoke).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(
        f"cannot read smoke setting {smoke!r}: use 1/0, true/false, yes/no or on/off "
        f"(from the SMOKE parameter or the {SMOKE_ENV_VAR} environment variable)"
    )
