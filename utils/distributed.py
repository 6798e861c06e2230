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

Helpers the worker scripts share: :func:`add_gpt_args` / :func:`gpt_config` (the
TinyGPT size options every script takes), :func:`step_times_ms` (a fixed-count
step timer), and for checking an all-reduce at any rank count,
:func:`exactly_summable` (data whose sums are exact in any order) and
:func:`sum_error_bound` (how far a floating-point sum may be from the exact one).
:func:`single_process_group` sets up a process group of one rank inside a
notebook, for exercises that count collectives without a launch. On the notebook side,
:func:`slowest_rank_timing` turns the ranks' per-step times into one
:class:`~utils.Timing`, and :func:`assert_grads_close` checks the gradients the ranks
saved against a reference computed in one process.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import inspect
import json
import math
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from .models import GPTConfig
    from .timing import Timing

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
    "add_gpt_args",
    "gpt_config",
    "gpt_args",
    "show_script",
    "exactly_summable",
    "sum_error_bound",
    "single_process_group",
    "slowest_rank_timing",
    "assert_grads_close",
    "worst_rank_value",
    "step_stats",
    "compare_step_times",
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
           cwd: str | os.PathLike | None = None,
           echo: bool | Callable[[str], Any] = True) -> LaunchResult:
    """Run ``script`` on ``nproc`` local processes with ``torchrun`` and wait for it.

    The ranks' output (stdout and stderr together) is shown line by line *while
    they run*, so a long launch is visibly alive, and kept for the error message.

    Args:
        script: path of the worker script (a real file: spawned processes
            cannot import code that exists only in a notebook cell).
        nproc: processes on this node (one per GPU with NCCL; CPU processes with gloo).
        args: extra command-line arguments for the script.
        timeout_s: kill the whole launch after this many seconds.
        env: extra environment variables for the workers.
        cwd: working directory (default: the script's folder).
        echo: ``True`` prints the command, then every output line as it arrives;
            ``False`` prints nothing; a function is called with each line (without
            its newline) as it arrives, and nothing is printed.

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
    if not (isinstance(echo, bool) or callable(echo)):
        raise TypeError(f"echo must be True, False or a function of one line, got {echo!r}")
    cmd = torchrun_command(path, nproc, args)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # torchrun sets OMP_NUM_THREADS=1 with a warning when it is unset; set it
    # ourselves so CPU ranks do not oversubscribe the cores, without the noise.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    shown = " ".join(shlex.quote(c) for c in ["torchrun", *cmd[3:]])
    if echo is True:
        print(f"$ {shown}", flush=True)
    on_line: Callable[[str], Any] | None
    on_line = (lambda line: print(line, flush=True)) if echo is True else (echo or None)
    lines: list[str] = []
    start = time.perf_counter()
    deadline = start + timeout_s
    # This is subprocess.run(cmd, check=True, timeout=...) written out with Popen for
    # two reasons: the output is shown while the ranks run, not only at the end; and on
    # a timeout, run() kills only torchrun and leaves its ranks running (torchrun
    # starts each in a session of its own); we stop them all. A thread reads the pipe
    # (a read blocks) and hands each line to this thread, which prints it: output
    # printed from the notebook's own thread lands in the running cell.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env=full_env, cwd=str(cwd or path.parent)) as proc:
        pipe: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, pipe), daemon=True)
        reader.start()
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                try:
                    line = pipe.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    continue
                if line is None:  # end of output: the launch is finishing
                    break
                lines.append(line)
                if on_line is not None:
                    on_line(line)
            proc.wait(timeout=max(deadline - time.perf_counter(), 1.0))
        except subprocess.TimeoutExpired:
            _stop_launch(proc)
            reader.join(timeout=10)
            lines.extend(_drain(pipe))
            raise DistributedLaunchError(
                f"`{shown}` did not finish within {timeout_s:g} s and was killed (a rank may be "
                f"waiting for a peer that died or never started). "
                f"Last output:\n{_tail(chr(10).join(lines))}"
            ) from None
        except BaseException:  # e.g. the notebook's interrupt button: leave no ranks behind
            _stop_launch(proc)
            raise
    wall = time.perf_counter() - start
    output = "\n".join(lines)
    if proc.returncode != 0:
        raise DistributedLaunchError(
            f"`{shown}` failed with exit code {proc.returncode}: at least one rank raised. "
            f"The ranks' last output:\n{_ranks_output(output)}"
        )
    return LaunchResult(tuple(cmd), proc.returncode, output, wall)


def _read_lines(stream, pipe: "queue.Queue[str | None]") -> None:
    """Put every line of ``stream`` (without its newline) on ``pipe``, then ``None``."""
    try:
        for line in stream:
            pipe.put(line.rstrip("\n"))
    except (OSError, ValueError):  # the pipe was closed under us (the launch was stopped)
        pass
    finally:
        pipe.put(None)


def _drain(pipe: "queue.Queue[str | None]") -> list[str]:
    out = []
    while True:
        try:
            line = pipe.get_nowait()
        except queue.Empty:
            return out
        if line is not None:
            out.append(line)


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

    def barrier(self, group: Any = None) -> None:
        """Wait until every rank (of ``group``) gets here; NCCL is told this rank's GPU."""
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(group=group, device_ids=[self.device.index])
        else:
            dist.barrier(group=group)


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
    dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s),
                            **_device_id_kwargs(backend, device))
    info = WorkerInfo(rank, world, local_rank, local_world, backend, device)
    try:
        yield info
        # On success only (a barrier after a failure would wait for a dead peer):
        # free what still holds communication state, and let every rank arrive
        # before any tears down. Without this, gloo ranks occasionally abort at exit.
        gc.collect()
        info.barrier()
        if backend == "gloo":
            time.sleep(_GLOO_SETTLE_S)  # after the barrier: see _GLOO_SETTLE_S
    finally:
        dist.destroy_process_group()


def _device_id_kwargs(backend: str, device: torch.device) -> dict[str, Any]:
    """``device_id=`` for ``init_process_group`` with NCCL, where this torch accepts it.

    Binding the group to the rank's GPU makes NCCL create its communicator at once
    (a wrong GPU or a broken NCCL fails here, not at the first collective), lets
    sub-groups be split from it cheaply, and tells collectives which GPU is meant.
    gloo ranks pass nothing: the argument is about accelerators.
    """
    import torch.distributed as dist

    if backend != "nccl":
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device}


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


def add_gpt_args(parser: argparse.ArgumentParser, *, vocab: int = 512, seq_len: int = 64,
                 n_layer: int = 2, n_head: int = 4, n_embd: int = 128) -> None:
    """Add the :class:`~utils.TinyGPT` size options every worker script takes.

    ``--vocab``, ``--seq-len``, ``--n-layer``, ``--n-head`` and ``--n-embd``, with
    the given defaults; :func:`gpt_config` turns the parsed options into a config.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"expected an argparse.ArgumentParser, got {type(parser).__name__}")
    g = parser.add_argument_group("model (utils.TinyGPT)")
    g.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")
    g.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    g.add_argument("--n-layer", type=int, default=n_layer, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=n_head, help="attention heads")
    g.add_argument("--n-embd", type=int, default=n_embd, help="model width")


def gpt_config(args: argparse.Namespace, **overrides: int) -> "GPTConfig":
    """The :class:`~utils.GPTConfig` of options added by :func:`add_gpt_args`.

    ``overrides`` replace single sizes (``n_embd=256``), e.g. for a width sweep.
    """
    from .models import GPTConfig

    sizes = {"vocab_size": args.vocab, "block_size": args.seq_len, "n_layer": args.n_layer,
             "n_head": args.n_head, "n_embd": args.n_embd}
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise ValueError(f"unknown GPTConfig size(s) {sorted(unknown)}: use {sorted(sizes)}")
    return GPTConfig(**{**sizes, **overrides})


def gpt_args(cfg: "GPTConfig") -> list[str]:
    """The options of :func:`add_gpt_args` that give a worker script ``cfg``'s sizes.

    The inverse of :func:`gpt_config`, for :func:`launch`'s ``args``:
    ``["--vocab", "512", "--seq-len", "64", "--n-layer", "2", "--n-head", "4", "--n-embd", "128"]``.

    Raises:
        TypeError: ``cfg`` is not a :class:`~utils.GPTConfig`.
        ValueError: ``cfg`` has dropout, which the worker scripts take no option for.
    """
    from .models import GPTConfig

    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"expected a GPTConfig, got {type(cfg).__name__}")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: the worker scripts have no dropout option")
    return ["--vocab", str(cfg.vocab_size), "--seq-len", str(cfg.block_size),
            "--n-layer", str(cfg.n_layer), "--n-head", str(cfg.n_head),
            "--n-embd", str(cfg.n_embd)]


def show_script(script: str | os.PathLike, *names: str) -> None:
    """Print the top-level functions (or classes) ``names`` of a worker script, in the file's
    order, read from the file without importing it: the notebook shows the code its ranks run.

    Raises:
        ValueError: no names given, or a name the script does not define at its top level.
    """
    import ast

    source = Path(script).read_text()
    defined = {node.name: node for node in ast.parse(source).body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    if not names:
        raise ValueError(f"name what to show: {Path(script).name} defines {sorted(defined)}")
    missing = [name for name in names if name not in defined]
    if missing:
        raise ValueError(f"{Path(script).name} defines no top-level {missing}; it defines "
                         f"{sorted(defined)}")
    lines = source.splitlines()
    for node in defined.values():
        if node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            print("\n".join(lines[start - 1:node.end_lineno]), end="\n\n")


def exactly_summable(numel: int, seed: int, world_size: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values whose sum over ``world_size`` such tensors is exact in any order.

    Each value is a random integer ``k`` times ``2**-8``, with ``|k|`` small enough
    that every partial sum of up to ``world_size`` values is a multiple of ``2**-8``
    that ``dtype`` represents exactly. Then every summation order (a ring, a tree,
    one after the other) gives the same, exact result, so an all-reduce of such data
    can be checked for equality at any number of ranks, not within a tolerance.

    Args:
        numel: number of values.
        seed: seed of this tensor (e.g. ``1000 + rank``; the same seed, the same values).
        world_size: how many such tensors will be summed (>= 1).
        dtype: a floating-point dtype (float32, bfloat16, float16, float64).

    Raises:
        ValueError: bad sizes, or more ranks than ``dtype`` can sum exactly this way.
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    significand_bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # 24 for float32
    # |sum of world_size values| <= world_size * k_max must stay below 2**(bits - 1).
    k_bits = significand_bits - 1 - math.ceil(math.log2(world_size))
    if k_bits < 1:
        raise ValueError(f"{dtype} cannot sum {world_size} random values exactly "
                         f"(at most {2 ** (significand_bits - 2)} ranks)")
    k_max = 2 ** k_bits
    k = torch.randint(-k_max, k_max + 1, (numel,), generator=torch.Generator().manual_seed(seed))
    return (k.to(torch.float64) * 2.0 ** -8).to(dtype)


def sum_error_bound(abs_sum: torch.Tensor, n_terms: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Largest possible |floating-point sum - exact sum| of ``n_terms`` terms.

    For any order of the additions (sequential, ring, tree), a sum of ``n`` terms
    in ``dtype`` makes at most ``n - 1`` roundings on the way to each result, so

        |fl(sum) - sum| <= gamma(n - 1) * sum(|x_i|),  gamma(k) = k u / (1 - k u)

    with ``u`` the unit roundoff (``2**-24`` for float32). The bound grows with
    ``n``: a fixed tolerance that is right for 2 ranks fails at a few hundred.

    Args:
        abs_sum: ``sum(|x_i|)`` element by element (compute it in float64).
        n_terms: how many terms were summed (the world size of an all-reduce).
        dtype: the dtype the sum was computed in.
    """
    if not isinstance(n_terms, int) or n_terms < 1:
        raise ValueError(f"n_terms must be a positive int, got {n_terms!r}")
    u = torch.finfo(dtype).eps / 2
    k = n_terms - 1
    if k * u >= 1:
        raise ValueError(f"{n_terms} terms are too many for a rounding bound in {dtype}")
    return abs_sum * (k * u / (1 - k * u))


#: How long :func:`single_process_group` and :func:`worker` wait, with the GIL released, after
#: their last barrier: time for gloo's worker threads to drop the work they just finished.
_GLOO_SETTLE_S = 0.01
#: Why: with torch 2.11, a gloo group destroyed while a DDP model still holds it is freed when
#: that model is. The process then holds the GIL while it joins gloo's worker threads, and a
#: worker still dropping a finished collective (an all-gather of Python-owned tensors) waits for
#: the GIL: neither moves, and the process hangs. (A loop of DDP in a one-rank group, then an
#: all-gather, hung within a few hundred rounds with torch 2.11, not with 2.15;
#: tests/test_distributed.py.) A barrier waits for the collectives before it; the pause, with
#: the GIL released, lets the workers let go of them.


@contextmanager
def single_process_group(backend: str = "gloo", timeout_s: float = 60) -> Iterator[None]:
    """A process group of one rank in this process (no torchrun), destroyed on exit.

    DDP and ``dist.all_reduce`` work in it unchanged (with nothing to add), so a
    notebook can run and count collectives without a launch. (FSDP2 and tensor
    parallelism skip their collectives on a mesh of one rank: use a launch there.)

    Raises:
        RuntimeError: this process already has a default process group.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already has a process group: destroy it first "
                           "(torch.distributed.destroy_process_group())")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=_dt.timedelta(seconds=timeout_s))
    try:
        yield
        dist.barrier()  # on success only: after an error it could raise over that error
    finally:
        time.sleep(_GLOO_SETTLE_S)  # see _GLOO_SETTLE_S
        dist.destroy_process_group()


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


def slowest_rank_timing(ranks: Sequence[dict[str, Any]], path: Sequence[str],
                        device: str) -> "Timing":
    """A :class:`~utils.Timing` of the per-step times that every rank stored at ``path`` in
    its results (:func:`read_rank_results`), each step's time being its *slowest* rank's: in
    a step with a collective the other ranks wait for that one. Labelled ``path[-1]``.

    Example: ``slowest_rank_timing(ranks, ("comm", "4", "ddp"), "2 x cpu (gloo)")`` reads
    ``ranks[r]["comm"]["4"]["ddp"]``, a list of step times in ms, from every rank ``r``.

    Raises:
        ValueError: no ranks or an empty ``path``, or the ranks timed different numbers of steps.
        KeyError: a rank's results have nothing at ``path``.
    """
    from .timing import Timing

    if not ranks or not path:
        raise ValueError("give the ranks' results and the path of their step times")
    per_rank = []
    for result in ranks:
        for key in path:
            result = result[key]
        per_rank.append([float(t) for t in result])
    if len({len(times) for times in per_rank}) != 1:
        raise ValueError(f"the ranks timed different numbers of steps at {list(path)}: "
                         f"{[len(times) for times in per_rank]}")
    slowest = [max(step) for step in zip(*per_rank)]
    return Timing.from_times(str(path[-1]), slowest, 1, str(device),
                             "per-step wall clock, slowest rank")


def assert_grads_close(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                       what: str, device: str | torch.device,
                       dtype: torch.dtype = torch.float32) -> float:
    """Assert that every named gradient is within :func:`utils.tolerance` for ``dtype`` on
    ``device`` of the expected one, the tolerance scaled to that expected tensor (the sums
    of a distributed step run in another order than one process's).

    Returns:
        The worst ``max|g - e| / max|e|`` over the tensors (fp32's epsilon is 1.2e-7): how
        close they are, in a unit that reads the same for every tensor.

    Raises:
        AssertionError: the names differ, or a gradient is outside its tolerance (the message
            names ``what`` and the parameter).
    """
    from .precision import tolerance

    if grads.keys() != expected.keys():
        raise AssertionError(
            f"{what}: parameter names differ: {sorted(grads.keys() ^ expected.keys())}")
    for name, e in expected.items():
        tol = tolerance(dtype, device, scale=e)
        g = grads[name]
        if (g.shape, g.dtype, g.device) == (e.shape, e.dtype, e.device) and tol.excess(g, e) < 1:
            continue  # within it: torch.testing's first call imports seconds' worth of modules
        torch.testing.assert_close(g, e, **tol.kwargs(),  # the failure, with torch's message
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")
    return max(((grads[n] - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
               for n, e in expected.items())


def worst_rank_value(ranks: Sequence[dict[str, Any]], config: str, key: str) -> float:
    """The largest value over the ranks of one per-rank number, ``ranks[r]["configs"][config]
    [key]`` (the layout module 05's FSDP worker writes): a peak or an error is only as good as
    its worst rank."""
    if not ranks:
        raise ValueError("no ranks' results")
    return max(r["configs"][config][key] for r in ranks)


def step_stats(ranks: Sequence[dict[str, Any]], config: str) -> tuple[float, float]:
    """``(median step ms, IQR / median)`` of the slowest rank (by median) at ``config``, from
    each rank's ``["configs"][config]["step_ms_all"]``: a synchronous step costs its slowest
    rank's time.

    Raises:
        ValueError: no ranks, or a rank with fewer than two step times (no spread).
    """
    if not ranks:
        raise ValueError("no ranks' results")
    times = max((r["configs"][config]["step_ms_all"] for r in ranks), key=statistics.median)
    if len(times) < 2:
        raise ValueError(f"{config}: need at least two step times for a spread, got {len(times)}")
    q1, _, q3 = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    return median, (q3 - q1) / median


def compare_step_times(ranks: Sequence[dict[str, Any]], a: str, b: str) -> tuple[float, str]:
    """The step time of ``b`` over ``a`` (:func:`step_stats`), and a sentence on whether the
    difference is larger than the step-to-step spread (the larger IQR / median of the two)."""
    (ta, na), (tb, nb) = step_stats(ranks, a), step_stats(ranks, b)
    ratio, spread = tb / ta, max(na, nb)
    if abs(ratio - 1) <= spread:
        verdict = (f"within the step-to-step spread ({spread:.0%} IQR): "
                   "no measurable difference on this machine")
    else:
        verdict = (f"{'faster' if ratio < 1 else 'slower'} by more than the step-to-step spread "
                   f"({spread:.0%} IQR)")
    return ratio, verdict
