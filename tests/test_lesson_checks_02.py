"""Module 02's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails a wrong answer that a learner-eyed review found it let through. Notebook
6's exercise is also released, to show that the student sees the class it is asked to complete."""

from __future__ import annotations

import copy
import math
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import utils
from conftest import REPO, cell_starting, code_cells
from utils.course.student import strip_solutions

NB_DIR = REPO / "02-mixed-precision"
CPU = torch.device("cpu")


def _code_cells(notebook: str) -> list[str]:
    return list(code_cells(NB_DIR / notebook).values())


def _cell(cells: list[str], start: str) -> str:
    return cell_starting(cells, start)


def _run(source: str, env: dict, name: str) -> dict:
    with utils.torch_threads(1):
        exec(compile(source, name, "exec"), env)  # noqa: S102
    return env


def _swap(source: str, right: str, wrong: str) -> str:
    assert source.count(right) == 1, f"the solution no longer holds {right!r}"
    return source.replace(right, wrong)


# -- 01_number_formats, exercise 1: the fate of a value stored in a dtype ---------------------

@pytest.mark.parametrize("right, wrong", [
    # no round-up: a value just below tiny is called subnormal although it rounds to tiny
    ("if value < fi.tiny * (1 - fi.eps / 2):", "if value < fi.tiny:"),
    # no round-down: a value a quarter gap above max is called an overflow
    ("if value >= fi.max + top * fi.eps / 2:", "if value > fi.max:"),
])
def test_01_exercise_1_check_probes_each_rounding_boundary(right, wrong):
    cells = _code_cells("01_number_formats.ipynb")
    solution = _cell(cells, "# Exercise 1: predict the fate")
    check = _cell(cells, "# Check Exercise 1")
    _run(solution + "\n" + check, {"torch": torch, "np": np}, "ex1")
    with pytest.raises(AssertionError):
        _run(_swap(solution, right, wrong) + "\n" + check, {"torch": torch, "np": np}, "ex1")


# -- 04_amp_end_to_end, exercise 1: activation bytes per token -----------------------------

class _Autocast(nn.Module):
    """Notebook 4's wrapper: the model's forward under autocast (or not, for fp32)."""

    def __init__(self, model, dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype or torch.bfloat16,
                            enabled=self.dtype is not None):
            return self.model(x)


def _ce_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _exercise_04_env() -> dict:
    """Section 4 of notebook 4 at smoke size: the measured bytes per token per precision."""
    cfg = utils.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg)
    tokens = utils.MarkovTokens(n=8, seq_len=cfg.block_size, vocab_size=cfg.vocab_size)
    ((x, y),) = utils.stack_batches(tokens, 1, 8, CPU)
    xh, yh = x[:4].clone(), y[:4].clone()
    precisions = {"fp32": None, "bf16": torch.bfloat16}
    saved = {}
    for name, dtype in precisions.items():
        full, half = (utils.memory_breakdown(_Autocast(model, dtype), batch, _ce_loss)
                      .activations_bytes for batch in ((x, y), (xh, yh)))
        saved["TinyGPT", name] = {"per_unit": (full - half) / 4 / cfg.block_size}
    return {"utils": utils, "S": types.SimpleNamespace(gpt=cfg), "PRECISIONS": precisions,
            "saved": saved, "low": "bf16",
            "act_ratio": saved["TinyGPT", "bf16"]["per_unit"] / saved["TinyGPT", "fp32"]["per_unit"]}


@pytest.mark.parametrize("right, wrong", [
    # the log-probabilities counted in the autocast dtype (they are fp32)
    ("loss = 4 * cfg.vocab_size", "loss = lp * cfg.vocab_size"),
    # the attention output, which the projection Linear saves, left out
    ("+ lp * c         # attention output", "+ 0 * c          # attention output"),
])
def test_04_exercise_1_check_fails_a_missing_or_narrowed_tensor(right, wrong):
    cells = _code_cells("04_amp_end_to_end.ipynb")
    solution = _cell(cells, "# Exercise 1: predict the activation bytes")
    check = _cell(cells, "# Check Exercise 1")
    env = _exercise_04_env()
    _run(solution + "\n" + check, dict(env), "ex1")
    with pytest.raises(AssertionError):
        _run(_swap(solution, right, wrong) + "\n" + check, dict(env), "ex1")


# -- 06_sensitive_code_under_autocast, exercise 1: a custom function kept in fp32 ------------

def _exercise_06_env() -> dict:
    return {"torch": torch, "F": F, "utils": utils, "DEVICE": CPU, "AMP_DTYPE": torch.bfloat16,
            "TOL_AMP": utils.tolerance(torch.bfloat16, CPU)}


def test_06_exercise_1_student_version_shows_the_class_and_what_forward_records():
    solution = _cell(_code_cells("06_sensitive_code_under_autocast.ipynb"),
                     "# Exercise 1: a custom autograd function")
    student = strip_solutions(solution, "Exercise 1")
    for kept in ("class SqDist(torch.autograd.Function):", "@fwd_decorator", "@bwd_decorator",
                 "def forward(ctx, a, b):", "SEEN_IN_FORWARD.append((a.dtype, b.dtype))",
                 "def backward(ctx, g):"):
        assert kept in student, f"the student version lacks {kept!r}"
    assert "custom_fwd" not in student and "g @ b" not in student, "the answers stay hidden"
    compile(student, "student", "exec")  # the stubs leave valid Python


def test_06_exercise_1_check_fails_a_forward_that_is_not_kept_in_fp32():
    cells = _code_cells("06_sensitive_code_under_autocast.ipynb")
    solution = _cell(cells, "# Exercise 1: a custom autograd function")
    check = _cell(cells, "# Check Exercise 1")
    _run(solution + "\n" + check, _exercise_06_env(), "ex1")
    bad = _swap(solution, "torch.amp.custom_fwd(device_type=DEVICE.type, cast_inputs=torch.float32)",
                "torch.amp.custom_fwd(device_type=DEVICE.type)")
    with pytest.raises(AssertionError, match="forward saw"):
        _run(bad + "\n" + check, _exercise_06_env(), "ex1")


# -- 07_fp16_training_in_practice, exercise 2: one host read for the whole forward -----------

def _exercise_07_env() -> dict:
    """Section 4 of notebook 7 as the notebook runs it: find_nonfinite and its network."""
    section4 = _cell(_code_cells("07_fp16_training_in_practice.ipynb"),
                     "def find_nonfinite(model, *inputs, amp_dtype=None):")
    ledger = types.SimpleNamespace(record=lambda *a, **k: None)
    env = {"torch": torch, "nn": nn, "math": math, "OrderedDict": OrderedDict, "utils": utils,
           "DEVICE": CPU, "DEVICE_TYPE": "cpu", "BF16_OK": True, "ledger": ledger,
           "S": types.SimpleNamespace(timing_s=0.01)}
    return _run(section4, env, "section4")


@pytest.mark.parametrize("wrong", [
    "counts.append(torch.tensor((~torch.isfinite(t)).sum().tolist()))",     # a read per module
    "counts.append(torch.as_tensor((~torch.isfinite(t)).sum().cpu().numpy()))",
])
def test_07_exercise_2_check_fails_a_host_read_per_module(wrong):
    cells = _code_cells("07_fp16_training_in_practice.ipynb")
    solution = _cell(cells, "# Exercise 2: find the first non-finite output")
    check = _cell(cells, "# Check Exercise 2")
    env = _exercise_07_env()
    _run(solution + "\n" + check, env, "ex2")
    bad = _swap(solution, "counts.append((~torch.isfinite(t)).sum())  # stays on the device", wrong)
    with pytest.raises(AssertionError, match="one transfer"):
        _run(bad + "\n" + check, env, "ex2")


# -- 02_autocast, exercise 3: serve with bf16 weights under inference_mode --------------------

def _exercise_02_env() -> dict:
    cfg = utils.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    torch.manual_seed(0)
    return {"torch": torch, "copy": copy, "utils": utils, "DEVICE": CPU,
            "short": utils.dtype_name, "S": types.SimpleNamespace(gpt=cfg)}


@pytest.mark.parametrize("right, wrong, message", [
    ("with torch.inference_mode():", "with torch.no_grad():", "inference_mode"),
    ("copy.deepcopy(model).to(torch.bfloat16)", "copy.deepcopy(model).to(torch.float16)",
     "bf16 weights"),
])
def test_02_exercise_3_check_wants_bf16_weights_and_inference_mode(right, wrong, message):
    cells = _code_cells("02_autocast.ipynb")
    solution = _cell(cells, "# Exercise 3: serve with bf16 weights")
    check = _cell(cells, "# Check Exercise 3")
    _run(solution + "\n" + check, _exercise_02_env(), "ex3")
    with pytest.raises(AssertionError, match=message):
        _run(_swap(solution, right, wrong) + "\n" + check, _exercise_02_env(), "ex3")


# -- 08_amp_with_channels_last_and_compile, exercise 1: fp32 master weights -------------------

_FP32_THEN_CAST = '''
    model.float()  # wrong: trains an fp32 model, and only the result is bf16
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = [utils.train_step(model, opt, x, y).item() for x, y in batches]
    model.to(torch.bfloat16)
    return losses
'''


def test_08_exercise_1_check_fails_fp32_training_cast_back_at_the_end():
    cells = _code_cells("08_amp_with_channels_last_and_compile.ipynb")
    setup = _cell(cells, "# Notebook 4, section 2b")
    solution = _cell(cells, "# Exercise 1: fp32 master weights")
    check = _cell(cells, "# Check Exercise 1")
    sizes = types.SimpleNamespace(ft_lr=1e-4, ft_steps=30, ft_width=16, ft_batch=16, ft_image=16)
    env = _run(setup, {"torch": torch, "F": F, "copy": copy, "math": math, "utils": utils,
                       "tqdm": lambda it, **kw: it, "DEVICE": CPU, "S": sizes, "LOSS_TOL": 0.02,
                       "MIN_LEARNED": 0.10}, "setup")
    _run(solution + "\n" + check, dict(env), "ex1")
    body = solution[solution.index("    ### BEGIN SOLUTION"):solution.index("    ### END SOLUTION")]
    bad = solution.replace(body, _FP32_THEN_CAST)
    with pytest.raises(AssertionError, match="in the bf16 model"):
        _run(bad + "\n" + check, dict(env), "ex1")
