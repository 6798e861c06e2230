"""Checkpoints that survive a crash and load safely.

:func:`atomic_save` writes to a temporary file in the target's folder, flushes it
to disk, then renames it over the target: the rename is atomic on POSIX file
systems, so a crash or a kill mid-save leaves the previous checkpoint (or none),
never half of one. :func:`safe_load` loads with ``weights_only=True`` (the
default since torch 2.6: tensors, containers and plain types, no arbitrary
pickled objects) and turns the errors of a truncated, foreign or unsafe file
into one :class:`CheckpointError` that names the file and says what to do.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "atomic_save", "safe_load"]


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


def atomic_save(obj: Any, path: str | os.PathLike, *, fsync: bool = True) -> Path:
    """``torch.save(obj, path)`` so that ``path`` is always either the old file or the new one.

    Args:
        obj: what to save (a state dict, or a dict of them with a step counter).
        path: the checkpoint file; its folder is created if missing.
        fsync: flush the data (and the rename) to disk before returning.

    Returns:
        The path written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
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
    try:
        return torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise CheckpointError(
                f"{p} holds objects that safe loading refuses ({first}). Save a state_dict "
                "(tensors, dicts, numbers) instead of a whole model or optimizer object; load "
                "with torch.load(..., weights_only=False) only a file you trust, since "
                "unpickling can run arbitrary code") from None
        raise CheckpointError(f"{p} is not a torch checkpoint ({first})") from None
    except Exception as exc:  # noqa: BLE001 - a foreign file can fail in any way (IndexError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{p} is not a complete torch checkpoint: truncated by a save "
                              f"that did not finish, or another format ({first})") from None
