"""03-fused-operations: the Triton add + RMSNorm kernel and its interpreter check script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import utils
from conftest import REPO

MODULE_DIR = REPO / "03-fused-operations"
CHECK_SCRIPT = MODULE_DIR / "triton_interpreter_check.py"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, MODULE_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


fused = _load("add_rmsnorm_triton")


def test_launch_config_single_pass_up_to_the_limit():
    assert fused.launch_config(1000) == fused.LaunchConfig(1024, 4, True)
    assert fused.launch_config(1) == fused.LaunchConfig(16, 4, True)
    assert fused.launch_config(4097).block == 8192 and fused.launch_config(4097).single_pass
    big = fused.launch_config(fused.MAX_SINGLE_PASS_BLOCK + 1)
    assert not big.single_pass and big.block == fused.LOOP_BLOCK
    forced = fused.launch_config(1000, block_size=256)
    assert forced.block == 256 and not forced.single_pass
    assert fused.launch_config(200, block_size=256).single_pass
    assert fused.launch_config(1000, num_warps=2).num_warps == 2


def test_two_pass_block_count_is_per_block_count_not_per_row_length():
    # N_BLOCKS is a compile-time constant of the kernel: rows with the same number of blocks
    # share one compiled version, and the blocks cover the row exactly.
    for n in (fused.MAX_SINGLE_PASS_BLOCK + 1, 9000, 12288, 12289, 100_000):
        cfg = fused.launch_config(n)
        assert not cfg.single_pass
        assert (cfg.n_blocks - 1) * cfg.block < n <= cfg.n_blocks * cfg.block
    assert fused.launch_config(9000).n_blocks == fused.launch_config(12288).n_blocks == 3
    assert fused.launch_config(1000, block_size=256).n_blocks == 4
    assert fused.launch_config(1000).n_blocks == 1  # single pass: no loop, one version per BLOCK


@pytest.mark.parametrize("kwargs", [dict(n_cols=0), dict(n_cols=10, block_size=100),
                                    dict(n_cols=10, block_size=8),
                                    dict(n_cols=10, num_warps=3)])
def test_launch_config_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        fused.launch_config(**kwargs)


def test_reference_is_rmsnorm_of_the_sum():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(4, 33, generator=g), torch.randn(4, 33, generator=g)
    w = torch.randn(33, generator=g)
    h, y = fused.reference_add_rmsnorm(x, r, w, eps=1e-6)
    torch.testing.assert_close(h, x + r)
    s = x + r
    expected = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, expected)
    hb, yb = fused.reference_add_rmsnorm(x.bfloat16(), r.bfloat16(), w.bfloat16())
    assert hb.dtype == yb.dtype == torch.bfloat16


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
def test_kernel_wrapper_explains_what_it_cannot_do():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="shape"):
        fused.add_rmsnorm(x, torch.randn(2, 9), torch.randn(8))
    with pytest.raises(ValueError, match="weight"):
        fused.add_rmsnorm(x, x, torch.randn(9))
    with pytest.raises(ValueError, match="dtype"):
        fused.add_rmsnorm(x, x.double(), torch.randn(8))
    if not fused.interpreter_active() and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            fused.add_rmsnorm(x, x, torch.randn(8))


@pytest.fixture(scope="module")
def interpreter_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--out", str(out)], env=env,
                       cwd=MODULE_DIR, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no result written; exit {r.returncode}\n{r.stderr[-3000:]}"
    return r.returncode, json.loads(out.read_text())


def test_interpreter_check_passes_on_awkward_sizes(interpreter_result):
    code, result = interpreter_result
    if result.get("skipped"):
        pytest.skip(result["skipped"])
    assert result["interpreter"] is True
    failed = [c for c in result["cases"] if not c["ok"]]
    assert code == 0 and result["ok"] and not failed, failed
    # the cases exercise both paths and row lengths that are no multiple of the block; the
    # two-pass path also as launch_config chooses it, for a row past MAX_SINGLE_PASS_BLOCK
    assert {c["single_pass"] for c in result["cases"]} == {True, False}
    assert any(not c["single_pass"] and not c["forced_block"]
               and c["shape"][-1] > fused.MAX_SINGLE_PASS_BLOCK for c in result["cases"])
    assert all(c["shape"][-1] % c["block"] or c["shape"][-1] < c["block"]
               for c in result["cases"])
    assert {c["dtype"] for c in result["cases"]} == {"float32", "float16", "bfloat16"}
    # the bfloat16 allowance for h is granted only where the interpreter was measured to round
    # toward zero; rounding to nearest even must give h bit for bit
    assert result["bf16_rounding"] in ("to nearest even", "toward zero", "other")
    if result["bf16_rounding"] == "to nearest even":
        assert all(c["h_elements_not_bit_equal"] == 0 for c in result["cases"])
    assert all(c["h_elements_not_bit_equal"] == 0 for c in result["cases"]
               if c["dtype"] != "bfloat16")


def test_broken_kernel_is_caught_only_by_awkward_sizes(interpreter_result):
    _, result = interpreter_result
    if result.get("skipped"):
        pytest.skip(result["skipped"])
    broken = result["broken_kernel"]
    assert broken["awkward"]["caught"] is True
    assert broken["power of two"]["caught"] is False
    # a negative control: caught by 10x or more even under the loosest (TF32) tolerance
    assert broken["awkward"]["loosest_excess"] >= 10


# The kernel must compile for a GPU, not only run in the interpreter (which accepts Python a
# compiler refuses, and refuses some Python a compiler accepts). Triton compiles ahead of time
# for a named target without a GPU: front end, LLVM and the bundled ptxas, here for an H100.
@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("n_cols,dtype", [(1000, "bf16"), (9000, "fp32"), (12289, "fp16")])
def test_kernel_compiles_for_sm90_without_a_gpu(n_cols, dtype):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if fused.interpreter_active():
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are not compiled")
    cfg = fused.launch_config(n_cols)
    ptr = "*" + dtype
    signature = {"x_ptr": ptr, "r_ptr": ptr, "w_ptr": ptr, "h_ptr": ptr, "y_ptr": ptr,
                 "n_cols": "i32", "stride_x": "i32", "stride_r": "i32", "stride_h": "i32",
                 "stride_y": "i32", "eps": "fp32", "BLOCK": "constexpr",
                 "SINGLE_PASS": "constexpr", "N_BLOCKS": "constexpr"}
    src = ASTSource(fused._add_rmsnorm_kernel, signature,
                    constexprs={"BLOCK": cfg.block, "SINGLE_PASS": cfg.single_pass,
                                "N_BLOCKS": cfg.n_blocks})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "enable_fp_fusion": True})
    assert compiled.asm.get("cubin"), "no machine code for sm_90"
    if not cfg.single_pass:
        assert "scf.for" in compiled.asm["ttir"], "the two-pass loop is not a loop"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fused.HAVE_TRITON),
                    reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,block", [((1, 1), None), ((3, 1000), None), ((7, 4097), None),
                                         ((5, 1000), 256), ((2, 9000), None),
                                         ((2, 3, 12289), None)])
def test_kernel_matches_pytorch_on_the_gpu(shape, block, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g).to("cuda", dtype)
    r = torch.randn(shape, generator=g).to("cuda", dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to("cuda", dtype)
    h, y = fused.add_rmsnorm(x, r, w, 1e-6, block_size=block)
    h_ref, y_ref = fused.reference_add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # one rounding of the same fp32 sum
    torch.testing.assert_close(y, y_ref, **utils.tolerance(dtype, x.device, scale=y_ref).kwargs())


# -- the kernel as a torch.library operator ----------------------------------------------------

def _op_inputs(shape=(4, 33), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    gh, gy = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return (x, r, w), (gh, gy)


def _grads(fn, inputs, upstream):
    for t in inputs:
        t.grad = None
    h, y = fn(*inputs, 1e-6)
    torch.autograd.backward([h, y], list(upstream))
    return (h.detach(), y.detach()), [t.grad.clone() for t in inputs]


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
def test_operator_is_registered_and_passes_opcheck():
    assert fused.add_rmsnorm_op is not None
    assert torch.ops.course03.add_rmsnorm.default is not None
    inputs, _ = _op_inputs()
    result = torch.library.opcheck(fused.add_rmsnorm_op, (*inputs, 1e-6))
    assert result and all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use", ["both", "y only"])
def test_operator_backward_matches_autograd_of_the_reference(dtype, use):
    inputs, (gh, gy) = _op_inputs((3, 2, 37), dtype)
    upstream = (gh if use == "both" else torch.zeros_like(gh), gy)
    (h, y), got = _grads(fused.add_rmsnorm_op, inputs, upstream)
    (h_ref, y_ref), want = _grads(fused.reference_add_rmsnorm, inputs, upstream)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **utils.tolerance(dtype, "cpu", scale=y_ref).kwargs())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **utils.tolerance(dtype, "cpu", scale=w).kwargs())


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
def test_a_backward_without_the_residual_gradient_is_caught_by_far():
    # the notebook's negative control: grad_h forgotten, caught at 10x the loosest tolerance
    inputs, (gh, gy) = _op_inputs((8, 100))
    (h, _), want = _grads(fused.reference_add_rmsnorm, inputs, (gh, gy))
    bad, _ = fused.add_rmsnorm_backward(h, inputs[2].detach(), 1e-6, torch.zeros_like(gh), gy)
    assert utils.loosest_tolerance(torch.float32, scale=want[0]).excess(bad, want[0]) >= 10
    good, _ = fused.add_rmsnorm_backward(h, inputs[2].detach(), 1e-6, gh, gy)
    assert utils.tolerance(torch.float32, "cpu", scale=want[0]).excess(good, want[0]) < 1


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="Triton is not installed")
def test_operator_compiles_without_a_graph_break():
    from torch._dynamo.utils import counters

    inputs, upstream = _op_inputs()
    _, eager = _grads(fused.add_rmsnorm_op, inputs, upstream)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, r, w, eps: fused.add_rmsnorm_op(x, r, w, eps),
                             backend="aot_eager")
    _, got = _grads(compiled, inputs, upstream)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    for g, w in zip(got, eager):
        torch.testing.assert_close(g, w, **utils.tolerance(torch.float32, "cpu", scale=w).kwargs())


def test_interpreter_check_runs_the_operator(interpreter_result):
    _, result = interpreter_result
    if result.get("skipped"):
        pytest.skip(result["skipped"])
    assert result["op"]["ok"], result["op"]
    assert result["op"]["op"] == fused.OP_NAME
    assert set(result["op"]["excess"]) == {"y", "x_grad", "residual_grad", "weight_grad"}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fused.HAVE_TRITON),
                    reason="needs a CUDA GPU and Triton")
def test_compiled_operator_launches_the_triton_kernel_on_the_gpu():
    x, r = (torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    w = torch.ones(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(lambda x, r, w: fused.add_rmsnorm_op(x, r, w, 1e-6))
    h, y = compiled(x, r, w)
    h_ref, y_ref = fused.reference_add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **utils.tolerance(torch.bfloat16, x.device,
                                                            scale=y_ref).kwargs())
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    counted = utils.count_kernels(lambda: compiled(x, r, w), device="cuda")
    assert any("add_rmsnorm_kernel" in name for name in counted.by_name), counted
