"""Module 05's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails a wrong answer that a learner-eyed review found it let through (or
rejects none of the right answers it turned away).

A check that launches ranks runs here in this one process instead: the launch is replaced by
what the worker script computes in a process group of one rank (FSDP2), or by the fields a
real two-rank launch wrote (tensor parallelism, where one rank has nothing to shard).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import utils
import utils.distributed as ud
from conftest import REPO, cell_starting, code_cells

MODULE = REPO / "05-distributed"  # the notebooks and the scripts they launch


def _code_cells(notebook: str) -> list[str]:
    return list(code_cells(MODULE / notebook).values())


def _cell(cells: list[str], start: str) -> str:
    return cell_starting(cells, start)


def _run(source: str, env: dict, name: str) -> None:
    exec(compile(source, name, "exec"), env)  # noqa: S102


# --- 01_ddp, Exercise 3: a bf16 communication hook ------------------------------------------

RIGHT_HOOK = "fp32.to(torch.bfloat16).div_(dist.get_world_size())"


@pytest.mark.parametrize("wrong, message", [
    ("fp32.to(torch.bfloat16)", "average"),                                  # never divides
    ("fp32.to(torch.bfloat16).mul_(dist.get_world_size())", "average"),      # multiplies
    ("fp32.to(torch.bfloat16).float().div_(dist.get_world_size())", "bf16"),  # sends fp32
])
def test_01_exercise_3_check_sees_what_the_hook_sends_and_averages(wrong, message):
    """In a group of one rank, dividing by the world size and sending bf16 change nothing:
    all three wrong hooks passed the old check."""
    cells = _code_cells("01_ddp.ipynb")
    solution = _cell(cells, "# Exercise 3: all-reduce the gradients in bf16")
    check = _cell(cells, "# Check Exercise 3")
    assert RIGHT_HOOK in solution

    def env():
        return {"torch": torch, "dist": dist, "default_hooks": default_hooks, "DDP": DDP,
                "utils": utils, "ud": ud, "exposed": 0.5, "S": types.SimpleNamespace(
                    demo_gpt=utils.GPTConfig(vocab_size=512, block_size=64, n_layer=2,
                                             n_head=4, n_embd=128))}

    with utils.torch_threads(1):
        _run(solution + "\n" + check, env(), "ex3")
        with pytest.raises(AssertionError, match=message):
            _run(solution.replace(RIGHT_HOOK, wrong) + "\n" + check, env(), "ex3")


# --- 07_fsdp2_in_practice, Exercise 1: accumulation with one reduce-scatter -----------------

def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _accumulation_ranks(accumulate_file: Path) -> tuple[dict, dict]:
    """What fsdp_memory.py writes for ``fsdp2_accum_fn`` (the file's function) and for
    ``fsdp2_accum`` (the naive loop), computed here on a process group and mesh of one rank.
    FSDP2 runs no collectives on one rank, so the counts are set to those of two ranks with
    one reduce-scatter per step; the losses and gradients are this process's own."""
    fm = _load(MODULE / "scripts" / "fsdp_memory.py", "fsdp_memory_05_checks")
    from torch.distributed.device_mesh import init_device_mesh

    args = argparse.Namespace(batch=4, steps=2, time_steps=0, lr=1e-3, seed=0, accum=4,
                              accum_fn=str(accumulate_file), vocab=64, seq_len=8, n_layer=1,
                              n_head=2, n_embd=16)
    cfg = fm.model_config(args)
    ranks = {}
    with ud.single_process_group():
        w = ud.WorkerInfo(0, 1, 0, 1, "gloo", torch.device("cpu"))
        mesh = init_device_mesh("cpu", (1,))
        batches = fm.make_batches(cfg, args, w)
        ref = fm.reference(cfg, args, w, batches)
        for name in ("fsdp2_accum_fn", "fsdp2_accum"):
            ranks[name] = {"reference_losses": ref["losses"], "configs": {
                name: fm.run_config(name, cfg, args, w, mesh, batches, ref)}}
    L = args.n_layer
    ranks["fsdp2_accum_fn"]["configs"]["fsdp2_accum_fn"]["comm_counts"] = {
        "all_gather": args.accum * (1 + 2 * L), "reduce_scatter": 1 + L}
    return ranks["fsdp2_accum_fn"], ranks["fsdp2_accum"]


def _check_accumulate(source: str, tmp_path: Path) -> None:
    """Run 07's check cell on ``accumulate`` as written in ``source``, its launch replaced."""
    check = _cell(_code_cells("07_fsdp2_in_practice.ipynb"), "# Check Exercise 1")
    tmp_path.mkdir()
    yours = tmp_path / "yours.py"
    yours.write_text("import torch\nimport torch.nn.functional as F\n\n\n" + source)
    accumulate = _load(yours, "accumulate_05_checks").accumulate  # inspect.getsource needs a file
    mine, naive = _accumulation_ranks(yours)

    def fresh_dir(name):
        (tmp_path / name).mkdir(exist_ok=True)
        return tmp_path / name

    env = {"torch": torch, "inspect": inspect, "fresh_dir": fresh_dir, "accumulate": accumulate,
           "launch": lambda *a, **k: None, "script_args": lambda *a, **k: [], "SCRIPT": None,
           "NPROC": 2, "RANK_ENV": {}, "S": types.SimpleNamespace(accum=4, launch_timeout_s=60),
           "read_rank_results": lambda out, n: [mine], "ranks": [naive],
           "acc": naive["configs"]["fsdp2_accum"], "L": 1,
           "worst_rank_value": ud.worst_rank_value,
           "fp32_tol": lambda e: utils.tolerance(torch.float32, "cpu", scale=torch.as_tensor(e))}
    _run(check, env, "check1")


def test_07_exercise_1_check_wants_each_micro_batch_loss_divided(tmp_path):
    """Adam is nearly blind to a gradient's scale: a loop that forgets the `/ k` trained
    almost like the right one, and the old check (losses, reduce-scatters) passed it."""
    solution = _cell(_code_cells("07_fsdp2_in_practice.ipynb"),
                     "# Exercise 1: gradient accumulation with one reduce-scatter")
    source = solution[solution.index("def accumulate"):]
    with utils.torch_threads(1):
        _check_accumulate(source, tmp_path / "right")
        right = "y.flatten()) / k"
        assert right in source
        wrong = source.replace(right, "y.flatten())").replace(
            "total += loss.detach()", "total += loss.detach() / k")  # the mean loss stays right
        with pytest.raises(AssertionError, match="divide each micro-batch's loss"):
            _check_accumulate(wrong, tmp_path / "wrong")


# --- 03_tensor_parallel, Exercise 3: a column/row plan for the MLP --------------------------

# What tp.py --mode plan wrote on rank 0 of a real launch (torchrun, 2 gloo ranks, torch 2.15;
# --vocab 256 --n-layer 2 --n-head 4 --n-embd 64 --seq-len 32 --batch 4) for each plan, keyed by
# the plan's layers and layouts. One rank cannot stand in here: a mesh of one shards nothing.
PLAN_RUN = {"L": 2, "N": 2, "C": 64, "batch": 4, "seq": 32, "mlp_bytes_ref": 264704}
PLAN_RESULTS = {
    # the notebook's gathering_plan: both layers column-parallel, outputs gathered
    "0:ColwiseParallel(Replicate()->Replicate()) 2:ColwiseParallel(Replicate()->Replicate())": {
        "comm_forward": {"all_gather": 4}, "comm_backward": {"all_reduce": 4},
        "mlp_bytes": 132352},
    # the solution: column-parallel, then row-parallel
    "0:ColwiseParallel(Replicate()->Shard(dim=-1)) 2:RowwiseParallel(Shard(dim=-1)->Replicate())": {
        "comm_forward": {"all_reduce": 2}, "comm_backward": {"all_reduce": 2},
        "mlp_bytes": 132608},
    # the review's wrong answer: mlp.0 left whole, mlp.2 row-parallel on a replicated input
    "2:RowwiseParallel(Replicate()->Replicate())": {
        "comm_forward": {"all_reduce": 2}, "comm_backward": {"all_gather": 2},
        "mlp_bytes": 199168},
}


def _plan_key(plan: dict) -> str:
    """``"0:ColwiseParallel(Replicate()->Shard(dim=-1)) ..."``: each layer's style and layouts."""
    def layouts(style, name):
        return ",".join(map(repr, getattr(style, name)))

    return " ".join(f"{k}:{type(s).__name__}({layouts(s, 'input_layouts')}->"
                    f"{layouts(s, 'output_layouts')})" for k, s in sorted(plan.items()))


def _check_plans(solution: str, tmp_path: Path) -> None:
    """Run 03's check cell on the solution cell's plans; its launch answers with PLAN_RESULTS."""
    cells = _code_cells("03_tensor_parallel.ipynb")
    check = _cell(cells, "# Check Exercise 3")
    tmp_path.mkdir()
    plans_py = tmp_path / "solution.py"  # a file: the check reads the functions' source
    plans_py.write_text("from torch.distributed.tensor import Replicate, Shard\n"
                        "from torch.distributed.tensor.parallel import ColwiseParallel, "
                        "RowwiseParallel\n\n\n" + solution)
    functions = _load(plans_py, "plans_05_checks")

    def launch(nproc, args, out, env, mode):
        written = _load(Path(args[args.index("--plan-file") + 1]), "written_05_checks")
        plans = {n: dict(PLAN_RESULTS[_plan_key(getattr(written, n)())])
                 for n in ("gathering_plan", "pair_plan")}
        plans["mlp_bytes_ref"] = PLAN_RUN["mlp_bytes_ref"]
        for p in plans.values():
            if isinstance(p, dict):  # the sharded logits matched one device's in that run
                p.update(logits_max_rel_err=0.0, logits_tol_excess=0.0)
        return [plans]

    env = {"inspect": inspect, "utils": utils, "launch": launch, "RUN_DIR": tmp_path,
           "TP_ARGS": ["--vocab", 256, "--steps", 2], "TP_SIZE": PLAN_RUN["N"], "TP_ENV": {},
           "L": PLAN_RUN["L"], "N": PLAN_RUN["N"], "C": PLAN_RUN["C"],
           "S": types.SimpleNamespace(batch=PLAN_RUN["batch"],
                                      gpt=types.SimpleNamespace(block_size=PLAN_RUN["seq"])),
           "gathering_plan": functions.gathering_plan, "pair_plan": functions.pair_plan}
    _run(check, env, "check3")


def test_03_exercise_3_check_wants_both_layers_split_and_no_backward_gather(tmp_path):
    """The review's plan (mlp.2 row-parallel on a replicated input, mlp.0 whole) made one
    all-reduce per block in forward and matched the logits, which was all the old check asked;
    yet each rank held 3/4 of the MLP and the backward all-gathered."""
    cells = _code_cells("03_tensor_parallel.ipynb")
    solution = _cell(cells, "# Exercise 3: a tensor-parallel plan for the MLP")
    _check_plans(solution, tmp_path / "right")
    start = solution.index("    ### BEGIN SOLUTION")
    end = solution.index("### END SOLUTION") + len("### END SOLUTION")
    wrong = solution[:start] + '    return {"2": RowwiseParallel(input_layouts=Replicate())}' \
        + solution[end:]
    with pytest.raises(AssertionError, match="split both layers"):
        _check_plans(wrong, tmp_path / "wrong")


# --- 08_resharding_and_async_save, Exercise 1: how often to checkpoint ----------------------

GRID_SEARCH = """def best_interval(C, M):
    return min(range(1, 10**6), key=lambda T: overhead(C, M, T))  # to the nearest second
"""


@pytest.mark.parametrize("answer, accepted", [
    (None, True),                                             # the notebook's solution
    (GRID_SEARCH, True),                                      # "search numerically": 1315 s
    ("def best_interval(C, M):\n    return (C * M) ** 0.5\n", False),   # a factor 2 missing
])
def test_08_exercise_1_check_accepts_a_numerical_search(answer, accepted):
    """The prompt invites a numerical search, and the old check demanded sqrt(2CM) to 1e-6:
    a search to the nearest second (1315 s for 1314.53 s) failed it."""
    cells = _code_cells("08_resharding_and_async_save.ipynb")
    solution = _cell(cells, "# Exercise 1: how often to checkpoint")
    check = _cell(cells, "# Check Exercise 1")
    if answer is not None:
        solution = solution[:solution.index("def best_interval")] + answer
    env = {"utils": utils, "BLOCK": {"dcp.save": (0.05, [0.05])}}
    if accepted:
        _run(solution + "\n" + check, env, "ex1")
    else:
        with pytest.raises(AssertionError, match="above the least possible"):
            _run(solution + "\n" + check, env, "ex1")


# --- 06_ddp_in_practice, section 1: all-reduces per step against the bucket caps ------------

def test_06_bucket_counts_stay_within_the_bound_and_fall_short_where_tensors_exceed_the_cap():
    """The review measured 7 all-reduces at bucket_cap_mb=0.112 for 1.79 MiB of gradients,
    where the old prediction ("roughly size / cap") said 16: a bucket holds whole tensors,
    and this model's largest are 0.25 MiB. The table's bound holds, and the count falls
    short of size / cap by the tensors larger than the cap."""
    ddp_train = _load(MODULE / "scripts" / "ddp_train.py", "ddp_train_05_checks")
    cfg = utils.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    grad_mb = utils.count_parameters(utils.TinyGPT(cfg)) * 4 / 2**20
    caps = [round(grad_mb / 16, 3), round(grad_mb / 4, 3), round(2 * grad_mb, 1)]  # 06's caps
    a = ddp_train.parse_args(["--out", "unused", "--experiments", "settings", "--batch", "2",
                              "--steps", "1", "--warmup", "0", "--rounds", "1",
                              "--bucket-caps", ",".join(map(str, caps)), *ud.gpt_args(cfg)])
    w = ud.WorkerInfo(0, 1, 0, 1, "gloo", torch.device("cpu"))
    with utils.torch_threads(1), ud.single_process_group():
        settings = ddp_train.run_settings(a, cfg, w, None)
    rows = ddp_train.bucket_count_rows(settings)
    header, body = rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert header[:2] == ["setting", "all-reduces/step"] and len(body) == len(settings["variants"])
    for name, row in body.items():
        assert 1 <= row["all-reduces/step"] <= row["at most"], row
        assert abs(row["MiB reduced/step"] - grad_mb) < 1e-3, row  # every gradient, once
    assert body["default"]["all-reduces/step"] == 2  # DDP's 1 MiB first bucket, then the rest
    assert body[f"bucket_cap_mb={caps[-1]:g}"]["all-reduces/step"] == 1
    smallest = body[f"bucket_cap_mb={caps[0]:g}"]
    assert smallest["tensors > cap"] > 0 and smallest["all-reduces/step"] < grad_mb / caps[0]
