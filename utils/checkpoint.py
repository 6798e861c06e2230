"""Checkpoints that survive a crash and load safely.

:func:`atomic_save` writes to a temporary file in the target's folder, flushes it
to disk, then renames it over the target: the rename is atomic on POSIX file
systems, so a crash or a kill mid-save leaves the previous checkpoint (or none),
never half of one. :func:`safe_load` loads with ``weights_only=True`` (the
default since torch 2.6: tensors, containers and plain types, no arbitrary
pickled objects) and turns the errors of a truncated, foreign or unsafe file
into one :class:`CheckpointError` that names the file and says what to do.

:func:`save_training_state` / :func:`load_training_state` keep everything a
resumed run needs in one atomic file (model, optimizer, GradScaler, step and
the random-number generators' states) and check, on loading, that the file is
one of theirs and has every part the caller asks for. A save killed mid-write
leaves a hidden temporary beside the checkpoint; :func:`stale_temporaries`
finds them and :func:`remove_stale_temporaries` cleans them up.

:func:`record_loads` records how a block of code calls ``torch.load`` and
``load_state_dict``, so that a check can tell a load that holds one copy of the
weights (``mmap=True``, a model on the meta device, ``assign=True``) from one
that holds two, without measuring memory.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch

__all__ = [
    "CheckpointError",
    "atomic_save",
    "safe_load",
    "TrainingState",
    "save_training_state",
    "load_training_state",
    "stale_temporaries",
    "remove_stale_temporaries",
    "state_to_cpu",
    "state_max_abs_diff",
    "LoadCalls",
    "record_loads",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
TRAINING_STATE_FORMAT = "pytorch-optimization-track/training-state"
TRAINING_STATE_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: truncated, not a torch file, or unsafe to unpickle."""


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it
    (``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_mode_for(target: Path) -> int:
    """The permissions a plain ``torch.save(obj, target)`` would leave: those of the
    file it overwrites, or for a new file ``0o666`` less the umask (``mkstemp``
    alone creates ``0o600``, which other users and jobs cannot read)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return 0o666 & ~_current_umask()


def atomic_save(obj: Any, path: str | os.PathLike, *, fsync: bool = True) -> Path:
    """``torch.save(obj, path)`` so that ``path`` is always either the old file or the new one.

    The file gets the permissions a plain ``torch.save`` would give it: those of
    the file it replaces, or, for a new file, read and write for everyone the
    umask allows (usually ``0o644``).

    Args:
        obj: what to save (a state dict, or a dict of them with a step counter).
        path: the checkpoint file; its folder is created if missing.
        fsync: flush the data (and the rename) to disk before returning.

    Returns:
        The path written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = _file_mode_for(target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        if hasattr(os, "fchmod"):  # POSIX; on Windows mkstemp's file is readable already
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(target.parent)
    return target


def safe_load(path: str | os.PathLike, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """Load a checkpoint with ``weights_only=True``; a clear error for a bad file.

    Args:
        path: the checkpoint file.
        map_location: where tensors go (default CPU; move them afterwards).
        mmap: map the file's tensors instead of reading them into memory
            (for files written by ``torch.save``'s zip format).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated, is not a torch checkpoint, or
            holds objects that ``weights_only`` loading refuses.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {p}")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{p} is empty: the save that wrote it did not finish")
    with open(p, "rb") as fh:
        head = fh.read(4)
    # torch.save writes a zip archive (since torch 1.6) or, in the legacy format, a pickle
    # stream, which starts with the PROTO opcode (0x80).
    if not (head.startswith(b"PK") or head[:1] == b"\x80"):
        raise CheckpointError(f"{p} is not a torch checkpoint: it starts with {head!r}, neither "
                              "a zip archive (torch.save) nor a pickle stream (legacy format)")
    if mmap and not head.startswith(b"PK"):
        raise CheckpointError(f"{p} is in torch's legacy (pre-1.6) format, which cannot be "
                              "memory-mapped: load it with mmap=False, or save it again")
    try:
        return torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        text = _ANSI.sub("", str(exc))
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        if "weights_only" in text or "Unsupported global" in text:
            found = _GLOBAL.search(text)
            what = (f"it names {found.group(1)}, which weights_only loading does not allow"
                    if found else first)
            raise CheckpointError(
                f"{p} holds objects that safe loading refuses ({what}). Save a state_dict "
                "(tensors, dicts, numbers) instead of a whole model or optimizer object; load "
                "with torch.load(..., weights_only=False) only a file you trust, since "
                "unpickling can run arbitrary code") from None
        raise CheckpointError(f"{p} is not a torch checkpoint ({first})") from None
    except Exception as exc:  # noqa: BLE001 - a foreign file can fail in any way (IndexError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{p} is not a complete torch checkpoint: truncated by a save "
                              f"that did not finish, or another format ({first})") from None


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}."


def stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Temporaries that :func:`atomic_save` left beside ``path`` when a save was
    killed before its rename (``.<name>.<random>.tmp``), oldest first."""
    target = Path(path)
    if not target.parent.is_dir():
        return []
    found = [p for p in target.parent.iterdir()
             if p.name.startswith(_tmp_prefix(target)) and p.name.endswith(".tmp") and p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def remove_stale_temporaries(path: str | os.PathLike) -> int:
    """Delete the temporaries of killed saves of ``path``; returns the bytes freed.

    Call it when no save of ``path`` is running (at the start of a job): a
    temporary belongs to a save in progress until its rename.
    """
    freed = 0
    for p in stale_temporaries(path):
        try:
            size = p.stat().st_size
            p.unlink()
            freed += size
        except FileNotFoundError:
            pass
    return freed


@dataclass(frozen=True)
class TrainingState:
    """What :func:`load_training_state` restored: the step to resume from,
    the caller's extra data, and which parts were restored."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    restored: tuple[str, ...] = ()
    path: str = ""


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def save_training_state(path: str | os.PathLike, *, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None = None,
                        scaler: Any = None, step: int, extra: dict[str, Any] | None = None,
                        rng: bool = True, fsync: bool = True) -> Path:
    """Save a resumable training state atomically (see :func:`atomic_save`).

    One file holds the model's and optimizer's ``state_dict``, the GradScaler's
    (its scale and growth tracker: without them a resumed fp16 run starts
    again from the initial scale), the step counter, the CPU and CUDA random
    generators' states, and ``extra`` (plain data: numbers, strings, lists,
    dicts, tensors). Everything in it loads with ``weights_only=True``.

    Args:
        path: the checkpoint file.
        model: the model (``model.state_dict()`` is saved).
        optimizer: its optimizer, if any.
        scaler: a ``torch.amp.GradScaler``, if the run uses one.
        step: the number of optimizer steps taken so far (>= 0).
        extra: anything else the run needs to resume (data-loader position...).
        rng: also save the random generators' states.
        fsync: flush to disk before returning.

    Raises:
        ValueError: a negative or non-integer step.
        TypeError: ``model`` is not a module, or ``extra`` is not a dict.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    state: dict[str, Any] = {
        "format": TRAINING_STATE_FORMAT,
        "version": TRAINING_STATE_VERSION,
        "step": step,
        "model": model.state_dict(),
        "extra": dict(extra or {}),
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if rng:
        state["rng"] = _rng_states()
    return atomic_save(state, path, fsync=fsync)


def load_training_state(path: str | os.PathLike, *, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        map_location: Any = "cpu", restore_rng: bool = True,
                        strict: bool = True, assign: bool = False,
                        mmap: bool = False) -> TrainingState:
    """Restore a state written by :func:`save_training_state` into live objects.

    The file is loaded with ``weights_only=True`` (:func:`safe_load`). Each
    object you pass is restored from its part of the file; a part you ask for
    that the file lacks is an error, not a silent fresh start.

    Args:
        path: the checkpoint file.
        model: restored with ``load_state_dict(..., strict=strict, assign=assign)``
            (``assign=True`` for a model built on the meta device).
        optimizer: restored if given (the file must hold optimizer state).
        scaler: a GradScaler, restored if given (the file must hold its state).
        map_location: where tensors are loaded (then copied into the model's
            own tensors, unless ``assign``).
        restore_rng: set the random generators back to the saved states.
        strict: passed to ``model.load_state_dict``.
        assign: passed to ``model.load_state_dict``.
        mmap: map the file's tensors instead of reading them into memory.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated, unsafe or foreign, misses a
            part that was asked for, or does not fit the model.
    """
    p = Path(path)
    state = safe_load(p, map_location=map_location, mmap=mmap)
    if not isinstance(state, dict) or state.get("format") != TRAINING_STATE_FORMAT:
        keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{p} is a torch file but not a training state written by save_training_state "
            f"(found {keys}); for a bare state_dict use model.load_state_dict(safe_load(path))")
    if state.get("version") != TRAINING_STATE_VERSION:
        raise CheckpointError(f"{p} has training-state version {state.get('version')!r}; this "
                              f"code reads version {TRAINING_STATE_VERSION}")
    wanted = {"optimizer": optimizer, "scaler": scaler}
    missing = [name for name, obj in wanted.items() if obj is not None and name not in state]
    if missing:
        raise CheckpointError(f"{p} has no {' or '.join(missing)} state, but one was passed to "
                              "restore: it was saved without it; resuming would silently start "
                              f"{' and '.join(missing)} from scratch")
    restored = []
    try:
        model.load_state_dict(state["model"], strict=strict, assign=assign)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{p} does not fit this model: {first}") from None
    restored.append("model")
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{p}: the optimizer state does not fit this optimizer "
                                  f"({str(exc).strip().splitlines()[0]})") from None
        restored.append("optimizer")
    if scaler is not None:
        try:
            scaler.load_state_dict(state["scaler"])
        except (RuntimeError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{p}: the GradScaler state does not fit this scaler "
                f"({str(exc).strip().splitlines()[0]}); a scaler saved while disabled (bf16 or "
                "CPU runs) has no state to restore into an enabled one") from None
        restored.append("scaler")
    if restore_rng and "rng" in state:
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        cuda_states = state["rng"].get("cuda")
        if cuda_states is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
        restored.append("rng")
    return TrainingState(step=int(state["step"]), extra=dict(state.get("extra", {})),
                         restored=tuple(restored), path=str(p))


def state_to_cpu(tree: Any) -> Any:
    """A copy of a nested state (dicts, lists and tuples of tensors and plain values, such as
    a model's and an optimizer's state dicts) with every tensor detached and cloned to the
    CPU, so that later training cannot change it; other values are kept as they are."""
    if isinstance(tree, dict):
        return {k: state_to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(state_to_cpu(v) for v in tree)
    return tree.detach().cpu().clone() if torch.is_tensor(tree) else tree


def _tensor_pairs(state: Any, reference: Any, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The matching tensors of two nested states; ValueError where their structure differs."""
    if isinstance(reference, dict):
        if not isinstance(state, dict) or state.keys() != reference.keys():
            raise ValueError(f"{where or 'the state'}: other keys than the reference's")
        return [pair for k in sorted(reference, key=str)
                for pair in _tensor_pairs(state[k], reference[k], f"{where}[{k!r}]")]
    if isinstance(reference, (list, tuple)):
        if not isinstance(state, (list, tuple)) or len(state) != len(reference):
            raise ValueError(f"{where}: another length than the reference's")
        return [pair for i, (a, b) in enumerate(zip(state, reference))
                for pair in _tensor_pairs(a, b, f"{where}[{i}]")]
    if torch.is_tensor(reference):
        if not torch.is_tensor(state) or state.shape != reference.shape:
            raise ValueError(f"{where}: not a tensor of the reference's shape "
                             f"{tuple(reference.shape)}")
        return [(state, reference)]
    if state != reference:
        raise ValueError(f"{where}: {state!r} where the reference has {reference!r}")
    return []


def state_max_abs_diff(state: Any, reference: Any) -> float:
    """The largest |difference| between the tensors of two nested states on the CPU (for
    example ``{"model": ..., "optim": ...}`` as saved and as loaded), in float64.

    First checks that they have the same structure: the same keys, lengths and tensor shapes,
    and equal plain values (an optimizer's hyper-parameters); raises ``ValueError`` naming the
    first place where they differ. 0.0 for identical states (and for states without tensors).
    """
    pairs = _tensor_pairs(state, reference, "")
    return max(((a.double() - b.double()).abs().max().item() for a, b in pairs if a.numel()),
               default=0.0)


@dataclass
class LoadCalls:
    """How the code inside :func:`record_loads` loaded weights, one entry per call in order.

    ``torch_load`` holds the keyword arguments of each ``torch.load`` call; ``load_state_dict``
    holds, for each ``Module.load_state_dict`` call, its ``strict`` and ``assign`` arguments and
    ``into_meta``: whether every parameter and buffer of the module was on the meta device
    when it was called (a model built without memory, which ``assign=True`` fills with the
    loaded tensors themselves).
    """

    torch_load: list[dict[str, Any]] = field(default_factory=list)
    load_state_dict: list[dict[str, bool]] = field(default_factory=list)

    @property
    def mmap(self) -> bool:
        """``torch.load`` was called, every time with ``mmap=True``."""
        return bool(self.torch_load) and all(k.get("mmap") is True for k in self.torch_load)

    @property
    def assign_into_meta(self) -> bool:
        """``load_state_dict`` was called, every time with ``assign=True`` on a module whose
        tensors were all on the meta device: the loaded tensors became the parameters, and no
        second copy of the weights was allocated for them."""
        return bool(self.load_state_dict) and all(c["assign"] and c["into_meta"]
                                                  for c in self.load_state_dict)


@contextlib.contextmanager
def record_loads() -> Iterator[LoadCalls]:
    """Record how ``torch.load`` and ``torch.nn.Module.load_state_dict`` are called inside the
    block (both still run as usual); yields a :class:`LoadCalls` filled as they are called.

    ``with record_loads() as calls: model = load(path)`` then ``calls.mmap`` and
    ``calls.assign_into_meta`` say whether ``load`` read the file with ``mmap=True`` and put
    the loaded tensors into a meta-device model with ``assign=True``. ``torch.load`` is
    recorded under both of its names (``torch.load`` and ``torch.serialization.load``), so a
    helper that calls it, such as :func:`safe_load`, is recorded too.
    """
    calls = LoadCalls()
    real_load = torch.serialization.load
    real_load_state_dict = torch.nn.Module.load_state_dict

    def load(*args: Any, **kwargs: Any) -> Any:
        calls.torch_load.append(dict(kwargs))
        return real_load(*args, **kwargs)

    def load_state_dict(module: torch.nn.Module, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        tensors = [*module.parameters(), *module.buffers()]
        calls.load_state_dict.append({"strict": bool(strict), "assign": bool(assign),
                                      "into_meta": bool(tensors) and all(t.is_meta
                                                                         for t in tensors)})
        return real_load_state_dict(module, state_dict, strict=strict, assign=assign)

    with mock.patch.object(torch, "load", load), \
            mock.patch.object(torch.serialization, "load", load), \
            mock.patch.object(torch.nn.Module, "load_state_dict", load_state_dict):
        yield calls
