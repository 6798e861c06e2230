"""Module 00's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails a wrong answer that a learner-eyed review found it let through."""

from __future__ import annotations

import copy
import math
import statistics
import types

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import utils
from conftest import REPO, cell_starting, code_cells


def _code_cells(notebook: str) -> list[str]:
    return list(code_cells(REPO / "00-foundations" / notebook).values())


def _cell(cells: list[str], start: str) -> str:
    return cell_starting(cells, start)


def test_03_exercise_2_check_wants_at_least_one_worker_even_for_free_items():
    cells = _code_cells("03_input_pipeline.ipynb")
    solution = _cell(cells, "# Exercise 2: workers needed")
    check = _cell(cells, "# Check for Exercise 2")
    solution = solution[:solution.index("\n\nfor case in")]  # the function, not the printout
    env = {"math": math, "item_ms": {"cheap": 0.05, "heavy": 2.0},
           "S": types.SimpleNamespace(batch=32), "step_ms": 10.0}
    exec(compile(solution + "\n" + check, "ex2", "exec"), dict(env))  # noqa: S102
    right = "return max(1, math.ceil(item_ms * batch_size / step_ms - 1e-9))"
    assert right in solution
    bad = solution.replace(right, "return math.ceil(item_ms * batch_size / step_ms - 1e-9)")
    with pytest.raises(AssertionError, match="at least 1 worker"):
        exec(compile(bad + "\n" + check, "ex2", "exec"), dict(env))  # noqa: S102


def _exercise_1_env() -> dict:
    """Section 3 of 00/04 in small: a model, its optimizer and train_step with its regions."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xb, yb = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def train_step():
        with record_function("forward"):
            loss = F.cross_entropy(model(xb), yb)
        with record_function("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer_step"):
            opt.step()
        return loss

    return {"torch": torch, "utils": utils, "copy": copy, "statistics": statistics,
            "profile": profile, "ProfilerActivity": ProfilerActivity, "model": model,
            "opt": opt, "train_step": train_step, "DEVICE": torch.device("cpu"),
            "S": types.SimpleNamespace(ex_steps=3)}


@pytest.mark.parametrize("wrong, message", [
    ("total += train_step()", "still attached to its graph"),     # the sum keeps every graph
    ("total += train_step().item()", "copies to the host"),       # one copy per step
])
def test_04_exercise_1_check_wants_one_copy_and_a_detached_sum(wrong, message):
    cells = _code_cells("04_events_noise_and_the_profiler.ipynb")
    solution = _cell(cells, "# Exercise 1: log the loss")
    check = _cell(cells, "# Check 1:")
    with utils.torch_threads(1):
        exec(compile(solution + "\n" + check, "ex1", "exec"), _exercise_1_env())  # noqa: S102
        assert "total += train_step().detach()" in solution
        bad = solution.replace("total += train_step().detach()", wrong)
        with pytest.raises(AssertionError, match=message):
            exec(compile(bad + "\n" + check, "ex1", "exec"), _exercise_1_env())  # noqa: S102
