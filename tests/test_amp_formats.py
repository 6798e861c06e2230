"""utils.round_to_tf32 and utils.fp8_quantize: the format helpers notebooks 1 and 5 of module 02
share."""

import pytest
import torch

import utils


def test_round_to_tf32_stays_within_the_unit_roundoff_and_keeps_representable_values():
    torch.manual_seed(0)
    x = torch.randn(10_000) * torch.logspace(-30, 30, 10_000)
    r = utils.round_to_tf32(x)
    assert r.dtype == torch.float32 and r.shape == x.shape
    rel = ((r.double() - x.double()).abs() / x.double().abs()).max().item()
    assert 2.0**-12 < rel <= 2.0**-11, rel          # TF32's unit roundoff, and reached
    assert torch.equal(utils.round_to_tf32(r), r)   # rounding twice changes nothing
    # every result has its 13 lowest mantissa bits clear: 10 stored bits are left
    assert (r.view(torch.int32) & 0x1FFF == 0).all()
    exact = torch.tensor([1 + 2.0**-10, -3.0, 0.0, 2.0**-100, float("inf")])
    assert torch.equal(utils.round_to_tf32(exact), exact)


def test_round_to_tf32_rounds_to_nearest_with_ties_to_even():
    u = 2.0**-10  # the gap above 1 in TF32
    cases = {
        1 + 2.0**-12: 1.0,              # a quarter of a gap: down
        1 + 0.75 * u: 1 + u,            # three quarters: up
        1 + 0.5 * u: 1.0,               # a tie between 1 (even) and 1 + u (odd): to 1
        1 + 1.5 * u: 1 + 2 * u,         # a tie between 1 + u (odd) and 1 + 2u (even): up
        -(1 + 0.75 * u): -(1 + u),      # negative values round the same way
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    assert utils.round_to_tf32(x).tolist() == list(cases.values())
    y = torch.tensor([1 + 2.0**-20])
    assert utils.round_to_tf32(y).item() == 1.0
    assert y.item() == 1 + 2.0**-20, "the input is left unchanged"
    # a non-contiguous input works too
    m = torch.full((4, 4), 1 + 2.0**-12)
    assert (utils.round_to_tf32(m.t()) == 1.0).all()


def test_round_to_tf32_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        utils.round_to_tf32(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32"):
        utils.round_to_tf32([1.0])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_quantize_fills_the_range_and_round_trips(dtype):
    torch.manual_seed(0)
    x = 1e-6 * torch.randn(10_000)   # below both formats' subnormals: 0 without a scale
    q, scale = utils.fp8_quantize(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.dim() == 0
    fmax = torch.finfo(dtype).max
    assert q.float().abs().max().item() == fmax, "amax maps to the format's largest value"
    back = q.float() * scale
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < 2 * torch.finfo(dtype).eps, rel     # a few percent: 3 (e4m3) or 2 (e5m2) bits
    unscaled = x.to(dtype).float()
    assert ((unscaled - x).norm() / x.norm()).item() > 10 * rel, "the scale is what saves it"
    assert utils.fp8_quantize(x.double(), dtype)[1].dtype == torch.float32


def test_fp8_quantize_refuses_what_it_cannot_scale():
    with pytest.raises(ValueError, match="largest magnitude"):
        utils.fp8_quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="largest magnitude"):
        utils.fp8_quantize(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="float8"):
        utils.fp8_quantize(torch.ones(4), torch.bfloat16)
