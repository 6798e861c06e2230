"""Module 03's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails a wrong answer that a learner-eyed review found it let through."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import utils
from conftest import REPO, cell_starting, code_cells


def _code_cells(notebook: str) -> list[str]:
    return list(code_cells(REPO / "03-fused-operations" / notebook).values())


def _cell(cells: list[str], start: str) -> str:
    return cell_starting(cells, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_03_exercise_1_check_wants_the_tanh_gelu_at_every_dtype(dtype):
    """On a GPU the notebook's activations are bf16, whose tolerance let the erf GELU through."""
    cells = _code_cells("03_compiler_fusion.ipynb")
    gelu = _cell(cells, "GELU_C = ")
    gelu = gelu[:gelu.index("\n\n\ndef bias_gelu_dropout")]
    solution = _cell(cells, "# Exercise 1: fewer eager kernels")
    solution = solution[:solution.index("\n\n\nwith torch.no_grad()")]
    check = _cell(cells, "# Check Exercise 1")
    device = torch.device("cpu")
    x, b = torch.randn(64, 256).to(dtype), torch.randn(256).to(dtype)

    def tol(expected, factor=1.0):
        return utils.tolerance(dtype, device, scale=expected, factor=factor).kwargs()

    def run(source):
        env = {"torch": torch, "F": F, "math": math, "utils": utils, "DEVICE": device, "x": x,
               "b": b, "tol": tol, "chain_k": {"eager, written out": types.SimpleNamespace(
                   per_call=6)}}
        exec(compile(gelu, "gelu", "exec"), env)  # noqa: S102
        exec(compile(source, "ex1", "exec"), env)  # noqa: S102
        with torch.no_grad():
            env["ref"] = env["bias_gelu"](x, b)
            env["ex1_out"] = env["bias_gelu_fewer_kernels"](x, b)
        env["ex1_k"] = types.SimpleNamespace(per_call=2)
        exec(compile(check, "check", "exec"), env)  # noqa: S102

    run(solution)
    with pytest.raises(AssertionError):
        run(solution.replace('F.gelu(x + b, approximate="tanh")', "F.gelu(x + b)"))


def test_05_exercise_1_check_wants_the_batch_norms_eps():
    """The running variances were large enough that a fold without eps passed."""
    import torch.nn as nn

    cells = _code_cells("05_inference_fusions.ipynb")
    setup = _cell(cells, "# Exercise 1: fold BatchNorm1d")
    check = _cell(cells, "# Check Exercise 1")
    env = {"torch": torch, "nn": nn, "utils": utils, "DEVICE": torch.device("cpu")}
    with utils.torch_threads(1):
        exec(compile(setup + "\n" + check, "ex1", "exec"), dict(env))  # noqa: S102
        right = "s = bn.weight / torch.sqrt(bn.running_var + bn.eps)"
        assert right in setup
        bad = setup.replace(right, "s = bn.weight / torch.sqrt(bn.running_var)")
        with pytest.raises(AssertionError):
            exec(compile(bad + "\n" + check, "ex1", "exec"), dict(env))  # noqa: S102
