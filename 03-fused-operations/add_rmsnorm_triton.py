"""A fused residual add + RMSNorm, written as one Triton kernel.

Transformer blocks in the Llama family end each sub-layer with
``h = x + residual`` followed by ``y = RMSNorm(h) * weight``; the next
sub-layer needs both ``h`` (the new residual stream) and ``y`` (its input).
Written in eager PyTorch that is a chain of small kernels, each reading and
writing the whole activation. The kernel below does it in one pass per row:
it reads ``x``, ``residual`` and ``weight`` once and writes ``h`` and ``y``
once, keeping the row in registers in between.

Notebook ``04_writing_a_triton_kernel`` imports this module on a GPU, and the
script ``triton_interpreter_check.py`` imports it under Triton's interpreter
(``TRITON_INTERPRET=1``) to check it on a CPU. A torch build without Triton
(most CPU-only installs) can still import this module: :data:`HAVE_TRITON`
is then ``False`` and :func:`add_rmsnorm` says why it cannot run.

The same kernel is also a PyTorch operator, :data:`add_rmsnorm_op`
(``torch.ops.course03.add_rmsnorm``), made with ``torch.library.triton_op`` and
``torch.library.wrap_triton``: ``torch.compile`` traces through it (and Inductor
launches the Triton kernel from its generated code), and autograd runs the
backward registered with ``torch.library.register_autograd``. On CPU tensors
the operator runs the kernel under the interpreter when it is on, and the
eager PyTorch version otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton
    triton = None
    tl = None

HAVE_TRITON = triton is not None
#: Longest row that one program keeps in registers in a single pass; longer rows are
#: processed in blocks, in two passes (one for the sum of squares, one to normalise).
MAX_SINGLE_PASS_BLOCK = 8192
#: Block width of the two-pass path.
LOOP_BLOCK = 4096
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["HAVE_TRITON", "LaunchConfig", "launch_config", "reference_add_rmsnorm",
           "add_rmsnorm", "launch_add_rmsnorm", "add_rmsnorm_backward", "add_rmsnorm_op",
           "OP_NAME", "interpreter_active"]
#: The operator's name: ``torch.ops.course03.add_rmsnorm``.
OP_NAME = "course03::add_rmsnorm"


def reference_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager PyTorch version, as a model's code writes it.

    The sum is rounded to the input dtype (it is the new residual stream), and
    the normalisation runs in float32, as RMSNorm implementations in
    low-precision models do.

    Returns:
        ``(h, y)``: ``h = x + residual`` and ``y = RMSNorm(h) * weight``, both in
        ``x.dtype``.
    """
    h = x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return h, y.to(x.dtype)


def interpreter_active() -> bool:
    """Whether Triton kernels defined in this process run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class LaunchConfig:
    """How one row is processed: block width, warps per program, one pass or two, and (two
    passes) how many blocks cover the row."""

    block: int
    num_warps: int
    single_pass: bool
    n_blocks: int = 1


def launch_config(n_cols: int, block_size: int | None = None,
                  num_warps: int | None = None) -> LaunchConfig:
    """Choose the block width and warps for rows of ``n_cols`` elements.

    By default a row up to :data:`MAX_SINGLE_PASS_BLOCK` elements fits one block
    (the next power of two: ``tl.arange`` needs one) and is processed in one
    pass; longer rows use blocks of :data:`LOOP_BLOCK` in two passes, over
    ``n_blocks = ceil(n_cols / block)`` blocks. More elements per program want
    more warps, so that each thread holds a few.

    Args:
        n_cols: elements per row (>= 1).
        block_size: force a block width (a power of two >= 16); rows longer than it
            take the two-pass path.
        num_warps: force the warps per program (1, 2, 4, 8, 16 or 32).

    Raises:
        ValueError: a size out of range or not a power of two.
    """
    if not isinstance(n_cols, int) or n_cols < 1:
        raise ValueError(f"n_cols must be a positive int, got {n_cols!r}")
    if block_size is None:
        block = _next_power_of_2(n_cols)
        single = block <= MAX_SINGLE_PASS_BLOCK
        block = block if single else LOOP_BLOCK
    else:
        if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")
        block, single = block_size, block_size >= n_cols
    if num_warps is None:
        num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    elif num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")
    block = max(block, 16)
    return LaunchConfig(block=block, num_warps=num_warps, single_pass=single,
                        n_blocks=1 if single else -(-n_cols // block))


if HAVE_TRITON:

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, n_cols,
                            stride_x, stride_r, stride_h, stride_y, eps,
                            BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr,
                            N_BLOCKS: tl.constexpr):
        # One program per row. int64 row offsets: rows x stride can pass 2^31 elements.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        r_row = r_ptr + row * stride_r
        h_row = h_ptr + row * stride_h
        y_row = y_ptr + row * stride_y
        if SINGLE_PASS:
            # The whole row in one block; the mask switches off the lanes past its end,
            # and `other=0.0` makes them add nothing to the sum of squares.
            cols = tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(h_ptr.dtype.element_ty)   # rounded like eager's `x + residual`
            tl.store(h_row + cols, h, mask=mask)
            hf = h.to(tl.float32)
            # Divide by the row's length, not by BLOCK: the padding lanes are not data.
            inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, (hf * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # Two passes over N_BLOCKS = ceil(n_cols / BLOCK) blocks. The trip count is a
            # compile-time constant: one compiled version serves every row length with the same
            # block count (8193 to 12288 columns share one), the compiler knows the loop's
            # length, and Triton 3.6's interpreter can run it (it cannot take `range` over a
            # runtime argument under NumPy 2.4). The masks still use the runtime n_cols.
            # Pass 1: h, stored as we go, and the sum of its squares.
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for b in range(N_BLOCKS):
                cols = b * BLOCK + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                h = (x + r).to(h_ptr.dtype.element_ty)
                tl.store(h_row + cols, h, mask=mask)
                hf = h.to(tl.float32)
                acc += hf * hf
            inv_rms = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
            # Pass 2: normalise. h is recomputed from x and r rather than read back from
            # the h just stored, so no load depends on a store of this same program.
            for b in range(N_BLOCKS):
                cols = b * BLOCK + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                hf = (x + r).to(h_ptr.dtype.element_ty).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_row + cols, (hf * inv_rms * w).to(y_ptr.dtype.element_ty),
                         mask=mask)


def _check_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if x.shape != residual.shape:
        raise ValueError(f"x and residual must have one shape, got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"x must have at least one element and one dimension, got shape "
                         f"{tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},) (the last dim of x), got "
                         f"{tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must share a dtype among {SUPPORTED_DTYPES}, got "
                         f"{x.dtype} and {residual.dtype}")
    if not (x.device == residual.device == weight.device):
        raise ValueError(f"all tensors must be on one device, got {x.device}, {residual.device}"
                         f" and {weight.device}")


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-6, *, block_size: int | None = None,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``y = RMSNorm(h) * weight`` in one Triton kernel.

    Computes what :func:`reference_add_rmsnorm` computes, over the last
    dimension, for any leading shape.

    Args:
        x, residual: tensors of one shape and dtype (float32, float16, bfloat16).
        weight: the RMSNorm scale, shape ``(x.shape[-1],)``.
        eps: added to the mean square before the square root.
        block_size, num_warps: override :func:`launch_config`'s choice.

    Returns:
        ``(h, y)`` shaped like ``x``.

    Raises:
        RuntimeError: Triton is not installed, or the tensors are on a CPU while
            the interpreter is off (Triton kernels run on GPUs; on a CPU only under
            ``TRITON_INTERPRET=1``, set before Triton is imported).
        TypeError / ValueError: inputs that do not fit (shapes, dtypes, devices).
    """
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed in this environment (CPU-only torch builds "
                           "do not bring it); install a CUDA build of torch, or `pip install "
                           "triton`, to run this kernel")
    _check_inputs(x, residual, weight)
    if x.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("these tensors are on the CPU, where a Triton kernel runs only in the "
                           "interpreter: set TRITON_INTERPRET=1 before Triton is imported (as "
                           "triton_interpreter_check.py does), or move the tensors to a GPU")
    cfg = launch_config(x.shape[-1], block_size, num_warps)
    # enable_fp_fusion: a multiply and an add may become one FMA, Triton's default so far;
    # said explicitly because Triton 3.9 warns when it is left unset (its default changes).
    return launch_add_rmsnorm(_add_rmsnorm_kernel, x, residual, weight, eps, cfg=cfg,
                              num_warps=cfg.num_warps, enable_fp_fusion=True)


def launch_add_rmsnorm(kernel, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, cfg: LaunchConfig | None = None,
                       **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``h`` and ``y`` and launch ``kernel`` with one program per row.

    ``kernel`` is the add + RMSNorm kernel or a wrapper of it: ``triton.autotune``'s (which
    then chooses ``num_warps`` itself), or ``torch.library.wrap_triton``'s inside a custom
    operator. The inputs are not checked (:func:`add_rmsnorm` checks them).

    Args:
        cfg: block width and passes (default: :func:`launch_config` of the row length).
        **options: launch options for Triton (``num_warps``, ``enable_fp_fusion``).

    Returns:
        ``(h, y)`` shaped like ``x``.
    """
    n_cols = x.shape[-1]
    cfg = cfg or launch_config(int(n_cols))
    x2 = x.reshape(-1, n_cols)
    r2 = residual.reshape(-1, n_cols)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    w = weight.contiguous()
    h = torch.empty_like(x2, memory_format=torch.contiguous_format)
    y = torch.empty_like(x2, memory_format=torch.contiguous_format)
    kernel[(x2.shape[0],)](
        x2, r2, w, h, y, n_cols, x2.stride(0), r2.stride(0), h.stride(0), y.stride(0), eps,
        BLOCK=cfg.block, SINGLE_PASS=cfg.single_pass, N_BLOCKS=cfg.n_blocks, **options)
    return h.view(x.shape), y.view(x.shape)


def add_rmsnorm_backward(h: torch.Tensor, weight: torch.Tensor, eps: float,
                         grad_h: torch.Tensor, grad_y: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``(h, y) = add_rmsnorm(x, residual, weight, eps)``, from the saved ``h``.

    With ``r = 1 / sqrt(mean(h^2) + eps)`` per row, ``n = h * r`` and ``g = grad_y * weight``:
    ``dL/dh = grad_h + r * (g - n * mean(g * n))`` (the residual stream's own gradient plus
    the normalisation's), which is also ``dL/dx`` and ``dL/dresidual`` since ``h = x +
    residual``; and ``dL/dweight`` is the sum over rows of ``grad_y * n``. Computed in float32,
    as the forward normalises.

    Returns:
        ``(grad_x, grad_weight)``: ``grad_x`` in ``h.dtype`` (also the residual's gradient),
        ``grad_weight`` in ``weight.dtype``.
    """
    hf = h.float()
    r = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    n = hf * r
    gy = grad_y.float()
    g = gy * weight.float()
    grad_h_total = grad_h.float() + r * (g - n * (g * n).mean(-1, keepdim=True))
    grad_w = (gy * n).reshape(-1, h.shape[-1]).sum(0)
    return grad_h_total.to(h.dtype), grad_w.to(weight.dtype)


#: The kernel as a PyTorch operator (``torch.ops.course03.add_rmsnorm``); ``None`` without Triton.
add_rmsnorm_op = None

if HAVE_TRITON:
    from torch.library import register_autograd, triton_op, wrap_triton

    @triton_op(OP_NAME, mutates_args=())
    def add_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, y)`` as :func:`add_rmsnorm`, as an operator that torch.compile and autograd know.

        This function is also the operator's fake (shape) implementation, and what Inductor
        traces: on a GPU a launch of the kernel through ``wrap_triton``, which makes it
        visible to the compiler; on a CPU the eager PyTorch version, which Inductor fuses.
        """
        if x.device.type != "cuda":
            return reference_add_rmsnorm(x, residual, weight, eps)
        cfg = launch_config(int(x.shape[-1]))
        launcher = wrap_triton(_add_rmsnorm_kernel)
        # Called eagerly, wrap_triton hands back the kernel itself, launched as add_rmsnorm does;
        # while torch.compile traces, a wrapper that records the launch, which takes no
        # enable_fp_fusion (Inductor compiles the kernel with Triton's default: FMAs on).
        options = {"enable_fp_fusion": True} if launcher is _add_rmsnorm_kernel else {}
        return launch_add_rmsnorm(launcher, x, residual, weight, eps, cfg=cfg,
                                  num_warps=cfg.num_warps, **options)

    @add_rmsnorm_op.register_kernel("cpu")
    def _add_rmsnorm_cpu(x, residual, weight, eps):
        # Eager calls on CPU tensors: the Triton kernel itself where the interpreter is on,
        # else PyTorch's ops. (torch.compile traces the function above instead.)
        if interpreter_active():
            return add_rmsnorm(x, residual, weight, eps)
        return reference_add_rmsnorm(x, residual, weight, eps)

    def _setup_context(ctx, inputs, output):
        _, _, weight, eps = inputs
        ctx.save_for_backward(output[0], weight)      # h, the forward's own output
        ctx.eps = eps

    def _backward(ctx, grad_h, grad_y):
        h, weight = ctx.saved_tensors
        grad_x, grad_w = add_rmsnorm_backward(h, weight, ctx.eps, grad_h, grad_y)
        return grad_x, grad_x, grad_w, None

    register_autograd(OP_NAME, _backward, setup_context=_setup_context)
