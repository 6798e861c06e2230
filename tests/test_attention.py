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


def test_bad_arguments():
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        utils.sdpa_backend_status(q, q, q, backends=["WARP_DRIVE"])
    with pytest.raises(ValueError, match="head_dim"):
        utils.sdpa_backend_status(q[0], q[0], q[0])
    with pytest.raises(TypeError):
        utils.sdpa_backend_status(q, "k", q)
