"""Module 05's worker scripts, each run once under torchrun on 2 gloo CPU processes.

The notebooks of 05-distributed launch these scripts at smoke size and take minutes; here each
script runs once, at the smallest size that still goes through every code path of its
notebook (several experiments per launch, as the notebooks do), and a few fields of what the
ranks wrote are checked. CI runs this file on the newest torch and on the GPU machine's torch
2.11, where two of the scripts once failed: ``CommDebugMode`` crashed under FSDP2's hooks
(``fsdp_memory.py``, now counted with ``utils.collectives.CollectiveCounter``) and a reused
``DefaultStager`` failed its second ``async_save`` (``dcp_checkpoint.py``).

A launch costs seconds before any rank does work (torchrun and each rank import torch); most
of this file's time is those start-ups. In one pytest process the first test starts the
launches of every selected test at once, so that their start-ups overlap; under pytest-xdist
each test starts only its own (the workers already run tests side by side, and two workers
must not both run one). Each test is named ``test_<launch>_...``.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import utils
from conftest import REPO
from utils.distributed import launch, read_rank_results

SCRIPTS = REPO / "05-distributed" / "scripts"
# CPU ranks, one thread each (two ranks share CI's two cores), no GPU even where one exists.
RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
# The smallest TinyGPT that has every part (embedding, a block, the tied head), as options.
TINY = {"vocab": 64, "seq-len": 8, "n-layer": 1, "n-head": 2, "n-embd": 16}
L = TINY["n-layer"]
ACCUM = 2   # fsdp_memory.py: micro-batches per step
K = 2       # dcp_checkpoint.py: steps before and after the checkpoint

# The notebooks' Exercise 3 answers, as their checks write them for the ranks to import.
ACCUMULATE_PY = """import torch.nn.functional as F


def accumulate(model, optimizer, micro_batches):
    optimizer.zero_grad(set_to_none=True)
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        loss = F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten()) / k
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total
"""
PLANS_PY = """from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def gathering_plan():
    return {"0": ColwiseParallel(output_layouts=Replicate()),
            "2": ColwiseParallel(output_layouts=Replicate())}


def pair_plan():
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}
"""
FSDP_CONFIGS = ["ddp", "zero1", "fsdp2", "fsdp2_keep", "fsdp2_bf16", "fsdp2_meta",
                "fsdp2_prefetch", "fsdp2_accum", "fsdp2_accum_fn"]


def tiny_args(**extra) -> list[str]:
    args = []
    for key, value in {**TINY, **extra}.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def launch_args(name: str, d: Path) -> tuple[str, list]:
    """(script, arguments) of the launch ``name``; it writes its ranks' results to d / name."""
    out = d / name
    if name == "ddp":
        return "ddp_train.py", [
            "--out", out, "--experiments", "check,bucket_view,comm,settings,accum,amp",
            "--backend", "gloo", "--threads", 1, "--check-batch", 2, "--accum", 2, "--batch", 1,
            "--steps", 1, "--warmup", 0, "--rounds", 1, "--bucket-caps", "0.001,100",
            "--profile-steps", 1, "--amp", "fp32,bf16", *tiny_args()]
    if name == "fsdp":
        (d / "accumulate.py").write_text(ACCUMULATE_PY)
        return "fsdp_memory.py", [
            "--out", out, "--configs", ",".join(FSDP_CONFIGS), "--backend", "gloo",
            "--batch", 2, "--steps", 2, "--time-steps", 1, "--accum", ACCUM,
            "--accum-fn", d / "accumulate.py", *tiny_args()]
    if name == "tp":
        (d / "plans.py").write_text(PLANS_PY)
        # 2d with --tp 1 on two ranks: FSDP2 across "dp" (2) over a TP-parallelised model on a
        # "tp" of 1 (the notebook's 2 x 2 mesh needs 4 ranks; its TP collectives run in `tp`)
        return "tp.py", [
            "--out", out, "--mode", "tp,plan,2d", "--plan-file", d / "plans.py", "--tp", 1,
            "--batch", 2, "--steps", 2, "--time-steps", 1, *tiny_args(**{"n-embd": 32})]
    if name == "dcp":
        # --time-rounds 1: a warm-up round and a timed one, so async_save runs three times
        # (once in `resume`, twice in `time`): torch 2.11's DefaultStager failed the second
        return "dcp_checkpoint.py", [
            "--out", out, "--ckpt", d / "ckpt", "--phases", "resume,time", "--backend", "gloo",
            "--batch", 2, "--steps", K, "--time-rounds", 1, "--time-steps", 1, *tiny_args()]
    if name == "allreduce":
        return "allreduce_bench.py", [
            "--out", out, "--backend", "gloo", "--min-bytes", 4096, "--max-bytes", 16384,
            "--factor", 4, "--reps", 1, "--budget-s", 0.001, "--max-iters", 2, "--debug-demo"]
    raise KeyError(name)


LAUNCHES = ("ddp", "fsdp", "tp", "dcp", "allreduce")


class Launches:
    """The launches of this file, started on first need (see the module docstring)."""

    def __init__(self, d: Path, wanted: list[str]) -> None:
        self.dir = d
        self.alone = "PYTEST_XDIST_WORKER" not in os.environ  # one pytest process runs all
        self.wanted = wanted  # the launches of the selected tests
        self._pool = ThreadPoolExecutor(max_workers=len(LAUNCHES))
        self._started: dict[str, Future] = {}
        self._lock = threading.Lock()

    def _run(self, name: str) -> list[dict]:
        script, args = launch_args(name, self.dir)
        res = launch(SCRIPTS / script, 2, [str(a) for a in args], timeout_s=300, echo=False,
                     env=RANK_ENV)
        assert res.returncode == 0
        return read_rank_results(self.dir / name, 2)

    def ranks(self, name: str) -> list[dict]:
        """The two ranks' results of launch ``name``, in rank order (raises if it failed)."""
        with self._lock:
            for n in [name, *(self.wanted if self.alone else [])]:
                if n not in self._started:
                    self._started[n] = self._pool.submit(self._run, n)
        return self._started[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    selected = {item.name.split("_")[1] for item in request.session.items
                if item.module is request.module}
    ls = Launches(tmp_path_factory.mktemp("module05_scripts"),
                  [n for n in LAUNCHES if n in selected])
    yield ls
    ls.close()


def test_ddp_train_every_experiment(launches):
    ranks = launches.ranks("ddp")
    out = launches.dir / "ddp"
    assert [r["backend"] for r in ranks] == ["gloo", "gloo"]
    for r in ranks:  # every rank ends each experiment with rank 0's gradients and weights
        assert r["check"]["grad_max_diff_across_ranks"] == 0.0
        assert r["check"]["param_max_diff_across_ranks"] == 0.0
        assert set(r["accum"]["grad_max_diff_across_ranks"].values()) == {0.0}
        assert set(r["amp"]["grad_max_diff_across_ranks"].values()) == {0.0}
    # DDP's gradients are one process's on the global batch (the notebook's reference check)
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPTS / "ddp_train.py")
    ddp_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_train)
    cfg = utils.GPTConfig(vocab_size=TINY["vocab"], block_size=TINY["seq-len"],
                          n_layer=L, n_head=TINY["n-head"], n_embd=TINY["n-embd"])
    model = utils.TinyGPT(cfg)
    model.load_state_dict(torch.load(out / "init.pt"))
    x, y = utils.lm_batch(cfg, 2 * 2, device="cpu", seed=ddp_train.CHECK_SEED)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    ddp_grads = torch.load(out / "grads_check.pt")
    for name, p in model.named_parameters():
        tol = utils.tolerance(torch.float32, "cpu", scale=p.grad)
        torch.testing.assert_close(ddp_grads[name], p.grad, **tol.kwargs())
    main = ranks[0]
    bv = main["bucket_view"]
    assert bv["default"]["grad_bytes_outside_buckets"] == bv["default"]["grad_bytes"] > 0
    assert bv["gradient_as_bucket_view"]["grad_bytes_outside_buckets"] == 0
    counts = main["settings"]["counts"]
    assert counts["bucket_cap_mb=100"]["allreduces"] == 1
    assert counts["bucket_cap_mb=0.001"]["allreduces"] > 1
    grad_bytes = main["settings"]["grad_mb"] * 2**20
    assert all(abs(c["bytes"] - grad_bytes) < 1 for c in counts.values()), counts
    acc = main["accum"]["counts"]
    assert acc["sync every micro-batch"]["allreduces"] == 2 * acc["no_sync"]["allreduces"]
    assert main["comm"]["profile"]["rows"], "the profile shows no all-reduce"
    assert (out / "grads_amp_bf16.pt").is_file()


def test_fsdp_memory_every_configuration_and_its_collectives(launches):
    ranks = launches.ranks("fsdp")
    r0 = ranks[0]
    cfg = {c: r0["configs"][c] for c in FSDP_CONFIGS}
    ref = torch.tensor(r0["reference_losses"])
    for c in FSDP_CONFIGS:  # every configuration trains the model one process trains
        for r in ranks:
            tol = utils.tolerance(torch.bfloat16 if c == "fsdp2_bf16" else torch.float32,
                                  "cpu", scale=ref)
            torch.testing.assert_close(torch.tensor(r["configs"][c]["losses"]), ref,
                                       **tol.kwargs(), msg=c)
    assert cfg["fsdp2_meta"]["losses"] == cfg["fsdp2"]["losses"]  # same weights, same shards
    # the collectives of one step, by kind and phase (utils.collectives.CollectiveCounter)
    assert cfg["ddp"]["comm_by_phase"]["backward"].get("all_reduce", 0) >= 1
    assert cfg["zero1"]["comm_by_phase"]["forward"]["broadcast"] == r0["n_param_tensors"]
    for c in ("fsdp2", "fsdp2_bf16", "fsdp2_meta", "fsdp2_prefetch"):
        assert cfg[c]["comm_counts"] == {"all_gather": 1 + 2 * L, "reduce_scatter": 1 + L}, c
        assert cfg[c]["comm_by_phase"]["backward"] == {"all_gather": L,
                                                       "reduce_scatter": 1 + L}, c
    assert cfg["fsdp2_keep"]["comm_counts"] == {"all_gather": 1 + L, "reduce_scatter": 1 + L}
    assert "all_gather" not in cfg["fsdp2_keep"]["comm_by_phase"]["backward"]
    assert cfg["fsdp2_accum"]["comm_counts"] == {"all_gather": ACCUM * (1 + 2 * L),
                                                 "reduce_scatter": ACCUM * (1 + L)}
    assert cfg["fsdp2_accum_fn"]["comm_counts"]["reduce_scatter"] == 1 + L
    # what a rank holds: FSDP2 about 1/N of DDP's state, and the whole model in full after
    # forward when it keeps the blocks
    total = {c: max(sum(r["configs"][c]["bytes"].values()) for r in ranks) for c in FSDP_CONFIGS}
    assert 0.85 <= total["fsdp2"] / (total["ddp"] / 2) <= 1.15, total
    assert cfg["fsdp2_keep"]["unsharded_after_forward_bytes"] == 4 * r0["n_params"]


def test_tp_every_mode_in_one_launch(launches):
    ranks = launches.ranks("tp")
    for r in ranks:
        tp = r["tp"]
        assert tp["backend"] == "gloo" and tp["world_size"] == 2
        for key in ("logits_tol_excess", "grad_tol_excess", "loss_tol_excess"):
            assert tp[key] <= 1, (key, tp[key])
        # one all-reduce per Colwise -> Rowwise pair in forward, one in backward, and where
        assert tp["comm_forward"] == {"all_reduce": 2 * L}
        assert tp["comm_backward"] == {"all_reduce": 2 * L}
        block0 = {k: v for k, v in tp["comm_by_module"].items() if "blocks.0." in k}
        assert block0 == {"forward blocks.0.attn.proj": {"all_reduce": 1},
                          "forward blocks.0.mlp.2": {"all_reduce": 1},
                          "backward blocks.0.mlp.0": {"all_reduce": 1},
                          "backward blocks.0.attn.qkv": {"all_reduce": 1}}, block0
        assert tp["dtensor"]["matmul"]["comm"] == {}
        assert tp["dtensor"]["matmul"]["partial_to_replicate_comm"] == {"all_reduce": 1}
        assert tp["dtensor"]["matmul"]["shard_to_replicate_comm"] == {"all_gather": 1}
        plan = r["plan"]
        assert plan["pair_plan"]["comm_forward"] == {"all_reduce": L}
        assert plan["gathering_plan"]["comm_forward"] == {"all_gather": 2 * L}
        assert max(plan[p]["logits_tol_excess"] for p in ("pair_plan", "gathering_plan")) <= 1
        two_d = r["2d"]
        assert two_d["mesh"]["dp"] == 2 and two_d["grad_tol_excess"] <= 1
        assert two_d["comm_step"] == {"all_gather": 1 + 2 * L, "reduce_scatter": 1 + L}


def test_dcp_checkpoint_resume_and_async_saves(launches, tmp_path):
    ranks = launches.ranks("dcp")
    ckpt = launches.dir / "ckpt"
    resume = ranks[0]["resume"]
    assert len(resume["losses"]) == 2 * K
    for r in ranks:  # resumed from the DCP checkpoint: the uninterrupted run, bit for bit
        assert r["resume"]["resumed_losses"] == resume["losses"][K:]
    assert (ckpt / "full_final.pt").is_file()
    # the asynchronous checkpoint holds the state of its step, like the old way's file
    dcp_to_torch_save(ckpt / "async_step", tmp_path / "async.pt")
    saved = torch.load(tmp_path / "async.pt", map_location="cpu")
    old = torch.load(ckpt / "full_step.pt", map_location="cpu")
    torch.testing.assert_close(saved["model"], old["model"], rtol=0, atol=0)
    torch.testing.assert_close(saved["optim"]["state"], old["optim"]["state"], rtol=0, atol=0)
    for r in ranks:
        rounds = r["time"]["rounds"]
        assert len(rounds) == 1 and rounds[0]["async_blocking_s"] >= 0


def test_allreduce_bench_checks_times_and_debug_demo(launches):
    ranks = launches.ranks("allreduce")
    for k, r in enumerate(ranks):
        assert r["rank"] == k and r["world_size"] == 2 and r["backend"] == "gloo"
        assert all(r["check"]["exact"].values()), r["check"]["exact"]
        assert max(r["check"]["random_err_over_bound"].values()) <= 1.0
        assert [p["bytes"] for p in r["sweep"]] == [4096, 16384]
        assert all(p["seconds"] > 0 for p in r["sweep"])
        assert "mismatch" in r["debug"]["error"].lower()
        assert r["debug"]["consistent_call_sum"] == 2
        assert r["env"]["OMP_NUM_THREADS"] == "1" and r["env"]["CUDA_VISIBLE_DEVICES"] == ""


FREED_PY = r"""
import argparse, gc, json, sys, weakref
sys.path.insert(0, sys.argv[1])
import torch
from torch.distributed.device_mesh import init_device_mesh
import utils.distributed as ud
import fsdp_memory as fm

gc.disable()  # only run_config's own collections may free anything
refs = {}
build = fm.build


def recording_build(name, *a, **k):
    model, inner, opt = build(name, *a, **k)
    refs[name] = [weakref.ref(p) for p in inner.parameters()]
    return model, inner, opt


fm.build = recording_build
args = argparse.Namespace(batch=2, steps=1, time_steps=1, lr=1e-3, seed=0, accum=2, accum_fn="",
                          vocab=64, seq_len=8, n_layer=1, n_head=2, n_embd=16)
cfg = fm.utils.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
alive = {}
with ud.worker(backend="gloo") as w:
    mesh = init_device_mesh("cpu", (1,))
    batches = fm.make_batches(cfg, args, w)
    ref = fm.reference(cfg, args, w, batches)
    for name in ("ddp", "fsdp2"):
        fm.run_config(name, cfg, args, w, mesh, batches, ref)
        alive[name] = sum(r() is not None for r in refs[name])
print(json.dumps(alive))
"""


def test_fsdp_memory_frees_each_configuration_before_the_next(tmp_path):
    """A configuration's model must be gone when run_config returns: on the H200 FSDP2's, held
    in reference cycles, outlived it and counted in the next configuration's CUDA peak (07's
    offload claim read 0.25 at smoke size). With the collector off, only run_config's own
    collection can free it, so the test does not depend on when Python collects."""
    import json
    import socket
    import subprocess
    import sys

    (tmp_path / "freed.py").write_text(FREED_PY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **RANK_ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(tmp_path / "freed.py"), str(SCRIPTS)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    alive = json.loads(r.stdout.strip().splitlines()[-1])
    assert alive == {"ddp": 0, "fsdp2": 0}, f"parameters still alive after run_config: {alive}"


def test_ddp_bucket_view_readings_wait_for_memory_to_settle(monkeypatch):
    """settled_allocated (CUDA only) reads until two readings agree: memory freed a moment after
    the last run ends must not fall inside the next run's window (bounded, never a hang)."""
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPTS / "ddp_train.py")
    ddp_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_train)
    readings = iter([300, 200, 100, 100, 50])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(readings))
    monkeypatch.setattr(ddp_train.time, "sleep", lambda s: None)
    assert ddp_train.settled_allocated("cuda:0") == 100, "the first value read twice in a row"
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(falling))
    falling = iter(range(1000, 0, -1))
    assert ddp_train.settled_allocated("cuda:0", tries=5) == 996, "gives up after `tries`"
