"""The helpers that modules 02 and 03 repeated in their notebooks, now in utils once.

Each test fails on the wrong code it guards against: a snapshot that aliases the live
gradient, an equality that ignores a changed tensor, a norm that is not clip_grad_norm_'s,
a gap check that applies where the reference did not learn, a slope through the wrong points.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import utils
from utils.amp import TimeBreakdown


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _backward(model: nn.Module) -> None:
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()


def test_grad_snapshot_is_a_copy_and_needs_gradients():
    m = _model()
    with pytest.raises(ValueError, match="no .grad"):
        utils.grad_snapshot(m)
    _backward(m)
    snap = utils.grad_snapshot(m)
    assert [g.shape for g in snap] == [p.shape for p in m.parameters()]
    _backward(m)  # accumulates: the live gradients double, the snapshot must not
    for s, p in zip(snap, m.parameters()):
        torch.testing.assert_close(2 * s, p.grad)
    with pytest.raises(TypeError, match="one tensor"):
        utils.grad_snapshot(torch.zeros(3))


def test_params_equal_sees_any_change_and_checks_pairing():
    m = _model()
    before = utils.param_snapshot(m)
    assert utils.params_equal(before, m)
    with torch.no_grad():
        m[2].bias[0] += 1e-7  # one element of the last tensor
    assert not utils.params_equal(before, m)
    with pytest.raises(ValueError, match="tensors against"):
        utils.params_equal(before[:-1], m)
    with pytest.raises(ValueError, match="shape"):
        utils.params_equal([torch.zeros(2)], [torch.zeros(3)])


def test_total_norm_is_clip_grad_norms():
    m = _model()
    _backward(m)
    grads = utils.grad_snapshot(m)
    want = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9)
    torch.testing.assert_close(utils.total_norm(grads), want)
    torch.testing.assert_close(utils.total_norm([torch.tensor([3.0]), torch.tensor([4.0])]),
                               torch.tensor(5.0))
    with pytest.raises(ValueError):
        utils.total_norm([])


def test_cudnn_benchmark_restores_the_setting():
    old = torch.backends.cudnn.benchmark
    with utils.cudnn_benchmark(not old):
        assert torch.backends.cudnn.benchmark is (not old)
    assert torch.backends.cudnn.benchmark is old
    with pytest.raises(RuntimeError), utils.cudnn_benchmark(not old):
        raise RuntimeError("inside")
    assert torch.backends.cudnn.benchmark is old
    with pytest.raises(TypeError):
        with utils.cudnn_benchmark(1):
            pass


def test_loss_gap_applicability():
    learned = utils.loss_gap([1.0, 0.5, 0.5], [1.0, 0.5, 0.5], last=1)
    ok, why = learned.applicability(0.1)
    assert ok and why == "" and bool(learned.applicability(0.1))
    assert "the check applies" in str(learned.applicability(0.1))
    barely = utils.loss_gap([1.0, 0.99, 0.99], [1.0, 0.99, 0.99], last=1)
    ok, why = barely.applicability(0.1, what="MSE", reference="TinyGPT's fp32 run")
    assert not ok and "TinyGPT's fp32 run shed 1.0% of its first MSE" in why
    assert "does NOT apply" in str(barely.applicability(0.1))
    with pytest.raises(ValueError):
        barely.applicability(1.5)


def test_amdahl_bound():
    assert utils.amdahl_bound(0.5, 2.0) == pytest.approx(4 / 3)
    assert utils.amdahl_bound(1.0, 3.0) == pytest.approx(3.0)
    assert utils.amdahl_bound(0.0, 100.0) == 1.0
    for share, speedup in [(-0.1, 2.0), (1.1, 2.0), (0.5, 0.0), (0.5, math.inf)]:
        with pytest.raises(ValueError):
            utils.amdahl_bound(share, speedup)


def test_time_breakdown_diff_orders_savings_first():
    a = TimeBreakdown("cpu", "CPU op time", (("matmul / conv", 4.0), ("casts and copies", 0.0),
                                             ("other", 1.0)), calls=1)
    b = TimeBreakdown("cpu", "CPU op time", (("matmul / conv", 1.0), ("casts and copies", 0.5),
                                             ("other", 1.0)), calls=1)
    rows = a.diff(b)
    assert rows[0] == ("matmul / conv", 4.0, 1.0) and rows[-1] == ("casts and copies", 0.0, 0.5)
    text = a.diff_lines(b)
    assert "matmul / conv 4.00 -> 1.00 ms" in text
    assert "largest saving: matmul / conv; the largest addition: casts and copies (+0.50 ms)" in text
    c = TimeBreakdown("cuda:0", "CUDA kernel time", a.ms_by_category, calls=1)
    with pytest.raises(ValueError, match="clocks"):
        a.diff(c)


def test_stack_batches_own_storage_in_order():
    ds = utils.SyntheticImages(n=12, image_size=4, seed=0)
    batches = utils.stack_batches(ds, 3, 4, device="cpu")
    assert len(batches) == 3
    x1, y1 = batches[1]
    assert x1.shape == (4, 3, 4, 4) and y1.dtype == torch.int64
    torch.testing.assert_close(x1[2], ds[6][0], rtol=0, atol=0)
    assert y1[2].item() == ds[6][1]
    assert batches[0][0].untyped_storage().data_ptr() != x1.untyped_storage().data_ptr()
    assert x1.untyped_storage().nbytes() == x1.nbytes
    tokens = utils.stack_batches(utils.MarkovTokens(n=4, seq_len=8, vocab_size=16), 2, 2,
                                 device="cpu")
    assert tokens[0][1].shape == (2, 8)
    with pytest.raises(ValueError, match="need 16"):
        utils.stack_batches(ds, 4, 4)


def test_check_close_and_worst_excess():
    e = [torch.ones(10), 100 * torch.ones(3)]
    near = [t * (1 + 2.0**-16) for t in e]
    assert utils.check_close(near, e, torch.float32, "cpu") < 1
    far = [e[0], e[1] * 1.01]  # 1% off on the large tensor only
    with pytest.raises(AssertionError):
        utils.check_close(far, e, torch.float32, "cpu")
    x = utils.worst_excess(far, e, torch.float32, "cpu")
    loose = utils.worst_excess(far, e, torch.float32, "cpu", loosest=True)
    assert x > 10 and 1 < loose < x  # TF32's tolerance is looser than fp32's
    with pytest.raises(ValueError, match="against"):
        utils.worst_excess(far[:1], e)
    with pytest.raises(TypeError):
        utils.check_close(e[0], e)


def test_fit_slope():
    xs = [1, 2, 4, 8]
    assert utils.fit_slope(xs, [3 * v + 1 for v in xs]) == pytest.approx(3.0)
    assert utils.fit_slope(xs, [v * v for v in xs], log=True) == pytest.approx(2.0)
    assert utils.fit_slope([4, 8], [10.0, 20.0], log=True) == pytest.approx(1.0)
    for bad in [([1], [1]), ([1, 2], [1]), ([2, 2], [1, 3])]:
        with pytest.raises(ValueError):
            utils.fit_slope(*bad)
    with pytest.raises(ValueError):
        utils.fit_slope([1, 2], [0, 1], log=True)


def test_curves_plot_draws_the_reference_wide_and_pale():
    import matplotlib
    matplotlib.use("Agg")
    ax = utils.curves_plot({"fp32": [3, 2, 1], "bf16": [3, 2, 1.1], "fp16": [3, 2.5, 2]},
                           reference="fp32")
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["fp32"].get_linewidth() > 2 * lines["bf16"].get_linewidth()
    assert lines["fp32"].get_alpha() < lines["bf16"].get_alpha()
    assert lines["bf16"].get_linestyle() != lines["fp16"].get_linestyle()
    assert list(lines["bf16"].get_xdata()) == [1, 2, 3]
    with pytest.raises(ValueError):
        utils.curves_plot({"a": [1]}, reference="b")


def test_sweep_plot_reference_and_ticks_at_x():
    import matplotlib
    matplotlib.use("Agg")
    xs = [4, 16, 64]
    ax = utils.sweep_plot(xs, {"fp32": [1, 2, 3], "fp16": [1, 2, 3.1]}, "n", "ms", logx=True,
                          reference="fp32", ticks_at_x=True)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["fp32"].get_linewidth() > 2 * lines["fp16"].get_linewidth()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "64"]
    plain = utils.sweep_plot(xs, {"a": [1, 2, 3]}, "n", "ms")
    assert plain.get_lines()[0].get_marker() == "o"  # the default is unchanged
    with pytest.raises(ValueError):
        utils.sweep_plot(xs, {"a": [1, 2, 3]}, "n", "ms", reference="b")
