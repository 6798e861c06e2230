"""DDP vs ZeRO-1 vs FSDP2 on the same TinyGPT: correctness, per-rank memory, communication.

Started by ``05-distributed/02_fsdp2_and_zero.ipynb`` (``ddp``, ``zero1``, ``fsdp2``) and
``05-distributed/07_fsdp2_in_practice.ipynb`` (the other configurations) through
``utils.distributed.launch`` (torchrun; gloo on CPU processes, NCCL with one GPU per
process). Every rank:

1. trains a single-process *reference* on the whole global batch (same seed, same data),
2. for each configuration in ``--configs`` builds the same model, wraps it, trains
   ``--steps`` steps on its slice of the global batch, and compares losses, the first
   step's gradients and the parameter updates with the reference,
3. counts the bytes of the parameters, gradients and optimizer state this rank holds
   (for a DTensor, its local shard), the unsharded parameter bytes still held when the
   forward pass ends, the collectives of one step (``utils.collectives.CollectiveCounter``,
   by kind and by phase), and the step time,
4. writes all of it to ``--out/rank<k>.json``.

Configurations: ``ddp``, ``zero1`` (DDP + ZeroRedundancyOptimizer), ``fsdp2`` (fully_shard
per block and at the root), ``fsdp2_keep`` (reshard_after_forward=False),
``fsdp2_bf16`` (MixedPrecisionPolicy bf16 compute, fp32 reduce), ``fsdp2_offload``
(CPUOffloadPolicy; needs CUDA ranks), ``fsdp2_meta`` (built on the meta device, sharded,
then given its weights from rank 0), ``fsdp2_prefetch`` (explicit all-gather prefetch two
blocks ahead), ``fsdp2_accum`` (gradient accumulation over ``--accum`` micro-batches,
reduce-scattering after every one) and ``fsdp2_accum_fn`` (the same, with the
``accumulate`` function of the file ``--accum-fn``: the notebook's exercise).

Run by hand: ``torchrun --standalone --nproc-per-node=2 fsdp_memory.py --out /tmp/r``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # torch >= 2.6: FSDP2 is public API here
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    FSDP_IMPORT = "torch.distributed.fsdp"
except ImportError:  # torch 2.4 / 2.5: the same API under its earlier, private path
    from torch.distributed._composable.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                    fully_shard)
    FSDP_IMPORT = "torch.distributed._composable.fsdp"

import utils
import utils.distributed as ud
from utils.collectives import CollectiveCounter

CONFIGS = ("ddp", "zero1", "fsdp2", "fsdp2_keep", "fsdp2_bf16", "fsdp2_offload",
           "fsdp2_meta", "fsdp2_prefetch", "fsdp2_accum", "fsdp2_accum_fn")
ACCUM_CONFIGS = ("fsdp2_accum", "fsdp2_accum_fn")

# Recent torch warns when an FSDP2 root returns a view (TinyGPT's logits are a view of the
# head's matmul output): an in-place op on it would skip a backward hook. train_step does no
# in-place op on the logits, so the warning does not apply here.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


# --- FSDP2: shard every transformer block, then the root --------------------------------
def apply_fsdp2(model, mesh, *, reshard_after_forward=True, mp_policy=None,
                offload_policy=None):
    """Shard ``model`` (a TinyGPT) in place with FSDP2 and return it.

    Each block becomes one FSDP unit: its parameters are all-gathered together just
    before the block runs and freed again after it (when ``reshard_after_forward``).
    The root call takes what is left (embeddings, final norm, the tied head) and sets
    up the whole model's hooks. Blocks first, root last: the order matters.
    """
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps its default: it is not resharded after forward, because backward
    # starts with it and would all-gather it again at once.
    fully_shard(model, **kwargs)
    return model


def build_on_meta(cfg, args, w, mesh):
    """FSDP2 without ever holding the whole model on one device.

    1. Build the model on the meta device: parameters with shapes but no memory.
    2. Shard it (``apply_fsdp2``): the parameters become DTensors, still on meta.
    3. ``to_empty`` allocates this rank's shards on its device, uninitialised.
    4. Fill them from a full state dict that only rank 0 holds (here the seeded initial
       weights, in a real job a pretrained checkpoint on rank 0's CPU):
       ``set_model_state_dict`` with ``full_state_dict=True, broadcast_from_rank0=True``
       sends each tensor from rank 0 and keeps this rank's slice of it.
    (Training from scratch, step 4 is the model's init function instead, run on the
    shards after ``to_empty``.)
    """
    with torch.device("meta"):
        model = utils.TinyGPT(cfg)
    apply_fsdp2(model, mesh)
    model.to_empty(device=w.device)
    full = new_model(cfg, args, "cpu").state_dict() if w.is_main else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    return model


def prefetch_two_ahead(model):
    """Explicit prefetch: each block starts the all-gathers of the next two blocks in
    forward (of the two before it in backward) instead of FSDP2's default of one."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])
    return model


def accumulate_naive(model, optimizer, micro_batches):
    """One optimizer step over micro-batches, every backward reduce-scattering its
    gradients (FSDP2's default): the same gradients as one big batch, k times the
    reduce-scatters. Returns the mean loss."""
    optimizer.zero_grad(set_to_none=True)
    k = len(micro_batches)
    total = 0.0
    for x, y in micro_batches:
        loss = F.cross_entropy(model(x).flatten(0, -2).float(), y.flatten()) / k
        loss.backward()
        total += loss.detach()
    optimizer.step()
    return total


def load_accumulate(path):
    """The function ``accumulate(model, optimizer, micro_batches)`` of the file ``path``."""
    spec = importlib.util.spec_from_file_location("accumulate_exercise", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "accumulate", None)):
        raise AttributeError(f"{path} defines no function accumulate(model, optimizer, "
                             "micro_batches)")
    return module.accumulate


# --- what one rank holds ----------------------------------------------------------------
def local(t):
    """The tensor this rank actually stores: a DTensor's local shard, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model, optimizer, device=None):
    """Bytes of parameters, gradients and optimizer state this rank holds.

    ``utils.tensor_bytes`` counts each storage once (its full size, so FSDP2's padding
    and DDP's gradient buckets count). With ``device``, only tensors on that device.
    """
    params = list(model.parameters())

    def on(ts):
        return [t for t in ts if t is not None and (device is None or t.device == device)]

    opt = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": utils.tensor_bytes(on(local(p) for p in params)),
        "grads": utils.tensor_bytes(on(local(p.grad) for p in params if p.grad is not None)),
        "optimizer": utils.tensor_bytes(on(local(v) for v in states)),
    }


def unsharded_param_bytes(module):
    """Bytes of parameters held in full (not as a DTensor shard) right now."""
    return utils.tensor_bytes(p for p in module.parameters() if not isinstance(p, DTensor))


def full_tensor(p, device):
    """The whole parameter on ``device`` (a collective for DTensors: every rank calls it)."""
    if not isinstance(p, DTensor):
        return p.detach().to(device)
    if p.to_local().device != device:  # a CPU-offloaded shard: move it to the mesh's device
        p = DTensor.from_local(p.to_local().to(device), p.device_mesh, p.placements,
                               shape=p.shape, stride=p.stride())
    return p.full_tensor().detach()


# --- training -----------------------------------------------------------------------------
def global_mean(loss, w):
    t = torch.as_tensor(loss).detach().float().reshape(1).to(w.device)
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return t.item() / w.world_size


def make_batches(cfg, args, w):
    """The same global batches on every rank; rank k trains on rows [k*B, (k+1)*B)."""
    return [utils.lm_batch(cfg, args.batch * w.world_size, args.seq_len, device="cpu",
                           seed=args.seed + step) for step in range(args.steps)]


def rank_slice(batch, w, args):
    rows = slice(w.rank * args.batch, (w.rank + 1) * args.batch)
    return batch[0][rows].to(w.device), batch[1][rows].to(w.device)


def new_model(cfg, args, device):
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every config
    return utils.TinyGPT(cfg).to(device)


def reference(cfg, args, w, batches):
    """One process, the whole global batch: what every data-parallel run must reproduce
    (its losses, the gradients of its first step and its final weights)."""
    model = new_model(cfg, args, w.device)
    init = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, grads = [], None
    for x, y in batches:
        losses.append(utils.train_step(model, opt, x.to(w.device), y.to(w.device)).item())
        if grads is None:
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
    final = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "init": init, "final": final, "grads": grads}


def grad_rel_err(model, ref_grads, device):
    """``||g - g_ref|| / ||g_ref||`` over every parameter: the gradients ``model`` holds (a
    DTensor's gathered in full, a collective: every rank calls this) against one process's.

    Adam divides each update by the gradient's own running scale, so a gradient off by a
    constant factor (an accumulation loop that forgets to divide its losses by the number of
    micro-batches) trains almost like the right one; the gradient itself shows it.
    """
    diff2 = norm2 = 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            raise RuntimeError(f"{n} has no gradient after the step")
        g = full_tensor(p.grad, device).float().cpu()
        diff2 += (g - ref_grads[n]).pow(2).sum().item()
        norm2 += ref_grads[n].pow(2).sum().item()
    return (diff2 / norm2) ** 0.5 if norm2 > 0 else float("nan")


def build(name, cfg, args, w, mesh):
    if name in ("ddp", "zero1"):
        model = new_model(cfg, args, w.device)
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets instead of
        # beside them, so DDP holds 4P bytes of gradients, not 4P + 4P of bucket copies.
        wrapped = DDP(model, device_ids=[w.local_rank] if w.device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
        if name == "ddp":
            opt = torch.optim.Adam(wrapped.parameters(), lr=args.lr)
        else:
            opt = ZeroRedundancyOptimizer(wrapped.parameters(),
                                          optimizer_class=torch.optim.Adam, lr=args.lr)
        return wrapped, model, opt
    if name == "fsdp2_offload" and w.device.type != "cuda":
        raise RuntimeError("fsdp2_offload offloads from GPU memory to CPU memory: it needs "
                           "CUDA ranks (NCCL); on CPU ranks the parameters are already there")
    if name == "fsdp2_meta":
        model = build_on_meta(cfg, args, w, mesh)
    else:
        model = apply_fsdp2(
            new_model(cfg, args, w.device), mesh,
            reshard_after_forward=(name != "fsdp2_keep"),
            mp_policy=(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)
                       if name == "fsdp2_bf16" else None),
            offload_policy=CPUOffloadPolicy() if name == "fsdp2_offload" else None,
        )
    if name == "fsdp2_prefetch":
        prefetch_two_ahead(model)
    # The optimizer is built AFTER sharding, over the DTensor shards: its state is sharded too.
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    return model, model, opt


def step_fn(name, model, opt, args):
    """One optimizer step of configuration ``name`` on (x, y): a plain train_step, or
    gradient accumulation over ``--accum`` micro-batches of it."""
    if name not in ACCUM_CONFIGS:
        return lambda x, y: utils.train_step(model, opt, x, y)
    accumulate = load_accumulate(args.accum_fn) if name == "fsdp2_accum_fn" else accumulate_naive
    return lambda x, y: accumulate(model, opt, list(zip(x.chunk(args.accum),
                                                        y.chunk(args.accum))))


def run_config(name, cfg, args, w, mesh, batches, ref):
    cuda = w.device.type == "cuda"
    gc.collect()  # nothing of an earlier configuration may count in this one's peaks
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(w.device)
    with torch.device("meta"):
        probe = utils.TinyGPT(cfg)
    full_bytes = utils.count_parameters(probe) * 4  # the whole model in fp32 (tied: once)
    model, inner, opt = build(name, cfg, args, w, mesh)
    build_peak = torch.cuda.max_memory_allocated(w.device) if cuda else None
    step = step_fn(name, model, opt, args)

    # 1. Correctness: the same steps as the reference, on this rank's slice of each batch,
    #    and after the first step, the same gradients.
    losses, grad_err = [], None
    for b in batches:
        losses.append(global_mean(step(*rank_slice(b, w, args)), w))
        if grad_err is None:
            grad_err = grad_rel_err(inner, ref["grads"], w.device)
    diff2 = upd2 = 0.0
    max_abs = 0.0
    for n, p in inner.named_parameters():
        full = full_tensor(p, w.device).float().cpu()
        max_abs = max(max_abs, (full - ref["final"][n]).abs().max().item())
        diff2 += (full - ref["final"][n]).pow(2).sum().item()
        upd2 += (ref["final"][n] - ref["init"][n]).pow(2).sum().item()

    # 2. Memory at rest (after an optimizer step, gradients still allocated).
    held = state_bytes(inner, opt)
    on_device = state_bytes(inner, opt, device=w.device) if cuda else held

    # 3. One step with its collectives counted, and a hook that looks at the parameters when
    #    the forward pass has ended (registered after FSDP's hooks, so it runs after them).
    seen = {}

    def after_forward(module, inputs, output):  # returns None: the output is left alone
        seen.setdefault("bytes", unsharded_param_bytes(module))

    hook = inner.register_forward_hook(after_forward)
    with CollectiveCounter() as comm:
        step(*rank_slice(batches[0], w, args))
    hook.remove()

    # 4. Step time: a fixed number of steps on every rank (ud.step_times_ms says why).
    x, y = rank_slice(batches[0], w, args)
    times = ud.step_times_ms(lambda: step(x, y), args.time_steps, w.device)

    result = {
        "losses": losses,
        "param_max_abs_diff": max_abs,
        "update_rel_err": (diff2 / upd2) ** 0.5 if upd2 > 0 else float("nan"),
        # the first step's gradients vs one process's, ||g - g_ref|| / ||g_ref||
        "grad_rel_err": grad_err,
        "bytes": held,
        "device_bytes": on_device,
        "unsharded_after_forward_bytes": seen.get("bytes"),
        "comm_counts": comm.as_dict(),
        # "backward": inside the autograd engine; "forward": the rest (the optimizer step too)
        "comm_by_phase": {phase: dict(sorted(c.items())) for phase, c in comm.by_phase.items()},
        "step_ms": statistics.median(times) if times else None,
        "step_ms_all": times,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(w.device) if cuda else None,
        # GPU memory at its highest while the model was built and sharded (before training)
        "cuda_build_peak_bytes": build_peak,
        "full_model_bytes": full_bytes,
    }
    # Free before the next configuration (and before the group ends). `step` too: its closure
    # holds the model and the optimizer, and FSDP2's and DDP's hooks keep them in reference
    # cycles that only the collector frees, so a collection while `step` lives frees nothing.
    del model, inner, opt, step
    gc.collect()
    return result


def add_model_args(p):
    """The TinyGPT size options (shared with dcp_checkpoint.py): utils.distributed's."""
    ud.add_gpt_args(p)


def model_config(args):
    return ud.gpt_config(args)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank<k>.json")
    p.add_argument("--configs", default="ddp,zero1,fsdp2",
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3, help="steps compared with the reference")
    p.add_argument("--time-steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accum", type=int, default=4,
                   help="micro-batches per optimizer step in fsdp2_accum* (divides --batch)")
    p.add_argument("--accum-fn", default="",
                   help="file defining accumulate(model, optimizer, micro_batches) for "
                        "fsdp2_accum_fn")
    p.add_argument("--timeout-s", type=float, default=300)
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}: use {', '.join(CONFIGS)}")
    if set(configs) & set(ACCUM_CONFIGS) and (args.accum < 1 or args.batch % args.accum):
        raise SystemExit(f"--accum ({args.accum}) must divide --batch ({args.batch})")
    if "fsdp2_accum_fn" in configs and not args.accum_fn:
        raise SystemExit("fsdp2_accum_fn needs --accum-fn FILE")

    # fp32 means fp32: every configuration is compared with one process in fp32, so TF32
    # stays off (torch's default for matmuls; set explicitly, with the current API).
    utils.set_tf32(False)
    cfg = model_config(args)
    backend = None if args.backend == "auto" else args.backend
    with ud.worker(backend=backend, timeout_s=args.timeout_s) as w:
        # An explicit 1-D mesh on the ranks' own device type: without it, fully_shard picks
        # the machine's accelerator, which is wrong for gloo ranks on a machine with a GPU.
        mesh = init_device_mesh(w.device.type, (w.world_size,))
        batches = make_batches(cfg, args, w)
        ref = reference(cfg, args, w, batches)
        with torch.device("meta"):  # sizes only
            probe = utils.TinyGPT(cfg)
        out = {
            "rank": w.rank, "world_size": w.world_size, "backend": w.backend,
            "device": str(w.device), "torch": torch.__version__, "fsdp_import": FSDP_IMPORT,
            "n_params": utils.count_parameters(probe),
            "n_param_tensors": len(list(probe.parameters())),
            "cuda_name": torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else None,
            "reference_losses": ref["losses"],
            "configs": {},
        }
        for name in configs:
            out["configs"][name] = run_config(name, cfg, args, w, mesh, batches, ref)
            if w.is_main:
                r = out["configs"][name]
                step_ms = "not timed" if r["step_ms"] is None else f"{r['step_ms']:.1f} ms"
                print(f"[rank 0] {name:<14} loss {r['losses'][-1]:.4f} "
                      f"(reference {ref['losses'][-1]:.4f})  state "
                      f"{sum(r['bytes'].values()) / 2**20:.2f} MiB  step {step_ms}",
                      flush=True)
        ud.write_rank_result(args.out, w.rank, out)


if __name__ == "__main__":
    main()
