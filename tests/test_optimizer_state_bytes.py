"""utils.memtools.optimizer_state_bytes: optimizer state counted from its tensors."""
import pytest
import torch

from utils.memtools import optimizer_state_bytes


def _stepped(opt_class, params, **kw):
    opt = opt_class(params, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_adamw_counts_two_fp32_moments_per_value_and_not_the_step():
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(7))]
    opt = _stepped(torch.optim.AdamW, params, lr=1e-3)
    assert optimizer_state_bytes(opt) == 2 * 4 * (64 * 32 + 7)
    assert optimizer_state_bytes(opt, "cpu") == 2 * 4 * (64 * 32 + 7)
    assert optimizer_state_bytes(opt, "cuda") == 0  # nothing on another device
    empty = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert optimizer_state_bytes(empty) == 0  # no step yet: no state


def test_sgd_momentum_and_bad_argument():
    params = [torch.nn.Parameter(torch.zeros(10, 10))]
    assert optimizer_state_bytes(_stepped(torch.optim.SGD, params, lr=0.1, momentum=0.9)) == 400
    with pytest.raises(ValueError):
        optimizer_state_bytes(object())


def test_torchao_8bit_state_counts_codes_scales_and_maps():
    ao = pytest.importorskip("torchao.optim")
    big, small = torch.nn.Parameter(torch.zeros(64, 128)), torch.nn.Parameter(torch.zeros(100))
    opt = ao.AdamW8bit([big, small], lr=1e-3)
    with torch.compiler.set_stance("force_eager"):  # the same state, without compiling
        for p in (big, small):
            p.grad = torch.ones_like(p)
        opt.step()
    n = big.numel()
    # per moment: 1-byte codes, one fp32 scale per 256 values, a 256-entry fp32 map;
    # the small tensor (under 4096 values) keeps two fp32 moments
    assert optimizer_state_bytes(opt) == 2 * (n + 4 * n // 256 + 4 * 256) + 2 * 4 * small.numel()


def test_an_optimizer_of_optimizers_counts_its_parts():
    class Offload:  # the shape of torchao's CPUOffloadOptimizer, which needs CUDA to build
        def __init__(self, parts, d_opt):
            self.optim_dict, self.d_opt = dict(enumerate(parts)), d_opt

    a = _stepped(torch.optim.AdamW, [torch.nn.Parameter(torch.zeros(5))])
    b = _stepped(torch.optim.AdamW, [torch.nn.Parameter(torch.zeros(3))])
    assert optimizer_state_bytes(Offload([a], b)) == 8 * 8
    assert optimizer_state_bytes(Offload([a, b], None)) == 8 * 8
