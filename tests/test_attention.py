"""utils.attention: which SDPA backends run a call, and why the others do not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import utils


def test_backends_are_listed_without_the_pseudo_members():
    names = utils.sdpa_backends()
    assert "MATH" in names and "FLASH_ATTENTION" in names and "EFFICIENT_ATTENTION" in names
    assert "ERROR" not in names and "OVERRIDEABLE" not in names


def test_math_always_runs_and_results_match():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    status = utils.sdpa_backend_status(q, k, v, is_causal=True)
    assert status["MATH"].available and status["MATH"].reason == ""
    assert set(status) == set(utils.sdpa_backends())
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, st in status.items():
        if st.available:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_cuda_only_backends_say_why_on_cpu():
    q = torch.randn(1, 2, 16, 8)
    st = utils.sdpa_backend_status(q, q, q, backends=["EFFICIENT_ATTENTION"])
    assert not st["EFFICIENT_ATTENTION"].available
    assert "cpu" in st["EFFICIENT_ATTENTION"].reason and "cannot run" in str(st["EFFICIENT_ATTENTION"])
    # not PyTorch's "turning off both the math kernel and the fused kernels", which reads as a
    # misconfiguration
    assert st["EFFICIENT_ATTENTION"].reason.startswith("a CUDA-only backend"), st
    assert "turning off" not in st["EFFICIENT_ATTENTION"].reason


def test_bad_arguments():
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        utils.sdpa_backend_status(q, q, q, backends=["WARP_DRIVE"])
    with pytest.raises(ValueError, match="head_dim"):
        utils.sdpa_backend_status(q[0], q[0], q[0])
    with pytest.raises(TypeError):
        utils.sdpa_backend_status(q, "k", q)


def test_the_backend_that_ran_is_read_from_the_trace():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from utils.attention import sdpa_backend_used

    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with sdpa_kernel([SDPBackend.MATH]):
        math_run = sdpa_backend_used(fwd_bwd, device="cpu")
    assert math_run.backend == "MATH" and math_run.device == "cpu"
    default = sdpa_backend_used(fwd_bwd, device="cpu")
    assert default.backend == "FLASH_ATTENTION (CPU)", default       # the CPU's fused kernel
    assert "ran FLASH_ATTENTION (CPU)" in str(default)
    none = sdpa_backend_used(lambda: q @ k.transpose(-1, -2), device="cpu")
    assert none.backend == "none" and not none.backends


@pytest.mark.parametrize("name, backend", [
    # names of kernels from the H100 run (03/02, torch 2.11, cuDNN 9.19) and flash's own
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
     "CUDNN_ATTENTION"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t>, true, false, false, false, true, true, false>(pytorch_flash::Flash_fwd_"
     "params)", "FLASH_ATTENTION"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "EFFICIENT_ATTENTION"),
    ("cutlassB_f32_aligned_64x64_k32_sm80", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None),
])
def test_backend_of_a_kernel_name(name, backend):
    from utils.attention import backend_of_kernel

    assert backend_of_kernel(name) == backend


def test_random_qkv_is_the_same_draw_in_every_dtype():
    q, k, v = utils.random_qkv(2, 3, 5, 4, device="cpu", seed=1)
    assert q.shape == k.shape == v.shape == (2, 3, 5, 4) and q.dtype == torch.float32
    assert not q.requires_grad and not torch.equal(q, k)       # three draws, not one
    q16, _, _ = utils.random_qkv(2, 3, 5, 4, device="cpu", dtype=torch.bfloat16,
                                 requires_grad=True, seed=1)
    assert q16.dtype == torch.bfloat16 and q16.requires_grad and q16.is_leaf
    torch.testing.assert_close(q16.float(), q, **utils.tolerance(torch.bfloat16, "cpu").kwargs())
    assert not torch.equal(utils.random_qkv(2, 3, 5, 4, device="cpu", seed=2)[0], q)


def test_attention_step_runs_backward_from_fresh_gradients():
    q, k, v = utils.random_qkv(1, 2, 8, 4, device="cpu", requires_grad=True)
    grad_out = torch.randn_like(q)
    run = utils.attention_step(lambda a, b, c: F.scaled_dot_product_attention(a, b, c))
    run(q, k, v, grad_out)
    first = [t.grad.clone() for t in (q, k, v)]
    run(q, k, v, grad_out)                  # a second step replaces the gradients, not adds
    for t, g in zip((q, k, v), first):
        assert torch.equal(t.grad, g)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref).backward(grad_out)
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, r.grad)
