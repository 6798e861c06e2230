"""Train the capstone's GPT on torch's own sources with the speedup ladder's settings, headless.

The model, the data and the training step are the ones the ladder notebook
(01_speedup_ladder.ipynb) measures: utils.TinyGPT scaled by config, the corpus of
corpus.py, and utils.ladder.Trainer configured by a utils.ladder.TrainConfig. By
default it runs the top rung of the ladder that runs on this machine (with CUDA
graphs on a GPU, without them on a CPU); --rung picks another rung by its short
name, --rung best the rung the notebook measured fastest on this machine (read from
its results file), and the ladder's own flags (--amp, --compile, ...) override
single settings. Beyond the ladder, --loss chunked computes the head and the loss a chunk
of tokens at a time (module 04's utils.chunked_linear_cross_entropy), --fp8 runs the
transformer blocks' linear layers in FP8 (torchao's float8 training; CUDA sm89+),
--bf16-residual keeps the residual stream between the blocks in bf16 (with --amp bf16), and
--compile max-autotune-gemm autotunes the matmuls (max-autotune, bounded to them), and
--compile reduce-overhead-tuned tunes the kernels Inductor generates instead (max-autotune's
coordinate-descent tuning, on its own).

It prints the loss, tokens/s and MFU as it goes (a progress bar, plus a line every
--log-every steps), against a matmul ceiling it measures on this machine at start,
and writes an atomic checkpoint at the end (utils.checkpoint.atomic_save).

Examples:

    python 06-capstone/train.py --help
    python 06-capstone/train.py --preset tiny --steps 50 --out /tmp/gpt.pt
    python 06-capstone/train.py --rung sdpa --steps 100                # an earlier rung
    python 06-capstone/train.py --rung best --steps 2000               # the notebook's fastest
    python 06-capstone/train.py --loss chunked --data random           # GPT-2's vocabulary, chunked loss
    python 06-capstone/train.py --fp8 --steps 100                      # FP8 linears (H100, L4, ...)
    python 06-capstone/train.py --compile max-autotune-gemm --steps 60 # autotuned matmuls
    python 06-capstone/train.py --compile reduce-overhead-tuned --steps 60  # tuned Triton kernels
    python 06-capstone/train.py --bf16-residual --steps 60             # a bf16 residual stream
    python 06-capstone/train.py --benchmark                            # one table, the runs below
    torchrun --standalone --nproc-per-node=8 06-capstone/train.py      # DDP, one process per GPU

Under torchrun each process trains a DistributedDataParallel replica on its slice of
every batch (NCCL with one GPU per process, gloo on CPUs); --batch-size is the global
batch, split over the processes. With more than one process a rung with CUDA graphs
runs with --compile default instead, unless --compile is given: CUDA graphs around
DDP's gradient buckets are untested in this course.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import io
import json
import math
import os
import re
import sys
import time
import textwrap
import traceback

_STARTED = time.perf_counter()  # --benchmark's budget counts from here: torch's import included
from pathlib import Path
from typing import Any, Mapping

import torch

import utils
import utils.distributed as ud
from utils import ladder
from utils.checkpoint import atomic_save
from utils.cli import native_bf16
from utils.compiletools import KERNEL_CATEGORIES, StepProfile, classify_kernel, profile_step

import corpus  # corpus.py sits next to this script, and Python puts that folder on sys.path

PRESETS = {
    # name: (n_layer, n_head, n_embd, block_size, n_words, max_chars, batch_size, base accum)
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, n_words=8000,
                 max_chars=8_000_000, batch_size=32, base_accum=4),
    "tiny": dict(n_layer=2, n_head=4, n_embd=128, block_size=64, n_words=500,
                 max_chars=1_000_000, batch_size=16, base_accum=4),
}
RUNG_KEYS = [r.key for r in ladder.LADDER]
#: Where the notebook's ledger lands (utils.Ledger's default path): --rung best reads it.
NOTEBOOK_LEDGER = "06-capstone/01_speedup_ladder"


def default_ledger_path() -> Path:
    return utils.results_dir() / (NOTEBOOK_LEDGER.replace("/", "__") + ".json")


def _rung_list() -> str:
    return "; ".join(f"{r.key} = {r.name}" for r in ladder.LADDER)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps each option's help without breaking at hyphens, so a command or a path in it
    (``bash ../shared/gpu/bundle-wheels.sh torchao``) stays whole and can be copied."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description=__doc__,
        epilog="The ladder's rungs, in order (--rung KEY): " + _rung_list() + ".",
        formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=("auto", *PRESETS), default="auto",
                   help="model and data sizes: gpt2 (12 layers, 768 wide, 1024 context), "
                        "tiny (a smoke-size model); auto (the default) = gpt2 on a GPU, "
                        "tiny on a CPU")
    p.add_argument("--rung", choices=("top", "best", *RUNG_KEYS), default="top", metavar="KEY",
                   help="start from this rung's settings: top (the default: every rung that "
                        "runs here), best (the rung the notebook measured fastest on this "
                        "machine, read from --ledger), or a rung's key: " + ", ".join(RUNG_KEYS)
                        + "; the ladder flags below override single settings")
    p.add_argument("--ledger", default=None, metavar="PATH",
                   help="the notebook's results file, for --rung best (default: "
                        "06-capstone__01_speedup_ladder.json in the course's results folder)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 200; with --benchmark, 15 for fp32 eager, 40 for "
                        "the larger batch and 60 for the others)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per optimizer step, over all processes (default: preset)")
    p.add_argument("--n-layer", type=int, default=None, help="layers (default: preset)")
    p.add_argument("--n-head", type=int, default=None, help="attention heads (default: preset)")
    p.add_argument("--n-embd", type=int, default=None, help="model width (default: preset)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per sequence (default: preset)")
    p.add_argument("--n-words", type=int, default=None,
                   help="tokenizer words; the vocabulary is 257 + this (default: preset)")
    p.add_argument("--max-chars", type=int, default=None,
                   help="characters of torch's sources to read (default: preset)")
    p.add_argument("--lr", type=float, default=6e-4,
                   help="AdamW peak learning rate (default: 6e-4)")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="linear learning-rate warm-up steps (default: 10)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay (default: 0.1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and the batch order (default: 0)")
    p.add_argument("--device", default=None,
                   help="cpu or cuda (default: cuda if there is a GPU); under torchrun each "
                        "process takes its own GPU")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per process (default: 0, torch's own choice)")
    p.add_argument("--log-every", type=int, default=10,
                   help="print a progress line every N steps (default: 10)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, lines only")
    p.add_argument("--out", default=str(utils.results_dir() / "capstone_gpt.pt"),
                   help="checkpoint written atomically at the end (default: capstone_gpt.pt in "
                        "the course's results folder, results/local/ or $COURSE_RESULTS_DIR)")
    p.add_argument("--data", choices=("corpus", "random"), default="corpus",
                   help="corpus (the default: torch's sources, tokenized) or random (uniform "
                        "random tokens over --vocab-size, for speed at a vocabulary the corpus "
                        "cannot give, such as GPT-2's; nothing to learn)")
    p.add_argument("--vocab-size", type=int, default=50257,
                   help="with --data random: the vocabulary (default: GPT-2's 50257; padded "
                        "rows are never counted as model FLOPs)")
    p.add_argument("--benchmark", action="store_true",
                   help="measure, briefly and one after the other: " + _benchmark_list() + "; "
                        "print one table (tokens/s, the gain over the run each one changes, "
                        "model TFLOP/s, MFU against the measured ceiling and the datasheet peak, "
                        "the FLOP convention), then the best run's time by kernel kind (CUDA "
                        "only); no checkpoint. A run that cannot run here (FP8 without CUDA "
                        "sm89+ or torchao) says why in its row; an optional run that would end "
                        "past --budget-s is left out, saying so. max-autotune is not among the "
                        "runs: its autotuning can take minutes on a GPU (this module's README "
                        "gives a measured first step), too much for the budget; run it apart "
                        "(--compile max-autotune-gemm, its first step is what it cost)")
    p.add_argument("--fp8-sweep", nargs="?", const=FP8_SWEEP_WIDTHS, default=None,
                   metavar="WIDTHS",
                   help="instead of training: time a GPT block's MLP (d -> 4d -> d) forward and "
                        "backward with bf16 and with FP8 linears at each width (comma-separated, "
                        f"default {FP8_SWEEP_WIDTHS}), each compiled, on the preset's batch x "
                        "--block-size tokens; print where FP8 starts to pay and write a ledger "
                        "(06-capstone/train_fp8_sweep). CUDA sm89+ and torchao; it compiles two small "
                        "models per width")
    p.add_argument("--budget-s", type=float, default=250,
                   help="--benchmark: leave out an optional run (after the first two) whose "
                        "estimated time, from the top rung's, would end it past this many "
                        "seconds from the process's start, imports included (default: 250). "
                        "The table so far and the ledger are written after "
                        "every run, so a run killed at a time limit keeps what it measured")
    p.add_argument("--profile-steps", type=int, default=None, metavar="N",
                   help="after training, profile N more steps and print the step's time by "
                        "kernel kind (matmul, attention, optimizer, copy, other, idle) against "
                        "the FLOP bound at the measured ceiling; CUDA only (default: none; "
                        f"--benchmark profiles {BENCHMARK_PROFILE_STEPS} steps of every compiled "
                        "run unless given --profile-steps 0)")
    p.add_argument("--results", default=None, metavar="PATH",
                   help="where to write this run's figures as a ledger (JSON, what "
                        "`python -m utils report` reads; default: 06-capstone__train.json in "
                        "the course's results folder); 'none' writes none")
    p.add_argument("--timeout-s", type=float, default=300,
                   help="under torchrun: how long a collective may wait for its peers "
                        "(default: 300)")
    ladder.TrainConfig.add_arguments(p)
    return p


def rung_config(rung_key: str | None, amp: str, base_accum: int,
                device_type: str) -> tuple[str, ladder.TrainConfig]:
    """The ladder's cumulative settings up to the rung ``rung_key`` (None or "top": the top
    rung that runs on ``device_type``), the way the notebook climbs it: rungs that need CUDA
    are passed over elsewhere. Returns the rung's name (with this machine's autocast
    dtype) and settings."""
    cfg, name = ladder.TrainConfig(accum_steps=base_accum), "fp32 eager"
    top = rung_key in (None, "top")
    stop = len(RUNG_KEYS) - 1 if top else RUNG_KEYS.index(rung_key)
    for i, rung in enumerate(ladder.default_ladder(amp)[: stop + 1]):
        if rung.needs_cuda and device_type != "cuda" and (top or i < stop):
            continue
        cfg, name = rung.apply(cfg), rung.name
    return name, cfg


def best_rung_key(path: str | os.PathLike, device_name: str) -> tuple[str, str]:
    """The key of the rung the notebook measured fastest, from its results file.

    Returns:
        (the rung's key, a line saying where it comes from).

    Raises:
        ValueError: no file, no best rung in it, or a file measured on another device.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--rung best reads the notebook's results, and {p} does not exist: run "
                         "06-capstone/01_speedup_ladder.ipynb on this machine first, pass its "
                         "results file with --ledger, or pick a rung (--rung top, "
                         + ", ".join(RUNG_KEYS) + ")")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        found = {m["name"]: m for m in data["measurements"]}
        best = found["best_rung_index"]
        measured_on = data.get("env", {}).get("device_name", "?")
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p} holds no best rung (best_rung_index): run the notebook up to "
                         f"section 7 ({type(exc).__name__}: {exc})") from None
    if measured_on != device_name:
        raise ValueError(f"{p} was measured on {measured_on}, and this run is on {device_name}: "
                         "the fastest rung on one device says little about another; run the "
                         "notebook here, or pick a rung")
    index = int(best["value"])
    if not 0 <= index < len(RUNG_KEYS):
        raise ValueError(f"{p}: best_rung_index {index} is not a rung of this ladder")
    size = "smoke" if data.get("smoke") else "full"
    return RUNG_KEYS[index], (f"the fastest rung measured by the notebook on {measured_on} "
                              f"({best.get('note') or RUNG_KEYS[index]}, {size} size, {p})")


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser, world: int):
    """Check the flags together; return (device type, preset name, sizes, config, rung name)."""
    cuda = torch.cuda.is_available()
    if args.device is None:
        device_type = "cuda" if cuda else "cpu"
    elif args.device in ("cpu", "cuda"):
        device_type = args.device
    else:
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device_type == "cuda" and not cuda:
        parser.error("--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() "
                     "is False); use --device cpu")
    preset = _preset(args, device_type)
    sizes = dict(PRESETS[preset])
    for key in ("n_layer", "n_head", "n_embd", "block_size", "n_words", "max_chars",
                "batch_size"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    for key, value in [*sizes.items(), ("steps", args.steps), ("log_every", args.log_every)]:
        if not isinstance(value, int) or value < 1:
            parser.error(f"--{key.replace('_', '-')} must be a positive integer, got {value!r}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.profile_steps is not None and args.profile_steps < 0:
        parser.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if sizes["n_embd"] % sizes["n_head"]:
        parser.error(f"--n-embd ({sizes['n_embd']}) must be divisible by --n-head "
                     f"({sizes['n_head']})")
    bf16_ok = native_bf16(torch.device(device_type))
    amp = "bf16" if bf16_ok else "fp16"
    notes: list[str] = []
    try:
        key = args.rung
        if key == "best":
            device_name = utils.get_env(device_type).device_name
            key, origin = best_rung_key(args.ledger or default_ledger_path(), device_name)
            notes.append(f"--rung best: {origin}")
        rung_name, cfg = rung_config(key, amp, sizes.pop("base_accum"), device_type)
        if world > 1 and device_type == "cuda" and cfg.uses_cuda_graphs and args.compile is None:
            cfg = dataclasses.replace(cfg, compile="default")
            notes.append(f"{world} processes: compile mode default instead of the rung's CUDA "
                         "graphs (CUDA graphs around DDP are untested here; --compile "
                         "reduce-overhead asks for them)")
        cfg = cfg.with_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if cfg.uses_cuda_graphs and device_type != "cuda":
        parser.error(f"--compile {cfg.compile} records CUDA graphs, which need a CUDA GPU; this "
                     "run is on the CPU: use --compile default (or pick an earlier --rung)")
    if cfg.amp == "bf16" and not bf16_ok:
        parser.error("--amp bf16: this GPU has no native bfloat16 (it needs sm80+); use --amp fp16")
    if cfg.fp8:
        reason = ladder.fp8_unavailable_reason(device_type)
        if reason:
            parser.error(f"--fp8: {reason}")
    per_rank, rest = divmod(sizes["batch_size"], world)
    if rest or per_rank % cfg.accum_steps:
        parser.error(f"--batch-size {sizes['batch_size']} must split into {world} process(es) x "
                     f"--accum-steps {cfg.accum_steps} equal micro-batches")
    tokens = per_rank // cfg.accum_steps * sizes["block_size"]
    if cfg.fp8 and tokens % 16:
        # The weight gradient's FP8 matmul has the micro-batch's tokens as an inner dimension,
        # which torch._scaled_mm needs to be a multiple of 16.
        parser.error(f"--fp8: a micro-batch of {tokens} tokens (batch x --block-size per "
                     "micro-batch); FP8 matmuls need a multiple of 16")
    return device_type, preset, sizes, cfg, rung_name, notes


def train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_type, preset, sizes, cfg, rung_name, notes = resolve(args, parser, world)
    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        if world > 1:
            w = stack.enter_context(ud.worker(
                backend="nccl" if device_type == "cuda" else "gloo", timeout_s=args.timeout_s))
            rank, device = w.rank, w.device
        else:
            rank, device = 0, utils.pick_device(device_type)  # cuda:<current>, never index-less
        return _train(args, sizes, cfg, rung_name, preset, rank, world, device, notes)


@functools.lru_cache(maxsize=2)
def _corpus(max_chars: int, n_words: int, seed: int) -> corpus.Corpus:
    """The corpus, built once per process (--benchmark trains on it more than once)."""
    return corpus.build_corpus(max_chars, n_words, seed=seed)


def _train(args, sizes, cfg, rung_name, preset, rank, world, device, notes=()) -> dict:
    from tqdm.auto import tqdm

    main = rank == 0
    say = print if main else (lambda *a, **k: None)
    t_start = time.perf_counter()
    if args.data == "random":
        data = corpus.RandomTokens(args.vocab_size, seed=args.seed)
        vocab = args.vocab_size
    else:
        data = _corpus(sizes["max_chars"], sizes["n_words"], args.seed)
        vocab = data.tokenizer.vocab_size
    gpt_cfg = utils.GPTConfig(vocab_size=vocab, block_size=sizes["block_size"],
                              n_layer=sizes["n_layer"], n_head=sizes["n_head"],
                              n_embd=sizes["n_embd"])
    per_rank = sizes["batch_size"] // world
    seq = sizes["block_size"]

    # The token stream and every step's window starts go to the device once: a step's batch is
    # then cut on the device, with no host-to-device copy for the training loop to wait on.
    batches = data.on_device(device, args.steps, sizes["batch_size"], seq, seed=args.seed)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batches(step)
        return x[rows], y[rows]

    model_fn = ladder.gpt_model_fn(gpt_cfg, seed=args.seed)
    x0, y0 = batch(0)
    flops = ladder.count_step_flops(model_fn(ladder.TrainConfig()), x0, y0, vocab)
    kind = cfg.ceiling_kind
    # the notebook's ceiling routine, with the notebook's settings: quick for the tiny preset
    # (as at smoke size), the default sizes for the GPU-sized model; measured once per kind in
    # a --benchmark (its runs share the cache)
    cache = getattr(args, "ceiling_cache", None)
    if cache is not None and kind in cache:
        ceiling = cache[kind]
    else:
        ceiling = ladder.measure_ceilings_tflops([kind], device, quick=preset == "tiny")[kind]
        if cache is not None:
            cache[kind] = ceiling
    if device.type == "cuda":  # this run's peak: not an earlier run's, nor the ceiling's matrices
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    say(f"device {device} x {world} process(es), torch {torch.__version__}; preset {preset}: "
        f"{gpt_cfg.n_layer} layers, width {gpt_cfg.n_embd}, {gpt_cfg.n_head} heads, "
        f"context {gpt_cfg.block_size}")
    padded_vocab = ladder.padded_size(vocab, cfg.vocab_multiple)
    if args.data == "random":
        say(f"data: uniform random tokens, vocabulary {vocab} (padded to {padded_vocab}): "
            "for speed only, nothing to learn")
    else:
        say(f"data: {data.n_chars:,} characters of torch's sources -> {data.tokens.numel():,} "
            f"tokens, vocabulary {vocab} (padded to {padded_vocab})")
    for note in notes:
        say(note)
    say(f"settings ({rung_name!r} + flags): {cfg.describe()}")
    say(f"  the same settings as flags: {' '.join(cfg.to_flags())}")
    say(f"batch: {sizes['batch_size']} x {seq} tokens per step ({per_rank} per process, "
        f"{cfg.accum_steps} micro-batch(es) of {per_rank // cfg.accum_steps})")
    say(f"FLOPs per step per process: {flops / 1e9:.2f} GFLOP (counted once, {FLOP_CONVENTION}); "
        f"ceiling: {kind} matmul, measured on this machine: {ceiling:.2f} TFLOP/s")

    wrap = None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        def wrap(module):
            return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)

    with utils.tf32(cfg.tf32):
        trainer = ladder.Trainer(model_fn(cfg).to(device), cfg, device=device, num_classes=vocab,
                                 lr=args.lr, weight_decay=args.weight_decay,
                                 warmup_steps=args.warmup_steps, wrap=wrap)
        if cfg.fp8:
            n_linear = sum(isinstance(m, torch.nn.Linear) for m in trainer.model.modules())
            say(f"FP8: {len(trainer.fp8_layers)} of {n_linear} linear layers converted "
                "(torchao float8 training, tensorwise scaling; the head stays in "
                f"{cfg.amp or 'fp32'}): {_name_span(trainer.fp8_layers)}")
        tokens_per_step = sizes["batch_size"] * seq  # all processes together
        bar = tqdm(total=args.steps, desc="train", unit="step",
                   disable=not main or args.no_progress)
        first_s = math.nan
        window_start, window_steps = time.perf_counter(), 0
        speed, mfu, loss = math.nan, math.nan, math.nan
        speeds: list[float] = []
        for step in range(args.steps):
            if step == 0:  # compiles, allocates, autotunes: timed apart, not in the rates
                out: list[torch.Tensor] = []
                first_s = utils.first_call_s(lambda: out.append(trainer.step(x0, y0)),
                                             device=device)
                loss_t = out[0]
                loss = loss_t.item()
                window_start = time.perf_counter()
            else:
                loss_t = trainer.step(*batch(step))
                window_steps += 1
            last = step == args.steps - 1
            if (step + 1) % args.log_every == 0 or last:
                if world > 1:  # the mean over all processes' shards
                    import torch.distributed as dist
                    loss_t = loss_t.clone()
                    dist.all_reduce(loss_t)
                    loss_t /= world
                loss = loss_t.item()  # waits for the step
                utils.synchronize(device)
                now = time.perf_counter()
                if window_steps:
                    elapsed = now - window_start
                    speed = tokens_per_step * window_steps / elapsed
                    mfu = flops * window_steps / elapsed / 1e12 / ceiling
                    speeds.append(speed)
                window_start, window_steps = now, 0
                if main:
                    tqdm.write(f"step {step + 1:>6}/{args.steps}  loss {loss:.4f}  "
                               f"{speed:,.0f} tokens/s  MFU {mfu:.1%} ({FLOP_CONVENTION}, of "
                               f"the measured {kind} ceiling)", file=sys.stdout)
                    sys.stdout.flush()
            if math.isnan(speed):  # no timed window has ended yet
                bar.set_postfix(loss=f"{loss:.3f}", tok_s="(timing)", mfu="(timing)")
            else:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed:,.0f}", mfu=f"{mfu:.1%}")
            bar.update()
        bar.close()
        profile = None
        if args.profile_steps and device.type != "cuda":
            say(f"--profile-steps: the time by kernel kind is measured on CUDA only; skipped on "
                f"{device.type}")
        elif args.profile_steps:
            try:
                profile = profile_step(trainer.step, *batch(args.steps - 1),
                                       steps=args.profile_steps, warmup=0, label=rung_name,
                                       device=device)
            except Exception as exc:  # a profiler fault must not lose the run's figures
                say(f"--profile-steps: the profiler failed ({type(exc).__name__}: {exc})")
    what = "compilation and warm-up" if cfg.compile else "warm-up"
    peak_gib = peak_reserved_gib = math.nan
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        peak_reserved_gib = torch.cuda.max_memory_reserved(device) / 2**30
        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        say(f"peak GPU memory: {peak_gib:.1f} GiB allocated, {peak_reserved_gib:.1f} GiB "
            f"reserved by the caching allocator, of {total_gib:.0f} GiB")
    say(f"first step ({what}): {first_s:.1f} s, not in the rates above")
    result = {"final_loss": loss, "tokens_per_s": speeds[-1] if speeds else math.nan,
              "mfu": mfu, "steps": args.steps, "world_size": world,
              "wall_s": time.perf_counter() - t_start, "rung": rung_name, "vocab_size": vocab,
              "padded_vocab": padded_vocab, "first_step_s": first_s, "ceiling_kind": kind,
              "ceiling_tflops": ceiling, "flops_per_step": flops,
              "batch_size": sizes["batch_size"], "settings": cfg.describe(),
              "fp8_layers": len(trainer.fp8_layers), "peak_gib": peak_gib,
              "peak_reserved_gib": peak_reserved_gib}
    if rank == 0 and (args.out or "").lower() != "none":
        state = trainer.state_dict()
        words = list(data.tokenizer.words) if args.data == "corpus" else None
        state.update(gpt_config=dataclasses.asdict(gpt_cfg), tokenizer_words=words,
                     vocab_size=vocab, rung=rung_name, result=result,
                     args={k: v for k, v in vars(args).items()})
        path = atomic_save(state, args.out)
        say(f"checkpoint: {path} ({path.stat().st_size / 2**20:.1f} MiB, written atomically)")
    say(f"done: final loss {loss:.4f}, {result['tokens_per_s']:,.0f} tokens/s, MFU {mfu:.1%}, "
        f"{result['wall_s']:.1f} s in all")
    report = None
    if speeds:
        step_s = tokens_per_step / speeds[-1]
        report = utils.mfu_report(flops, step_s, ceiling, kind, device)
        say(f"MFU per process, last window, FLOPs {FLOP_CONVENTION}: {report}")
        result["report"] = report
    if profile is not None:
        result["profile"] = profile
        if not getattr(args, "quiet_profile", False):
            for line in kernel_breakdown(profile, flops, ceiling, kind):
                say(line)
    if main and (args.results or "").lower() != "none":
        path = write_ledger(args, result, report, first_s=first_s, flops=flops, ceiling=ceiling,
                            kind=kind, rung_name=rung_name, cfg=cfg, preset=preset, vocab=vocab,
                            tokens_per_step=tokens_per_step, device=device)
        say(f"figures: {path} (a ledger; `python -m utils report {path.parent}` renders it)")
    del trainer
    return result


def write_ledger(args, result, report, *, first_s, flops, ceiling, kind, rung_name, cfg, preset,
                 vocab, tokens_per_step, device) -> Path:
    """This run's figures as a course ledger, so that no figure of it is typed in by hand."""
    ledger = utils.Ledger("06-capstone/train", smoke=preset == "tiny", env=utils.get_env(device),
                          strict=False)
    flags = " ".join(cfg.to_flags())

    def record(name, value, unit, note=""):
        if value is not None and math.isfinite(value):  # a run too short to time has no rate
            ledger.record(name, value, unit, note=note)

    record("tokens_per_s", result["tokens_per_s"], "tokens/s",
           note=f"{rung_name}: {flags}; the last {args.log_every}-step window, all processes")
    record("final_loss", result["final_loss"], "")
    record("first_step_s", first_s, "s", note="compilation and warm-up, not in the rates")
    record("flops_per_step", flops, "FLOP",
           note=f"per process, counted once (utils.ladder.count_step_flops): {FLOP_CONVENTION}")
    record("tokens_per_step", tokens_per_step, "tokens")
    record("vocab_size", vocab, "tokens")
    record("world_size", result["world_size"], "processes")
    record("measured_ceiling_tflops", ceiling, "TFLOP/s", note=f"{kind} matmul, this machine")
    if report is not None:
        record("model_tflops", report.achieved_tflops, "TFLOP/s",
               note=f"per process, FLOPs {FLOP_CONVENTION}")
        record("mfu_vs_measured_ceiling", report.vs_measured, "fraction",
               note=f"of the {kind} matmul ceiling measured here")
        if report.vs_datasheet is not None:
            record("mfu_vs_datasheet", report.vs_datasheet, "fraction",
                   note=f"of {report.datasheet_peak_tflops:g} TFLOP/s dense {kind} "
                        f"({report.device_name})")
    path = Path(args.results) if args.results else \
        utils.results_dir() / "06-capstone__train.json"
    return ledger.save(path)


@dataclasses.dataclass(frozen=True)
class BenchmarkRun:
    """One run of ``--benchmark``.

    Attributes:
        label: its row in the table.
        overrides: train.py's arguments (argparse names) for this run, over the command line's.
        versus: the label of the run it changes one thing from: the table's gain column.
        cost: its expected wall time in units of the top rung's (measured before it), for the
            budget (--budget-s): more for a run that compiles more (FP8's casts) or steps
            longer (a larger batch).
        required: run whatever the budget.
        batch_factor: its batch per step, as a multiple of the preset's (or --batch-size).
    """

    label: str
    overrides: Mapping[str, Any]
    versus: str = ""
    cost: float = 1.0
    required: bool = False
    batch_factor: int = 1


#: The runs of --benchmark, in order of importance (the budget leaves out the last first). MFU's
#: FLOPs are counted with the fp32 baseline model (hand-written attention, unpadded vocabulary),
#: in BENCHMARK_CONVENTION (below).
BENCHMARK_RUNS = (
    BenchmarkRun("fp32 eager", {"rung": "fp32", "steps": 15}, required=True),
    BenchmarkRun("top rung", {"rung": "top", "steps": 60}, versus="fp32 eager", required=True),
    BenchmarkRun("top rung, GPT-2 vocabulary", {"rung": "top", "data": "random", "steps": 60}),
    BenchmarkRun("chunked loss, GPT-2 vocabulary",
                 {"rung": "top", "data": "random", "loss": "chunked", "steps": 60},
                 versus="top rung, GPT-2 vocabulary"),
    BenchmarkRun("FP8 linears", {"rung": "top", "fp8": True, "steps": 60}, versus="top rung",
                 cost=2.0),
    BenchmarkRun("bf16 residual stream", {"rung": "top", "bf16_residual": True, "steps": 60},
                 versus="top rung"),
    BenchmarkRun("bf16 residual stream, chunked loss, GPT-2 vocabulary",
                 {"rung": "top", "data": "random", "loss": "chunked", "bf16_residual": True,
                  "steps": 60}, versus="chunked loss, GPT-2 vocabulary", cost=1.2),
    # the larger batch on the best run at each vocabulary (the H100, 2026-11-27: without the bf16
    # stream it gained 1.01x at GPT-2's vocabulary and 1.04x at the course's)
    BenchmarkRun("2x batch, bf16 residual stream, chunked loss, GPT-2 vocabulary",
                 {"rung": "top", "data": "random", "loss": "chunked", "bf16_residual": True,
                  "steps": 40},
                 versus="bf16 residual stream, chunked loss, GPT-2 vocabulary", cost=1.5,
                 batch_factor=2),
    BenchmarkRun("2x batch, bf16 residual stream", {"rung": "top", "bf16_residual": True,
                                                    "steps": 40},
                 versus="bf16 residual stream", cost=1.5, batch_factor=2),
)
#: --benchmark's claim: the bf16 residual stream's final loss is within this share of the top
#: rung's (the same weights, batches and 60 steps): the ladder notebook's bar between rungs.
BF16_RESIDUAL_LOSS_TOL = 0.02
#: --fp8-sweep's widths: GPT-2 small's 768 up to the widths of 7B-class models.
FP8_SWEEP_WIDTHS = "768,1024,1536,2048,3072,4096"
#: --fp8-sweep: FP8 "pays" from the smallest width at which it is at least this much faster
#: than bf16 at every larger width measured.
FP8_PAYS_AT = 1.1
#: --fp8-sweep's claim: at the largest width measured, from this width on, FP8 is at least
#: FP8_LARGE_SPEEDUP x bf16 (FP8 tensor cores do twice bf16's FLOPs; there the matmuls outweigh
#: the scaling and casting FP8 adds). A conversion that did not take, or casts that cost as much
#: as the matmuls, lands near 1x.
FP8_LARGE_WIDTH = 3072
FP8_LARGE_SPEEDUP = 1.2
FP8_LARGE_TOKENS = 32 * 1024  # the gpt2 preset's batch x context: the sweep the claim is about
#: train.py's steps when --steps is not given (--benchmark: each run's own, above).
DEFAULT_STEPS = 200
#: Steps --benchmark profiles after each compiled run (CUDA only), for the kernel breakdown.
BENCHMARK_PROFILE_STEPS = 3
#: The FLOPs MFU counts, as utils.ladder.count_step_flops counts them on the fp32 baseline model
#: (notebook 01 checks the count to the FLOP against utils.flops.gpt_flops): short and in full.
FLOP_CONVENTION = "6N+attn less biases and norms"
BENCHMARK_CONVENTION = ("6N + 12 L d T per token less the biases and norms: every matmul forward "
                        "and backward, attention over the full T x T (nanoGPT's 6N+attn), N "
                        "without the position embeddings")


def _benchmark_list() -> str:
    return "; ".join(r.label for r in BENCHMARK_RUNS)


def _name_span(names: list[str]) -> str:
    """``blocks.0-11.{attn.qkv, mlp.0}`` for layer names that repeat over the blocks."""
    found = [re.fullmatch(r"(.*?)\.(\d+)\.(.+)", n) for n in names]
    if names and all(found) and len({m.group(1) for m in found}) == 1:
        idx = sorted({int(m.group(2)) for m in found})
        tails = list(dict.fromkeys(m.group(3) for m in found))
        span = f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else str(idx[0])
        return f"{found[0].group(1)}.{span}.{{{', '.join(tails)}}}"
    return ", ".join(names) if names else "none"


def kernel_breakdown(profile: StepProfile, flops: float, ceiling_tflops: float,
                     kind: str) -> list[str]:
    """Where a profiled step's time goes, by kernel kind, against its FLOP bound.

    The bound is the step's model FLOPs at the measured ceiling; the gap from it to the
    profiled step is the matmul and attention kernels' time above the bound, the other
    kernels' time and the time no kernel ran (kernel times are summed: kernels that overlap
    count twice, so the parts can add to a little more than the gap).
    """
    wall = profile.wall_ms_per_step
    if not profile.kernels_per_step or wall <= 0:
        return [f"time by kernel kind, {profile.label}: the profiler recorded no GPU kernels in "
                f"{profile.steps} profiled step(s) ({wall:.2f} ms per step), so there is no "
                "breakdown to show (with CUDA graphs, some CUPTI versions record no replayed "
                "kernels)"]
    ms = profile.kernel_ms_by_category
    idle = max(wall - profile.busy_ms_per_step, 0.0)
    bound = flops / (ceiling_tflops * 1e12) * 1e3
    compute = ms.get("matmul", 0.0) + ms.get("attention", 0.0)
    rest = sum(v for k, v in ms.items() if k not in ("matmul", "attention"))
    lines = [f"time by kernel kind, {profile.label}: {profile.steps} profiled step(s), "
             f"{wall:.2f} ms per step under the profiler, {profile.kernels_per_step:.0f} kernels "
             "per step"]
    for cat in KERNEL_CATEGORIES:
        lines.append(f"  {cat:<10} {ms.get(cat, 0.0):9.2f} ms {ms.get(cat, 0.0) / wall:6.1%}  "
                     f"({profile.kernels_by_category.get(cat, 0.0):.0f} kernels)")
    lines.append(f"  {'idle':<10} {idle:9.2f} ms {idle / wall:6.1%}  (no kernel running)")
    lines.append(f"the step's model FLOPs at the measured {kind} ceiling ({ceiling_tflops:.3g} "
                 f"TFLOP/s) take {bound:.2f} ms; the {wall - bound:.2f} ms between that and the "
                 "profiled step:")
    lines.append(f"  matmul and attention kernels beyond the bound {compute - bound:9.2f} ms")
    lines.append(f"  other kernels (elementwise, norms, loss, optimizer, copies) {rest:9.2f} ms")
    lines.append(f"  idle (launch gaps, host work, synchronisation) {idle:9.2f} ms")
    for name, t in profile.top_kernels[:5]:
        lines.append(f"    top kernel {t:8.2f} ms  [{classify_kernel(name)}] {name[:90]}")
    others = [(n, t) for n, t in profile.top_kernels if classify_kernel(n) == "other"][:8]
    if others:
        lines.append(f"  the longest of the other kernels ({ms.get('other', 0.0):.2f} ms per step "
                     "in all):")
        for name, t in others:
            lines.append(f"    {t:8.2f} ms  {name[:100]}")
    return lines


def _preset(args: argparse.Namespace, device_type: str) -> str:
    """The preset a run uses: --preset, where ``auto`` is gpt2 on a GPU and tiny on a CPU."""
    return args.preset if args.preset != "auto" else ("gpt2" if device_type == "cuda" else "tiny")


def _device_type(args: argparse.Namespace) -> str:
    if args.device in ("cpu", "cuda"):
        return args.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _release_compiled(device_type: str) -> None:
    """Drop the last run's compiled code and CUDA-graph memory pools before the next run."""
    if "torch._dynamo" in sys.modules:  # nothing compiled without it (and importing it takes s)
        torch.compiler.reset()
    if device_type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _skip_reason(run: BenchmarkRun, device_type: str, amp: str | None = None) -> str:
    """Why ``run`` cannot run on this machine (or with ``--amp amp``), or ``""``."""
    if run.overrides.get("fp8"):
        return ladder.fp8_unavailable_reason(device_type)
    if run.overrides.get("bf16_residual"):
        if amp is not None and amp != "bf16":
            return f"a bf16 residual stream needs bf16 autocast, and --amp {amp} was given"
        if not native_bf16(torch.device(device_type)):
            return ("a bf16 residual stream needs bf16 autocast, and this GPU has no native "
                    "bfloat16 (it needs sm80+)")
    return ""


def benchmark(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict]:
    """Run :data:`BENCHMARK_RUNS` one after the other and print one table."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--benchmark measures one process: run it without torchrun")
    if not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if getattr(args, "bf16_residual", None) is not None:
        parser.error("--benchmark sets --bf16-residual itself, run by run (the fp32 run cannot "
                     "have it): run the benchmark without it")
    device_type = _device_type(args)
    preset = _preset(args, device_type)
    base_batch = args.batch_size or PRESETS[preset]["batch_size"]
    start = _STARTED
    unit_s = None  # the top rung's wall time: the unit of the runs' estimated costs
    ceilings: dict[str, float] = {}
    rows: list[dict] = []
    for run in BENCHMARK_RUNS:
        overrides = dict(run.overrides)
        if args.steps is not None:  # the command line's steps win over each run's own
            overrides["steps"] = args.steps
        if run.batch_factor != 1:
            overrides["batch_size"] = base_batch * run.batch_factor
        reason = _skip_reason(run, device_type, args.amp)
        spent = time.perf_counter() - start
        if not reason and not run.required and unit_s is not None \
                and spent + run.cost * unit_s > args.budget_s:
            reason = (f"left out for time: about {run.cost * unit_s:.0f} s ({run.cost:g} x the top "
                      f"rung's) after {spent:.0f} s would pass --budget-s {args.budget_s:g}")
        if reason:
            print(f"\n=== {run.label}: skipped: {reason}", flush=True)
            rows.append({"label": run.label, "versus": run.versus, "skipped": reason})
            continue
        profile_steps = args.profile_steps or 0
        if device_type == "cuda" and run.overrides.get("rung") != "fp32" \
                and args.profile_steps is None:
            profile_steps = BENCHMARK_PROFILE_STEPS
        run_args = argparse.Namespace(**{**vars(args), **overrides, "out": "none",
                                         "results": "none", "benchmark": False,
                                         "profile_steps": profile_steps, "quiet_profile": True,
                                         "ceiling_cache": ceilings})
        print(f"\n=== {run.label} ===", flush=True)
        t0 = time.perf_counter()
        try:
            result = train(run_args, parser)
        except SystemExit as exc:  # parser.error: settings this run cannot take (said above)
            if run.required:
                raise
            reason = f"failed: its settings were refused (exit code {exc.code}; the message above)"
            print(f"=== {run.label}: {reason}", flush=True)
            rows.append({"label": run.label, "versus": run.versus, "skipped": reason})
            result = None
        except Exception as exc:
            if run.required:
                raise
            traceback.print_exc()
            reason = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"=== {run.label}: {reason}", flush=True)
            rows.append({"label": run.label, "versus": run.versus, "skipped": reason})
            result = None
        if result is None:  # released outside the handler: the exception's traceback holds
            _release_compiled(device_type)  # the failed run's frames until the handler ends
            continue
        if run.label == "top rung":
            unit_s = time.perf_counter() - t0
        rows.append({"label": run.label, "versus": run.versus, **result})
        _release_compiled(device_type)
        if run is not BENCHMARK_RUNS[-1]:
            # what is measured so far, where a time limit that kills the process finds it: the
            # table in the log's last lines and the ledger on disk
            print(f"\n--- the table so far, after {time.perf_counter() - start:.0f} s ---")
            print_benchmark_table(rows, device_type, breakdown=False)
            if (args.results or "").lower() != "none":
                with contextlib.redirect_stdout(io.StringIO()):  # its claims: printed at the end
                    write_benchmark_ledger(args, rows)
    print_benchmark_table(rows, device_type)
    path = write_benchmark_ledger(args, rows, save=(args.results or "").lower() != "none")
    if path is not None:
        print(f"figures: {path}")
    print(f"--benchmark: {time.perf_counter() - start:.0f} s in all, imports included")
    return rows


def _ran(rows: list[dict]) -> dict[str, dict]:
    return {r["label"]: r for r in rows if "skipped" not in r}


def _gain(row: dict, ran: dict[str, dict]) -> float | None:
    other = ran.get(row.get("versus", ""))
    if other is None or "skipped" in row:
        return None
    a, b = row.get("tokens_per_s", math.nan), other.get("tokens_per_s", math.nan)
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else None


def print_benchmark_table(rows: list[dict], device_type: str, breakdown: bool = True) -> None:
    """--benchmark's table, each run's settings, and (``breakdown``) the best run's time by
    kernel kind."""
    ran = _ran(rows)
    width = max(len(r["label"]) for r in rows)
    print(f"\nFLOPs ({FLOP_CONVENTION}): {BENCHMARK_CONVENTION}; padded vocabulary rows are not "
          "counted.")
    print(f"{'run':<{width}} {'vocab (padded)':>15} {'batch':>5} {'tokens/s':>11} {'TFLOP/s':>8} "
          f"{'MFU measured':>13} {'MFU datasheet':>14} {'peak GiB':>8}  gain")
    for r in rows:
        if "skipped" in r:  # a reason, or "failed: ..."
            why = r["skipped"] if r["skipped"].startswith("failed") else f"skipped: {r['skipped']}"
            print(f"{r['label']:<{width}} {why}")
            continue
        rep = r.get("report")
        tf = f"{rep.achieved_tflops:8.3g}" if rep else f"{'-':>8}"
        vm = f"{rep.vs_measured:13.1%}" if rep else f"{'-':>13}"
        vd = (f"{rep.vs_datasheet:14.1%}" if rep and rep.vs_datasheet is not None
              else f"{'n/a':>14}")
        g = _gain(r, ran)
        gain = f"{g:.2f}x over {r['versus']}" if g is not None else "-"
        peak = r.get("peak_reserved_gib", math.nan)
        pk = f"{peak:8.1f}" if math.isfinite(peak) else f"{'-':>8}"
        print(f"{r['label']:<{width}} {r['vocab_size']:>7} ({r['padded_vocab']:>5}) "
              f"{r.get('batch_size', '?'):>5} {r['tokens_per_s']:>11,.0f} {tf} {vm} {vd} {pk}  "
              f"{gain}")
    print("MFU measured: of the matmul ceiling measured here in each run's arithmetic; MFU "
          "datasheet: of the GPU's dense peak in that arithmetic (none for a CPU). FP8 runs: "
          "against the bf16 ceilings (no FP8 ceiling is measured). peak GiB: the most GPU "
          "memory the caching allocator held in the run (what a smaller GPU must have free). "
          "gain: tokens/s over the run it changes one thing from.")
    for r in rows:
        if "skipped" not in r:
            print(f"  {r['label']}: {r['rung']} + flags: {r.get('settings', '')}")
    if not breakdown:
        return
    profiled = [r for r in ran.values() if r.get("profile") is not None and r.get("report")]
    if device_type != "cuda":
        print("\nTime by kernel kind: skipped (profiled on CUDA only; on a CPU the kernels are "
              "operators and the ceilings are not the GPU's)")
    elif not profiled:
        print("\nTime by kernel kind: no profile came back (see each run's output above)")
    else:
        best = max(profiled, key=lambda r: r["report"].achieved_tflops)
        print(f"\nThe best run by model TFLOP/s, {best['label']}:")
        for line in kernel_breakdown(best["profile"], best["flops_per_step"],
                                     best["ceiling_tflops"], best["ceiling_kind"]):
            print(line)


def write_benchmark_ledger(args: argparse.Namespace, rows: list[dict], *,
                           save: bool = True) -> Path | None:
    """--benchmark's figures as one ledger (``06-capstone/train_benchmark``), its claims
    printed; saved (its path returned) unless ``save`` is false."""
    ledger = utils.Ledger("06-capstone/train_benchmark",
                          smoke=_preset(args, _device_type(args)) == "tiny",
                          env=utils.get_env(args.device), strict=False)
    ran = _ran(rows)

    def key_of(label: str) -> str:
        return label.replace(", ", "_").replace(" ", "_").replace("-", "")

    for r in ran.values():
        key = key_of(r["label"])
        if math.isfinite(r["tokens_per_s"]):
            ledger.record(f"tokens_per_s_{key}", r["tokens_per_s"], "tokens/s",
                          note=f"{r['rung']}, vocabulary {r['vocab_size']} (padded to "
                               f"{r['padded_vocab']}), batch {r.get('batch_size', '?')}: "
                               f"{r.get('settings', '')}")
        rep = r.get("report")
        if rep is not None:
            ledger.record(f"model_tflops_{key}", rep.achieved_tflops, "TFLOP/s",
                          note=BENCHMARK_CONVENTION)
            ledger.record(f"mfu_vs_measured_ceiling_{key}", rep.vs_measured, "fraction",
                          note=f"{rep.precision} matmul ceiling measured here")
            if rep.vs_datasheet is not None:
                ledger.record(f"mfu_vs_datasheet_{key}", rep.vs_datasheet, "fraction",
                              note=f"{rep.datasheet_peak_tflops:g} TFLOP/s dense {rep.precision}")
        for name, field in (("peak_allocated_gib", "peak_gib"),
                            ("peak_reserved_gib", "peak_reserved_gib")):
            value = r.get(field, math.nan)
            if math.isfinite(value):
                ledger.record(f"{name}_{key}", value, "GiB",
                              note="the run's most GPU memory, allocated by tensors or "
                                   "reserved by the caching allocator")
        if math.isfinite(r.get("final_loss", math.nan)):
            ledger.record(f"final_loss_{key}", r["final_loss"], "",
                          note="the training loss of the run's last step")
        g = _gain(r, ran)
        if g is not None and r["label"] != "top rung":
            ledger.record(f"gain_{key}", g, "x", note=f"tokens/s over {r['versus']}")
        prof = r.get("profile")
        if prof is not None:
            for cat, ms in prof.kernel_ms_by_category.items():
                ledger.record(f"kernel_ms_{cat}_{key}", ms, "ms",
                              note="per step, summed kernel time under the profiler")
            ledger.record(f"idle_ms_{key}", max(prof.wall_ms_per_step - prof.busy_ms_per_step, 0),
                          "ms", note="per step, no kernel running, under the profiler")
    base, top = ran.get("fp32 eager"), ran.get("top rung")
    if base and top and math.isfinite(base["tokens_per_s"]) and \
            math.isfinite(top["tokens_per_s"]) and base["tokens_per_s"] > 0:
        ledger.record("speedup_top_over_fp32", top["tokens_per_s"] / base["tokens_per_s"], "x")
    residual = ran.get("bf16 residual stream")
    if residual and top and math.isfinite(residual.get("final_loss", math.nan)) \
            and math.isfinite(top.get("final_loss", math.nan)):
        ledger.expect("bf16_residual_final_loss_rel_diff",
                      abs(residual["final_loss"] / top["final_loss"] - 1),
                      at_most=BF16_RESIDUAL_LOSS_TOL, unit="fraction",
                      description="|the final loss with a bf16 residual stream / the top rung's "
                                  "- 1|: the same weights, batches and steps",
                      reason="the stream rounds what each block adds to bf16's 8 bits; a stream "
                             "that lost those updates would train slower and end higher")
    if not save:
        return None
    path = Path(args.results) if args.results else \
        utils.results_dir() / "06-capstone__train_benchmark.json"
    return ledger.save(path)


def _fp8_sweep_ledger(points: list, widths: list[int], tokens: int, preset: str,
                      env: Any) -> utils.Ledger:
    """--fp8-sweep's ledger from the widths measured so far (all of ``widths`` once it ends)."""
    ledger = utils.Ledger("06-capstone/train_fp8_sweep", smoke=preset == "tiny", env=env,
                          strict=False)
    for p in points:
        ledger.record("fp8_mlp", p)
    measured = {p.width for p in points}
    missing = [w for w in widths if w not in measured]
    ledger.record("fp8_sweep_widths_unmeasured", float(len(missing)), "",
                  note=("every width asked for was measured" if not missing else
                        f"not measured (the sweep stopped first): {missing}"))
    start = ladder.fp8_pays_from(points, min_speedup=FP8_PAYS_AT)
    ledger.record("fp8_pays_from_width", float(start or 0), "",
                  note=f"smallest width from which FP8 is >= {FP8_PAYS_AT:g}x bf16 at every "
                       "larger width measured; 0: none")
    widest = max(points, key=lambda p: p.width)
    large = widest.width >= FP8_LARGE_WIDTH and tokens >= FP8_LARGE_TOKENS
    ledger.expect("fp8_mlp_speedup_at_largest_width", widest.speedup,
                  at_least=FP8_LARGE_SPEEDUP, applies=large, unit="x",
                  description=f"a GPT block's MLP at width {widest.width} (the largest measured), "
                              "forward and backward: bf16 time / FP8 time",
                  reason=(f"FP8 tensor cores do twice bf16's FLOPs; from width "
                          f"{FP8_LARGE_WIDTH} the matmuls outweigh FP8's scaling and casts"
                          if large else
                          f"needs a width of {FP8_LARGE_WIDTH} or more and "
                          f"{FP8_LARGE_TOKENS} tokens or more (here width {widest.width}, "
                          f"{tokens} tokens): below, the casts can cost as much as FP8 saves"))
    return ledger


def fp8_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    """--fp8-sweep: bf16 against FP8 linears in a GPT block's MLP, width by width."""
    try:
        widths = [int(w) for w in str(args.fp8_sweep).split(",") if w.strip()]
    except ValueError:
        parser.error(f"--fp8-sweep takes comma-separated widths, got {args.fp8_sweep!r}")
    device_type = _device_type(args)
    preset = _preset(args, device_type)
    tokens = (args.batch_size or PRESETS[preset]["batch_size"]) * \
        (args.block_size or PRESETS[preset]["block_size"])
    if not widths or any(w < 16 or w % 16 for w in widths) or tokens % 16:
        parser.error(f"--fp8-sweep: widths and batch x --block-size ({tokens} tokens) must be "
                     f"positive multiples of 16, got widths {widths}")
    reason = ladder.fp8_unavailable_reason(device_type)
    if reason:
        parser.error(f"--fp8-sweep: {reason}")
    device = utils.pick_device(device_type)
    env = utils.get_env(device)
    print(f"FP8 against bf16 in a GPT block's MLP (d -> 4d -> d, forward and backward, "
          f"{tokens} tokens, compiled) on {env.device_name}", flush=True)
    path = None if args.results == "none" else (
        Path(args.results) if args.results else
        utils.results_dir() / "06-capstone__train_fp8_sweep.json")
    measured: list = []

    def on_point(point: ladder.Fp8SweepPoint) -> None:
        # after every width, so a sweep stopped at a time limit keeps the widths it measured
        measured.append(point)
        if path is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # its claim: printed at the end
                _fp8_sweep_ledger(measured, widths, tokens, preset, env).save(path)

    points = ladder.fp8_mlp_sweep(widths, tokens=tokens, device=device,
                                  compile=device.type == "cuda",
                                  progress=lambda line: print("  " + line, flush=True),
                                  on_point=on_point)
    print(utils.format_table(
        [["width", "bf16 ms", "FP8 ms", "bf16 TFLOP/s", "FP8 TFLOP/s", "FP8 speedup"]]
        + [[p.width, p.bf16_ms, p.fp8_ms, p.tflops(p.bf16_ms), p.tflops(p.fp8_ms),
            f"{p.speedup:.2f}x"] for p in points]))
    start = ladder.fp8_pays_from(points, min_speedup=FP8_PAYS_AT)
    print(f"FP8 is at least {FP8_PAYS_AT:g}x bf16 at every width from {start} on" if start else
          f"FP8 is not {FP8_PAYS_AT:g}x bf16 at the largest width measured ({max(widths)})")
    if path is not None:
        _fp8_sweep_ledger(points, widths, tokens, preset, env).save(path)
        print(f"figures: {path}")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data == "random" and args.vocab_size < 2:
        parser.error(f"--vocab-size must be at least 2, got {args.vocab_size}")
    if args.fp8_sweep is not None:
        fp8_sweep(args, parser)
    elif args.benchmark:
        benchmark(args, parser)
    else:
        train(args, parser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
