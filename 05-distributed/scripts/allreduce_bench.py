"""All-reduce worker for 05-distributed/05_scaling_out.ipynb: check it, time it, show the env.

Start it with torchrun, one process per GPU (NCCL) or several CPU processes (gloo):

    torchrun --standalone --nproc-per-node=2 allreduce_bench.py --out /tmp/ar

On a cluster the same script measures the links between nodes (see ../cluster/).
One launch does, in order:

1. ``env``: the launch-related environment variables this rank sees (what torchrun
   set, thread and GPU visibility, NCCL and torch.distributed debugging switches).
2. ``check``: all-reduce (SUM) results against sums computed here: bit for bit for
   exactly summable random values, and within the rounding bound of an N-term sum
   for normal random values (a bound that grows with N), at awkward sizes too.
3. ``sweep``: the time of one all-reduce of float32 buffers over a sweep of sizes,
   the way nccl-tests times it: back-to-back calls between two synchronisations, the
   best of a few repetitions (and their median), the slowest rank's value.
4. ``debug``: with ``--debug-demo``, a collective whose shapes differ across ranks,
   run on a group created under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` semantics, so the
   notebook can show the error that debug level gives (every rank catches it).

Each rank writes ``rank<k>.json`` (utils.distributed.write_rank_result).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

import utils
import utils.distributed as ud

# Variable names (and prefixes) worth knowing when a launch misbehaves.
ENV_NAMES = (
    # set by torchrun for every rank
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    # resources the rank may use
    "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    # torch.distributed debugging
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL",
)
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "SLURM_JOB_ID", "SLURM_NODEID",
                "SLURM_PROCID")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for rank<k>.json")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL when every local rank has a GPU, else gloo on CPU")
    p.add_argument("--timeout-s", type=float, default=120,
                   help="a collective that waits longer than this raises")
    p.add_argument("--min-bytes", type=int, default=2**12, help="smallest message, bytes")
    p.add_argument("--max-bytes", type=int, default=2**24, help="largest message, bytes")
    p.add_argument("--factor", type=int, default=4, help="size step of the sweep (x factor)")
    p.add_argument("--budget-s", type=float, default=0.05,
                   help="time of one repetition of back-to-back calls, per size")
    p.add_argument("--reps", type=int, default=3, help="repetitions per size (the best is kept)")
    p.add_argument("--max-iters", type=int, default=200, help="most calls per repetition")
    p.add_argument("--debug-demo", action="store_true",
                   help="also show what TORCH_DISTRIBUTED_DEBUG=DETAIL reports on a mismatch")
    a = p.parse_args(argv)
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes or a.factor < 2:
        p.error("need 4 <= --min-bytes <= --max-bytes and --factor >= 2")
    return a


def sweep_sizes(a) -> list[int]:
    """Message sizes in bytes: min, min*factor, ... up to max (float32: multiples of 4)."""
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s // 4 * 4)
        s *= a.factor
    return sizes


def env_subset() -> dict[str, str]:
    """The launch-related environment variables this process sees."""
    seen = {k: os.environ[k] for k in ENV_NAMES if k in os.environ}
    seen.update({k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)})
    return dict(sorted(seen.items()))


def check_allreduce(w: ud.WorkerInfo) -> dict:
    """All-reduce (SUM) results against sums computed on this rank, at any world size.

    1. Exactly summable random values (``ud.exactly_summable``): every order of the
       additions gives the same, exact sum, so the result must equal it bit for bit,
       with 2 ranks or with thousands.
    2. Normal random values: the result may differ from the exact sum (computed here in
       float64) by rounding, and the rounding allowed grows with the number of terms
       (``ud.sum_error_bound``). A fixed tolerance, right for 2 ranks, would fail at a
       few hundred; this bound holds at any world size.

    Rank r's tensor comes from seed 1000 + r, so every rank can rebuild all the
    contributions. Sizes include ones that do not split evenly into N chunks.
    """
    n = w.world_size
    res = {"exact": {}, "random_err_over_bound": {}, "random_max_abs_err": {}}
    for numel in (1, 7, 1000, 2**16 + 3):
        t = ud.exactly_summable(numel, 1000 + w.rank, n).to(w.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        exact = torch.zeros(numel, dtype=torch.float64)
        for r in range(n):
            exact += ud.exactly_summable(numel, 1000 + r, n).double()
        res["exact"][str(numel)] = bool((t.cpu().double() == exact).all().item())
    for numel in (5, 4099, 2**18):
        t = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + w.rank))
        t = t.to(w.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        exact = torch.zeros(numel, dtype=torch.float64)
        abs_sum = torch.zeros(numel, dtype=torch.float64)
        for r in range(n):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + r)).double()
            exact += x
            abs_sum += x.abs()
        err = (t.cpu().double() - exact).abs()
        # the float64 reference rounds too, by a bound 2**29 times smaller
        bound = (ud.sum_error_bound(abs_sum, n, torch.float32)
                 + ud.sum_error_bound(abs_sum, n, torch.float64))
        res["random_err_over_bound"][str(numel)] = (err / bound.clamp_min(1e-300)).max().item()
        res["random_max_abs_err"][str(numel)] = err.max().item()
    return res


def time_allreduce(nbytes: int, a, w: ud.WorkerInfo) -> dict:
    """Seconds per all-reduce of ``nbytes`` of float32 (best of ``--reps``, slowest rank)."""
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=w.device)  # zeros: no inf/denormals

    def timed(iters: int) -> float:
        w.barrier()
        utils.synchronize(w.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        utils.synchronize(w.device)  # NCCL returns at once; wait for the GPU to finish
        return (time.perf_counter() - t0) / iters

    # Three single calls: the first pays for first use of this size (buffers, NCCL
    # channels); the faster of the other two estimates a call, robust to one hiccup.
    # Every rank must make the same number of calls, so they agree on the slowest estimate.
    single = [timed(1) for _ in range(3)]
    est = torch.tensor([min(single[1:])], dtype=torch.float64, device=w.device)
    dist.all_reduce(est, op=dist.ReduceOp.MAX)
    iters = int(max(1, min(a.max_iters, a.budget_s / max(est.item(), 1e-9))))
    reps = [timed(iters) for _ in range(a.reps)]
    # The best repetition is the one least disturbed by other processes (timeit's advice);
    # the median shows how much disturbance there was. A collective is as slow as its
    # slowest rank, so both are maxima over the ranks.
    stats = torch.tensor([min(reps), statistics.median(reps)], dtype=torch.float64,
                         device=w.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"bytes": nbytes, "iters": iters, "rank_reps_s": reps,
            "seconds": stats[0].item(), "median_seconds": stats[1].item()}


def debug_demo(w: ud.WorkerInfo) -> dict:
    """A shape mismatch across ranks, on a group built at debug level DETAIL.

    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in the environment sets this level before the
    default group exists, so every group is checked. Here we set it from code for one
    new group only, so that the timed collectives above ran without the extra checks.
    """
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        group = dist.new_group(backend=w.backend)  # wrapped: checks every collective
    finally:
        dist.set_debug_level(before)
    t = torch.ones(4 + w.rank, device=w.device)   # rank 0: 4 numbers, rank 1: 5, ...
    try:
        dist.all_reduce(t, group=group)
        message = ""
    except RuntimeError as exc:  # DETAIL compares shapes across ranks before the real call
        message = str(exc)
    ok = torch.ones(3, device=w.device)  # the group still works for a consistent call
    dist.all_reduce(ok, group=group)
    dist.destroy_process_group(group)
    return {"error": message, "consistent_call_sum": ok[0].item()}


def main(argv=None) -> None:
    a = parse_args(argv)
    backend = None if a.backend == "auto" else a.backend
    with ud.worker(backend=backend, timeout_s=a.timeout_s) as w:
        result = {"rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank,
                  "backend": w.backend, "device": str(w.device),
                  "hostname": socket.gethostname(), "pid": os.getpid(),
                  "torch_threads": torch.get_num_threads(), "env": env_subset()}
        result["check"] = check_allreduce(w)
        sweep = []
        for nbytes in sweep_sizes(a):
            sweep.append(time_allreduce(nbytes, a, w))
            if w.is_main:
                print(f"[rank 0] {nbytes:>12,} B: {sweep[-1]['seconds'] * 1e6:10.1f} us "
                      f"({sweep[-1]['iters']} calls x {a.reps})", flush=True)
        result["sweep"] = sweep
        if a.debug_demo:
            result["debug"] = debug_demo(w)
        ud.write_rank_result(a.out, w.rank, result)
        w.barrier()  # nobody tears the group down while a peer still talks to it


if __name__ == "__main__":
    main()
