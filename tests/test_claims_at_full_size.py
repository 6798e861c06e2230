"""What the notebooks do at the sizes CI does not run.

CI runs the notebooks at smoke size; the full sizes run on a GPU node, and on a CPU only when a
learner asks for them (--full). Running every notebook at --full on a CPU (2026-11-27) found:

- a claim that could not hold at either full size: 04/02 checked the compiled step's peak at
  the lowest activation_memory_budget it tried, and at full size that is 0, whose peak comes
  back (the notebook says so itself). The claim now takes the lowest budget above 0;
- two notebooks whose CPU-full sizes were the GPU's, with fp16 training that a CPU emulates:
  02/03 and 02/07 each stopped at a 300 s cell limit. Their CPU-full sizes are now smaller.

(The third, 06/02's CNN exercise, is in test_capstone_top_rung.py.) A reading of the GPU-full
column then found a check that only the GPU's bf16 breaks (03/03's dropout share) and a CPU's
bound that applied on a GPU at full size (01/01's fused-kernel ratio).
"""

from __future__ import annotations

import re
import types

import torch
import torch.nn.functional as F

import utils
from test_shared_sizes import read, size_rows

NB_04_02 = "04-memory-efficiency/02_activation_checkpointing.ipynb"


def test_the_budget_claim_is_made_on_a_budget_above_zero_at_every_size():
    """The notebook's own expression for the claim's budget, evaluated on each tier's budgets
    (smoke, CPU full, GPU full)."""
    nb = read(NB_04_02)
    code = next(c.source for c in nb.cells
                if c.cell_type == "code" and "compiled_budget_peak_ratio" in c.source)
    expr = re.search(r"^lowest = (.+)$", code, re.M).group(1)
    for tier, budgets in enumerate(size_rows(nb)["budgets"]):
        claimed = eval(expr, {"S": types.SimpleNamespace(budgets=budgets), "min": min})
        assert claimed in budgets and claimed > 0, (tier, budgets, claimed)


def test_budget_zero_brings_the_peak_back_so_it_cannot_carry_the_claim():
    """What the claim's choice rests on, measured as the notebook measures it (the partitioner
    under aot_eager, the tensor-storage recorder): at budget 0.2 the compiled step's peak
    falls below the notebook's 0.7x, at budget 0 it is back near the eager step's."""
    import torch._functorch.config as functorch_config

    from utils.memory import TensorMemoryTracker

    class Tracker(TensorMemoryTracker):
        @classmethod
        def ignore_compile_internals(cls):
            return True

    torch.manual_seed(0)
    model = utils.TinyGPT(utils.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4,
                                          n_embd=128))
    idx, targets = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))

    def model_loss(i, t):
        return F.cross_entropy(model(i).flatten(0, 1), t.flatten())

    def step(fn):
        model.zero_grad(set_to_none=False)
        fn(idx, targets).backward()

    def peak(fn):
        with Tracker() as meter:
            step(fn)
        return meter.peak_bytes

    ratio = {}
    with utils.torch_threads(1):  # CI runs two test workers on two cores
        step(model_loss)  # the gradients exist before any measured step, as in the notebook
        eager = peak(model_loss)
        for budget in (0.2, 0.0):
            torch._dynamo.reset()
            compiled = torch.compile(model_loss, backend="aot_eager")
            with functorch_config.patch(activation_memory_budget=budget):
                step(compiled)  # compiles at this budget
            ratio[budget] = peak(compiled) / eager
        torch._dynamo.reset()
    assert ratio[0.2] <= 0.7, ratio
    assert ratio[0.0] > 0.7, ratio


# ---- the CPU-full tier of the fp16 notebooks stays runnable on a CPU ------------------------

#: The most that one fp16 mode's training may be projected to take at the CPU-full sizes here.
#: The sizes in use project to well under a minute on CI's 2-core machine; the GPU sizes they
#: replaced projected to over half an hour (5 s per step: CPUs without fp16 units emulate it).
FP16_CPU_FULL_BUDGET_S = 300.0


def _fp16_step_s(in_features: int, hidden: int, out_features: int, batch: int) -> float:
    """Seconds of one fp16-autocast training step of utils.MLP(depth=3) on this CPU: the
    fastest of two after a warm-up."""
    import time

    torch.manual_seed(0)
    model = utils.MLP(in_features=in_features, hidden=hidden, out_features=out_features, depth=3)
    x = torch.randn(batch, in_features)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().square().mean().backward()

    step()
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def test_the_fp16_notebooks_cpu_full_sizes_train_in_minutes_on_a_cpu():
    """02/03 and 02/07 train MLPs under fp16 autocast on any device. Their CPU-full sizes were
    the GPU's, and a run at --full on a CPU stopped at a 300 s cell limit in both: here each
    fp16 mode's steps at the table's CPU-full sizes, projected from one timed step, must fit
    FP16_CPU_FULL_BUDGET_S."""
    nb03 = size_rows(read("02-mixed-precision/03_grad_scaler.ipynb"))
    nb07 = size_rows(read("02-mixed-precision/07_fp16_training_in_practice.ipynb"))
    cpu = 1  # the CPU-full column
    runs = {
        "03 regression": (_fp16_step_s(nb03["reg_dim"][cpu], nb03["reg_hidden"][cpu],
                                       nb03["reg_dim"][cpu], nb03["reg_batch"][cpu]),
                          nb03["reg_steps"][cpu]),
        "03 classifier": (_fp16_step_s(3 * nb03["img"][cpu] ** 2, nb03["cls_hidden"][cpu], 10,
                                       nb03["cls_batch"][cpu]), nb03["scale_steps"][cpu]),
        "07 classifier": (_fp16_step_s(3 * nb07["img"][cpu] ** 2, nb07["cls_hidden"][cpu], 10,
                                       nb07["cls_batch"][cpu]), nb07["resume_steps"][cpu]),
    }
    projected = {name: step_s * steps for name, (step_s, steps) in runs.items()}
    assert max(projected.values()) <= FP16_CPU_FULL_BUDGET_S, projected


# ---- 03/03's dropout check in bf16 at the GPU-full size ---------------------------------------

def test_the_dropout_share_is_counted_where_a_drop_can_be_seen():
    """03/03 checks that dropout zeroed a share p of the outputs, within 6 sigma + 1e-3. On a
    GPU its activations are bf16, where about 1.5% of the GELU outputs round to exactly 0; a
    count that took those as kept came out low by about 0.0016, past the bound at the GPU-full
    size (2^28 outputs: 0.0011) and already at 2^24 (0.0014). A reviewer's reading found it;
    the notebook's dropped_share counts only where the no-dropout value is not 0."""
    import ast
    import math

    nb = read("03-fused-operations/03_compiler_fusion.ipynb")
    code = next(c.source for c in nb.cells
                if c.cell_type == "code" and "def dropped_share" in c.source)
    fn = next(n for n in ast.parse(code).body
              if isinstance(n, ast.FunctionDef) and n.name == "dropped_share")
    scope: dict = {}
    exec(compile(ast.Module([fn], []), "03_03", "exec"), scope)  # noqa: S102
    dropped_share = scope["dropped_share"]

    p, rows, cols = 0.1, 4096, 4096  # 2^24 outputs, in bf16 as on a GPU
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    b = torch.randn(cols, generator=g).to(torch.bfloat16)
    t = x + b
    ref = 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))
    torch.manual_seed(0)
    y = F.dropout(ref, p=p, training=True)
    frac, n_live = dropped_share(y, ref)
    bound = 6 * math.sqrt(p * (1 - p) / n_live) + 1e-3
    assert abs(frac - p) < bound, (frac, bound)
    naive = 1 - ((y != 0) | (ref == 0)).float().mean().item()  # the count it replaced
    assert abs(naive - p) > 6 * math.sqrt(p * (1 - p) / y.numel()) + 1e-3, naive


# ---- 01/01's fused-kernel ratio on a GPU ------------------------------------------------------

def _expect_statement(notebook: str, name: str):
    """The ``_ = ledger.expect("name", ...)`` statement of a notebook, parsed."""
    import ast

    nb = read(notebook)
    for cell in nb.cells:
        if cell.cell_type != "code" or f'"{name}"' not in cell.source:
            continue
        for node in ast.parse(cell.source).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "attr", "") == "expect"
                    and isinstance(node.value.args[0], ast.Constant)
                    and node.value.args[0].value == name):
                return ast.Module([node], [])
    raise AssertionError(f"no ledger.expect({name!r}) in {notebook}")


def test_the_cpu_bound_on_fused_kernels_is_not_held_against_a_gpu():
    """01/01 bounds compiled / eager "other" kernels at 0.6, set from a CPU's counts (operators
    and Inductor's C++ kernels). On CUDA the profiler counts kernels, and the one H100 count
    (smoke, one block) was 0.76 or more; the claim applied there at full size all the same
    (in_smoke=not ENV.is_cuda), holding a GPU run to a CPU's bound that the one GPU count did
    not meet. On a CPU it still catches a compile that fused nothing (about 1.0)."""
    statement = compile(_expect_statement("01-torch-compile/01_compile_basics.ipynb",
                                          "gpt_fused_other_kernels_ratio"), "01_01", "exec")

    def verdict(is_cuda: bool, smoke: bool, ratio: float) -> str:
        ledger = utils.Ledger("test/01_01", smoke=smoke, env=None, autosave=False, strict=False)
        exec(statement, {"ledger": ledger, "ENV": types.SimpleNamespace(is_cuda=is_cuda),  # noqa: S102
                         "other_ratio": {("gpt", "compiled"): ratio}, "first_gpt": "gpt"})
        (claim,) = ledger.expectations.values()
        return claim.status

    assert verdict(is_cuda=True, smoke=False, ratio=0.8) == "not applicable"
    assert verdict(is_cuda=False, smoke=False, ratio=1.0) == "not met"
    assert verdict(is_cuda=False, smoke=True, ratio=1.0) == "not met"
    assert verdict(is_cuda=False, smoke=True, ratio=0.5) == "met"
