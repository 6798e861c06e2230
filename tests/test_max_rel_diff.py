"""utils.max_rel_diff: how far apart two sets of tensors are, relative to the expected ones."""

import math

import pytest
import torch

import utils


def test_relative_to_each_expected_tensors_largest_value():
    expected = [torch.tensor([1.0, -4.0]), torch.tensor([0.5])]
    actual = [torch.tensor([1.0, -3.0]), torch.tensor([0.5])]
    assert utils.max_rel_diff(actual, expected) == pytest.approx(0.25)  # 1 / 4
    assert utils.max_rel_diff(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.5


def test_equal_tensors_are_zero_in_any_dtype():
    t = torch.randn(3, 4, dtype=torch.bfloat16)
    assert utils.max_rel_diff(t, t.clone()) == 0.0
    assert utils.max_rel_diff([t, torch.zeros(2)], [t, torch.zeros(2)]) == 0.0


def test_an_all_zero_reference_and_nan_are_not_hidden():
    assert utils.max_rel_diff(torch.tensor([1e-3]), torch.zeros(1)) == math.inf
    got = utils.max_rel_diff([torch.ones(2), torch.tensor([math.nan])],
                             [torch.ones(2), torch.ones(1)])
    assert math.isnan(got)


def test_sides_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError):
        utils.max_rel_diff([torch.ones(2)], [torch.ones(2), torch.ones(2)])
    with pytest.raises(ValueError):
        utils.max_rel_diff(torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError):
        utils.max_rel_diff(torch.ones(2), [torch.ones(2)])
