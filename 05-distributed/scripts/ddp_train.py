"""DistributedDataParallel worker for 05-distributed/01_ddp.ipynb and 06_ddp_in_practice.ipynb.

Start it with torchrun, one process per GPU (NCCL) or several CPU processes (gloo):

    torchrun --standalone --nproc-per-node=2 ddp_train.py --out /tmp/ddp --experiments check

Every rank trains a copy of ``utils.TinyGPT`` on its shard of a global batch.
``--experiments`` picks what the launch does (a comma-separated list, run in the order given):

* ``check``    one DDP step on the check batch; rank 0 saves the initial weights and
               its gradients so the notebook can recompute them on one process.
* ``bucket_view`` where the gradients live with and without ``gradient_as_bucket_view``:
               the bytes of gradients outside DDP's all-reduce buckets (counted from
               the tensors, any device) and, on GPUs, the allocated memory.
* ``comm``     step time with and without the gradient all-reduce (``no_sync``), for
               each per-rank batch in ``--comm-batches``; a profile of rank 0.
* ``settings`` step time and all-reduce count for DDP constructor options
               (``gradient_as_bucket_view``, ``static_graph``, ``bucket_cap_mb``).
* ``accum``    gradient accumulation over ``--accum`` micro-batches, with and
               without ``no_sync``: all-reduces counted, gradients saved, steps timed.
* ``amp``      one step and a timing per ``--amp`` dtype (fp32, bf16 autocast,
               fp16 autocast + GradScaler, which needs CUDA).

Each rank writes ``rank<k>.json`` (utils.distributed.write_rank_result); rank 0
also writes ``*.pt`` files with gradients for the notebook's reference check, which
``reference_grads`` computes in the notebook's own process, without DDP.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import utils
import utils.distributed as ud
import utils.profiling

EXPERIMENTS = ("check", "bucket_view", "comm", "settings", "accum", "amp")
CHECK_SEED, TIME_SEED = 1, 2  # seeds of the check batch and of the timed batches
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CAP_MB = 25  # DDP's bucket_cap_mb when none is given


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for rank<k>.json and the .pt files")
    p.add_argument("--experiments", default="check",
                   help=f"comma-separated, from: {', '.join(EXPERIMENTS)}")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL when every local rank has a GPU, else gloo on CPU")
    p.add_argument("--timeout-s", type=float, default=120,
                   help="a collective that waits longer than this raises")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0: keep)")
    ud.add_gpt_args(p)  # --vocab, --seq-len, --n-layer, --n-head, --n-embd
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights")
    # batches and steps
    p.add_argument("--check-batch", type=int, default=4,
                   help="sequences per rank in the correctness checks (divisible by --accum)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank in timed steps")
    p.add_argument("--comm-batches", default="",
                   help="comma-separated per-rank batches for `comm` (default: --batch)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step in `accum`")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--rounds", type=int, default=2,
                   help="timed steps are split into this many rounds, variants interleaved")
    p.add_argument("--bucket-caps", default="1,100",
                   help="comma-separated bucket_cap_mb values for `settings`")
    p.add_argument("--amp", default="fp32,bf16", help="comma-separated, from fp32, bf16, fp16")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps profiled on rank 0 in `comm` (0: no profile)")
    a = p.parse_args(argv)
    a.experiments = [e for e in a.experiments.split(",") if e]
    bad = [e for e in a.experiments if e not in EXPERIMENTS]
    if bad:
        p.error(f"unknown experiment(s) {bad}; choose from {EXPERIMENTS}")
    a.amp = [d for d in a.amp.split(",") if d]
    if any(d not in AMP_DTYPES for d in a.amp):
        p.error(f"--amp takes {list(AMP_DTYPES)}, got {a.amp}")
    a.bucket_caps = [float(c) for c in a.bucket_caps.split(",") if c]
    a.comm_batches = [int(b) for b in a.comm_batches.split(",") if b] or [a.batch]
    if a.check_batch % a.accum:
        p.error(f"--check-batch ({a.check_batch}) must be divisible by --accum ({a.accum})")
    return a


# ----------------------------------------------------------------------------- helpers

def shard_of_global_batch(cfg, per_rank: int, w: ud.WorkerInfo, seed: int):
    """This rank's slice of one global batch (what a DistributedSampler would give it)."""
    x, y = utils.lm_batch(cfg, per_rank * w.world_size, device="cpu", seed=seed)
    rows = slice(w.rank * per_rank, (w.rank + 1) * per_rank)
    return x[rows].to(w.device), y[rows].to(w.device)


def build_ddp(cfg, w: ud.WorkerInfo, seed: int, **ddp_options):
    """The same initial model on every rank, wrapped in DDP, with its optimizer."""
    torch.manual_seed(seed)
    model = utils.TinyGPT(cfg).to(w.device)
    device_ids = [w.device.index] if w.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, **ddp_options)  # broadcasts rank 0's weights
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    return ddp, opt


def loss_of(model, x, y) -> torch.Tensor:
    """The loss utils.train_step computes (mean cross-entropy over all tokens)."""
    return F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())


def reference_grads(cfg, per_rank: int, world: int, device: torch.device, init_state: dict):
    """What the ``check`` step's DDP gradients must equal, computed in one process without
    DDP or a process group: the backward of ``utils.train_step``'s loss (``loss_of``) from
    the same initial weights on the whole global batch (every rank's shard, before it is
    cut). The optimizer step that follows does not change the gradients, so none is taken
    (and the notebook does not pay for importing what an optimizer imports). Returns
    ``(loss, {name: fp32 gradient on the CPU})``."""
    model = utils.TinyGPT(cfg).to(device)
    model.load_state_dict(init_state)
    x, y = utils.lm_batch(cfg, world * per_rank, device=device, seed=CHECK_SEED)
    loss = loss_of(model, x, y)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    del model, x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the memory back: a later launch's ranks share the GPU
    return loss.item(), grads


class CommCounter:
    """State of ``counting_allreduce_hook``: all-reduce calls and bytes sent."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0


def counting_allreduce_hook(state, bucket):
    """DDP's default all-reduce of one gradient bucket, counted on the way.

    (No type annotations: DDP checks a hook's annotations against dist.GradBucket,
    and ``from __future__ import annotations`` would turn them into strings.)
    """
    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)  # None: the default process group


def interleaved_times(variants: dict, a: argparse.Namespace, w: ud.WorkerInfo) -> dict:
    """Warm each variant up, then time them in rounds (A B C, A B C, ...) so that a
    machine that gets busier or quieter during the run affects every variant alike."""
    for step in variants.values():
        for _ in range(a.warmup):
            step()
    times = {k: [] for k in variants}
    per_round = max(1, math.ceil(a.steps / a.rounds))
    for _ in range(a.rounds):
        for name, step in variants.items():
            w.barrier()
            times[name] += ud.step_times_ms(step, per_round, w.device)
    return times


def max_diff_across_ranks(tensors, w: ud.WorkerInfo) -> float:
    """Largest |this rank's value - rank 0's value| over all tensors and ranks."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def grads_cpu(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.module.named_parameters()}


# ----------------------------------------------------------------------------- experiments

def run_check(a, cfg, w, out):
    """One DDP step on this rank's shard; gradients and weights compared across ranks."""
    ddp, opt = build_ddp(cfg, w, a.seed)
    if w.is_main:  # the weights every rank starts from (DDP broadcast rank 0's)
        torch.save({k: v.cpu() for k, v in ddp.module.state_dict().items()}, f"{out}/init.pt")
    x, y = shard_of_global_batch(cfg, a.check_batch, w, seed=CHECK_SEED)
    loss = utils.train_step(ddp, opt, x, y)  # forward, backward (+ all-reduce), AdamW step
    params = list(ddp.module.parameters())
    res = {
        "local_loss": loss.item(),
        "grad_max_diff_across_ranks": max_diff_across_ranks([p.grad for p in params], w),
        "param_max_diff_across_ranks": max_diff_across_ranks(params, w),
        "n_params": sum(p.numel() for p in params),
    }
    if w.is_main:
        torch.save(grads_cpu(ddp), f"{out}/grads_check.pt")
    return res


class BucketRecorder:
    """State of ``recording_allreduce_hook``: the storages of the buckets DDP reduced."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}  # data_ptr -> bytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives inside one of the recorded bucket buffers."""
        return t.untyped_storage().data_ptr() in self.storages


def recording_allreduce_hook(state, bucket):
    """DDP's default all-reduce of one bucket, noting which storage the bucket is."""
    buf = bucket.buffer()
    state.storages[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
    return default_hooks.allreduce_hook(None, bucket)


def settled_allocated(device, tries=20, pause_s=0.05):
    """``torch.cuda.memory_allocated`` once two readings 50 ms apart agree (at most 1 s).

    A reading taken right after a run can still count tensors that are freed a moment later,
    outside this thread (for instance those a finished collective still references); such a
    release inside the next run's window would count against that run.
    """
    now = None
    for _ in range(tries):
        gc.collect()
        torch.cuda.synchronize(device)
        prev, now = now, torch.cuda.memory_allocated(device)
        if now == prev:
            break
        time.sleep(pause_s)
    return now


def run_bucket_view(a, cfg, w, out):
    """Gradient bytes outside DDP's buckets (and allocated GPU memory) after a backward,
    with and without ``gradient_as_bucket_view``.

    DDP all-reduces flat *buckets*. By default each parameter's ``.grad`` is a tensor of
    its own: backward writes it, DDP copies it into the bucket, reduces the bucket and
    copies the result back, so the gradients exist twice. With the option, ``.grad`` is a
    view into the bucket. We look at one backward after two warm steps (DDP rebuilds its
    buckets after the first), stopped before the optimizer step, when every gradient
    exists. The model, batch and Adam state are the same in both runs, so the allocated
    memory differs by the gradients' second copy, if the option works.
    """
    cuda = w.device.type == "cuda"
    x, y = shard_of_global_batch(cfg, a.batch, w, seed=TIME_SEED)
    res = {}
    for name, opts in (("default", {}),
                       ("gradient_as_bucket_view", {"gradient_as_bucket_view": True})):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            base = settled_allocated(w.device)
        ddp, opt = build_ddp(cfg, w, a.seed, **opts)
        rec = BucketRecorder()
        ddp.register_comm_hook(rec, recording_allreduce_hook)
        for _ in range(2):
            utils.train_step(ddp, opt, x, y)
        rec.storages.clear()                      # keep only the buckets of this backward
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, x, y).backward()
        utils.synchronize(w.device)
        grads = [p.grad for p in ddp.parameters()]
        res[name] = {
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "grad_bytes_outside_buckets": sum(g.numel() * g.element_size() for g in grads
                                              if not rec.holds(g)),
            "bucket_bytes": sum(rec.storages.values()),
            "buckets": len(rec.storages),
            "cuda_allocated_bytes": settled_allocated(w.device) - base if cuda else None,
            # where the window started: if the saving is not 1x the gradient bytes, the bases
            # say whether the second run started lower
            "cuda_base_bytes": base if cuda else None,
        }
        del ddp, opt, grads
    return res


def run_comm(a, cfg, w, out):
    """Step time with the gradient all-reduce (a normal DDP step) and without it
    (the same step inside ``no_sync``) for each per-rank batch size."""
    res = {}
    for b in a.comm_batches:
        ddp, opt = build_ddp(cfg, w, a.seed)
        x, y = shard_of_global_batch(cfg, b, w, seed=TIME_SEED)

        def with_allreduce():
            utils.train_step(ddp, opt, x, y)

        def without_allreduce():
            with ddp.no_sync():  # backward skips the all-reduce: local gradients only
                utils.train_step(ddp, opt, x, y)

        res[str(b)] = interleaved_times({"ddp": with_allreduce, "no_sync": without_allreduce},
                                        a, w)
    if a.profile_steps:  # what the profiler sees on rank 0, at --batch
        ddp, opt = build_ddp(cfg, w, a.seed)
        x, y = shard_of_global_batch(cfg, a.batch, w, seed=TIME_SEED)
        for _ in range(a.warmup):
            utils.train_step(ddp, opt, x, y)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if w.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        # utils.profiling.new_profiler: a torch.profiler.profile that keeps its events after
        # its one cycle (without that, torch 2.11 warns that it "clears events at the end of
        # each cycle", a line that reads like a fault)
        ctx = (utils.profiling.new_profiler(acts) if w.is_main else contextlib.nullcontext())
        w.barrier()
        with ctx as prof:
            for _ in range(a.profile_steps):
                utils.train_step(ddp, opt, x, y)
            utils.synchronize(w.device)
        if w.is_main:
            res["profile"] = profile_summary(prof, a.profile_steps, w)
    return res


def profile_summary(prof, steps: int, w) -> dict:
    """Communication rows of a profile, per step: name, calls, CPU and device time (ms)."""
    on_gpu = w.device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        name = e.key.lower()
        if any(k in name for k in ("allreduce", "all_reduce", "nccl", "gloo")):
            dev_us = 0.0
            if on_gpu:  # device_time_total is the newer name of cuda_time_total
                dev_us = (e.device_time_total if hasattr(e, "device_time_total")
                          else e.cuda_time_total)
            rows.append({"name": e.key, "calls_per_step": e.count / steps,
                         "cpu_ms_per_step": e.cpu_time_total / 1e3 / steps,
                         "device_ms_per_step": dev_us / 1e3 / steps})
    return {"rows": rows}


def ddp_variants(a) -> dict[str, dict]:
    """Name -> DDP constructor options, for `settings`."""
    v = {
        "default": {},
        "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True},
        "bucket_view + static_graph": {"gradient_as_bucket_view": True, "static_graph": True},
    }
    for cap in a.bucket_caps:
        v[f"bucket_cap_mb={cap:g}"] = {"bucket_cap_mb": cap}
    return v


def attach_counter(ddp) -> CommCounter:
    """Route ``ddp``'s gradient all-reduces through ``counting_allreduce_hook``."""
    c = CommCounter()
    ddp.register_comm_hook(c, counting_allreduce_hook)
    return c


def count_step(c: CommCounter, step) -> dict:
    """All-reduces and bytes of one call of ``step``."""
    c.calls = c.bytes = 0
    step()
    return {"allreduces": c.calls, "bytes": c.bytes}


def run_settings(a, cfg, w, out):
    """Step time of each DDP option set, and how many all-reduces one step makes."""
    x, y = shard_of_global_batch(cfg, a.batch, w, seed=TIME_SEED)
    counts, steps = {}, {}
    for name, opts in ddp_variants(a).items():
        # Count with a hook on a separate copy: a Python hook is a little slower
        # than DDP's built-in all-reduce, so the timed copies run without one.
        # DDP rebuilds its buckets (in the order gradients arrived) after the first
        # step(s), so we count the third step.
        counted, opt = build_ddp(cfg, w, a.seed, **opts)
        c = attach_counter(counted)
        step = (lambda m=counted, o=opt: utils.train_step(m, o, x, y))
        for _ in range(2):
            step()
        counts[name] = count_step(c, step)
        del counted, opt, step
        ddp, opt = build_ddp(cfg, w, a.seed, **opts)
        steps[name] = (lambda m=ddp, o=opt: utils.train_step(m, o, x, y))
    grad_tensor_mb = [p.numel() * p.element_size() / 2**20 for p in ddp.parameters()]
    times = interleaved_times(steps, a, w)
    return {"grad_mb": sum(grad_tensor_mb), "variants": list(steps), "counts": counts,
            "times_ms": times, "grad_tensor_mb": grad_tensor_mb,
            "cap_mb": {n: opts.get("bucket_cap_mb", DEFAULT_CAP_MB)
                       for n, opts in ddp_variants(a).items()}}


def bucket_count_rows(settings: dict) -> list[list]:
    """The table of ``settings``' all-reduce counts: per setting, the calls and MiB of one
    step, its bucket cap, the most calls that cap allows and the gradient tensors larger
    than the cap (header first).

    A bucket holds whole tensors and closes once it holds at least the cap, so every bucket
    but the last holds at least the cap: at most ``ceil(size / cap)`` buckets, plus one for
    DDP's smaller first bucket (1 MiB under the default cap). A tensor larger than the cap
    closes a bucket on its own, with more than the cap in it: then there are fewer.
    """
    size, tensors = settings["grad_mb"], settings["grad_tensor_mb"]
    rows = [["setting", "all-reduces/step", "MiB reduced/step", "cap MiB", "at most",
             "tensors > cap"]]
    for n in settings["variants"]:
        cap, c = settings["cap_mb"][n], settings["counts"][n]
        rows.append([n, c["allreduces"], c["bytes"] / 2**20, cap, math.ceil(size / cap) + 1,
                     sum(t > cap for t in tensors)])
    return rows


def accumulate(ddp, opt, x, y, k: int, skip_sync: bool):
    """One optimizer step over ``k`` micro-batches; with ``skip_sync`` all but the
    last backward run inside ``no_sync`` and only the last one all-reduces."""
    opt.zero_grad(set_to_none=True)
    for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
        last = i == k - 1
        ctx = ddp.no_sync() if (skip_sync and not last) else contextlib.nullcontext()
        with ctx:
            (loss_of(ddp, xm, ym) / k).backward()  # / k: the mean over the whole batch
    opt.step()


def run_accum(a, cfg, w, out):
    """Gradient accumulation with and without no_sync: gradients, all-reduces, time."""
    x, y = shard_of_global_batch(cfg, a.check_batch, w, seed=CHECK_SEED)  # the `check` batch
    res = {"counts_first_step": {}, "counts": {}, "grad_max_diff_across_ranks": {}}
    steps = {}
    for name, skip in (("no_sync", True), ("sync every micro-batch", False)):
        ddp, opt = build_ddp(cfg, w, a.seed)
        c = attach_counter(ddp)  # both variants carry the hook, so their times compare
        step = (lambda m=ddp, o=opt, s=skip: accumulate(m, o, x, y, a.accum, s))
        # The first step starts from the initial weights: its gradients are checked.
        res["counts_first_step"][name] = count_step(c, step)
        res["grad_max_diff_across_ranks"][name] = max_diff_across_ranks(
            [p.grad for p in ddp.parameters()], w)
        if w.is_main:
            torch.save(grads_cpu(ddp), f"{out}/grads_accum_{'nosync' if skip else 'sync'}.pt")
        step()  # DDP rebuilds its buckets after the first step(s): count the third
        res["counts"][name] = count_step(c, step)
        steps[name] = step
    res["times_ms"] = interleaved_times(steps, a, w)
    return res


def amp_step(ddp, opt, x, y, dtype, scaler):
    return utils.train_step(ddp, opt, x, y, amp_dtype=dtype, scaler=scaler)


def run_amp(a, cfg, w, out):
    """fp32, bf16 autocast and fp16 autocast + GradScaler under DDP."""
    if "fp16" in a.amp and w.device.type != "cuda":
        raise RuntimeError("fp16 + GradScaler is a CUDA recipe: drop fp16 from --amp on CPU")
    x_chk, y_chk = shard_of_global_batch(cfg, a.check_batch, w, seed=CHECK_SEED)
    x, y = shard_of_global_batch(cfg, a.batch, w, seed=TIME_SEED)
    res = {"skipped_steps": {}, "grad_max_diff_across_ranks": {}}
    steps = {}
    for name in a.amp:
        dtype = AMP_DTYPES[name]
        ddp, opt = build_ddp(cfg, w, a.seed)
        scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None
        # First step on the check batch: its gradients go to the notebook. With fp16
        # the scaler may find inf/NaN gradients, skip the update and lower its scale;
        # the weights are then unchanged, so we retry on the same batch.
        skipped = 0
        for _ in range(10):
            scale = scaler.get_scale() if scaler else None
            amp_step(ddp, opt, x_chk, y_chk, dtype, scaler)
            if scaler is None or scaler.get_scale() >= scale:
                break
            skipped += 1
        res["skipped_steps"][name] = skipped
        res["grad_max_diff_across_ranks"][name] = max_diff_across_ranks(
            [p.grad for p in ddp.parameters()], w)
        if w.is_main and name != "fp32":  # (the scaler unscaled fp16 gradients in its step)
            torch.save(grads_cpu(ddp), f"{out}/grads_amp_{name}.pt")
        steps[name] = (lambda m=ddp, o=opt, d=dtype, s=scaler: amp_step(m, o, x, y, d, s))
    res["times_ms"] = interleaved_times(steps, a, w)
    return res


RUNNERS = {"check": run_check, "bucket_view": run_bucket_view, "comm": run_comm, "settings": run_settings,
           "accum": run_accum, "amp": run_amp}


def main(argv=None) -> None:
    a = parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.threads:
        torch.set_num_threads(a.threads)
    backend = None if a.backend == "auto" else a.backend
    # fp32 means fp32 here: the gradients are checked against fp32 on one process, so TF32
    # matmuls (off by default in torch; an image or a site config may turn them on) stay off.
    utils.set_tf32(False)
    with ud.worker(backend=backend, timeout_s=a.timeout_s) as w:
        cfg = ud.gpt_config(a)
        result = {"backend": w.backend, "world_size": w.world_size, "device": str(w.device),
                  "threads": torch.get_num_threads(), "experiment_s": {}}
        for name in a.experiments:
            t0 = time.perf_counter()
            result[name] = RUNNERS[name](a, cfg, w, a.out)
            result["experiment_s"][name] = time.perf_counter() - t0
            if w.is_main:
                print(f"[rank 0] {name}: done in {result['experiment_s'][name]:.1f} s", flush=True)
        ud.write_rank_result(a.out, w.rank, result)
        # Tear down cleanly: free the DDP models (their reducers hold the process group and
        # gloo's pending work) while Python is fully alive, then let every rank arrive
        # before the group is destroyed. Without this, a gloo rank can abort at exit.
        gc.collect()
        w.barrier()


if __name__ == "__main__":
    main()
