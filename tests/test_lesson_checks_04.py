"""Module 04's exercise checks, run on the notebooks' own solution and check cells: each passes
the solution and fails the wrong answers that a learner-eyed review found it let through. And
03's side-stream offload, run from its cell: its host copies go when the hooks do."""

from __future__ import annotations

import contextlib
import gc
import os
import types
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import utils
from conftest import REPO, cell_starting, code_cells
from utils.checkpoint import atomic_save, record_loads, safe_load
from utils.memtools import MemoryMeter, OutOfMemoryError, SavedTensorCompression

MODULE = REPO / "04-memory-efficiency"
SMALL_GPT = utils.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128,
                            dropout=0.1)


@pytest.fixture(autouse=True)
def _collect_afterwards():
    """An exec'd cell's functions hold its globals, which hold them: collect those cycles (and
    the tensors in them) here, not inside a later test's memory measurement."""
    yield
    gc.collect()


def _code_cells(notebook: str) -> list[str]:
    return list(code_cells(MODULE / notebook).values())


def _cell(cells: list[str], start: str) -> str:
    return cell_starting(cells, start)


def _solution(cell: str) -> str:
    """The text between a solution's markers (the part a wrong answer replaces)."""
    begin = cell.index("### BEGIN SOLUTION\n") + len("### BEGIN SOLUTION\n")
    return cell[begin:cell.index("### END SOLUTION")]


def _run(source: str, env: dict, name: str) -> None:
    exec(compile(source, name, "exec"), env)  # noqa: S102


# -- 08, Exercise 1: a loader for inference with one copy of the weights -----------------------

def _08_env(tmp_path: Path) -> dict:
    torch.manual_seed(0)
    return {"torch": torch, "utils": utils, "atomic_save": atomic_save,
            "record_loads": record_loads, "small": utils.TinyGPT(SMALL_GPT), "WORK": tmp_path,
            "S": types.SimpleNamespace(small_gpt=SMALL_GPT), "DEVICE": torch.device("cpu")}


PLAIN = """    model = utils.TinyGPT(cfg)
    model.load_state_dict(torch.load(path))
    return model.to(device).eval()
"""  # the reviewer's answer: the usual recipe, which keeps the tie and gives the same outputs
META_NO_MMAP = """    with torch.device("meta"):
        model = utils.TinyGPT(cfg)
    model.load_state_dict(torch.load(path, weights_only=True), assign=True)
    model.head.weight = model.tok_emb.weight
    return model.to(device).eval()
"""
MMAP_INTO_A_COPY = """    model = utils.TinyGPT(cfg)
    model.load_state_dict(torch.load(path, mmap=True, weights_only=True))
    return model.to(device).eval()
"""


@pytest.mark.parametrize("wrong, message", [(PLAIN, "mmap=True"), (META_NO_MMAP, "mmap=True"),
                                            (MMAP_INTO_A_COPY, "meta")])
def test_08_exercise_1_check_wants_mmap_and_assign_into_a_meta_model(tmp_path, wrong, message):
    cells = _code_cells("08_loading_large_models.ipynb")
    solution = _cell(cells, "# Exercise 1: load for inference")
    check = _cell(cells, "# Check Exercise 1")
    with utils.torch_threads(1):
        _run(solution + "\n" + check, _08_env(tmp_path), "ex1")
        bad = solution.replace(_solution(solution), wrong)
        with pytest.raises(AssertionError, match=message):
            _run(bad + "\n" + check, _08_env(tmp_path), "ex1")


# -- 05, Exercise 2: rotating checkpoints, never deleting before the new one is complete -------

def _05_env(tmp_path: Path) -> dict:
    return {"torch": torch, "Path": Path, "atomic_save": atomic_save, "safe_load": safe_load,
            "WORK": tmp_path, "contextlib": contextlib, "os": os, "mock": mock}


DELETE_FIRST_PLAIN_SAVE = """    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(folder.glob("step_*.pt"))[:-(keep - 1) or None]:
        old.unlink()
    torch.save(state, folder / f"step_{step:08d}.pt")
"""  # the reviewer's answer
DELETE_FIRST_ATOMIC = """    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(folder.glob("step_*.pt"))[:-(keep - 1) or None]:
        old.unlink()
    return atomic_save(state, folder / f"step_{step:08d}.pt")
"""
PLAIN_SAVE_THEN_DELETE = """    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / f"step_{step:08d}.pt")
    for old in sorted(folder.glob("step_*.pt"))[:-keep]:
        old.unlink()
"""


@pytest.mark.parametrize("wrong, message", [
    (DELETE_FIRST_PLAIN_SAVE, "only after the new one is complete"),
    (DELETE_FIRST_ATOMIC, "only after the new one is complete"),
    (PLAIN_SAVE_THEN_DELETE, "write it atomically"),
])
def test_05_exercise_2_check_kills_a_save_and_wants_the_old_checkpoints_intact(
        tmp_path, wrong, message):
    cells = _code_cells("05_checkpoints_and_loading.ipynb")
    solution = _cell(cells, "# Exercise 2: keep the last few checkpoints")
    check = _cell(cells, "# Check Exercise 2")
    _run(solution + "\n" + check, _05_env(tmp_path / "right"), "ex2")
    bad = solution.replace(_solution(solution), wrong)
    with pytest.raises(AssertionError, match=message):
        _run(bad + "\n" + check, _05_env(tmp_path / "wrong"), "ex2")
    assert torch.save.__module__ == "torch.serialization", "the check put torch.save back"


# -- 04, Exercise 2: the folklore finder's four faults -----------------------------------------

def _04_env() -> dict:
    """What the check reads besides the finder: section 1's answer and the memory it left."""
    return {"torch": torch, "gc": gc, "utils": utils, "OutOfMemoryError": OutOfMemoryError,
            "ENV": types.SimpleNamespace(is_cuda=False), "ex_left": 0, "ex_batch": 5,
            "search": types.SimpleNamespace(max_batch=5), "is_largest": lambda batch: True}


RIGHT_CATCH = """        except OutOfMemoryError:
            failed = True"""
WRONG_CATCH = {
    # the reviewer's answer: any RuntimeError whose message says "out of memory"
    "message": """        except RuntimeError as exc:
            if "out of memory" not in str(exc):
                raise
            failed = True""",
    "any RuntimeError": """        except RuntimeError:
            failed = True""",
}


@pytest.mark.parametrize("wrong", [*WRONG_CATCH, "no bisection", "cleanup while the error lives"])
def test_04_exercise_2_check_catches_each_fault_of_the_folklore_finder(wrong):
    cells = _code_cells("04_batch_size_and_habits.ipynb")
    cell = _cell(cells, "# Exercise 2: fix the folklore finder")
    finder = cell[:cell.index("\n\ndef trial_from_empty_cache")]  # the function, not its run
    check = _cell(cells, "# Check Exercise 2")
    _run(finder + "\n" + check, _04_env(), "ex2")
    assert RIGHT_CATCH in finder and "    while hi - lo > 1:" in finder
    if wrong in WRONG_CATCH:
        bad = finder.replace(RIGHT_CATCH, WRONG_CATCH[wrong])
    elif wrong == "no bisection":
        bad = finder.replace("    while hi - lo > 1:", "    while False:")
    else:
        bad = finder.replace(RIGHT_CATCH, """        except OutOfMemoryError:
            failed = True
            cleanup()""")
    with pytest.raises(AssertionError):
        _run(bad + "\n" + check, _04_env(), "ex2")


# -- 03, Exercise 1: fp8 saved activations -----------------------------------------------------

@pytest.fixture(scope="module")
def env_03():
    """Section 2 of 04/03 at its smoke size, as much of it as the exercise reads."""
    cfg = utils.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    batch = 8
    with utils.torch_threads(1):
        torch.manual_seed(0)
        model = utils.TinyGPT(cfg)
        idx, targets = utils.lm_batch(cfg, batch)
        stats_exact = batch * cfg.block_size * cfg.n_embd

        def step(hooks=contextlib.nullcontext()):
            model.zero_grad(set_to_none=False)
            with hooks:
                loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            loss.backward()

        step()
        ref = [p.grad.clone() for p in model.parameters()]

        def grad_error():
            return max(((p.grad - r).norm() / r.norm()).item()
                       for p, r in zip(model.parameters(), ref) if r.norm() > 0)

        grad_err = {}
        for name, mode, min_numel in (("bf16, statistics exact", "bf16", stats_exact),
                                      ("int8", "int8", 1024)):
            step(SavedTensorCompression(mode, keep=model.parameters(), min_numel=min_numel))
            grad_err[name] = grad_error()
        model.zero_grad(set_to_none=False)
        with MemoryMeter("cpu") as meter:
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            held = meter.held_bytes
        del loss
    return {"torch": torch, "F": F, "gc": gc, "utils": utils, "MemoryMeter": MemoryMeter,
            "DEVICE": torch.device("cpu"), "model": model, "idx": idx, "targets": targets,
            "STATS_EXACT": stats_exact, "grad_error": grad_error, "grad_err": grad_err,
            "mem": {"none": (held,)}}


SCALE = "    scale = t.detach().abs().amax().float().clamp_min(1e-30) / 448.0\n"
WRONG_FP8 = {  # the four wrong answers of the review, each passed by the old check
    "no scale": [(SCALE, "    scale = torch.ones((), device=t.device)\n")],
    "statistics not exact": [("t.numel() < STATS_EXACT", "t.numel() < 1024")],
    "parameters compressed too": [("\n            or t.untyped_storage().data_ptr() in PARAM_PTRS",
                                   "")],
    "e5m2": [("/ 448.0", "/ 57344.0"), ("torch.float8_e4m3fn", "torch.float8_e5m2")],
}


@pytest.mark.parametrize("wrong", WRONG_FP8)
def test_03_exercise_1_check_rejects_each_wrong_fp8_answer(env_03, wrong):
    cells = _code_cells("03_offloading_and_compression.ipynb")
    solution = _cell(cells, "# Exercise 1: fp8 saved activations")
    check = _cell(cells, "# Check Exercise 1")
    with utils.torch_threads(1):
        _run(solution + "\n" + check, dict(env_03), "ex1")
        bad = solution
        for old, new in WRONG_FP8[wrong]:
            assert old in bad, old
            bad = bad.replace(old, new)
        with pytest.raises(AssertionError):
            _run(bad + "\n" + check, dict(env_03), "ex1")


def test_03_side_stream_offload_frees_its_host_copies_when_the_hooks_go():
    """Section 3.1's hooks keep no reference cycle: after backward, `del hooks` frees the host
    copies at once, with the garbage collector off (a cycle kept them until a collection)."""
    cell = _cell(_code_cells("03_offloading_and_compression.ipynb"), "# One side stream")
    env = {"torch": torch, "DEVICE": torch.device("cpu")}
    _run(cell[:cell.index("\n\ndef fwd_bwd_side")], env, "c122")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    x = torch.randn(16, 32)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        hooks = env["SideStreamOffload"](keep=model.parameters())
        with hooks:
            loss = model(x).square().mean()
        loss.backward()
        assert hooks.host, "the hooks copied the activations"
        copies = [weakref.ref(t) for t in hooks.host]
        del hooks, loss
        assert all(r() is None for r in copies), "the host copies wait for gc.collect()"
    finally:
        if was_enabled:
            gc.enable()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
