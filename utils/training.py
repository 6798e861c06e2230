"""One training step and one batch, shared by every module that trains.

Modules 01 (compile), 02 (mixed precision), 04 and 05 all time "a training
step of the reference model". Writing that step once keeps the comparisons
fair: the eager, compiled, autocast and distributed versions differ only in
what the notebook changes, never in how the loss or the optimizer is called.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .env import pick_device, synchronize
from .models import GPTConfig

__all__ = ["lm_batch", "image_batch", "train_step", "first_call_s", "grad_snapshot",
           "param_snapshot", "params_equal", "total_norm", "cudnn_benchmark", "AttachedOps"]


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


def _tensors(source: nn.Module | Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
    """A module's parameters, or the tensors of an iterable, as a list."""
    if isinstance(source, nn.Module):
        return list(source.parameters())
    if isinstance(source, torch.Tensor):
        raise TypeError(f"{what}: expected a module or an iterable of tensors, got one tensor "
                        "(wrap it in a list)")
    items = list(source)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: item {i} is a {type(t).__name__}, not a tensor")
    return items


def grad_snapshot(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of every parameter's ``.grad``, in ``parameters()`` order.

    A copy, so the next ``backward()`` or ``zero_grad()`` leaves the snapshot alone: the
    notebooks compare the gradients of two ways of computing one step.

    Args:
        model: a module, or an iterable of parameters.

    Raises:
        ValueError: a parameter has no gradient (``backward()`` has not reached it, or
            ``zero_grad(set_to_none=True)`` ran since), or there are no parameters.
    """
    params = _tensors(model, "grad_snapshot")
    if not params:
        raise ValueError("grad_snapshot: no parameters")
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise ValueError(f"grad_snapshot: parameters {missing[:5]}{'...' if len(missing) > 5 else ''}"
                         f" of {len(params)} have no .grad: run backward() first")
    return [p.grad.detach().clone() for p in params]


def param_snapshot(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of every parameter, in ``parameters()`` order (to tell later whether an
    optimizer step changed them, with :func:`params_equal`)."""
    return [p.detach().clone() for p in _tensors(model, "param_snapshot")]


def params_equal(a: nn.Module | Iterable[torch.Tensor],
                 b: nn.Module | Iterable[torch.Tensor]) -> bool:
    """Whether two modules (or lists of tensors) hold bit-identical values, tensor by tensor.

    Bit-identical, not close: it answers "did this step change the weights?" (a step a
    GradScaler skipped leaves them exactly as they were).

    Raises:
        ValueError: the two hold different numbers of tensors, or tensors of different shapes.
    """
    ta, tb = _tensors(a, "params_equal"), _tensors(b, "params_equal")
    if len(ta) != len(tb):
        raise ValueError(f"params_equal: {len(ta)} tensors against {len(tb)}")
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x.shape != y.shape:
            raise ValueError(f"params_equal: tensor {i} has shape {tuple(x.shape)} against "
                             f"{tuple(y.shape)}")
    return all(torch.equal(x.detach(), y.detach().to(x.device)) for x, y in zip(ta, tb))


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all the tensors together, as ``clip_grad_norm_`` computes it (in fp32 or
    wider: the norm of each tensor, then the norm of those norms).

    Raises:
        ValueError: no tensors.
    """
    items = _tensors(tensors, "total_norm")
    if not items:
        raise ValueError("total_norm: no tensors")
    norms = [torch.linalg.vector_norm(t.detach().float() if t.dtype in (torch.float16, torch.bfloat16)
                                      else t.detach()) for t in items]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


@contextlib.contextmanager
def cudnn_benchmark(flag: bool) -> Iterator[None]:
    """``with cudnn_benchmark(True):`` sets ``torch.backends.cudnn.benchmark``, restored after.

    With it on, cuDNN times its convolution algorithms for each new input shape and keeps
    the fastest; on a CPU the setting changes nothing.

    Raises:
        TypeError: ``flag`` is not a bool.
    """
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {type(flag).__name__}")
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = flag
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


class AttachedOps(torch.overrides.TorchFunctionMode):
    """Names the operations that take a tensor still attached to an autograd graph.

    Inside its ``with`` block, every torch function called with grad mode on and a tensor that
    requires grad among its arguments is listed in :attr:`names` (``detach`` and ``.data``,
    which take a tensor off its graph, are not). :meth:`paused` leaves out a stretch of code
    that is meant to build a graph, such as a training step, so what remains is what the
    caller did with the step's results: a running sum of losses that still carry their graphs
    shows up here, as ``add_``.

    Example::

        watch = utils.AttachedOps()
        with watch:
            total = torch.zeros(())
            for _ in range(3):
                with watch.paused():
                    loss = train_step()
                total += loss.detach()
        assert not watch.names
    """

    _FREE = (torch.Tensor.detach, torch.Tensor.detach_, torch.Tensor.data.__get__)

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Operations inside this block are not watched."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def unwatched(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, run with watching :meth:`paused` (e.g. a training step)."""
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return fn(*args, **kwargs)
        return run

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (not self._paused and torch.is_grad_enabled() and func not in self._FREE
                and any(isinstance(t, torch.Tensor) and t.requires_grad
                        for t in tree_flatten((args, kwargs))[0])):
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)
