"""Tensor parallelism with DTensor on TinyGPT: the worker of 05-distributed/03_tensor_parallel.

Start it with torchrun; the notebook does, through ``utils.distributed.launch``::

    torchrun --standalone --nproc-per-node=2 tp.py --out OUT --mode tp
    torchrun --standalone --nproc-per-node=4 tp.py --out OUT --mode 2d --tp 2

``--mode`` takes a comma-separated list (``tp,2d``): one launch then runs each mode in turn,
which saves the seconds of a torchrun start-up per mode.

``--mode tp``: DeviceMesh and DTensor basics, then TinyGPT with ColwiseParallel /
RowwiseParallel, checked against the same model on one device (logits, gradients, and the
losses of a few AdamW steps); the collectives of one forward and one backward, by phase and
by module (``utils.collectives.CollectiveCounter``); the parameter bytes each rank holds; the
step time of both at a few widths.

``--mode 2d``: a 2-D ("dp", "tp") mesh: tensor parallelism inside each "tp" group, FSDP2
(``fully_shard``) across "dp"; gradients and losses checked against one device.

``--mode plan --plan-file FILE``: the MLP of every block sharded with each plan that FILE
defines (functions whose names end in ``_plan`` and return a ``parallelize_module`` plan
for ``mlp.0`` / ``mlp.2``), attention left replicated; for each plan, the logits against
one device and the collectives of one forward and one backward (the notebook's exercise).

Every rank writes what it measured to ``OUT/rank<k>.json``, one entry per mode
(``{"tp": {...}, "2d": {...}}``), each with the rank's ``rank``, ``world_size``, ``backend``,
``device`` and ``torch``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import types
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import utils
import utils.distributed as ud
from utils.collectives import CollectiveCounter, collective_kind

# Which Linear of a TinyGPT block gets which style. Each Colwise -> Rowwise pair needs one
# all-reduce in the forward pass (after the Rowwise layer) and one in the backward pass
# (the gradient of the Colwise layer's replicated input).
TP_PLAN = {
    "attn.qkv": ColwiseParallel(),   # output features split: each rank computes its heads' q, k, v
    "attn.proj": RowwiseParallel(),  # input features split: partial sums, all-reduced
    "mlp.0": ColwiseParallel(),      # the 4x-wide hidden layer split by columns
    "mlp.2": RowwiseParallel(),      # back to n_embd: partial sums, all-reduced
}
TP_LAYERS = tuple(TP_PLAN)
MODES = ("tp", "2d", "plan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for rank<k>.json")
    p.add_argument("--mode", default="tp",
                   help=f"comma-separated, from {', '.join(MODES)}, run in the order given")
    p.add_argument("--tp", type=int, default=2, help="2d mode: size of the 'tp' mesh dimension")
    p.add_argument("--plan-file", default="", help="plan mode: the file defining *_plan()")
    ud.add_gpt_args(p, vocab=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
    p.add_argument("--batch", type=int, default=4, help="global batch (split over 'dp' in 2d)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps compared with one device")
    p.add_argument("--time-steps", type=int, default=5, help="timed steps per model (0: none)")
    p.add_argument("--time-widths", default="",
                   help="comma-separated n_embd values to time (default: --n-embd)")
    p.add_argument("--timeout", type=float, default=120, help="collective timeout, seconds")
    a = p.parse_args()
    a.mode = [m for m in a.mode.split(",") if m]
    if not a.mode or set(a.mode) - set(MODES):
        p.error(f"--mode takes a comma-separated list of {', '.join(MODES)}, got {a.mode}")
    return a


# ----------------------------------------------------------------------------- DTensor basics
def dtensor_demo(mesh, device) -> dict:
    """Place one 8 x 8 matrix three ways; then a sharded matmul that ends Partial."""
    full = torch.arange(64, dtype=torch.float32, device=device).reshape(8, 8)
    report = {}
    for name, placement in (("Shard(0)", Shard(0)), ("Shard(1)", Shard(1)),
                            ("Replicate()", Replicate())):
        d = distribute_tensor(full, mesh, [placement])   # rank 0's copy is scattered/broadcast
        local = d.to_local()                              # the plain tensor this rank stores
        assert torch.equal(d.full_tensor(), full)         # full_tensor() all-gathers it back
        report[name] = {"global_shape": list(d.shape), "local_shape": list(local.shape),
                        "local_first_row": local[0].tolist()}

    # x split by columns, w split by rows: each rank multiplies its slices -> a partial sum.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(device)
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(device)
    xd, wd = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)])
    with CollectiveCounter() as matmul_comm:
        yd = xd @ wd                                      # no communication: the result is Partial
    with CollectiveCounter() as reduce_comm:
        y = yd.redistribute(mesh, [Replicate()])          # Partial -> Replicate = all-reduce
    torch.testing.assert_close(y.to_local(), x @ w, **utils.tolerance(torch.float32, device,
                                                                      scale=x @ w).kwargs())
    rows = distribute_tensor(full, mesh, [Shard(0)])
    with CollectiveCounter() as gather_comm:
        rows.redistribute(mesh, [Replicate()])           # Shard -> Replicate = all-gather
    report["matmul"] = {"placement": str(yd.placements[0]), "comm": matmul_comm.as_dict(),
                        "local_y00": yd.to_local()[0, 0].item(), "full_y00": (x @ w)[0, 0].item(),
                        "partial_to_replicate_comm": reduce_comm.as_dict(),
                        "shard_to_replicate_comm": gather_comm.as_dict()}
    return report


# ------------------------------------------------------------------ tensor-parallel TinyGPT
def head_major_qkv(attn, tp: int) -> None:
    """Reorder qkv's output rows from [q | k | v] to [q0 k0 v0 | q1 k1 v1 | ...].

    ColwiseParallel gives rank r the r-th contiguous block of rows. With the fused
    [q | k | v] layout, rank 0 of 2 would get all of q and half of k. After this
    reordering, rank r's block holds q, k and v of the same n_head / tp heads.
    """
    c = attn.proj.in_features
    with torch.no_grad():
        for p in (attn.qkv.weight, attn.qkv.bias):
            p.copy_(p.view(3, tp, c // tp, -1).transpose(0, 1).reshape(p.shape))


def qkv_to_standard(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Undo head_major_qkv on a full (un-sharded) qkv weight, bias or gradient."""
    c = t.shape[0] // 3
    return t.reshape(tp, 3, c // tp, -1).transpose(0, 1).reshape(t.shape)


def tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """utils' CausalSelfAttention.forward, with this rank's widths instead of the full ones.

    The original reads the width c from x, which is replicated (full n_embd), and splits
    the qkv output into chunks of c. Under TP the qkv output is this rank's 3 * c / tp
    columns, so the split and the head view must use the local width, and n_head must be
    this rank's head count (apply_tp divides it by tp).
    """
    b, t, _ = x.shape
    qkv = self.qkv(x)                      # (b, t, 3 * c_local): q, k, v of this rank's heads
    c_local = qkv.shape[-1] // 3
    q, k, v = (z.view(b, t, self.n_head, c_local // self.n_head).transpose(1, 2)
               for z in qkv.split(c_local, dim=2))
    y = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
    return self.proj(y.transpose(1, 2).reshape(b, t, c_local))  # Rowwise: all-reduce inside


def apply_tp(model, tp_mesh):
    """Shard every block's attention and MLP over tp_mesh (in place); returns the model."""
    tp = tp_mesh.size()
    for blk in model.blocks:
        if blk.attn.n_head % tp:
            raise ValueError(f"n_head={blk.attn.n_head} is not divisible by the TP size {tp}")
        head_major_qkv(blk.attn, tp)
        parallelize_module(blk, tp_mesh, TP_PLAN)
        blk.attn.n_head //= tp                             # this rank's heads
        blk.attn.forward = types.MethodType(tp_attention_forward, blk.attn)
    return model


# ------------------------------------------------------------------------------- helpers
def check_close(got: torch.Tensor, want: torch.Tensor, what: str,
                device: torch.device | None = None) -> tuple[float, float]:
    """Assert got == want within the fp32 tolerance; return (max|got - want| / max|want|,
    the worst error in units of the tolerance).

    The sharded model adds its partial sums in another order than one device does, so the
    results differ by rounding. ``utils.tolerance`` gives the tolerance for fp32 on this
    rank's device (TF32 is off in every rank: ``main`` turns it off), with the absolute part
    scaled to the values' size, so that entries near zero are not held to a relative bound
    they cannot meet. ``device``: where the values were computed (default: where they are).
    """
    tol = utils.tolerance(torch.float32, device or want.device, scale=want)
    torch.testing.assert_close(got, want, **tol.kwargs(), msg=lambda m: f"{what}: {m}")
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale, tol.excess(got, want)


class CollectivesByModule(CollectiveCounter):
    """``utils.collectives.CollectiveCounter`` that also notes in which module each
    collective ran: the innermost module whose forward was running, or in backward the
    module whose backward started last (a hook on its output's gradient marks the start).

    ``by_module[(phase, module name)]`` is a Counter of kinds. Use it as a context manager
    around one forward and backward of ``model``; the hooks are removed on exit.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.by_module: dict[tuple[str, str], Counter] = {}
        self._model = model
        self._stack: list[str] = []       # modules whose forward is running
        self._backward_in = "(outside any module)"
        # outputs that already carry an inner module's hook, held until exit: an id alone could
        # be reused by a later tensor once the first is freed, and that tensor's hook then lost
        self._hooked: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self):
        for name, module in self._model.named_modules():
            if name:
                self._handles += [module.register_forward_pre_hook(self._enter(name)),
                                  module.register_forward_hook(self._leave(name))]
        return super().__enter__()

    def _enter(self, name):
        def hook(module, inputs):
            self._stack.append(name)
        return hook

    def _leave(self, name):
        def hook(module, inputs, output):
            self._stack.pop()
            # An output shared with an inner module (a Sequential's last layer) keeps the
            # inner module's hook: the innermost module is the one named.
            if (isinstance(output, torch.Tensor) and output.requires_grad
                    and self._hooked.get(id(output)) is not output):
                self._hooked[id(output)] = output
                output.register_hook(self._backward_starts(name))
        return hook

    def _backward_starts(self, name):
        def hook(grad):
            self._backward_in = name
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = collective_kind(func)
        backward_before = self.by_phase["backward"][kind] if kind else 0
        out = super().__torch_dispatch__(func, types, args, kwargs)  # counts it
        if kind is not None:
            if self.by_phase["backward"][kind] > backward_before:
                key = ("backward", self._backward_in)
            else:
                key = ("forward", self._stack[-1] if self._stack else "(outside any module)")
            self.by_module.setdefault(key, Counter())[kind] += 1
        return out

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hooked = {}
        return super().__exit__(*exc)

    def table(self) -> dict[str, dict[str, int]]:
        """``{"forward blocks.0.mlp.2": {"all_reduce": 1}, ...}``, JSON-ready."""
        return {f"{phase} {name}": dict(sorted(c.items()))
                for (phase, name), c in self.by_module.items()}


def full_tensors(model, tp: int, grads: bool) -> dict[str, torch.Tensor]:
    """name -> the full (un-sharded) parameter or gradient, in the single-device layout.

    Collective (full_tensor all-gathers the shards): every rank must call it.
    """
    out = {}
    for name, p in model.named_parameters():
        t = (p.grad if grads else p).detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = qkv_to_standard(t, tp) if ".attn.qkv." in name else t
    return out


def check_grads(model, ref, tp: int) -> dict:
    """Every gradient of model (gathered) against ref's: worst relative and absolute error."""
    got = full_tensors(model, tp, grads=True)
    checked = {n: check_close(got[n], p.grad, f"gradient of {n}")
               for n, p in ref.named_parameters()}
    worst = max(checked, key=lambda n: checked[n][0])
    abs_err = max((got[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    return {"grad_max_rel_err": checked[worst][0], "grad_worst_param": worst,
            "grad_max_abs_err": abs_err,
            "grad_tol_excess": max(excess for _, excess in checked.values())}


def param_max_abs_err(model, ref, tp: int) -> float:
    got = full_tensors(model, tp, grads=False)
    return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


def local_bytes(p: torch.Tensor) -> int:
    t = p.to_local() if isinstance(p, DTensor) else p
    return t.numel() * t.element_size()


def param_bytes(model) -> dict[str, int]:
    """Bytes this rank stores: all parameters, and those of the TP-sharded layers."""
    total = sharded = 0
    for name, p in model.named_parameters():      # a tied weight is listed once
        n = local_bytes(p)
        total += n
        if any(f".{layer}." in name for layer in TP_LAYERS):
            sharded += n
    return {"all": total, "tp_layers": sharded}


def time_steps(step, n: int, device) -> list[float]:
    """Seconds of n calls of step(), all ranks starting each call together
    (a fixed count: ud.step_times_ms says why not utils.benchmark)."""
    return [ms / 1e3 for ms in ud.step_times_ms(step, n, device, barrier=True)]


def time_width(a, w, mesh, n_embd: int) -> dict:
    """Seconds per training step of TinyGPT at this width: one device, and TP over mesh."""
    cfg = ud.gpt_config(a, n_embd=n_embd)
    torch.manual_seed(0)
    ref = utils.TinyGPT(cfg).to(w.device)
    model = apply_tp(copy.deepcopy(ref), mesh)
    x, y = utils.lm_batch(cfg, a.batch, a.seq_len, device=w.device, seed=1)
    check_close(model(x), ref(x), f"logits at n_embd={n_embd}")   # correct before timed
    out = {}
    for name, m in (("ref", ref), ("tp", model)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        time_steps(lambda: utils.train_step(m, opt, x, y), 2, w.device)      # warm-up
        out[name] = time_steps(lambda: utils.train_step(m, opt, x, y), a.time_steps, w.device)
    return out


# --------------------------------------------------------------------------------- modes
def run_tp(a, w) -> dict:
    mesh = init_device_mesh(w.device.type, (w.world_size,))
    tp = mesh.size()
    res = {"dtensor": dtensor_demo(mesh, w.device)}

    cfg = ud.gpt_config(a)
    torch.manual_seed(0)
    ref = utils.TinyGPT(cfg).to(w.device)            # the same model on one device
    model = apply_tp(copy.deepcopy(ref), mesh)       # same weights, sharded over the mesh
    x, y = utils.lm_batch(cfg, a.batch, a.seq_len, device=w.device, seed=1)  # same batch on all

    # 1. one forward and one backward, their collectives counted by phase and by module
    with CollectivesByModule(model) as comm:
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    res["comm_forward"] = dict(sorted(comm.by_phase["forward"].items()))
    res["comm_backward"] = dict(sorted(comm.by_phase["backward"].items()))
    res["comm_by_module"] = comm.table()
    res["allreduce_payload_bytes"] = a.batch * a.seq_len * a.n_embd * logits.element_size()

    # 2. the logits (replicated on every rank) and every gradient (gathered to full size)
    #    against the single-device model's
    logits_ref = ref(x)
    F.cross_entropy(logits_ref.flatten(0, 1), y.flatten()).backward()
    logits, logits_ref = logits.detach(), logits_ref.detach()
    res["logits_max_rel_err"], res["logits_tol_excess"] = check_close(logits, logits_ref, "logits")
    res["logits_max_abs_err"] = (logits - logits_ref).abs().max().item()
    res.update(check_grads(model, ref, tp))

    # 3. a few AdamW steps with the shared train_step: the losses must stay equal
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, losses_ref = [], []
    for _ in range(a.steps):
        losses.append(utils.train_step(model, opt, x, y).item())
        losses_ref.append(utils.train_step(ref, opt_ref, x, y).item())
    res["loss_max_rel_err"], res["loss_tol_excess"] = check_close(
        torch.tensor(losses), torch.tensor(losses_ref), "losses", device=w.device)
    res["losses"], res["losses_ref"] = losses, losses_ref
    res["param_max_abs_err_after_steps"] = param_max_abs_err(model, ref, tp)

    # 4. what each rank stores
    res["bytes_tp"], res["bytes_ref"] = param_bytes(model), param_bytes(ref)
    res["local_shapes"] = {n: list(p.to_local().shape) if isinstance(p, DTensor) else
                           list(p.shape) for n, p in model.named_parameters()
                           if n.startswith("blocks.0.")}

    # 5. step time, TP over the mesh vs one device alone, for a few model widths
    widths = [int(v) for v in a.time_widths.split(",") if v] or [a.n_embd]
    res["timing"] = {w_: time_width(a, w, mesh, w_) for w_ in widths} if a.time_steps else {}
    return res


def run_2d(a, w) -> dict:
    if w.world_size % a.tp:
        raise ValueError(f"world size {w.world_size} is not divisible by --tp {a.tp}")
    dp = w.world_size // a.tp
    if a.batch % dp:
        raise ValueError(f"--batch {a.batch} is not divisible by the dp size {dp}")
    mesh = init_device_mesh(w.device.type, (dp, a.tp), mesh_dim_names=("dp", "tp"))

    cfg = ud.gpt_config(a)
    torch.manual_seed(0)
    ref = utils.TinyGPT(cfg).to(w.device)
    model = apply_tp(copy.deepcopy(ref), mesh["tp"])   # TP inside each "tp" group...
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh["dp"])              # ...then FSDP2 across "dp"
    fully_shard(model, mesh=mesh["dp"])

    x, y = utils.lm_batch(cfg, a.batch, a.seq_len, device=w.device, seed=1)
    dp_rank = mesh.get_local_rank("dp")
    xl, yl = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]  # this dp rank's share of the batch

    # Gathering a parameter that is sharded twice on dim 0 (FSDP over TP) takes two
    # all-gathers, and torch logs a warning that this is slow: irrelevant for a one-off check.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # FSDP2 warns when a wrapped module returns a view (TinyGPT's logits are one); that only
    # matters for in-place ops on the output, which train_step does not do.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, losses_ref, res = [], [], {}
    for step in range(a.steps):
        with CollectiveCounter() as comm:
            loss = utils.train_step(model, opt, xl, yl)    # half the batch per dp rank
        dist.all_reduce(loss, group=mesh.get_group("dp"))  # mean over the dp shares
        losses.append(loss.item() / dp)
        losses_ref.append(utils.train_step(ref, opt_ref, x, y).item())  # the whole batch
        if step == 0:   # FSDP2 averaged the gradients over "dp": they must equal one device's
            res.update(check_grads(model, ref, a.tp))
            res["comm_step"] = comm.as_dict()
            res["comm_step_backward"] = dict(sorted(comm.by_phase["backward"].items()))
    res["loss_max_rel_err"], res["loss_tol_excess"] = check_close(
        torch.tensor(losses), torch.tensor(losses_ref), "losses", device=w.device)
    res["param_max_abs_err_after_steps"] = param_max_abs_err(model, ref, a.tp)
    res["placements"] = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()
                         if n.startswith("blocks.0.") or n == "tok_emb.weight"}
    res.update(mesh={"dp": dp, "tp": a.tp, "dp_rank": dp_rank,
                     "tp_rank": mesh.get_local_rank("tp")},
               losses=losses, losses_ref=losses_ref,
               bytes_2d=param_bytes(model), bytes_ref=param_bytes(ref))
    return res


def load_plans(path: str) -> dict:
    """name -> function for every ``*_plan`` function defined in the file ``path``."""
    spec = importlib.util.spec_from_file_location("tp_plans", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plans = {n: f for n, f in vars(module).items() if n.endswith("_plan") and callable(f)}
    if not plans:
        raise ValueError(f"{path} defines no function whose name ends in _plan")
    return plans


def run_plans(a, w) -> dict:
    """Each plan of --plan-file on every block's MLP: logits vs one device, collectives."""
    if not a.plan_file:
        raise ValueError("--mode plan needs --plan-file")
    mesh = init_device_mesh(w.device.type, (w.world_size,))
    cfg = ud.gpt_config(a)
    torch.manual_seed(0)
    ref = utils.TinyGPT(cfg).to(w.device)
    x, y = utils.lm_batch(cfg, a.batch, a.seq_len, device=w.device, seed=1)
    logits_ref = ref(x).detach()
    res = {}
    for name, make_plan in load_plans(a.plan_file).items():
        model = copy.deepcopy(ref)
        for blk in model.blocks:
            parallelize_module(blk.mlp, mesh, make_plan())  # keys "0" and "2": mlp.0, mlp.2
        with CollectiveCounter() as comm:
            logits = model(x)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach()
        err = (logits - logits_ref).abs().max().item() / logits_ref.abs().max().item()
        tol = utils.tolerance(torch.float32, w.device, scale=logits_ref)
        res[name] = {"logits_max_rel_err": err, "logits_tol_excess": tol.excess(logits, logits_ref),
                     "comm_forward": dict(sorted(comm.by_phase["forward"].items())),
                     "comm_backward": dict(sorted(comm.by_phase["backward"].items())),
                     "mlp_bytes": sum(local_bytes(p) for n, p in model.named_parameters()
                                      if ".mlp." in n)}
    res["mlp_bytes_ref"] = sum(local_bytes(p) for n, p in ref.named_parameters() if ".mlp." in n)
    res["activation_bytes"] = a.batch * a.seq_len * a.n_embd * logits_ref.element_size()
    return res


def main() -> None:
    a = parse_args()
    utils.set_tf32(False)  # fp32 means fp32: every check compares with one device in fp32
    with ud.worker(timeout_s=a.timeout) as w:
        out = {}
        for mode in a.mode:
            res = {"tp": run_tp, "2d": run_2d, "plan": run_plans}[mode](a, w)
            res.update(rank=w.rank, world_size=w.world_size, backend=w.backend,
                       device=str(w.device), torch=torch.__version__)
            out[mode] = res
            if w.is_main:
                print(f"[rank 0] mode={mode} world={w.world_size} backend={w.backend} "
                      f"device={w.device}: checks passed", flush=True)
        ud.write_rank_result(a.out, w.rank, out)


if __name__ == "__main__":
    main()
