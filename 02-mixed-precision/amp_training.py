"""Mixed-precision training against fp32, recipe by recipe: one command, no Jupyter.

For each model (the course's transformer, CNN and LSTM, or your own), every recipe that
runs on this machine trains from the same initial weights on the same batches:

  fp32        the reference: fp32 weights and arithmetic, TF32 off
  tf32        fp32 weights, fp32 matmuls on TF32 tensor cores (NVIDIA sm80+)
  bf16        bf16 autocast, fp32 master weights (a CPU, or a GPU with bf16)
  fp16        fp16 autocast + GradScaler, fp32 master weights; the gradients are
              unscaled (scaler.unscale_) before they are clipped (CUDA only)
  pure-bf16   the model converted to bf16 (model.to(torch.bfloat16)): weights,
              gradients and AdamW's state in bf16, no fp32 master copy

Every recipe clips the gradients' norm (--clip) and warms the learning rate up, as GPT
recipes do. For each recipe the script

  1. checks, BEFORE training or timing, that at the initial weights it computes the same
     function as fp32 (loss, and logits as a whole tensor) within utils.tolerance for its
     arithmetic; a recipe that fails is not run further, and the script exits with status 1;
  2. trains N steps (--steps) and compares the final loss with fp32's, as a share of the
     drop fp32 achieved (utils.loss_gap); the comparison applies only where fp32 learned
     (shed at least 10% of its first loss), and a recipe with fp32 master weights that ends
     further than 2% of the drop from fp32 fails the run (status 1); pure bf16, which keeps
     no master weights, is reported, not failed;
  3. times a training step (utils.benchmark: median and interquartile range over blocks of
     steps, the recipes interleaved) and measures one step's peak memory
     (utils.measure_peak_memory), both against fp32.

The models train on data they can learn: utils.MarkovTokens (a fixed random Markov chain)
for the transformer and the LSTM, utils.SyntheticImages for the CNN. Everything measured
goes to a ledger (JSON) that `python -m utils report` reads; the report's table of popular
claims ("AMP: 2-3x faster training, 50% less memory", ...) takes its figures from it.

Size: --smoke is small models and 30 steps (under a minute on a 2-core CPU; with no other
choice it runs TinyGPT in fp32 and one mixed-precision recipe); full size (the default on a
GPU) runs all three models in every recipe this machine can run.

Examples:

    python 02-mixed-precision/amp_training.py                        # full size on a GPU
    python 02-mixed-precision/amp_training.py --smoke
    python 02-mixed-precision/amp_training.py --models tinygpt,lstm --modes bf16,fp16 --steps 300
    python 02-mixed-precision/amp_training.py --model mypkg.nets:build --modes bf16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import utils
from utils import cli, ladder

NOTEBOOK = "02-mixed-precision/amp_training"  # the ledger's name (results/.../<this>.json)


@dataclass(frozen=True)
class Recipe:
    """One way to train: what it changes, and the arithmetic its check is held to."""

    key: str
    label: str
    amp: str | None = None                  # ladder.TrainConfig.amp: autocast dtype
    tf32: bool = False
    weights: torch.dtype = torch.float32    # the model's own dtype (pure bf16: bfloat16)
    dtype: torch.dtype = torch.float32      # the arithmetic its results are compared in

    @property
    def master_weights(self) -> bool:
        """fp32 weights that every update lands in (autocast and TF32 keep them)."""
        return self.weights == torch.float32


RECIPES = {r.key: r for r in (
    Recipe("fp32", "fp32"),
    Recipe("tf32", "fp32 + TF32", tf32=True),
    Recipe("bf16", "bf16 autocast", amp="bf16", dtype=torch.bfloat16),
    Recipe("fp16", "fp16 autocast + GradScaler", amp="fp16", dtype=torch.float16),
    Recipe("pure-bf16", "pure bf16 (model.to(bf16))", weights=torch.bfloat16,
           dtype=torch.bfloat16),
)}

# Sizes are data: one column per tier (smoke; full size on a CPU, which runs but whose speed
# says little about a GPU; full size on a GPU). TinyGPT and SmallCNN take module 02's
# notebook 04 sizes (the GPU's TinyGPT is GPT-2-small-like in width and sequence, about 64 M
# parameters, 16 x 1024 tokens per step).
SIZES = {
    "tinygpt": {
        "smoke": dict(vocab=512, seq=64, layers=2, heads=4, width=128, batch=8, lr=1e-3),
        "cpu": dict(vocab=2048, seq=128, layers=4, heads=4, width=256, batch=8, lr=1e-3),
        "gpu": dict(vocab=8192, seq=1024, layers=8, heads=12, width=768, batch=16, lr=6e-4),
    },
    "smallcnn": {
        "smoke": dict(width=16, image=16, batch=32, lr=1e-3),
        "cpu": dict(width=32, image=32, batch=64, lr=1e-3),
        "gpu": dict(width=64, image=64, batch=256, lr=1e-3),
    },
    # The LSTM's learning rates are what makes fp32 shed a real share of its first loss in the
    # run (the loss check needs 10%), without driving the bf16 run away from it (the check
    # allows 2% of the drop). Measured on a CPU: at lr 3e-3 the smoke model shed 6% in 30 steps,
    # at 1e-2 29% (bf16 gap 0.3%); the CPU column shed 51% at 1e-2 but its bf16 gap was 1.6%,
    # at 5e-3 18% and 0.6%; a stand-in for the GPU column (vocabulary 4096, width and hidden
    # 512, 8 x 64 tokens per step, 150 steps, lr 5e-3) shed 25% with a bf16 gap of 0.9% (at
    # vocabulary 8192 it shed 14%).
    "lstm": {
        "smoke": dict(vocab=512, seq=64, layers=1, width=128, hidden=128, batch=8, lr=1e-2),
        "cpu": dict(vocab=1024, seq=128, layers=2, width=256, hidden=256, batch=8, lr=5e-3),
        "gpu": dict(vocab=4096, seq=512, layers=2, width=512, hidden=1024, batch=32, lr=5e-3),
    },
}
STEPS = {"smoke": 30, "cpu": 60, "gpu": 150}     # training steps per recipe (--steps)
POOL = 32                                        # distinct batches, cycled
RUN_S = {"smoke": 0.2, "cpu": 0.3, "gpu": 1.0}   # min_run_time_s of each timing
ROUNDS = {"smoke": 2, "cpu": 2, "gpu": 1}        # interleaved timing rounds, fastest kept
# The loss check, as module 02's notebook 04 sets it: a final loss within LOSS_TOL of fp32's
# loss drop; applied where fp32 shed at least MIN_LEARNED of its first loss. That notebook
# measured rounding gaps of at most 0.3% of the drop (CPU and the first H100 run) and broken
# recipes 36% (pure bf16 at a fine-tuning learning rate) and 50% (fp16 without a scaler).
LOSS_TOL = 0.02
MIN_LEARNED = 0.10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="amp_training.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when every check passed; 1 when a recipe failed its "
               "correctness check, a recipe with fp32 master weights ended too far from "
               "fp32's loss, or a run failed (the table says which); 2 for a bad option or "
               "hardware this machine lacks (nothing was run).")
    what = p.add_argument_group("what to run")
    what.add_argument("--models", metavar="LIST",
                      help="comma-separated built-in models: " + ", ".join(
                          f"{k} ({cli.FAMILIES[v]})" for k, v in cli.MODELS.items())
                      + "; or all. Default: tinygpt at smoke size, all at full size")
    what.add_argument("--model", action="append", default=[], metavar="MODULE:FACTORY",
                      help="your own model (repeatable): package.module:factory or "
                           "path/to/file.py:factory, where factory() (or factory(smoke=...)) "
                           "returns (model, inputs, targets), targets being class indices for "
                           "cross-entropy shaped like the logits without their last "
                           "dimension; every step trains on that one batch. Given alone, it "
                           "replaces the built-in models")
    what.add_argument("--modes", metavar="LIST",
                      help="comma-separated recipes: " + ", ".join(RECIPES) + "; or all "
                           "(every one this machine runs). fp32 (the reference) always runs. "
                           "Default: one mixed-precision recipe at smoke size (bf16, or fp16 "
                           "on a GPU without bf16), every recipe this machine can run at full "
                           "size")
    what.add_argument("--steps", type=int, default=None, metavar="N",
                      help="training steps per recipe (default: 30 smoke, 150 at full size on "
                           "a GPU, 60 on a CPU)")
    what.add_argument("--clip", type=float, default=1.0, metavar="NORM",
                      help="clip the gradients' total norm to NORM in every recipe (default "
                           "1.0; 0 turns clipping off)")
    cli.add_size_and_output_args(
        p, ledger_file="02-mixed-precision__amp_training.json",
        smoke_what="small models, few steps", run_time_default="0.2 smoke, 1.0 on a GPU",
        module="module 02")
    return p


def why_not(recipe: Recipe, dev: torch.device) -> str | None:
    """Why ``recipe`` does not run on ``dev`` (``None``: it runs)."""
    cuda = dev.type == "cuda"
    bf16_gpu = cuda and cli.native_bf16(dev)
    if recipe.key == "tf32" and not (cuda and torch.cuda.get_device_capability(dev) >= (8, 0)):
        return ("TF32 exists on NVIDIA GPUs from sm80 (Ampere) on; "
                + ("this GPU is older" if cuda else "on a CPU fp32 matmuls are plain fp32"))
    if recipe.key == "fp16" and not cuda:
        return ("fp16 training runs on CUDA GPUs only in this course: CPUs have no fp16 "
                "arithmetic units (it is emulated, slowly), and nn.LSTM has no CPU fp16 kernel")
    if recipe.dtype == torch.bfloat16 and cuda and not bf16_gpu:
        return "needs a GPU with native bfloat16 (sm80 or newer)"
    return None


def choose_recipes(asked: list[str] | None, smoke: bool, dev: torch.device,
                   every: bool = False) -> tuple[list[Recipe], dict[str, str]]:
    """The recipes to run (fp32 first) and why the others do not run here: those named in
    ``asked``, else every one that runs here (``every``, ``--modes all``, or full size), else
    fp32 and one mixed-precision recipe (smoke size).

    Raises:
        cli.UsageError: a recipe asked for by name does not run on this machine.
    """
    skipped = {k: why for k, r in RECIPES.items() if (why := why_not(r, dev))}
    if asked is not None:
        bad = [k for k in asked if k in skipped]
        if bad:
            can = [k for k in RECIPES if k not in skipped]
            raise cli.UsageError("--modes " + "; ".join(f"{k}: {skipped[k]}" for k in bad)
                                 + f". This run is on {dev}; here you can run "
                                 + ", ".join(can))
        keys = ["fp32"] + [k for k in asked if k != "fp32"]
        return [RECIPES[k] for k in keys], {}
    if smoke and not every:
        first = next((k for k in ("bf16", "fp16") if k not in skipped), None)
        keys = ["fp32"] + ([first] if first else [])
        return [RECIPES[k] for k in keys], {k: why for k, why in skipped.items()}
    return [r for k, r in RECIPES.items() if k not in skipped], skipped


@dataclass
class Run:
    """One model in one recipe: what it measured."""

    model: str
    recipe: Recipe
    status: str = "ok"               # ok / FAILED CHECK / LOSS DIFFERS / error
    note: str = ""
    excess: float | None = None
    losses: list[float] = field(default_factory=list)
    timing: utils.Timing | None = None
    peak_bytes: int | None = None
    gap: utils.LossGap | None = None
    trainer: ladder.Trainer | None = None


def _context(recipe: Recipe) -> contextlib.AbstractContextManager:
    """TF32 on for the tf32 recipe, off for every other (the fp32 reference is true fp32)."""
    return utils.tf32(recipe.tf32)


def check_function(wl: cli.Workload, recipe: Recipe, dev: torch.device,
                   ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, str]:
    """At the initial weights: the recipe's loss and logits against fp32's, in units of the
    tolerance of its arithmetic (below 1 passes). Returns (excess, the tolerance in words)."""
    model = copy.deepcopy(wl.model).to(dev, dtype=recipe.weights)
    x, y = wl.batch(0, dev, recipe.weights if recipe.weights != torch.float32 else None)
    with _context(recipe), torch.no_grad(), torch.autocast(
            dev.type, dtype=ladder.AMP_DTYPES.get(recipe.amp or "bf16"),
            enabled=recipe.amp is not None):
        logits = model(x).float()
        tol = utils.tolerance(recipe.dtype, dev, scale=ref[1])  # reads the TF32 state in here
    loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    # The loss is one number; the logits are compared as a whole tensor (norm of the
    # difference over the norm of fp32's), as module 02's notebook 04 does: the worst of
    # millions of elements strays further than the tensor does.
    excess = max(utils.rel_error(logits, ref[0]) / tol.rtol, tol.excess(loss, ref[1]))
    return excess, f"loss and logits vs fp32 at the initial weights, {tol}"


def train_recipe(wl: cli.Workload, recipe: Recipe, dev: torch.device, steps: int,
                 clip: float | None) -> Run:
    """Train ``steps`` steps from the initial weights (the check has passed); the trainer is
    kept for timing and memory."""
    run = Run(wl.name, recipe)
    model = copy.deepcopy(wl.model).to(dev, dtype=recipe.weights)
    cfg = ladder.TrainConfig(amp=recipe.amp, tf32=recipe.tf32)
    run.trainer = ladder.Trainer(model, cfg, device=dev, num_classes=wl.num_classes, lr=wl.lr,
                                 warmup_steps=max(3, steps // 10), max_grad_norm=clip)
    cast = recipe.weights if recipe.weights != torch.float32 else None
    with _context(recipe), warnings.catch_warnings():
        # A step the GradScaler skips (an overflow) leaves AdamW untouched, and the learning-rate
        # scheduler then warns that it stepped first: harmless here, so that one is silenced.
        warnings.filterwarnings("ignore", message="Detected call of", category=UserWarning)
        losses = [run.trainer.step(*wl.batch(i, dev, cast)) for i in range(steps)]
    run.losses = torch.stack(losses).float().cpu().tolist()
    if not all(math.isfinite(v) for v in run.losses):
        run.status, run.note = "error", "the loss became NaN or infinite: the run diverged"
    return run


def peak_step_bytes(run: Run, wl: cli.Workload, dev: torch.device) -> int:
    """One training step's peak memory above what was held before it (the model and AdamW's
    state exist already; the last step's gradients are freed first, so both count theirs)."""
    cast = run.recipe.weights if run.recipe.weights != torch.float32 else None
    x, y = wl.batch(0, dev, cast)
    run.trainer.optimizer.zero_grad(set_to_none=True)
    with _context(run.recipe):
        return utils.measure_peak_memory(run.trainer.step, x, y, device=dev).peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except cli.UsageError as exc:
        print(f"amp_training.py: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    # Everything that can be refused is refused before any work (and before the printout).
    dev = cli.resolve_device(args.device)
    smoke = cli.resolve_size(args.smoke, args.full, dev)
    tier = cli.size_tier(smoke, dev)
    models = cli.split_list(args.models, list(cli.MODELS), "models")
    if models is None:
        models = [] if args.model else (["tinygpt"] if smoke else list(cli.MODELS))
    every = (args.modes or "").strip() == "all"   # all that run here, the others listed
    recipes, skipped = choose_recipes(
        None if every else cli.split_list(args.modes, list(RECIPES), "modes"), smoke, dev,
        every=every)
    steps = STEPS[tier] if args.steps is None else args.steps
    if steps < 6:
        raise cli.UsageError(f"--steps must be at least 6 (the final loss is the mean of the "
                             f"last 5 steps, compared with the first), got {steps}")
    if not args.clip >= 0:
        raise cli.UsageError(f"--clip must be a norm >= 0 (0: no clipping), got {args.clip}")
    if args.min_run_time is not None and not args.min_run_time > 0:
        raise cli.UsageError(f"--min-run-time must be a positive number of seconds, "
                             f"got {args.min_run_time}")
    if args.threads is not None and args.threads < 1:
        raise cli.UsageError(f"--threads must be at least 1, got {args.threads}")
    workloads = {m: cli.build_workload(m, SIZES[m][tier], n_batches=min(steps, POOL))
                 for m in models}
    for spec in args.model:
        wl = cli.factory_workload(spec, smoke=smoke)
        wl.name = cli.unique_name(wl.name, workloads)
        if not wl.trains:
            raise cli.UsageError(f"--model {spec}: its factory gave no targets, and this script "
                                 "trains: return (model, inputs, targets)")
        workloads[wl.name] = wl
    k_last = max(5, steps // 10)
    clip = args.clip or None

    env = utils.print_env(dev)   # what every number below was measured on
    # On a CPU, ONE thread unless --threads says otherwise (module 02's notebooks do the
    # same: on a busy machine a second thread's waits bury what is measured).
    if dev.type == "cpu" or args.threads:
        torch.set_num_threads(args.threads or 1)
    utils.set_tf32(False)                     # the reference is true fp32; tf32 turns it on
    torch.backends.cudnn.benchmark = True     # cuDNN picks its fastest convolutions
    print(f"\nsize: {'smoke' if smoke else 'full'} ({tier} sizes); {steps} steps per recipe "
          f"(learning-rate warm-up {max(3, steps // 10)} steps), AdamW, gradients clipped to "
          f"norm {clip if clip else 'off'}; CPU threads {torch.get_num_threads()}")
    print("recipes: " + ", ".join(r.label for r in recipes))
    for key, why in skipped.items():
        print(f"  {RECIPES[key].label}: not run here ({why})")
    for name, wl in workloads.items():
        print(f"  {name:<9} {wl.describe}")
    print(f"loss check: the mean of the last {k_last} losses within {LOSS_TOL:.0%} of fp32's "
          f"loss drop, where fp32 shed at least {MIN_LEARNED:.0%} of its first loss")

    ledger = None
    if (args.results or "").lower() != "none":
        ledger = utils.Ledger(NOTEBOOK, smoke=smoke, env=env, strict=False)
        ledger.record("torch_threads_used", torch.get_num_threads(), "threads")
        ledger.record("steps", steps, "steps")
    runs: list[Run] = []
    bar = cli.progress(len(workloads) * len(recipes), "check + train",
                       enabled=not args.no_progress)
    for name, wl in workloads.items():
        cli.say(f"{name}:", bar)
        model_runs = run_model(wl, recipes, dev, steps, k_last, clip, tier, args, bar)
        runs += model_runs
        if ledger is not None:  # saved after every model: a crash loses nothing measured
            write_ledger(model_runs, ledger, wl)
            ledger.save(args.results)
        for r in model_runs:
            r.trainer = None  # free the model and its optimizer state
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()

    print("\n" + table(runs, skipped))
    print("check: the worst of loss and logits vs fp32 at the initial weights, in units of the "
          "recipe's tolerance (above 1 fails); step ms: median over blocks of steps, IQR its "
          "spread (75th - 25th percentile, a share of the median); speedup and memory: fp32 / "
          "the recipe and the recipe / fp32; loss gap: |final - fp32's final| / fp32's drop "
          f"(final = mean of the last {k_last} steps)")
    if ledger is not None:
        print(f"results: {ledger.save(args.results)} (python -m utils report <its folder> "
              "renders it)")
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        print(f"\n{len(failed)} run(s) failed: " + "; ".join(
            f"{r.model}, {r.recipe.key}: {r.status} ({r.note})" for r in failed))
        return 1
    return 0


def run_model(wl: cli.Workload, recipes: list[Recipe], dev: torch.device, steps: int,
              k_last: int, clip: float | None, tier: str, args: argparse.Namespace,
              bar) -> list[Run]:
    # The reference function: fp32 at the initial weights, TF32 off.
    ref_model = copy.deepcopy(wl.model).to(dev)
    x0, y0 = wl.batch(0, dev)
    with utils.tf32(False), torch.no_grad():
        ref_logits = ref_model(x0).float()
    ref = (ref_logits, F.cross_entropy(ref_logits.flatten(0, -2), y0.flatten()))
    del ref_model
    runs: list[Run] = []
    for recipe in recipes:
        try:
            if recipe.key == "fp32":
                excess, how = 0.0, "the reference"
            else:
                excess, how = check_function(wl, recipe, dev, ref)
            if excess > 1:
                run = Run(wl.name, recipe, status="FAILED CHECK", excess=excess,
                          note=f"{excess:.1f}x its tolerance ({how}); not trained or timed")
                cli.say(f"  {recipe.label}: FAILED its correctness check: {run.note}", bar)
            else:
                run = train_recipe(wl, recipe, dev, steps, clip)
                run.excess = excess
                cli.say(f"  {recipe.label}: " + (f"matches fp32 at the start ({excess:.2f} of "
                        f"its tolerance); " if recipe.key != "fp32" else "") +
                        f"loss {run.losses[0]:.3f} -> {sum(run.losses[-k_last:]) / k_last:.3f} "
                        f"in {steps} steps", bar)
        except Exception as exc:  # noqa: BLE001 - one failing recipe must not stop the rest
            run = Run(wl.name, recipe, status="error", note=cli.short_error(exc))
            cli.say(f"  {recipe.label}: ERROR {run.note}", bar)
        runs.append(run)
        if bar is not None:
            bar.update()
    ok = [r for r in runs if r.status == "ok"]
    ref_run = next((r for r in ok if r.recipe.key == "fp32"), None)
    if ref_run is not None:
        for r in ok:
            try:
                r.gap = utils.loss_gap(r.losses, ref_run.losses, last=k_last)
            except ValueError as exc:  # fp32 did not learn at all: no gap to speak of
                r.note = str(exc)
                continue
            if r.recipe.key == "fp32" or not r.gap.reference_learned(MIN_LEARNED):
                continue
            if r.gap.gap_of_drop > LOSS_TOL and r.recipe.master_weights:
                r.status = "LOSS DIFFERS"
                r.note = (f"ended {r.gap.gap_of_drop:.1%} of fp32's loss drop away from fp32 "
                          f"(allowed {LOSS_TOL:.0%})")
        for r in ok:  # memory first: one step each, before the timing rounds
            try:
                r.peak_bytes = peak_step_bytes(r, wl, dev)
            except Exception as exc:  # noqa: BLE001
                r.note = (r.note + "; " if r.note else "") + "memory: " + cli.short_error(exc)
        jobs = {}
        for r in ok:
            cast = r.recipe.weights if r.recipe.weights != torch.float32 else None
            x, y = wl.batch(0, dev, cast)
            jobs[r.recipe.key] = utils.TimingJob(
                r.recipe.label, r.trainer.step, (x, y),
                context=(lambda rec=r.recipe: _context(rec)))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of", category=UserWarning)
            timings = utils.best_of_rounds(jobs, rounds=ROUNDS[tier], device=dev,
                                           min_run_time_s=args.min_run_time or RUN_S[tier])
        for r in ok:
            r.timing = timings[r.recipe.key]
        fp32_ms = timings["fp32"].median_ms
        for r in ok:
            if r.recipe.key != "fp32":
                cli.say(f"  {r.recipe.label}: step {fp32_ms / r.timing.median_ms:.2f}x fp32's "
                        "speed" + (f", peak memory {r.peak_bytes / ref_run.peak_bytes:.2f}x "
                                   "fp32's" if r.peak_bytes and ref_run.peak_bytes else ""), bar)
    return runs


def _ref(runs: list[Run]) -> Run | None:
    return next((r for r in runs if r.recipe.key == "fp32" and r.status == "ok"), None)


def table(runs: list[Run], skipped: dict[str, str]) -> str:
    rows = []
    for model in dict.fromkeys(r.model for r in runs):
        mine = [r for r in runs if r.model == model]
        ref = _ref(mine)
        for r in mine:
            speed = mem = "-"
            if r.timing is not None and ref is not None and ref.timing is not None:
                speed = f"{ref.timing.median_ms / r.timing.median_ms:.2f}x"
            if r.peak_bytes and ref is not None and ref.peak_bytes:
                mem = f"{r.peak_bytes / ref.peak_bytes:.2f}x"
            if r.gap is None:
                gap, verdict = "-", ("reference" if r.recipe.key == "fp32" and r.status == "ok"
                                     else "-")
            elif r.recipe.key == "fp32":
                gap, verdict = "-", f"reference (shed {r.gap.ref_drop_share:.0%})"
            else:
                gap = f"{r.gap.gap_of_drop:.2%}"
                if not r.gap.reference_learned(MIN_LEARNED):
                    verdict = f"n/a: fp32 shed only {r.gap.ref_drop_share:.0%}"
                elif r.gap.gap_of_drop <= LOSS_TOL:
                    verdict = "trains like fp32"
                elif r.recipe.master_weights:
                    verdict = "DIFFERS"
                else:
                    verdict = "differs (no fp32 master weights: reported)"
            final = (f"{sum(r.losses[-5:]) / len(r.losses[-5:]):.3f}" if r.losses else "-")
            rows.append([model, r.recipe.label,
                         "-" if r.excess is None else f"{r.excess:.2f}",
                         "-" if r.timing is None else f"{r.timing.median_ms:.3f}",
                         "-" if r.timing is None else f"{r.timing.iqr_fraction:.0%}",
                         speed,
                         "-" if r.peak_bytes is None else utils.format_bytes(r.peak_bytes),
                         mem,
                         f"{r.losses[0]:.3f}" if r.losses else "-", final, gap,
                         verdict if r.status == "ok" else f"{r.status}: {r.note}"])
    for key, why in skipped.items():
        rows.append(["*", RECIPES[key].label] + ["-"] * 9 + [f"not run here ({why})"])
    return cli.text_table(["model", "recipe", "check", "step ms", "IQR", "speedup", "peak mem",
                           "mem vs fp32", "first loss", "final loss", "loss gap", "verdict"],
                          rows, right=range(2, 11))


def write_ledger(runs: list[Run], ledger: utils.Ledger, wl: cli.Workload) -> None:
    ref = _ref(runs)
    quiet = contextlib.redirect_stdout(io.StringIO())  # the lines are printed already
    with quiet:
        for r in runs:
            key = f"{r.model}, {r.recipe.key}"
            what = f"{wl.describe}; {r.recipe.label}"
            if r.excess is not None and r.recipe.key != "fp32":
                ledger.expect(f"check_excess[{key}]", r.excess, at_most=1.0, in_smoke=True,
                              description=f"{r.model}, {r.recipe.label} vs fp32 at the initial "
                                          "weights: worst of loss and logits, in units of the "
                                          "tolerance",
                              reason="the same function in another arithmetic")
            if r.timing is not None:
                ledger.record(f"step_ms[{key}]", r.timing.median_ms, "ms",
                              note=f"median; IQR {r.timing.iqr_fraction:.0%} of it")
                if ref is not None and ref.timing is not None and r is not ref:
                    ledger.record(f"step_speedup[{key}]",
                                  ref.timing.median_ms / r.timing.median_ms, "x",
                                  note=f"{what}: training step vs fp32 (TF32 off)")
            if r.peak_bytes is not None:
                ledger.record(f"peak_bytes[{key}]", r.peak_bytes, "bytes",
                              note="one training step's peak above what it started with")
                if ref is not None and ref.peak_bytes and r is not ref:
                    ledger.record(f"peak_ratio[{key}]", r.peak_bytes / ref.peak_bytes, "x",
                                  note=f"{what}: training step peak memory / fp32's")
            if r.gap is not None:
                if r.recipe.key == "fp32":
                    ledger.record(f"fp32_drop_share[{r.model}]", r.gap.ref_drop_share,
                                  "fraction", note="share of its first loss fp32 shed")
                    continue
                learned = r.gap.reference_learned(MIN_LEARNED)
                if r.recipe.master_weights:
                    ledger.expect(f"loss_gap[{key}]", r.gap.gap_of_drop, at_most=LOSS_TOL,
                                  in_smoke=True, applies=learned, unit="fraction",
                                  description=f"{r.model}, {r.recipe.label}: final-loss gap "
                                              "to fp32 as a share of fp32's loss drop",
                                  reason="fp32 master weights keep every update; rounding "
                                         "only" if learned else
                                         f"fp32 shed only {r.gap.ref_drop_share:.0%} of its "
                                         f"first loss (< {MIN_LEARNED:.0%}): no drop to "
                                         "measure a gap against")
                else:
                    ledger.record(f"loss_gap[{key}]", r.gap.gap_of_drop, "fraction",
                                  note="no fp32 master weights: reported, not checked")


if __name__ == "__main__":
    sys.exit(main())
