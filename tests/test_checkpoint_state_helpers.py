"""utils.checkpoint.state_to_cpu and state_max_abs_diff: the state-dict comparisons that
05-distributed/04 and 08 use to check a checkpoint against the state it saved."""

import pytest
import torch

from utils.checkpoint import state_max_abs_diff, state_to_cpu


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict()}


def test_state_to_cpu_is_a_copy_that_later_training_does_not_change():
    model, opt, live = _state()
    copy = state_to_cpu(live)
    assert copy["optim"]["param_groups"] == live["optim"]["param_groups"]
    assert state_max_abs_diff(copy, live) == 0.0
    with torch.no_grad():
        model.weight.fill_(0.0)  # the copy keeps the old weights
    now = {"model": model.state_dict(), "optim": opt.state_dict()}
    assert state_max_abs_diff(copy, now) == copy["model"]["weight"].abs().max().item() > 0
    assert isinstance(state_to_cpu((torch.ones(1), 2)), tuple)


def test_state_max_abs_diff_measures_the_largest_difference_of_any_tensor():
    ref = {"a": torch.zeros(2), "b": [torch.zeros(3), 0.9], "step": torch.tensor(4.0)}
    other = {"a": torch.tensor([0.0, -0.25]), "b": [torch.zeros(3), 0.9], "step": torch.tensor(4.5)}
    assert state_max_abs_diff(other, ref) == 0.5
    assert state_max_abs_diff({"x": 1}, {"x": 1}) == 0.0  # no tensors
    assert state_max_abs_diff({"e": torch.zeros(0)}, {"e": torch.zeros(0)}) == 0.0


@pytest.mark.parametrize("state, reference, where", [
    ({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, "keys"),
    ({"a": torch.zeros(3)}, {"a": torch.zeros(2)}, "shape"),
    ({"a": [1, 2]}, {"a": [1, 2, 3]}, "length"),
    ({"lr": 0.1}, {"lr": 0.2}, "0.1"),  # a hyper-parameter differs
    ({"a": 1.0}, {"a": torch.ones(1)}, "not a tensor"),
])
def test_state_max_abs_diff_refuses_states_of_another_structure(state, reference, where):
    with pytest.raises(ValueError, match=where):
        state_max_abs_diff(state, reference)
