"""utils.op_cost: the FLOPs and minimum bytes of an op placed on a roofline (00/02, 00/05)."""

import pytest
import torch
import torch.nn.functional as F

import utils


def test_a_matmul_is_counted_and_its_bytes_are_inputs_plus_output():
    a, b = torch.randn(12, 8), torch.randn(8, 5)
    op = utils.op_cost("mm", lambda: torch.mm(a, b), [a, b])
    assert op.flops == 2 * 12 * 8 * 5 and op.source == "FlopCounterMode"
    assert op.bytes_moved == 4 * (12 * 8 + 8 * 5 + 12 * 5)
    assert op.intensity == pytest.approx(op.flops / op.bytes_moved)
    torch.testing.assert_close(op.call(), a @ b)


def test_an_op_the_counter_ignores_takes_the_analytic_count():
    x = torch.randn(6, 10)
    op = utils.op_cost("softmax", lambda: F.softmax(x, -1), [x], analytic_flops_per_output=5)
    assert (op.flops, op.source, op.bytes_moved) == (5 * 60, "analytic", 2 * 4 * 60)


def test_a_wrong_or_missing_count_is_refused():
    a, x = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="counted no FLOPs"):
        utils.op_cost("add", lambda: x + x, [x])
    with pytest.raises(ValueError, match="use them"):
        utils.op_cost("mm", lambda: a @ a, [a], analytic_flops_per_output=1)
    with pytest.raises(ValueError, match="positive"):
        utils.op_cost("add", lambda: x + x, [x], analytic_flops_per_output=0)
    with pytest.raises(ValueError, match="input tensors"):
        utils.op_cost("add", lambda: x + x, [])
    with pytest.raises(TypeError, match="not a tensor"):
        utils.op_cost("tuple", lambda: (x, x), [x], analytic_flops_per_output=1)
