"""Distributed checkpoints (torch.distributed.checkpoint, DCP) of an FSDP2-sharded TinyGPT.

Started by ``05-distributed/04_distributed_checkpoints.ipynb`` (the ``resume`` phase) and
``08_resharding_and_async_save.ipynb`` (both phases) through ``utils.distributed.launch``
(torchrun; gloo on CPU processes, NCCL with one GPU per process). Two phases, chosen with
``--phases``:

``resume``
    Train ``--steps`` steps, then checkpoint the model and the Adam state at that step three
    ways: ``dcp.save`` (every rank writes its own shards), ``dcp.async_save`` (the same, copied
    to CPU memory and written by background threads while training goes on; the next
    optimizer step waits for the copy) and the old way (gather the full state dict to rank 0
    and ``torch.save`` it). Train ``--steps`` more steps: the *uninterrupted* losses; their
    final state is saved the old way too, for the notebook to compare with.
    Then build a fresh model, load the DCP checkpoint into it and train the same steps again:
    the *resumed* losses. Notebook 08 loads the same checkpoint into one process, too.

``time``
    How long each way of checkpointing blocks the training loop: ``--time-rounds`` rounds
    (plus one warm-up) of ``--time-steps`` steps, a ``dcp.save``, the old way, a
    ``dcp.async_save`` and ``--time-steps`` steps while it is written in the background
    (for ``async_save``, the blocking time is the call plus the first optimizer step's
    wait for the staging copy).

Every rank writes what it measured to ``--out/rank<k>.json``; the checkpoints go under
``--ckpt``. Run by hand:
``torchrun --standalone --nproc-per-node=2 dcp_checkpoint.py --out /tmp/r --ckpt /tmp/c``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import utils
import utils.distributed as ud
# The FSDP2 recipe of notebook 02 (fully_shard per block, then the root), its seeded model
# and its helpers, reused rather than copied (this folder is on sys.path for its scripts).
from fsdp_memory import (FSDP_IMPORT, add_model_args, apply_fsdp2, global_mean, local,
                         model_config, new_model, rank_slice)

try:  # torch >= 2.9: a stager that copies the state in a background thread
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
except ImportError:  # older torch: async_save stages before it returns
    DefaultStager = StagingOptions = None

PHASES = ("resume", "time")


# --- the checkpoint code the notebook shows ----------------------------------------------
def training_state(model, optimizer):
    """What a checkpoint holds: the model's and the optimizer's state dicts.

    ``get_state_dict`` returns both keyed by parameter names (FQNs) and, for an FSDP2
    model, holding DTensors: each rank's entries are views of the shards it owns, so this
    copies nothing and gathers nothing.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(model, optimizer, path, pg):
    """Every rank writes its own shards to ``path``; rank 0 also writes ``.metadata``."""
    dcp.save(training_state(model, optimizer), checkpoint_id=path, process_group=pg)


def make_stager(device):
    """How ``async_save`` copies the state to CPU memory: in a background thread, so that
    the copy overlaps the next forward and backward (into pinned memory, with non-blocking
    copies, on GPUs). ``None`` where this torch has no ``DefaultStager`` (before 2.9): then
    ``async_save`` copies before it returns.

    One stager per checkpoint, closed once that checkpoint is written: in torch 2.11 a
    ``DefaultStager`` stages only once (its staging ends by emptying the table it copies
    with, so a second checkpoint through it fails in the stager with
    ``KeyError: <class 'type'>``); newer torch can reuse one and keep its buffers."""
    if DefaultStager is None:
        return None
    on_gpu = device.type == "cuda"
    wanted = {"use_pinned_memory": on_gpu, "use_shared_memory": False,
              "use_async_staging": True, "use_non_blocking_copy": on_gpu}
    fields = getattr(StagingOptions, "__dataclass_fields__", {})
    if "use_async_staging" not in fields:  # a torch whose options we do not know: default stager
        return None
    return DefaultStager(StagingOptions(**{k: v for k, v in wanted.items() if k in fields}))


def async_save(model, optimizer, path, pg, stager=None):
    """Start a checkpoint and return two futures, ``(staging, upload)``.

    ``staging`` is done once this rank's state is copied (staged) to CPU memory. Until
    then the copy is still reading the live weights and Adam state, so the next
    ``optimizer.step()``, which changes them in place, must wait for it (``train_step``
    below does). ``upload`` is done once the files are written: wait for it before the
    next checkpoint and before the program exits.
    """
    extra = {"async_stager": stager} if stager is not None else {}
    response = dcp.async_save(training_state(model, optimizer), checkpoint_id=path,
                              process_group=pg, **extra)
    if hasattr(response, "staging_completion"):  # AsyncSaveResponse: staging in the background
        return response.staging_completion, response.upload_completion
    staged = Future()  # a plain Future: the copy was made before async_save returned
    staged.set_result(None)
    return staged, response


def train_step(model, optimizer, x, y, staging=None):
    """``utils.train_step``, except that the optimizer step first waits for ``staging``
    (a pending checkpoint's copy of the weights). Returns (loss, seconds waited)."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())
    loss.backward()                       # forward and backward only read the weights
    t0 = time.perf_counter()
    if staging is not None:
        staging.result()                  # the copy must be complete before the weights change
    waited = time.perf_counter() - t0
    optimizer.step()
    return loss.detach(), waited


def load(model, optimizer, path, pg):
    """Load ``path`` into an already built (and sharded) model and optimizer, in place.

    The state dict to load INTO says which pieces this rank wants (its shards); DCP reads
    them from whichever files hold them, whatever the sharding was at save time.
    """
    state = training_state(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=pg)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def save_the_old_way(model, optimizer, path, rank):
    """Gather the full state dict to rank 0 (on its CPU) and ``torch.save`` one file there."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # other ranks get {}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    return {"model": model_sd, "optim": optim_sd}


# --- helpers --------------------------------------------------------------------------------
def iter_tensors(state):
    """Every tensor in a nested state dict (dicts, lists and tuples)."""
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif torch.is_tensor(obj):
            yield obj


def written_bytes(state):
    """Bytes of the tensors in this rank's state dict, entry by entry (a tied weight counts
    under each of its names, as DCP writes it): DTensors as the local shard, and the
    plain (replicated) tensors such as Adam's ``step`` counters separately."""
    shards = plain = 0
    for t in iter_tensors(state):
        if isinstance(t, DTensor):
            shards += t.to_local().numel() * t.element_size()
        else:
            plain += t.numel() * t.element_size()
    return {"shards": shards, "plain": plain}


def held_bytes(state):
    """Bytes of memory a state dict holds on this rank (each storage once)."""
    return utils.tensor_bytes(local(t) for t in iter_tensors(state))


def global_batch(cfg, args, world, step):
    """The same global batch on every rank (and in the notebook); rank k trains on its rows."""
    return utils.lm_batch(cfg, args.batch * world, args.seq_len, device="cpu",
                          seed=args.seed + step)


def build(cfg, args, w, mesh):
    model = apply_fsdp2(new_model(cfg, args, w.device), mesh)
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def train(model, opt, cfg, args, w, steps, staging=None):
    """Train on the global batches of ``steps``; the losses averaged over ranks. The first
    optimizer step waits for ``staging`` (a checkpoint started just before)."""
    losses = []
    for i, s in enumerate(steps):
        loss, _ = train_step(model, opt, *rank_slice(global_batch(cfg, args, w.world_size, s),
                                                     w, args), staging if i == 0 else None)
        losses.append(global_mean(loss, w))
    return losses


def timed(fn, device):
    """(fn(), seconds), with the device synchronised before and after."""
    utils.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    utils.synchronize(device)
    return out, time.perf_counter() - t0


class CudaPeak:
    """Extra CUDA memory allocated at the peak of a block (None on CPU ranks)."""

    def __init__(self, device):
        self.device, self.extra_bytes = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.extra_bytes = torch.cuda.max_memory_allocated(self.device) - self.before


# --- phases ---------------------------------------------------------------------------------
def phase_resume(cfg, args, w, mesh, pg, ckpt):
    """Checkpoint at step k three ways, train on (uninterrupted), then resume from DCP."""
    k = args.steps
    model, opt = build(cfg, args, w, mesh)
    losses = train(model, opt, cfg, args, w, range(k))

    save(model, opt, ckpt / "dcp_step", pg)
    written = written_bytes(training_state(model, opt))
    full = save_the_old_way(model, opt, ckpt / "full_step.pt", w.rank)
    old_held = held_bytes(full)
    del full
    dist.barrier(pg)  # nobody goes on before rank 0's file is written

    # The same step once more, asynchronously; training goes on while it is copied and
    # written, and the first optimizer step waits for the copy.
    stager = make_stager(w.device)
    staging, upload = async_save(model, opt, ckpt / "async_step", pg, stager)
    staging_pending = not staging.done()  # still copying when async_save returned?
    losses += train(model, opt, cfg, args, w, range(k, 2 * k), staging=staging)
    async_pending = not upload.done()  # still being written when training got here?
    upload.result()
    background = stager is not None
    if background:
        stager.close()
    # The uninterrupted run's state after its 2k steps, for the notebook's resumed runs to
    # be compared with (the old way: one full file on rank 0).
    save_the_old_way(model, opt, ckpt / "full_final.pt", w.rank)
    dist.barrier(pg)
    del model, opt
    gc.collect()

    # Resume: a fresh model (other random weights), the checkpoint loaded into it.
    torch.manual_seed(args.seed + 1)
    model, opt = build(cfg, args, w, mesh)
    load(model, opt, ckpt / "dcp_step", pg)
    resumed = train(model, opt, cfg, args, w, range(k, 2 * k))
    del model, opt
    gc.collect()
    return {"losses": losses, "resumed_losses": resumed, "written": written,
            "old_held_bytes": old_held, "async_pending_after_steps": async_pending,
            "staging_pending_at_return": staging_pending,
            "background_staging": background}


def phase_time(cfg, args, w, mesh, pg, ckpt):
    """Blocking time of each way to checkpoint, and step times while async_save writes."""
    model, opt = build(cfg, args, w, mesh)
    x, y = rank_slice(global_batch(cfg, args, w.world_size, 0), w, args)

    def step_ms(staging=None):
        """(ms of one training step, ms of it spent waiting for ``staging``)."""
        (_, waited), seconds = timed(lambda: train_step(model, opt, x, y, staging), w.device)
        return seconds * 1e3, waited * 1e3

    rounds = []
    for r in range(args.time_rounds + 1):  # round 0 is a warm-up
        idle = [step_ms()[0] for _ in range(args.time_steps)]
        dist.barrier(pg)
        with CudaPeak(w.device) as sync_peak:
            _, sync_s = timed(lambda: save(model, opt, ckpt / f"sync_{r}", pg), w.device)
        dist.barrier(pg)
        with CudaPeak(w.device) as old_peak:
            _, old_s = timed(lambda: save_the_old_way(model, opt, ckpt / f"full_{r}.pt",
                                                      w.rank), w.device)
        dist.barrier(pg)
        stager = make_stager(w.device)  # a new one for every checkpoint (make_stager says why)
        with CudaPeak(w.device) as async_peak:
            (staging, upload), async_s = timed(
                lambda: async_save(model, opt, ckpt / f"async_{r}", pg, stager), w.device)
        busy, staging_wait_ms = [], 0.0
        for i in range(args.time_steps):
            ms, waited = step_ms(staging if i == 0 else None)
            busy.append(ms)
            staging_wait_ms += waited
        _, wait_s = timed(upload.result, w.device)
        if stager is not None:
            stager.close()
        rounds.append({"sync_s": sync_s, "old_s": old_s, "async_s": async_s,
                       "staging_wait_s": staging_wait_ms / 1e3,
                       "async_blocking_s": async_s + staging_wait_ms / 1e3,
                       "wait_s": wait_s, "idle_step_ms": idle, "busy_step_ms": busy,
                       "cuda_extra_bytes": {"sync": sync_peak.extra_bytes,
                                            "old": old_peak.extra_bytes,
                                            "async": async_peak.extra_bytes}})
        dist.barrier(pg)
        if w.is_main:  # keep only the latest checkpoints, as a training run would
            for old in (ckpt / f"sync_{r}", ckpt / f"async_{r}", ckpt / f"full_{r}.pt"):
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    background = stager is not None  # (the last round's: every round makes the same kind)
    del model, opt
    gc.collect()
    return {"rounds": rounds[1:], "warmup": rounds[0], "background_staging": background}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank<k>.json")
    p.add_argument("--ckpt", required=True, help="folder for the checkpoints")
    p.add_argument("--phases", default="resume,time", help=f"comma-separated, from {PHASES}")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3, help="steps before and after the checkpoint")
    p.add_argument("--time-rounds", type=int, default=3, help="timed checkpoints of each kind")
    p.add_argument("--time-steps", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300)
    args = p.parse_args()
    phases = [x for x in args.phases.split(",") if x]
    if not phases or set(phases) - set(PHASES):
        raise SystemExit(f"--phases must name some of {PHASES}, got {args.phases!r}")

    utils.set_tf32(False)  # fp32 means fp32: the resumed losses are compared with fp32 runs
    cfg = model_config(args)
    ckpt = Path(args.ckpt)
    backend = None if args.backend == "auto" else args.backend
    with ud.worker(backend=backend, timeout_s=args.timeout_s) as w:
        mesh = init_device_mesh(w.device.type, (w.world_size,))
        # DCP coordinates the ranks (who writes what, the .metadata) with collectives on this
        # group. async_save needs a group with a CPU backend, because its background thread
        # must not issue collectives on the training's NCCL stream; a gloo group serves
        # both kinds of save (with gloo ranks it is simply a second gloo group).
        pg = dist.new_group(backend="gloo")
        out = {"rank": w.rank, "world_size": w.world_size, "backend": w.backend,
               "device": str(w.device), "torch": torch.__version__, "fsdp_import": FSDP_IMPORT,
               "cuda_name": torch.cuda.get_device_name(w.device) if w.device.type == "cuda"
               else None}
        if "resume" in phases:
            out["resume"] = phase_resume(cfg, args, w, mesh, pg, ckpt)
        if "time" in phases:
            out["time"] = phase_time(cfg, args, w, mesh, pg, ckpt)
        ud.write_rank_result(args.out, w.rank, out)
        if w.is_main:
            print(f"[rank 0] phases {phases} done on {w.world_size} {w.backend} rank(s)",
                  flush=True)
        dist.destroy_process_group(pg)


if __name__ == "__main__":
    main()
