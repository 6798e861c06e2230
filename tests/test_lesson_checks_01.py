"""Module 01's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails a wrong answer that a learner-eyed review found it let through, at every
size of the notebook's size table (smoke, CPU full, GPU full), read from the notebook itself.

The checks count graphs with trace-only backends (``"eager"``, a counting backend) or run eager
models, so no test here compiles code. Model widths are shrunk where the count does not depend
on them; the sizes that decide the check (lengths, buckets, depth) are the tier's own."""

from __future__ import annotations

import ast
import dataclasses
import random
import types
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import utils
from conftest import REPO, cell_starting, code_cells
from utils import compiletools as ct

NB_DIR = REPO / "01-torch-compile"   # a test of the old notebooks points this elsewhere
TIERS = ("smoke", "cpu", "gpu")      # the columns of a size table, in order
# test ids: a bare "gpu" keyword would make conftest skip the test where CUDA is absent
TIER_IDS = ["smoke", "cpu-full", "gpu-full"]


def _code_cells(notebook: str) -> dict[str, str]:
    """Code cells by id."""
    return code_cells(Path(NB_DIR) / notebook)


def _cell(cells: dict[str, str], start: str) -> str:
    return cell_starting(cells, start)


def _sizes_cell(cells: dict[str, str]) -> str:
    (found,) = [s for s in cells.values() if "utils.size_table(" in s]
    return found


def _tier(cells: dict[str, str], tier: str) -> types.SimpleNamespace:
    """The notebook's size table, the column of `tier`, read without running the cell."""
    for node in ast.walk(ast.parse(_sizes_cell(cells))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "size_table":
            table = node.args[0]
            break
    sizes = {}
    for key, value in zip(table.keys, table.values):
        v = eval(compile(ast.Expression(value), "sizes", "eval"), {"utils": utils})  # noqa: S307
        sizes[ast.literal_eval(key)] = v[TIERS.index(tier)] if isinstance(v, tuple) else v
    return types.SimpleNamespace(tier=tier, **sizes)


def _defs(source: str, names: set[str]) -> str:
    """The top-level statements of a cell that define one of `names` (a def, a class, an
    assignment), in their order: a cell's helpers without the experiment it runs."""
    tree = ast.parse(source)
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound = {node.name}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        else:
            continue
        if bound & names:
            kept.append(ast.get_source_segment(source, node))
    missing = names - {n for seg in kept for n in names if n in seg}
    assert not missing, f"not defined in the cell: {missing}"
    return "\n\n".join(kept) + "\n"


def _run(source: str, env: dict, name: str) -> dict:
    exec(compile(source, name, "exec"), env)  # noqa: S102
    return env


def _small(cfg: utils.GPTConfig) -> utils.GPTConfig:
    """The tier's model, narrow: same vocabulary and block size, one thin layer."""
    return dataclasses.replace(cfg, n_layer=1, n_head=2, n_embd=16)


# -- 03, the shared environment: the tier's lengths and buckets, the notebook's helpers --------

def _03_env(tier: str) -> tuple[dict, dict[str, str]]:
    cells = _code_cells("03_dynamic_shapes.ipynb")
    S = _tier(cells, tier)
    S.cfg = _small(S.cfg)
    torch.manual_seed(0)
    env = {"torch": torch, "F": F, "utils": utils, "ct": ct, "random": random, "S": S,
           "DEVICE": torch.device("cpu"), "model": utils.TinyGPT(S.cfg).eval(),
           "DYNAMO_CFG": torch._dynamo.config, "LIMIT_NAME": ct.recompile_limit_name()}
    env["DEFAULT_LIMIT"] = getattr(torch._dynamo.config, env["LIMIT_NAME"])
    sizes = _sizes_cell(cells)
    _run(_defs(sizes, {"lo", "hi", "edges", "rng", "LENGTHS", "BUCKETS"}), env, "03 sizes")
    _run(_defs(_cell(cells, "class CompileLog:"),
               {"CompileLog", "fresh_dynamo", "batch_for", "loss_of", "tol"}), env, "03 c007")
    _run(_defs(_cell(cells, "PAD_ID, IGNORE_INDEX"),
               {"PAD_ID", "bucket_for", "pad_to"}), env, "03 c010")
    _run(_defs(_cell(cells, "def mark_length_dynamic"),
               {"mark_length_dynamic", "to_bucket", "as_is", "STRATEGIES", "make_step",
                "count_compiles"}), env, "03 c013")
    return env, cells


RIGHT_BUCKETS = "return len({bucket_for(t, buckets) for t in lengths})"


@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
def test_03_exercise_1_check_counts_the_buckets_a_stream_uses(tier):
    """`return len(buckets)` passed at smoke size, where the exercise's stream used both
    buckets; at full size 3 of 4 are used. The check now also predicts a stream that uses one."""
    env, cells = _03_env(tier)
    solution = _cell(cells, "# Exercise 1: predict the number of compiles")
    check = _cell(cells, "# Check Exercise 1")
    assert RIGHT_BUCKETS in solution
    with utils.torch_threads(1):
        _run(solution + "\n" + check, dict(env), "03 ex1")
        bad = solution.replace(RIGHT_BUCKETS, "return len(buckets)")
        with pytest.raises(AssertionError, match="bucket"):
            _run(bad + "\n" + check, dict(env), "03 ex1 wrong")
        torch._dynamo.reset()


RIGHT_PAD = "length = -(-idx.size(1) // m) * m"


@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
def test_03_exercise_2_check_catches_padding_a_multiple_further(tier):
    """`T + m - T % m` pads a length that is already a multiple of m by m more. The check's
    lengths held a multiple of M at smoke size only; it now adds one at every size."""
    env, cells = _03_env(tier)
    solution = _cell(cells, "# Exercise 2: pad to a multiple of m")
    check = _cell(cells, "# Check Exercise 2")
    env.update(order=env["LENGTHS"], buckets_used=len(env["BUCKETS"]))  # for its printout
    assert RIGHT_PAD in solution
    with utils.torch_threads(1):
        _run(solution + "\n" + check, dict(env), "03 ex2")
        bad = solution.replace(RIGHT_PAD, "length = idx.size(1) + m - idx.size(1) % m")
        with pytest.raises(AssertionError, match="multiple"):
            _run(bad + "\n" + check, dict(env), "03 ex2 wrong")


# -- 02, Exercise 2: graphs run per forward pass as a function of the depth ------------------

def _02_env(tier: str) -> tuple[dict, dict[str, str]]:
    cells = _code_cells("02_graph_breaks.ipynb")
    S = _tier(cells, tier)
    S.tokens = 8   # the count does not depend on the rows; the guard fires at every width
    env = {"torch": torch, "nn": nn, "F": F, "utils": utils, "S": S,
           "DEVICE": torch.device("cpu")}
    _run(_defs(_cell(cells, "class GuardedMLPBlock(nn.Module):"),
               {"GuardedMLPBlock", "GuardedMLPBlockFixed", "BlockStack"}), env, "02 c020")
    _run(_defs(_cell(cells, "block_explained = {}"), {"graphs_run_per_forward"}), env, "02 c022")
    torch.manual_seed(0)
    env["x_model"] = torch.randn(S.tokens, S.d_model)
    broken = env["BlockStack"](env["GuardedMLPBlock"], S.d_model, S.depth, S.max_rms).eval()
    with torch.no_grad():
        env["graph_runs"] = {"broken": env["graphs_run_per_forward"](broken, env["x_model"])[0]}
    assert env["graph_runs"]["broken"] >= 2 * S.depth   # the guard fired: the lesson's setting
    return env, cells


@pytest.mark.parametrize("wrong", ['return 2 * graph_runs["broken"]', "return 24"])
@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
def test_02_exercise_2_check_wants_a_function_of_the_depth(tier, wrong):
    """Doubling the measured count, or the constant it gives at depth 4, passed a check that
    asked for one depth only (twice the notebook's)."""
    env, cells = _02_env(tier)
    solution = _cell(cells, "# Exercise 2: graphs run per forward pass")
    check = _cell(cells, "# Check Exercise 2")
    with utils.torch_threads(1):
        _run(solution + "\n" + check, dict(env), "02 ex2")
        begin = solution.index("### BEGIN SOLUTION\n") + len("### BEGIN SOLUTION\n")
        end = solution.index("    ### END SOLUTION")
        bad = solution[:begin] + "    " + wrong + "\n" + solution[end:]
        with pytest.raises(AssertionError, match="predicted"):
            _run(bad + "\n" + check, dict(env), "02 ex2 wrong")
        torch._dynamo.reset()
