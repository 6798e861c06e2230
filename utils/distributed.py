"""Run ``torch.distributed`` workers from a notebook, and set one up inside a worker.

Two halves:

* The notebook side, :func:`launch`, starts a real worker script under
  ``torchrun`` (``python -m torch.distributed.run``) as a subprocess, with the
  semantics of ``subprocess.run(..., check=True)``: a rank that fails makes the
  launch fail, with the ranks' last output in the error message. A launch that
  runs past its time limit is killed, torchrun and every rank, instead of
  hanging the notebook.
* The worker side, :func:`worker`, is a context manager for the script: it
  reads the ``torchrun`` environment, picks NCCL on GPUs and gloo on CPUs, says
  clearly when more GPUs are asked for than the node has, initialises the
  process group with a timeout (so a lost peer raises instead of hanging) and
  always tears it down. :func:`write_rank_result` and :func:`read_rank_results`
  carry each rank's numbers back to the notebook as JSON files.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = [
    "DistributedLaunchError",
    "LaunchResult",
    "WorkerInfo",
    "launch",
    "torchrun_command",
    "worker",
    "write_rank_result",
    "read_rank_results",
    "step_times_ms",
]

_BACKENDS = ("gloo", "nccl")


class DistributedLaunchError(RuntimeError):
    """A ``torchrun`` launch failed or timed out; the message holds the ranks' output."""


@dataclass(frozen=True)
class LaunchResult:
    """What a finished :func:`launch` returns."""

    command: tuple[str, ...]
    returncode: int
    output: str
    wall_s: float


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_AGENT_LINE = re.compile(r"^[IWE]\d{4} .*torch/distributed/elastic")


def _ranks_output(output: str, lines: int = 40) -> str:
    """The ranks' own output, without torchrun's traceback of itself after a failure."""
    all_lines = output.rstrip().splitlines()
    cut = next((i for i, line in enumerate(all_lines) if "failed (exitcode:" in line),
               len(all_lines))
    ranks = [line for line in all_lines[:cut] if not _AGENT_LINE.match(line)]
    failed = re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)",
                        output)
    summary = ", ".join(f"rank {r} exited with {c}" for r, c in failed)
    return (f"[{summary}]\n" if summary else "") + "\n".join(ranks[-lines:])


def torchrun_command(script: str | os.PathLike, nproc: int = 2,
                     args: Sequence[str] = ()) -> list[str]:
    """The ``torchrun`` command line :func:`launch` runs (single node, free port).

    ``python -m torch.distributed.run`` is ``torchrun`` run by this interpreter,
    so the workers see the same environment as the notebook.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *map(str, args)]


def launch(script: str | os.PathLike, nproc: int = 2, args: Sequence[str] = (), *,
           timeout_s: float = 300, env: dict[str, str] | None = None,
           cwd: str | os.PathLike | None = None, echo: bool = True) -> LaunchResult:
    """Run ``script`` on ``nproc`` local processes with ``torchrun`` and wait for it.

    Args:
        script: path of the worker script (a real file: spawned processes
            cannot import code that exists only in a notebook cell).
        nproc: processes on this node (one per GPU with NCCL; CPU processes with gloo).
        args: extra command-line arguments for the script.
        timeout_s: kill the whole launch after this many seconds.
        env: extra environment variables for the workers.
        cwd: working directory (default: the script's folder).
        echo: print the command before and the workers' output after.

    Raises:
        FileNotFoundError: the script does not exist.
        DistributedLaunchError: a rank failed (non-zero exit) or the launch timed out.
    """
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"worker script {str(path)!r} does not exist")
    path = path.resolve()  # the ranks run in the script's folder (cwd below)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    cmd = torchrun_command(path, nproc, args)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # torchrun sets OMP_NUM_THREADS=1 with a warning when it is unset; set it
    # ourselves so CPU ranks do not oversubscribe the cores, without the noise.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    shown = " ".join(shlex.quote(c) for c in ["torchrun", *cmd[3:]])
    if echo:
        print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    # This is subprocess.run(cmd, check=True, timeout=...) written out with Popen for
    # one reason: on a timeout, run() kills only torchrun and leaves its ranks
    # running (torchrun starts each in a session of its own); we stop them all.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=full_env, cwd=str(cwd or path.parent)) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_launch(proc)
            try:
                output, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                output = ""
            raise DistributedLaunchError(
                f"`{shown}` did not finish within {timeout_s:g} s and was killed (a rank may be "
                f"waiting for a peer that died or never started). Last output:\n{_tail(output)}"
            ) from None
        except BaseException:  # e.g. the notebook's interrupt button: leave no ranks behind
            _stop_launch(proc)
            raise
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise DistributedLaunchError(
            f"`{shown}` failed with exit code {proc.returncode}: at least one rank raised. "
            f"The ranks' last output:\n{_ranks_output(output)}"
        )
    if echo and output.strip():
        print(output.rstrip())
    return LaunchResult(tuple(cmd), proc.returncode, output, wall)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop_launch(proc: subprocess.Popen) -> None:
    """Stop torchrun and every rank it started.

    torchrun starts each rank in a session of its own, so killing torchrun's
    process group is not enough. We ask torchrun to stop (SIGTERM, which it
    forwards to its ranks), give it a few seconds, then kill whatever is left.
    """
    ranks = _descendants(proc.pid)
    try:
        proc.terminate()
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *ranks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


@dataclass(frozen=True)
class WorkerInfo:
    """Who this process is in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"environment variable {name} is not set: start this script with torchrun "
            "(e.g. `torchrun --standalone --nproc-per-node=2 script.py`), not with python"
        )
    return int(value)


@contextmanager
def worker(backend: str | None = None, timeout_s: float = 120) -> Iterator[WorkerInfo]:
    """Initialise this ``torchrun`` process's group; always destroy it on exit.

    Args:
        backend: ``"nccl"`` (one GPU per process) or ``"gloo"`` (CPU). ``None``
            picks NCCL when this node has a GPU for every local process, else gloo.
        timeout_s: how long a collective may wait for its peers before raising.

    Free the objects that hold communication state (a DDP model, a
    ``ZeroRedundancyOptimizer``) inside the ``with`` block: one that outlives
    the destroyed process group can abort the process at exit with gloo.

    Raises:
        RuntimeError: not started by torchrun, an unknown backend, or NCCL asked
            for with fewer GPUs than processes on this node.
    """
    import torch.distributed as dist

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if n_gpus >= local_world and n_gpus > 0 else "gloo"
    if backend not in _BACKENDS:
        raise RuntimeError(f"unknown backend {backend!r}: use one of {', '.join(_BACKENDS)}")
    if backend == "nccl" and n_gpus < local_world:
        raise RuntimeError(
            f"NCCL needs one GPU per process: {local_world} processes were started on this "
            f"node but it has {n_gpus} GPU(s). Start at most {n_gpus} per node "
            "(torchrun --nproc-per-node), or use the gloo backend on CPU."
        )
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))
    try:
        yield WorkerInfo(rank, world, local_rank, local_world, backend, device)
        # On success only (a barrier after a failure would wait for a dead peer):
        # free what still holds communication state, and let every rank arrive
        # before any tears down. Without this, gloo ranks occasionally abort at exit.
        gc.collect()
        if backend == "nccl":
            dist.barrier(device_ids=[local_rank])
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def step_times_ms(step: Callable[[], Any], n: int, device: torch.device, *,
                  barrier: bool = False) -> list[float]:
    """Wall time in ms of ``n`` synchronised calls of ``step()``, one value per call.

    Inside ranks, use this rather than :func:`utils.benchmark`: that picks its
    repeat count from its own timings, which differ between ranks, and a rank
    that runs one more collective than its peers waits forever. Here every rank
    runs exactly ``n`` steps, with the device synchronised around each.

    Args:
        step: one step (it may hold collectives).
        n: how many steps to time (>= 0).
        device: the rank's device, synchronised before and after each step.
        barrier: start every step on all ranks together (needs a process group).
    """
    import torch.distributed as dist

    from .env import synchronize

    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    times = []
    for _ in range(n):
        if barrier:
            dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def write_rank_result(out_dir: str | os.PathLike, rank: int, data: dict[str, Any]) -> Path:
    """Write one rank's results as ``out_dir/rank<k>.json`` (JSON-serialisable values)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))  # keeps the writer's key order
    tmp.replace(path)
    return path


def read_rank_results(out_dir: str | os.PathLike, world_size: int) -> list[dict[str, Any]]:
    """Read back what :func:`write_rank_result` wrote, ordered by rank.

    Raises:
        FileNotFoundError: a rank wrote nothing (it failed before writing).
    """
    out = Path(out_dir)
    missing = [r for r in range(world_size) if not (out / f"rank{r}.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"no results from rank(s) {missing} in {out}: did the launch fail before they wrote?"
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
