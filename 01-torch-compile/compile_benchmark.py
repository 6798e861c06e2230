"""Eager against torch.compile, mode by mode, for training and inference: one command, no Jupyter.

For each model (the course's transformer, CNN and LSTM, or your own) and each task (a
training step: forward, loss, backward and AdamW; an inference forward pass), this script

  1. runs the eager version once, and each compile mode's version once from the same
     weights on the same batch: that first call compiles, and its time is reported on its
     own (compile time is a one-off; it is not in the steady-state figures);
  2. checks that the compiled version computes what eager computes (the loss and every
     gradient, or the outputs) within utils.tolerance for the dtype and the TF32 state in
     effect, BEFORE timing anything; a version that fails is not timed, and the script
     exits with status 1;
  3. times eager and every version that passed with utils.benchmark (blocks of calls on a
     clock that synchronises the device; median and interquartile range over blocks), and
     prints one table: compile time, median, spread, speedup, and how many calls the
     compile takes to pay for itself.

Everything it measures goes to a ledger (JSON) that `python -m utils report` reads; the
report's table of popular claims ("torch.compile gives 1.3-2x", ...) takes its figures
from it.

Size: --smoke is small models on one batch (about a minute on a 2-core CPU; with no
other choice it runs one model, TinyGPT, in one mode, default); full size (the default
on a GPU) runs all three models in every mode this machine can run. The modes
reduce-overhead and max-autotune record CUDA graphs and need a CUDA GPU.

Examples:

    python 01-torch-compile/compile_benchmark.py          # everything, full size on a GPU
    python 01-torch-compile/compile_benchmark.py --smoke               # a quick check of the setup
    python 01-torch-compile/compile_benchmark.py --models lstm --modes default,max-autotune
    python 01-torch-compile/compile_benchmark.py --model mypkg.nets:build --tasks infer
    python 01-torch-compile/compile_benchmark.py --amp bf16 --results runs/compile.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import math
import sys
import warnings
from dataclasses import dataclass

import torch
import torch._dynamo

import utils
from utils import cli, ladder
from utils import compiletools as ct

NOTEBOOK = "01-torch-compile/compile_benchmark"  # the ledger's name (results/.../<this>.json)
MODES = ladder.COMPILE_MODES
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
TASKS = ("train", "infer")
AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Sizes are data: one column per tier (smoke; full size on a CPU, which runs but whose
# speedups say little about a GPU; full size on a GPU). The GPU column is module 01's
# notebook 01 (about 21 M parameters and 8192 tokens per step for TinyGPT): real work for an
# H100, small enough that max-autotune compiles in minutes.
SIZES = {
    "tinygpt": {
        "smoke": dict(vocab=256, seq=32, layers=1, heads=2, width=64, batch=4, lr=1e-3),
        "cpu": dict(vocab=1024, seq=64, layers=2, heads=4, width=128, batch=8, lr=1e-3),
        "gpu": dict(vocab=4096, seq=256, layers=6, heads=8, width=512, batch=32, lr=1e-3),
    },
    "smallcnn": {
        "smoke": dict(width=8, image=32, batch=16, lr=1e-3),
        "cpu": dict(width=16, image=32, batch=64, lr=1e-3),
        "gpu": dict(width=64, image=32, batch=256, lr=1e-3),
    },
    "lstm": {
        "smoke": dict(vocab=256, seq=32, layers=1, width=64, hidden=64, batch=4, lr=2e-3),
        "cpu": dict(vocab=1024, seq=64, layers=2, width=128, hidden=128, batch=8, lr=2e-3),
        "gpu": dict(vocab=4096, seq=256, layers=2, width=512, hidden=512, batch=32, lr=2e-3),
    },
}
RUN_S = {"smoke": 0.05, "cpu": 0.3, "gpu": 0.5}   # min_run_time_s of each timing
ROUNDS = {"smoke": 1, "cpu": 2, "gpu": 1}          # interleaved timing rounds, fastest kept
DEFAULTS = {  # what runs when --models / --modes / --tasks are not given
    "smoke": dict(models=["tinygpt"], modes=["default"], tasks=list(TASKS)),
    "full": dict(models=list(cli.MODELS), modes=list(MODES), tasks=list(TASKS)),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compile_benchmark.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 when every check passed; 1 when a compiled version failed its "
               "correctness check or a run failed (the table says which); 2 for a bad option "
               "or hardware this machine lacks (nothing was run).")
    what = p.add_argument_group("what to run")
    what.add_argument("--models", metavar="LIST",
                      help="comma-separated built-in models: " + ", ".join(
                          f"{k} ({cli.FAMILIES[v]})" for k, v in cli.MODELS.items())
                      + "; or all. Default: tinygpt at smoke size, all at full size")
    what.add_argument("--model", action="append", default=[], metavar="MODULE:FACTORY",
                      help="your own model (repeatable): package.module:factory or "
                           "path/to/file.py:factory, where factory() (or factory(smoke=...)) "
                           "returns (model, inputs, targets): targets are class indices for "
                           "cross-entropy, shaped like the logits without their last "
                           "dimension, or None to run inference only. Given alone, it "
                           "replaces the built-in models")
    what.add_argument("--modes", metavar="LIST",
                      help="comma-separated torch.compile modes: " + ", ".join(MODES)
                           + "; or all (every one this machine runs). Default: default at "
                             "smoke size, every mode this machine can run at full size (the "
                             "CUDA-graph modes need a GPU)")
    what.add_argument("--tasks", metavar="LIST",
                      help="train (forward + loss + backward + AdamW, model and loss "
                           "compiled together), infer (forward under no_grad), or both "
                           "(the default)")
    what.add_argument("--amp", choices=tuple(AMP), default="fp32",
                      help="precision: fp32 (default; TF32 on where the GPU has it), bf16 "
                           "autocast (a CPU or a GPU with bf16), fp16 autocast + GradScaler "
                           "(CUDA only)")
    what.add_argument("--allow-rnn", action="store_true",
                      help="set torch._dynamo.config.allow_rnn: compile unrolls nn.LSTM over "
                           "time instead of leaving it to its library kernel (experimental "
                           "in torch; compile time grows with the sequence length)")
    _, out = cli.add_size_and_output_args(
        p, ledger_file="01-torch-compile__compile_benchmark.json",
        smoke_what="small models, short timings", run_time_default="0.05 smoke, 0.5 on a GPU",
        module="module 01")
    out.add_argument("--fresh-cache", action="store_true",
                     help="compile into an empty Inductor cache: cold compile times, as a first "
                          "run on a new machine sees them (default: the cache as it is)")
    return p


@dataclass
class Row:
    """One line of the final table."""

    model: str
    task: str
    mode: str
    status: str = "ok"              # ok / FAILED CHECK / error / skipped
    note: str = ""
    compile_s: float | None = None
    graphs: int | None = None
    excess: float | None = None
    timing: utils.Timing | None = None
    eager: utils.Timing | None = None

    @property
    def speedup(self) -> float | None:
        if self.timing is None or self.eager is None:
            return None
        return self.eager.median_ms / self.timing.median_ms

    def key(self) -> str:
        return f"{self.model} {self.task}, {self.mode}"


def check_hardware(args: argparse.Namespace, dev: torch.device,
                   modes: list[str], explicit: bool) -> tuple[list[str], dict[str, str]]:
    """The modes that run here and why the others do not.

    Raises:
        cli.UsageError: the user asked for something this machine cannot run.
    """
    skipped: dict[str, str] = {}
    cuda = dev.type == "cuda"
    for m in modes:
        if m in CUDA_GRAPH_MODES and not cuda:
            skipped[m] = "it records CUDA graphs, which need a CUDA GPU"
    if explicit and skipped:
        can = [m for m in modes if m not in skipped] or ["default", "max-autotune-no-cudagraphs"]
        raise cli.UsageError(
            f"--modes {','.join(skipped)}: " + "; ".join(f"{m}: {why}" for m, why in
                                                           skipped.items())
            + f", and this run is on {dev}. Run it on a GPU node, or choose from "
              f"{', '.join(can)}")
    if args.amp == "fp16" and not cuda:
        raise cli.UsageError(
            "--amp fp16: fp16 training runs on CUDA GPUs only in this course: CPUs have no "
            "fp16 arithmetic units (it is emulated, slowly), and nn.LSTM has no CPU fp16 "
            "kernel; use --amp bf16 on a CPU, or run on a GPU node")
    if args.amp == "bf16" and cuda and not cli.native_bf16(dev):
        raise cli.UsageError(f"--amp bf16: {torch.cuda.get_device_name(dev)} has no native "
                             "bfloat16 (it needs sm80 or newer); use --amp fp16")
    return [m for m in modes if m not in skipped], skipped


def _first_train_step(trainer: ladder.Trainer, x: torch.Tensor, y: torch.Tensor,
                      dev: torch.device) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """Seconds of the first step (compiling, for a compiled trainer), its loss, and the
    gradients it handed to AdamW (one fp32 copy per parameter)."""
    out: list[torch.Tensor] = []
    seconds = utils.first_call_s(lambda: out.append(trainer.step(x, y)), device=dev)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().clone()
             for p in trainer.model.parameters()]
    return seconds, out[0].detach().float().clone(), grads


def _excess(actual: torch.Tensor, expected: torch.Tensor, tol: utils.Tolerance,
            whole_tensor: bool) -> float:
    """The error in units of ``tol``: the worst element's (fp32, TF32), or, for 16-bit
    autocast, the tensor's as a whole: RMS(actual - expected) against atol + rtol x
    RMS(expected), assert_close's rule in RMS form. Under autocast eager rounds every op's
    output to 16 bits and compiled code keeps fused intermediates in fp32, so single
    elements (sums that cancel, such as a BatchNorm's gradients) differ by more than a few
    roundings while the tensor does not: measured on the smoke-size SmallCNN in bf16, the
    worst element was 4.8x its tolerance and the worst tensor 0.7x (module 02's notebook 04
    compares bf16 logits as whole tensors for the same reason). A real bug (a wrong sign, a
    missing term) moves the whole tensor."""
    if not whole_tensor:
        return tol.excess(actual, expected)
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    rms = (lambda t: float(t.pow(2).mean().sqrt()) if t.numel() else 0.0)
    return rms(a - e) / (tol.atol + tol.rtol * rms(e))


def _inference_fn(model: torch.nn.Module, amp_dtype: torch.dtype | None, device_type: str,
                  cudagraphs: bool = False):
    """``model(x)`` under no_grad (and autocast). With CUDA graphs each call is marked as a
    new step, so that the graph may reuse its output memory: no output is kept past the next
    call."""
    @torch.no_grad()
    def infer(x: torch.Tensor) -> torch.Tensor:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device_type, dtype=amp_dtype or torch.bfloat16,
                            enabled=amp_dtype is not None):
            return model(x)
    return infer


def run_task(wl: cli.Workload, task: str, modes: list[str], args: argparse.Namespace,
             dev: torch.device, tier: str, bar) -> list[Row]:
    """Eager and every mode for one model and task: first calls, checks, then timings."""
    amp_dtype = AMP[args.amp]
    dtype = amp_dtype or torch.float32
    whole = amp_dtype is not None   # 16-bit autocast: compare whole tensors (see _excess)
    x, y = wl.batch(0, dev)
    rows: list[Row] = []
    jobs: dict[str, utils.TimingJob] = {}
    cache = ct.fresh_cache if args.fresh_cache else contextlib.nullcontext
    # Forget what the tasks before compiled (they are timed already): every compiled version
    # of one function counts against Dynamo's recompile limit (8 per function), and the modes
    # of one task must all stay compiled until they are timed, so nothing is reset between
    # them: their graphs are counted as differences.
    ct.reset_compile_state()
    if task == "train":
        cfg = ladder.TrainConfig(amp=None if args.amp == "fp32" else args.amp)

        def trainer(mode: str | None) -> ladder.Trainer:
            c = ladder.TrainConfig(amp=cfg.amp, compile=mode)
            return ladder.Trainer(copy.deepcopy(wl.model).to(dev), c, device=dev,
                                  num_classes=wl.num_classes, lr=wl.lr)

        eager = trainer(None)
        _, loss_e, grads_e = _first_train_step(eager, x, y, dev)
        jobs["eager"] = utils.TimingJob("eager", eager.step, (x, y))
        for mode in modes:
            row = Row(wl.name, task, mode)
            rows.append(row)
            try:
                before = ct.compile_counts().graphs
                compiled = trainer(mode)
                with cache():
                    row.compile_s, loss_c, grads_c = _first_train_step(compiled, x, y, dev)
                row.graphs = ct.compile_counts().graphs - before
                tol_l = utils.tolerance(dtype, dev, scale=loss_e)
                row.excess = tol_l.excess(loss_c, loss_e)
                flat_e = torch.cat([g.flatten() for g in grads_e])
                flat_c = torch.cat([g.flatten() for g in grads_c])
                if bool(torch.isfinite(flat_e).all() and torch.isfinite(flat_c).all()):
                    # atol from the RMS of all the gradients together, so that a small
                    # gradient is held to the same standard as a large one
                    tol_g = utils.tolerance(dtype, dev, scale=flat_e)
                    row.excess = max([row.excess] + [_excess(c, e, tol_g, whole)
                                                     for c, e in zip(grads_c, grads_e)])
                    row.note = (f"loss and gradients vs eager, {tol_g}"
                                + (", each gradient as a whole tensor" if whole else ""))
                else:  # fp16: the GradScaler's first scale overflowed and it skipped the step
                    row.note = (f"loss vs eager, {tol_l} (the first step's fp16 gradients "
                                "overflowed, so the GradScaler skipped it: loss compared only)")
                if row.excess <= 1:
                    jobs[mode] = utils.TimingJob(mode, compiled.step, (x, y))
            except Exception as exc:  # noqa: BLE001 - one failing mode must not stop the rest
                row.status, row.note = "error", cli.short_error(exc)
            _report_check(row, bar)
    else:
        eager_model = copy.deepcopy(wl.model).to(dev).eval()
        eager_fn = _inference_fn(eager_model, amp_dtype, dev.type)
        ref = eager_fn(x).float()
        jobs["eager"] = utils.TimingJob("eager", eager_fn, (x,))
        for mode in modes:
            row = Row(wl.name, task, mode)
            rows.append(row)
            try:
                before = ct.compile_counts().graphs
                model_c = torch.compile(copy.deepcopy(wl.model).to(dev).eval(), mode=mode,
                                        dynamic=False)
                fn = _inference_fn(model_c, amp_dtype, dev.type,
                                   cudagraphs=dev.type == "cuda" and mode in CUDA_GRAPH_MODES)
                with cache():
                    row.compile_s = utils.first_call_s(fn, x, device=dev)
                row.graphs = ct.compile_counts().graphs - before
                for _ in range(2):  # with CUDA graphs: 1 warms up, 2 records, 3 replays
                    fn(x)
                out = fn(x).float()
                tol = utils.tolerance(dtype, dev, scale=ref)
                row.excess = _excess(out, ref, tol, whole)
                row.note = f"outputs vs eager, {tol}" + (" (as a whole tensor)" if whole else "")
                if row.excess <= 1:
                    jobs[mode] = utils.TimingJob(mode, fn, (x,))
            except Exception as exc:  # noqa: BLE001
                row.status, row.note = "error", cli.short_error(exc)
            _report_check(row, bar)
    if len(jobs) > 1 or not modes:
        timings = utils.best_of_rounds(jobs, rounds=ROUNDS[tier], device=dev,
                                       min_run_time_s=args.min_run_time or RUN_S[tier])
        for row in rows:
            row.eager = timings["eager"]
            row.timing = timings.get(row.mode)
        if not modes:
            rows.append(Row(wl.name, task, "eager", eager=timings["eager"],
                            timing=timings["eager"]))
    for row in rows:
        if row.speedup is not None:
            cli.say(f"  {row.key()}: {row.speedup:.2f}x eager (eager "
                    f"{row.eager.median_ms:.3f} ms, compiled {row.timing.median_ms:.3f} ms)", bar)
    return rows


def _report_check(row: Row, bar) -> None:
    if row.status == "error":
        cli.say(f"  {row.key()}: ERROR {row.note}", bar)
    elif row.excess is not None and row.excess > 1:
        row.status = "FAILED CHECK"
        cli.say(f"  {row.key()}: FAILED its correctness check: the worst element is "
                f"{row.excess:.1f}x its tolerance ({row.note}); not timed", bar)
    else:
        cli.say(f"  {row.key()}: compiled in {row.compile_s:.1f} s ({row.graphs} graph(s)); "
                f"matches eager (worst element {row.excess:.2f} of its tolerance)", bar)
    if bar is not None:
        bar.update()


def table(rows: list[Row], skipped: dict[str, str]) -> str:
    out = []
    for r in rows:
        s = r.speedup
        pays = "-"
        if s is not None and r.compile_s is not None and r.mode != "eager":
            saved = r.eager.median_ms - r.timing.median_ms
            pays = f"{math.ceil(r.compile_s * 1e3 / saved):,} calls" if saved > 0 else "never"
        out.append([
            r.model, r.task, r.mode,
            "-" if r.compile_s is None else f"{r.compile_s:.1f}",
            "-" if r.graphs is None else str(r.graphs),
            "-" if r.eager is None else f"{r.eager.median_ms:.3f}",
            "-" if r.timing is None else f"{r.timing.median_ms:.3f}",
            "-" if r.timing is None else f"{r.timing.iqr_fraction:.0%}",
            "-" if s is None else f"{s:.2f}x",
            pays,
            "-" if r.excess is None else f"{r.excess:.2f}",
            r.status if r.status != "error" else "error: " + r.note,
        ])
    for mode, why in skipped.items():
        out.append(["*", "*", mode, "-", "-", "-", "-", "-", "-", "-", "-", f"skipped: {why}"])
    return cli.text_table(
        ["model", "task", "mode", "compile s", "graphs", "eager ms", "compiled ms", "IQR",
         "speedup", "pays off after", "check", "status"], out, right=range(3, 11))


def write_ledger(rows: list[Row], ledger: utils.Ledger, workloads: dict[str, cli.Workload],
                 args: argparse.Namespace) -> None:
    for r in rows:
        if r.mode == "eager":
            continue
        key = r.key()
        what = (f"{workloads[r.model].describe}; {r.task} ({args.amp}"
                + (", allow_rnn" if args.allow_rnn else "") + f"), compile mode {r.mode}")
        if r.excess is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # the check's line is printed already
                ledger.expect(f"check_excess[{key}]", r.excess, at_most=1.0, in_smoke=True,
                              description=f"compiled vs eager, worst element in units of its "
                                          f"tolerance: {r.model} {r.task}, mode {r.mode}",
                              reason="the same function, computed in another order")
        if r.compile_s is not None:
            ledger.record(f"compile_s[{key}]", r.compile_s, "s",
                          note="first call: compile and one step" + (
                              ", fresh Inductor cache" if args.fresh_cache else ""))
        if r.graphs is not None:
            ledger.record(f"graphs[{key}]", r.graphs, "graphs")
        if r.speedup is not None:
            ledger.record(f"speedup[{key}]", r.speedup, "x", note=what)
            ledger.record(f"compiled_ms[{key}]", r.timing.median_ms, "ms",
                          note=f"median; IQR {r.timing.iqr_fraction:.0%} of it")
            ledger.record(f"eager_ms[{r.model} {r.task}]", r.eager.median_ms, "ms",
                          note=f"median; IQR {r.eager.iqr_fraction:.0%} of it")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except cli.UsageError as exc:
        print(f"compile_benchmark.py: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    # Everything that can be refused is refused before any work (and before the printout).
    dev = cli.resolve_device(args.device)
    smoke = cli.resolve_size(args.smoke, args.full, dev)
    tier = cli.size_tier(smoke, dev)
    defaults = DEFAULTS["smoke" if smoke else "full"]
    models = cli.split_list(args.models, list(cli.MODELS), "models")
    if models is None:
        models = [] if args.model else defaults["models"]
    every = (args.modes or "").strip() == "all"   # all that run here, the others listed
    modes_asked = None if every else cli.split_list(args.modes, list(MODES), "modes")
    modes, skipped = check_hardware(args, dev, list(MODES) if every else
                                    (modes_asked or defaults["modes"]),
                                    explicit=modes_asked is not None)
    tasks = cli.split_list(args.tasks, list(TASKS), "tasks") or defaults["tasks"]
    if args.min_run_time is not None and not args.min_run_time > 0:
        raise cli.UsageError(f"--min-run-time must be a positive number of seconds, "
                             f"got {args.min_run_time}")
    if args.threads is not None and args.threads < 1:
        raise cli.UsageError(f"--threads must be at least 1, got {args.threads}")
    workloads = {m: cli.build_workload(m, SIZES[m][tier]) for m in models}
    for spec in args.model:
        wl = cli.factory_workload(spec, smoke=smoke)
        wl.name = cli.unique_name(wl.name, workloads)
        workloads[wl.name] = wl

    env = utils.print_env(dev)   # what every number below was measured on
    if args.threads and dev.type == "cuda":
        torch.set_num_threads(args.threads)
    # The module's switches (utils.compiletools.compile_settings): TF32 for fp32 matmuls and
    # cuDNN convolutions where the GPU has it, cudnn.benchmark on, and on a CPU one thread
    # unless --threads says otherwise (on a busy machine a second thread's waits bury what is
    # measured: a smoke-size training step took 2.4 ms on one thread and 600 ms on two, on a
    # 2-core machine with other work running); set once, before compiling.
    settings = ct.compile_settings(env, tf32=True, cudnn_benchmark=True,
                                   cpu_threads=args.threads or 1)
    if args.allow_rnn:
        torch._dynamo.config.allow_rnn = True
    print(f"\nsize: {'smoke' if smoke else 'full'} ({tier} sizes); settings: {settings}")
    print(f"precision: {args.amp}" + (" (autocast)" if args.amp != "fp32" else "")
          + f"; modes: {', '.join(modes) or 'none'}; tasks: {', '.join(tasks)}")
    for name, wl in workloads.items():
        print(f"  {name:<9} {wl.describe}")
    for mode, why in skipped.items():
        print(f"  mode {mode}: skipped here ({why})")

    ledger = None
    if (args.results or "").lower() != "none":
        ledger = utils.Ledger(NOTEBOOK, smoke=smoke, env=env, strict=False)
    rows: list[Row] = []
    runs = [(name, task) for name in workloads for task in tasks
            if task == "infer" or workloads[name].trains]
    for name in workloads:
        if "train" in tasks and not workloads[name].trains:
            print(f"  {name}: its factory gave no targets, so it runs inference only")
    bar = cli.progress(len(runs) * max(len(modes), 1), "compile + check",
                       enabled=not args.no_progress)
    with warnings.catch_warnings():
        # torch 2.11's autotuner calls the deprecated tensor.storage() itself
        # (torch/_inductor/select_algorithm.py); only that warning, from there, is silenced.
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                                module=r"torch\._inductor\.select_algorithm")
        for name, task in runs:
            cli.say(f"{name} {task}:", bar)
            task_rows = run_task(workloads[name], task, modes, args, dev, tier, bar)
            rows += task_rows
            if ledger is not None:  # saved after every model and task: a crash loses nothing
                write_ledger(task_rows, ledger, workloads, args)
                ledger.save(args.results)
    bar.close()

    print("\n" + table(rows, skipped))
    print("compile s: the first call (compile and one step); graphs: graphs Dynamo compiled "
          "(a graph break adds one; 0: nothing was compiled); ms: median per call over "
          "blocks of calls; IQR: its spread (75th - 25th percentile, a share of the median); "
          "speedup: eager / compiled; check: the error in units of its tolerance (fp32: the "
          "worst element; 16-bit autocast: each tensor as a whole), above 1 fails")
    failed = [r for r in rows if r.status not in ("ok",)]
    if ledger is not None:
        print(f"results: {ledger.save(args.results)} (python -m utils report <its folder> "
              "renders it)")
    if failed:
        print(f"\n{len(failed)} run(s) failed: " + "; ".join(
            f"{r.key()}: {r.status}" for r in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
