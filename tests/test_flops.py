import pytest
import torch

import utils


@pytest.mark.parametrize("m,n,k", [(3, 5, 7), (64, 128, 32), (1, 1, 1)])
def test_matmul_flops_are_exact(m, n, k):
    a, b = torch.randn(m, k), torch.randn(k, n)
    fc = utils.count_flops(torch.mm, a, b)
    assert fc.total_flops == 2 * m * n * k
    assert int(fc) == 2 * m * n * k
    assert fc.by_operator == {"aten.mm": 2 * m * n * k}


def test_backward_counts_twice_the_forward_matmul():
    w = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)

    def step():
        (x @ w).sum().backward()

    assert utils.count_flops(step).total_flops == 3 * 2 * 8 * 16 * 32


def test_throughput_arithmetic():
    assert utils.achieved_tflops(2e12, 0.5) == pytest.approx(4.0)
    assert utils.achieved_gbs(1e9, 0.25) == pytest.approx(4.0)
    assert utils.mfu(30.0, 60.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        utils.achieved_tflops(1.0, 0.0)
    with pytest.raises(ValueError):
        utils.mfu(1.0, 0)


def test_measured_ceilings_are_real_numbers():
    c = utils.measure_ceilings("cpu", smoke=True)
    assert c.matmul_tflops > 0 and c.bandwidth_gbs > 0
    assert c.ridge_flops_per_byte == pytest.approx(c.matmul_tflops * 1e3 / c.bandwidth_gbs)


def test_roofline_plot():
    import matplotlib

    matplotlib.use("Agg")
    c = utils.Ceilings("cpu", "float32", 1.0, 100.0, 1024, 1 << 20)
    pts = [utils.RooflinePoint("add", 1e6, 12e6, 1e-3), utils.RooflinePoint("mm", 2e9, 12e6, 1e-2)]
    ax = utils.plot_roofline(pts, c)
    assert ax.get_xscale() == "log" and len(ax.collections) == 2
    assert pts[0].intensity == pytest.approx(1 / 12)
    with pytest.raises(ValueError):
        utils.plot_roofline([], c)
