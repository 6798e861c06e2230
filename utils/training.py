"""One training step and one batch, shared by every module that trains.

Modules 01 (compile), 02 (mixed precision), 04 and 05 all time "a training
step of the reference model". Writing that step once keeps the comparisons
fair: the eager, compiled, autocast and distributed versions differ only in
what the notebook changes, never in how the loss or the optimizer is called.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .env import pick_device, synchronize
from .models import GPTConfig

__all__ = ["lm_batch", "image_batch", "train_step", "first_call_s"]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lm_batch(cfg: GPTConfig, batch_size: int, seq_len: int | None = None,
             device: str | torch.device | None = None,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets for :class:`~utils.TinyGPT`.

    Args:
        cfg: the model's config (for ``vocab_size`` and ``block_size``).
        batch_size: sequences in the batch (>= 1).
        seq_len: tokens per sequence (default and maximum: ``cfg.block_size``).
        device: where the tensors go (default: the course's device).
        seed: the same seed gives the same batch on every device.

    Returns:
        ``(idx, targets)``, both ``int64`` of shape ``(batch_size, seq_len)``.
    """
    seq_len = cfg.block_size if seq_len is None else seq_len
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(seq_len, int) or not 1 <= seq_len <= cfg.block_size:
        raise ValueError(f"seq_len must be an int in [1, {cfg.block_size}], got {seq_len!r}")
    tokens = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), generator=_generator(seed))
    dev = pick_device(device)
    # Fresh row-major copies: slices of one buffer would keep stride (T+1, 1) on
    # the CPU (even a batch of 1, which .contiguous() leaves alone) but not after a
    # copy to a GPU, and compiled code guards on strides.
    fresh = torch.contiguous_format
    return (tokens[:, :-1].clone(memory_format=fresh).to(dev),
            tokens[:, 1:].clone(memory_format=fresh).to(dev))


def image_batch(batch_size: int, image_size: int = 32, channels: int = 3, num_classes: int = 10,
                device: str | torch.device | None = None,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(N, C, H, W)`` float32 images and ``int64`` labels for :class:`~utils.SmallCNN`."""
    for name, v in (("batch_size", batch_size), ("image_size", image_size),
                    ("channels", channels), ("num_classes", num_classes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    g = _generator(seed)
    x = torch.randn(batch_size, channels, image_size, image_size, generator=g)
    y = torch.randint(num_classes, (batch_size,), generator=g)
    dev = pick_device(device)
    return x.to(dev), y.to(dev)


def train_step(model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
               optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor, *,
               amp_dtype: torch.dtype | None = None,
               scaler: "torch.amp.GradScaler | None" = None) -> torch.Tensor:
    """One optimizer step on cross-entropy; returns the loss, detached.

    ``model(inputs)`` may return ``(N, classes)`` logits (the CNN) or
    ``(B, T, vocab)`` logits (the GPT): both are flattened to rows for
    :func:`torch.nn.functional.cross_entropy`, so the same step serves both,
    and a compiled model (``torch.compile(model)``) drops in unchanged.

    Args:
        model: the module (or compiled module) to train.
        optimizer: its optimizer.
        inputs: the batch.
        targets: class indices, shaped like the logits without their last dim.
        amp_dtype: run the forward pass under ``torch.autocast`` with this dtype
            (``torch.bfloat16`` or ``torch.float16``) on the inputs' device type.
        scaler: a ``torch.amp.GradScaler`` for fp16: the loss is scaled before
            backward and the step goes through the scaler.
    """
    if amp_dtype is not None and amp_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"amp_dtype must be torch.bfloat16 or torch.float16, got {amp_dtype!r}")
    optimizer.zero_grad(set_to_none=True)
    ctx = (torch.autocast(device_type=inputs.device.type, dtype=amp_dtype)
           if amp_dtype is not None else nullcontext())
    with ctx:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return loss.detach()


def first_call_s(fn: Callable[..., Any], *args: Any,
                 device: str | torch.device | None = None, **kwargs: Any) -> float:
    """Wall-clock seconds of one synchronised call of ``fn``.

    Meant for the *first* call of a compiled function, which pays for tracing
    and code generation: that cost happens once, so it is measured once, apart
    from the steady-state time that :func:`utils.benchmark` reports.
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    dev = pick_device(device)
    synchronize(dev)
    start = time.perf_counter()
    fn(*args, **kwargs)
    synchronize(dev)
    return time.perf_counter() - start
