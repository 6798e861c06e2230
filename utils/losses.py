"""Losses that keep a language model's logits from filling memory.

A language model's last step multiplies every token's hidden state by the output
matrix (``V x C``) and takes the cross-entropy of the resulting logits. Written
plainly, ``F.cross_entropy(hidden @ weight.T, targets)`` makes tensors of
``tokens x V`` values: the logits, the log-probabilities cross-entropy saves for
backward, and in backward the gradient of the log-probabilities and the gradient
of the logits (module 04, notebook 1, measures all four). With a vocabulary of
tens of thousands of entries they are the largest tensors of a training step.

:func:`chunked_linear_cross_entropy` computes the same loss and the same
gradients a chunk of tokens at a time. The forward pass keeps only one number
per token (the log-sum-exp of its logits); the backward pass computes each
chunk's logits again, turns them into the gradient of the logits in place, and
adds that chunk's share to the gradients of the hidden states and of the
weight. No ``tokens x V`` tensor ever exists whole: the logits exist one chunk
(``chunk_tokens x V``) at a time. The price is the output matmul run twice (once
more in backward), a third more FLOPs for this layer.

With ``grads_in_forward=True`` it takes the other road, the one Liger Kernel's fused
linear cross-entropy takes: the forward pass computes each chunk's logits once, turns
them at once into the gradient of those logits, and adds the chunk's share to the
gradients of the hidden states and of the weight; it saves those two gradients, and the
backward pass only scales them by the loss's incoming gradient. The matmul runs once, no
more FLOPs than the plain loss, and the memory held from forward to backward is the two
gradients instead of one number per token. The gradients are computed whenever autograd
will want them (grad mode on, an input that requires grad), even if ``backward`` is
never called. Not under float16, where they would underflow (see the argument).

Eagerly both are a ``torch.autograd.Function``, whose every operation dispatch modes see
(the course's memory tracker and FLOP counter among them). Under ``torch.compile`` the
recomputing version is one custom operator (``torch.library.custom_op``, with its backward
registered), so that the compiler keeps the chunking: traced as Python, the compiled graphs
saved every chunk's logits for backward. The gradients-in-forward version is traced as
Python: its backward needs no logits, so there is nothing of theirs to save, and the
compiler fuses each chunk's element-wise work (the log-sum-exp, the softmax, the one-hot
subtraction, the scaling and the cast) between the matmuls: on a CPU, Inductor makes one
kernel of them per chunk (``tests/test_losses.py`` reads its generated code). Under bf16
autocast Inductor may keep each chunk's bf16 share of the weight's gradient and add them up
in backward, at most one ``(V, C)`` tensor per chunk, still far from the logits' size.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum")
_NO_SECOND_DERIVATIVE = (
    "chunked_linear_cross_entropy has no second derivative: its backward is not differentiable "
    "(backward(create_graph=True) or autograd.grad(..., create_graph=True) through it); use "
    "F.cross_entropy(hidden @ weight.T, targets) where you need one")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: the autocast dtype where autocast is on for the
    tensors' device type (as ``hidden @ weight.T`` would), else the tensors' own."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and hidden.is_floating_point():
        return torch.get_autocast_dtype(dev)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same "
                         "dtype outside autocast, as for hidden @ weight.T")
    return hidden.dtype


def _acc_dtype(cdt: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the loss and the weight's gradient sums: fp64 for fp64
    matmuls, else fp32 (as ``F.cross_entropy`` under autocast)."""
    return torch.float64 if cdt == torch.float64 else torch.float32


def _valid_and_safe(targets, ignore_index):
    """The rows that count, and the targets with the ignored rows' set to class 0."""
    valid = targets != ignore_index
    return valid, torch.where(valid, targets, torch.zeros_like(targets))


def _softmax_to_logit_grad_(probs, safe, row_scale):
    """In place, eagerly: a chunk's softmax ``probs`` becomes the gradient of its logits,
    ``row_scale * (probs - one_hot(safe))``."""
    minus_one = torch.full((1, 1), -1.0, dtype=probs.dtype, device=probs.device)
    probs.scatter_add_(1, safe.unsqueeze(1), minus_one.expand(probs.shape[0], 1))
    return probs.mul_(row_scale.unsqueeze(1))


def _add_chunk_grads(dlogits, w, h, sl, grad_h, grad_w, pieces):
    """Add one chunk's shares of the gradients: ``dlogits @ w`` into ``grad_h[sl]`` (compiled:
    appended to ``pieces``, joined once at the end, so that the matmuls can write in place)
    and ``dlogits.T @ h`` into ``grad_w`` (either may be ``None``: not wanted). Eagerly in
    place, no second ``(V, C)`` tensor; for the compiler, functional. Returns ``grad_w``."""
    cdt = dlogits.dtype
    compiling = torch.compiler.is_compiling()
    if grad_h is not None or pieces is not None:
        if compiling:
            pieces.append(torch.mm(dlogits, w))
        elif grad_h.dtype == cdt:
            torch.mm(dlogits, w, out=grad_h[sl])
        else:
            grad_h[sl] = torch.mm(dlogits, w)
    if grad_w is not None:
        if grad_w.dtype == cdt:  # out= rather than addmm_: FLOP counters see addmm
            grad_w = torch.addmm(grad_w, dlogits.t(), h, out=None if compiling else grad_w)
        elif compiling:
            grad_w = grad_w + torch.mm(dlogits.t(), h)
        else:  # a (V, C) product in cdt, added in fp32 across chunks
            grad_w.add_(torch.mm(dlogits.t(), h))
    return grad_w


def _chunked_forward(hidden, weight, targets, chunk, ignore_index, mean, cdt, classes):
    """The loss (mean or sum over the valid rows) and each row's log-sum-exp, a chunk of rows
    at a time. ``hidden`` is ``(N, C)``, ``weight`` ``(V, C)``, ``targets`` ``(N,)``."""
    acc = _acc_dtype(cdt)
    dev = hidden.device.type
    n = hidden.shape[0]
    valid, safe = _valid_and_safe(targets, ignore_index)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    with torch.autocast(device_type=dev, enabled=False):
        w = weight.to(cdt)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            logits = torch.mm(hidden[sl].to(cdt), w.t()).to(acc)  # (chunk, V): the only one
            if classes < logits.shape[1]:  # padded rows: out of the softmax
                logits[:, classes:] = float("-inf")
            picked = logits.gather(1, safe[sl].unsqueeze(1)).squeeze(1)
            top = logits.amax(dim=1, keepdim=True)
            logits.sub_(top).exp_()  # in place: no second (chunk, V) tensor
            chunk_lse = logits.sum(dim=1).log_().add_(top.squeeze(1))
            lse[sl] = chunk_lse
            total += torch.where(valid[sl], chunk_lse - picked, 0).sum()
            del logits
    return (total / valid.sum().to(acc) if mean else total), lse


def _chunked_backward(grad_out, hidden, weight, targets, lse, chunk, ignore_index, mean, cdt,
                      classes, want_h, want_w):
    """The gradients of :func:`_chunked_forward`'s loss to ``hidden`` and ``weight`` (``None``
    where not wanted), the logits computed again a chunk at a time."""
    acc = lse.dtype
    n = hidden.shape[0]
    valid, safe = _valid_and_safe(targets, ignore_index)
    g = grad_out.to(acc)
    if mean:
        g = g / valid.sum().to(acc)
    # d loss / d logits = g * (softmax - one_hot(target)) on valid rows, 0 on ignored ones
    row_scale = torch.where(valid, g, torch.zeros((), dtype=acc, device=lse.device))
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        w = weight.to(cdt)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(cdt)
            probs = torch.mm(h, w.t()).to(acc)
            if classes < probs.shape[1]:  # padded rows: probability 0, no gradient
                probs[:, classes:] = float("-inf")
            probs.sub_(lse[sl].unsqueeze(1)).exp_()  # softmax, in place
            _softmax_to_logit_grad_(probs, safe[sl], row_scale[sl])
            dlogits = probs if cdt == acc else probs.to(cdt)
            grad_w = _add_chunk_grads(dlogits, w, h, sl, grad_h, grad_w, None)
            del probs, dlogits
    if grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return grad_h, grad_w


def _logits_to_grad(logits, safe, row_scale, classes):
    """One chunk's log-sum-exps, target logits and logit gradients (``row_scale`` times
    ``softmax - one_hot(target)``, 0 for the padded classes), from its ``(rows, V)`` logits
    in the accumulation dtype.

    Eagerly it works in place, turning ``logits`` into the gradient: no second ``(rows, V)``
    tensor. Traced by ``torch.compile`` it is written as one expression of element-wise
    operations and reductions, which the compiler fuses; in-place ``scatter_add_`` would cut
    the fusion in two and cost a pass over the chunk."""
    if torch.compiler.is_compiling():
        cols = torch.arange(logits.shape[1], device=logits.device)
        if classes < logits.shape[1]:
            logits = torch.where(cols < classes, logits, float("-inf"))
        picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
        lse = torch.logsumexp(logits, dim=1)
        target = cols == safe.unsqueeze(1)
        grad = (torch.exp(logits - lse.unsqueeze(1)) - target.to(logits.dtype)) \
            * row_scale.unsqueeze(1)
        return lse, picked, grad
    if classes < logits.shape[1]:  # padded rows: out of the softmax, no gradient
        logits[:, classes:] = float("-inf")
    picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    top = logits.amax(dim=1, keepdim=True)
    logits.sub_(top).exp_()
    total = logits.sum(dim=1, keepdim=True)
    lse = total.log().add_(top).squeeze(1)
    logits.div_(total)  # the softmax
    return lse, picked, _softmax_to_logit_grad_(logits, safe, row_scale)


def _chunked_forward_with_grads(hidden, weight, targets, chunk, ignore_index, mean, cdt,
                                classes, want_h, want_w):
    """:func:`_chunked_forward`'s loss together with its gradients to ``hidden`` and
    ``weight`` for an incoming gradient of 1 (``None`` where not wanted): each chunk's
    logits are computed once and turned into their gradient at once."""
    acc = _acc_dtype(cdt)
    n = hidden.shape[0]
    valid, safe = _valid_and_safe(targets, ignore_index)
    count = valid.sum().to(acc)
    one = torch.ones((), dtype=acc, device=hidden.device)
    # d loss / d logits = row_scale * (softmax - one_hot(target)); 0 on ignored rows
    row_scale = torch.where(valid, one / count if mean else one, torch.zeros_like(one))
    total = torch.zeros((), dtype=acc, device=hidden.device)
    compiling = torch.compiler.is_compiling()
    grad_h = torch.empty_like(hidden) if want_h and not compiling else None
    pieces = [] if want_h and compiling else None  # compiled: grad_h's chunks
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        w = weight.to(cdt)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(cdt)
            logits = torch.mm(h, w.t()).to(acc)  # (chunk, V): the only one
            lse, picked, grad = _logits_to_grad(logits, safe[sl], row_scale[sl], classes)
            total = total + torch.where(valid[sl], lse - picked, 0).sum()
            dlogits = grad.to(cdt)
            grad_w = _add_chunk_grads(dlogits, w, h, sl, grad_h, grad_w, pieces)
            del logits, grad, dlogits
    if pieces:
        grad_h = torch.cat(pieces).to(hidden.dtype)
    if grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return (total / count if mean else total), grad_h, grad_w


class _ChunkedGradsInForward(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets)`` in chunks of rows, its gradients computed
    in forward and saved; backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, mean, cdt, classes, want_h,
                want_w):
        loss, grad_h, grad_w = _chunked_forward_with_grads(
            hidden, weight, targets, chunk, ignore_index, mean, cdt, classes, want_h, want_w)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(_NO_SECOND_DERIVATIVE)
        grad_h, grad_w = ctx.saved_tensors
        # the loss is linear in its incoming gradient: scale, new tensors (retain_graph may
        # call this again on the same saved ones; compiled, Inductor scales in place and
        # torch refuses a second backward)
        return (grad_h * grad_out if grad_h is not None else None,
                grad_w * grad_out if grad_w is not None else None,
                None, None, None, None, None, None, None, None)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets)`` in chunks of rows, logits recomputed in
    backward (eager: every op inside is visible to dispatch modes, the course's memory tracker
    and FLOP counter among them)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, mean, cdt, classes):
        loss, lse = _chunked_forward(hidden, weight, targets, chunk, ignore_index, mean, cdt,
                                     classes)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.args = (chunk, ignore_index, mean, cdt, classes)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(_NO_SECOND_DERIVATIVE)
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_h, grad_w = _chunked_backward(grad_out, hidden, weight, targets, lse, *ctx.args,
                                           ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_h, grad_w, None, None, None, None, None, None


# Under torch.compile the loss is one custom operator, opaque to the compiler. Traced as Python
# instead, the chunk loops were unrolled into the compiled graphs, and the compiler moved
# backward's work on each chunk's logits into forward and saved the results for backward: as
# much memory as the whole logits (tests/test_losses.py measures what forward saves).
@torch.library.custom_op("course_utils::chunked_linear_cross_entropy", mutates_args=())
def _chunked_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                ignore_index: int, mean: bool, cdt: torch.dtype,
                classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _chunked_forward(hidden, weight, targets, chunk, ignore_index, mean, cdt, classes)


@_chunked_op.register_fake
def _(hidden, weight, targets, chunk, ignore_index, mean, cdt, classes):
    acc = _acc_dtype(cdt)
    return hidden.new_empty((), dtype=acc), hidden.new_empty((hidden.shape[0],), dtype=acc)


@torch.library.custom_op("course_utils::chunked_linear_cross_entropy_backward", mutates_args=())
def _chunked_op_backward(grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         targets: torch.Tensor, lse: torch.Tensor, chunk: int, ignore_index: int,
                         mean: bool, cdt: torch.dtype, classes: int, want_h: bool,
                         want_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    grad_h, grad_w = _chunked_backward(grad_out, hidden, weight, targets, lse, chunk,
                                       ignore_index, mean, cdt, classes, want_h, want_w)
    # an operator returns tensors: an empty one stands for a gradient not asked for
    return (grad_h if grad_h is not None else hidden.new_empty((0,)),
            grad_w if grad_w is not None else weight.new_empty((0,)))


@_chunked_op_backward.register_fake
def _(grad_out, hidden, weight, targets, lse, chunk, ignore_index, mean, cdt, classes, want_h,
      want_w):
    return (torch.empty_like(hidden) if want_h else hidden.new_empty((0,)),
            torch.empty_like(weight) if want_w else weight.new_empty((0,)))


def _op_setup_context(ctx, inputs, output):
    hidden, weight, targets, chunk, ignore_index, mean, cdt, classes = inputs
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.args = (chunk, ignore_index, mean, cdt, classes)


def _op_backward(ctx, grad_loss, grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_h, grad_w = _chunked_op_backward(grad_loss, hidden, weight, targets, lse, *ctx.args,
                                          want_h, want_w)
    return (grad_h if want_h else None, grad_w if want_w else None,
            None, None, None, None, None, None)


_chunked_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, *, chunk_tokens: int,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 num_classes: int | None = None,
                                 grads_in_forward: bool = False) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` without the whole logits tensor.

    The loss and its gradients (to ``hidden`` and ``weight``) are those of the plain
    expression, up to the order of the sums; no tensor of ``tokens x V`` values is made,
    in forward or in backward, only one chunk of ``chunk_tokens x V`` at a time. By default
    the logits are computed again in backward (the output matmul runs twice) and the
    forward pass saves one number per token (the log-sum-exp of its logits); with
    ``grads_in_forward`` the forward pass computes the gradients and saves them instead.

    Under ``torch.autocast`` the matmuls run in the autocast dtype, as ``hidden @
    weight.T`` would, and the softmax and the loss in fp32, as ``F.cross_entropy`` does.
    The loss is fp32 (fp64 for fp64 inputs); the weight's gradient is added up over the
    chunks in fp32.

    Args:
        hidden: ``(..., C)`` hidden states (the output head's input).
        weight: ``(V, C)`` output matrix (an ``nn.Linear(C, V, bias=False)``'s weight, or
            a tied embedding's).
        targets: ``(...)`` class indices, shaped like ``hidden`` without its last dim.
        chunk_tokens: rows per chunk. Memory for the logits is ``chunk_tokens x V``
            values; smaller chunks run more, smaller matmuls.
        ignore_index: targets with this value add nothing to the loss or the gradients,
            and are not counted in the mean (as in ``F.cross_entropy``).
        reduction: ``"mean"`` over the counted tokens (a mean over none is NaN, as in
            ``F.cross_entropy``) or ``"sum"``.
        num_classes: the classes are the weight's first ``num_classes`` rows (default: all):
            the logits of the rest, a vocabulary's padding rows, are left out of the softmax
            and get no gradient, as if the weight were cut to ``weight[:num_classes]``; the
            matmuls keep the padded, aligned shape.
        grads_in_forward: compute the gradients in the forward pass, from each chunk's
            logits computed once, and save them for backward (no second matmul; the two
            gradients, in ``hidden``'s and ``weight``'s dtypes, are saved instead of one
            number per token; compiled under bf16 autocast, Inductor may save up to one bf16
            ``(V, C)`` share of the weight's gradient per chunk instead). They are computed
            only where autograd will ask for them: grad mode on and the tensor requiring
            grad. Not under float16 (autocast or tensors): the gradients, made in forward
            for an incoming gradient of 1, would underflow there before a ``GradScaler``'s
            scale reached them, so the logits are computed again in backward instead. A
            second backward through the same graph works eagerly; compiled, the saved
            gradients are scaled in their own memory and torch refuses it. Default: the
            logits are computed again in backward.

    Returns:
        The loss, a 0-dim tensor.

    Raises:
        TypeError: ``hidden`` or ``weight`` is not a floating-point tensor, ``targets`` not
            an integer tensor, ``chunk_tokens`` not an int, ``grads_in_forward`` not a bool.
        ValueError: shapes that do not fit together, tensors on different devices, dtypes
            that differ outside autocast, ``chunk_tokens`` below 1, an unknown reduction,
            ``num_classes`` outside 1 .. the weight's rows.
    """
    def kind(t):
        return t.dtype if isinstance(t, torch.Tensor) else type(t).__name__

    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {kind(t)}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() \
            or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class indices, got {kind(targets)}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"chunk_tokens must be an int, got {chunk_tokens!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, width), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dim must be the weight's width {weight.shape[1]}, got "
                         f"shape {tuple(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must be shaped like hidden without its last dim "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, "
                         f"{weight.device} and {targets.device}")
    classes = weight.shape[0] if num_classes is None else num_classes
    if isinstance(classes, bool) or not isinstance(classes, int) \
            or not 1 <= classes <= weight.shape[0]:
        raise ValueError(f"num_classes must be an int from 1 to the weight's {weight.shape[0]} "
                         f"rows, got {num_classes!r}")
    if not isinstance(grads_in_forward, bool):
        raise TypeError(f"grads_in_forward must be a bool, got {grads_in_forward!r}")
    cdt = _compute_dtype(hidden, weight)
    args = (hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_tokens,
            ignore_index, reduction == "mean", cdt, classes)
    if grads_in_forward and cdt != torch.float16:
        want_h = torch.is_grad_enabled() and hidden.requires_grad
        want_w = torch.is_grad_enabled() and weight.requires_grad
        if want_h or want_w:
            return _ChunkedGradsInForward.apply(*args, want_h, want_w)
        return _chunked_forward(*args)[0]  # no gradient wanted: the loss alone
    if torch.compiler.is_compiling():
        return _chunked_op(*args)[0]
    return _ChunkedLinearCrossEntropy.apply(*args)
