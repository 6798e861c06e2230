"""Check the fused add + RMSNorm Triton kernel on a CPU, under Triton's interpreter.

Triton compiles kernels for GPUs. With ``TRITON_INTERPRET=1`` set before
Triton is imported, ``@triton.jit`` functions instead run in Python with NumPy,
on CPU tensors: slowly, but with the same indexing, masking and arithmetic, so
a kernel's correctness can be tested on a machine without a GPU (CI does).
This script sets the variable first, in its own process, then imports
``add_rmsnorm_triton`` from its folder and compares the kernel with the eager
PyTorch version on row lengths that are *not* multiples of the block width.

It also runs a deliberately broken copy of the kernel (it divides the sum of
squares by the block width instead of the row length, so its padding lanes
count as data) to show that only awkward sizes catch that bug, and reports how
far outside the loosest tolerance the course uses (``utils.loosest_tolerance``)
its error lies.

Last, it calls the kernel as a PyTorch operator (``add_rmsnorm_op``, made with
``torch.library.triton_op``): on CPU tensors under the interpreter the operator runs the
same kernel, and its registered backward must match autograd through the eager version.

Notebook ``04_writing_a_triton_kernel`` runs it with ``subprocess``; the test
suite runs it too. Output: one JSON object on the last line of stdout (also
written to ``--out``); exit status 0 when every case matches, 1 when one does
not, 0 with ``"skipped"`` set when Triton is not installed.

Example::

    python triton_interpreter_check.py --out check.json
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (torch may)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the course's utils, also where it is not installed
import add_rmsnorm_triton as fused  # noqa: E402
import utils  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (shape, dtype, forced block width or None). Row lengths are prime, one past a power of two,
# or not a multiple of the forced block, so the masked tail of a block is always exercised;
# forcing a small block sends rows down the two-pass path, and so does a row longer than
# MAX_SINGLE_PASS_BLOCK (9000 columns: three blocks of 4096, the last one ragged).
DEFAULT_CASES = [
    ((1, 1), "float32", None),
    ((3, 1000), "float32", None),
    ((7, 4097), "float32", None),
    ((5, 1000), "float32", 256),
    ((2, 9000), "float32", None),
    ((2, 3, 777), "float32", None),
    ((4, 513), "float16", None),
    ((4, 513), "bfloat16", None),
    ((3, 1031), "bfloat16", 128),
]
EPS = 1e-6
# y: within utils.tolerance for the dtype (the sum of squares is added up in another order),
# its atol scaled to the values' size. h = x + r is one rounding of an exact float32 sum, so it
# must match eager bit for bit, except where the interpreter converts float32 to bfloat16
# differently from PyTorch (which rounds to nearest even). :func:`bf16_rounding` measures how
# this Triton's interpreter rounds; where it cuts the extra bits off (toward zero), an h may be
# one bfloat16 step (at most two unit roundoffs, 2^-7, relative) closer to zero, and only then
# do we allow that step, reporting how many elements it touched.
BF16_TOWARD_ZERO_TOLERANCE = (2 * utils.precision.UNIT_ROUNDOFF["bf16"], 0.0)
# The broken kernel's awkward row: 600 columns in a block of 1024, so the padding is 40% of the
# block and its error (sqrt(1024 / 600) - 1, about 30%) lies far outside any tolerance. A row
# of 1000 would be off by only about 1.2%, which a bfloat16 or TF32 tolerance could pass.
AWKWARD_COLS = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the first three cases only")
    return p.parse_args(argv)


def bf16_rounding() -> str:
    """How a kernel's float32 -> bfloat16 conversion rounds here, measured on 4096 values.

    Returns ``"to nearest even"`` (what PyTorch and a GPU do), ``"toward zero"`` (the extra
    bits cut off) or ``"other"``.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def to_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        tl.store(y_ptr + cols, tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.bfloat16),
                 mask=mask)

    x = torch.randn(4096, generator=torch.Generator().manual_seed(123))
    y = torch.empty(4096, dtype=torch.bfloat16)
    to_bf16[(1,)](x, y, 4096, BLOCK=4096)
    if torch.equal(y, x.to(torch.bfloat16)):
        return "to nearest even"
    toward_zero = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return "toward zero" if torch.equal(y, toward_zero) else "other"


def run_case(shape: tuple[int, ...], dtype_name: str, block: int | None,
             gen: torch.Generator, rounding: str = "to nearest even") -> dict:
    dtype = DTYPES[dtype_name]
    n = shape[-1]
    x = torch.randn(shape, generator=gen).to(dtype)
    r = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    cfg = fused.launch_config(n, block)
    t0 = time.perf_counter()
    h, y = fused.add_rmsnorm(x, r, w, EPS, block_size=block)
    seconds = time.perf_counter() - t0
    h_ref, y_ref = fused.reference_add_rmsnorm(x, r, w, EPS)
    tol = utils.tolerance(dtype, "cpu", scale=y_ref)
    errors = []
    h_rtol, h_atol = 0.0, 0.0
    if dtype == torch.bfloat16 and rounding == "toward zero":
        h_rtol, h_atol = BF16_TOWARD_ZERO_TOLERANCE
    try:
        torch.testing.assert_close(h, h_ref, rtol=h_rtol, atol=h_atol)
    except AssertionError as exc:
        errors.append("h: " + str(exc).splitlines()[0])
    try:
        torch.testing.assert_close(y, y_ref, **tol.kwargs())
    except AssertionError as exc:
        errors.append("y: " + str(exc).splitlines()[0])
    return {"shape": list(shape), "dtype": dtype_name, "block": cfg.block,
            "single_pass": cfg.single_pass, "forced_block": block is not None,
            "max_abs_err_y": (y.float() - y_ref.float()).abs().max().item(),
            "y_excess": tol.excess(y, y_ref), "y_tolerance": str(tol),
            "h_elements_not_bit_equal": int((h != h_ref).sum().item()),
            "seconds": seconds, "ok": not errors, "errors": errors}


def broken_kernel_check(gen: torch.Generator) -> dict:
    """A copy of the single-pass kernel that divides by BLOCK instead of n_cols.

    For a power-of-two row and an awkward one: whether the float32 comparison the real kernel
    passes catches it (``caught``), and its worst error in units of that tolerance
    (``excess``) and of the loosest one the course uses anywhere (``loosest_excess``: a GPU
    check with TF32 on must still catch it by far).
    """
    import triton
    import triton.language as tl

    @triton.jit
    def divides_by_block(x_ptr, r_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        h = x + r
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / BLOCK + eps)  # the bug
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, h * inv_rms * w, mask=mask)

    result = {}
    for label, n in (("power of two", 1024), ("awkward", AWKWARD_COLS)):
        x = torch.randn(3, n, generator=gen)
        r = torch.randn(3, n, generator=gen)
        w = torch.ones(n)
        y = torch.empty_like(x)
        divides_by_block[(3,)](x, r, w, y, n, EPS, BLOCK=fused.launch_config(n).block)
        _, y_ref = fused.reference_add_rmsnorm(x, r, w, EPS)
        excess = utils.tolerance(torch.float32, "cpu", scale=y_ref).excess(y, y_ref)
        result[label] = {"n_cols": n, "block": fused.launch_config(n).block,
                         "caught": excess > 1, "excess": excess,
                         "loosest_excess": utils.loosest_tolerance(torch.float32,
                                                                   scale=y_ref).excess(y, y_ref),
                         "max_abs_err": (y - y_ref).abs().max().item()}
    return result


def op_check(gen: torch.Generator) -> dict:
    """The kernel as a ``torch.library`` operator, forward and backward, on CPU tensors.

    Under the interpreter the operator's CPU implementation launches the Triton kernel; the
    backward is the registered formula. Both are compared with autograd through
    :func:`add_rmsnorm_triton.reference_add_rmsnorm`, for upstream gradients on ``h`` and ``y``.
    """
    shape = (5, 1000)
    x, r = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).requires_grad_()
    gh, gy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    got, want = {}, {}
    for out, fn in ((got, fused.add_rmsnorm_op), (want, fused.reference_add_rmsnorm)):
        for t in (x, r, w):
            t.grad = None
        h, y = fn(x, r, w, EPS)
        torch.autograd.backward([h, y], [gh, gy])
        out.update(h=h.detach(), y=y.detach(), x_grad=x.grad, residual_grad=r.grad,
                   weight_grad=w.grad)
    errors, excess = [], {}
    for name in ("y", "x_grad", "residual_grad", "weight_grad"):
        tol = utils.tolerance(torch.float32, "cpu", scale=want[name])
        excess[name] = tol.excess(got[name], want[name])
        if excess[name] > 1:
            errors.append(f"{name}: {excess[name]:.1f}x the tolerance")
    if not torch.equal(got["h"], want["h"]):
        errors.append("h: not bit for bit")
    return {"op": fused.OP_NAME, "shape": list(shape), "excess": excess, "ok": not errors,
            "errors": errors}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict = {"interpreter": fused.interpreter_active(), "torch": torch.__version__}
    if not fused.HAVE_TRITON:
        out.update(skipped="Triton is not installed (CPU-only torch builds do not bring it)",
                   ok=True, cases=[])
    else:
        import triton

        out["triton"] = triton.__version__
        gen = torch.Generator().manual_seed(args.seed)
        cases = DEFAULT_CASES[:3] if args.quick else DEFAULT_CASES
        out["bf16_rounding"] = bf16_rounding()
        out["cases"] = [run_case(tuple(s), d, b, gen, out["bf16_rounding"])
                        for s, d, b in cases]
        out["broken_kernel"] = broken_kernel_check(gen)
        out["op"] = op_check(gen)
        out["ok"] = all(c["ok"] for c in out["cases"]) and out["op"]["ok"]
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
