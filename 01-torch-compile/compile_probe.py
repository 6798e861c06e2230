"""Measure how long ``torch.compile`` takes, in a fresh Python process.

Notebooks ``04_regional_compilation_and_caching`` and ``06_the_compile_cache`` run
this script with ``subprocess`` so that every compile-time measurement starts from nothing: no
module imported yet, no compiled code in memory, and an inductor cache
directory chosen by the caller (empty for a *cold* compile, reused for a
*warm* one). A measurement taken inside a long-lived notebook process would be
flattered by whatever an earlier cell already compiled or imported.

What one run does:

1. points ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR`` inside it) at
   ``--cache-dir`` *before* importing torch;
2. builds ``utils.TinyGPT`` with the given sizes and runs one **eager** step
   (this pays for CUDA context creation, cuBLAS handles and the optimizer
   state, which are not compilation); a step is a training step
   (``utils.train_step``) or, with ``--workload infer``, a forward pass;
3. compiles the model, either whole (``torch.compile(model)``) or by region
   (``block.compile()`` for every transformer block);
   with ``--backend`` (``inductor`` by default; ``aot_eager`` and ``eager`` trace without
   generating code, which notebook 2 uses to record a ``TORCH_TRACE`` cheaply);
4. times the first compiled step with ``utils.first_call_s``: that call
   traces, compiles (forward, and backward for a training step) and runs once;
5. writes a JSON result (times, the compile phases of ``compile_times()``,
   dynamo/inductor cache counters, the cache directory's size) to ``--out`` and
   prints it as the last line of stdout.

Example::

    python compile_probe.py --mode regional --cache-dir /tmp/cc --n-layer 8 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

_T0 = time.perf_counter()  # as early as possible: the import time is part of the story

MODES = ("whole", "regional", "eager")
WORKLOADS = ("train", "infer")
BACKENDS = ("inductor", "aot_eager", "eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True,
                   help="whole: torch.compile(model); regional: block.compile() per block")
    p.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR for this process")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workload", choices=WORKLOADS, default="train",
                   help="train: utils.train_step (forward, backward, AdamW); infer: forward under no_grad")
    p.add_argument("--backend", choices=BACKENDS, default="inductor",
                   help="torch.compile backend (aot_eager / eager: trace only, no code generation)")
    p.add_argument("--tf32", choices=("on", "off"), default="on",
                   help="TF32 for fp32 matmuls and convolutions (utils.set_tf32), as the notebooks "
                        "of this module set it")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for this process (CPU kernels specialise on it, "
                        "and it is part of the cache key)")
    p.add_argument("--save-artifacts", default=None,
                   help="after compiling, write torch.compiler.save_cache_artifacts() here")
    p.add_argument("--load-artifacts", default=None,
                   help="before compiling, feed this file to torch.compiler.load_cache_artifacts()")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--deadline-s", type=int, default=None,
                   help="fail (cleanly, compile workers shut down) after this many seconds")
    args = p.parse_args(argv)
    for name in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "batch", "threads",
                 "deadline_s"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def compile_model(model, mode: str, backend: str = "inductor"):
    """Return the callable to train: the whole model compiled, or its blocks compiled in place.

    ``block.compile()`` (``nn.Module.compile``) compiles a module in place: the
    module stays where it is in ``model.blocks`` and its ``state_dict`` keys do
    not change, unlike ``torch.compile(block)``, which returns a wrapper.
    """
    import torch

    if mode == "whole":
        return torch.compile(model, backend=backend)
    if mode == "regional":
        for block in model.blocks:
            block.compile(backend=backend)
        return model
    return model  # eager: the reference


def make_step(model, opt, x, y, workload: str):
    """The function whose first call is timed: one training step, or one forward pass."""
    import torch

    import utils

    if workload == "train":
        return lambda: utils.train_step(model, opt, x, y)

    def infer():
        with torch.no_grad():
            return model(x)
    return infer


def dir_bytes(path: Path) -> tuple[int, int]:
    """Total size in bytes and number of files under ``path``."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
                files += 1
            except OSError:  # a lock or temp file that vanished meanwhile
                pass
    return total, files


def run(mode: str, cache_dir: str | Path, *extra: str, workdir: str | Path, deadline_s: int,
        size_args: Sequence[str] = (), label: str | None = None) -> dict:
    """Run this script in a fresh Python process and return its JSON result.

    The cache folders are passed to the child explicitly, so the caller's own settings never
    leak in, and the child imports the same ``utils`` package as the caller, whatever the
    install. The child stops itself at ``deadline_s`` (shutting its compile workers down); a
    subprocess timeout 30 s later is the backstop. Two fields are added to the result:
    ``process_s`` (interpreter start to exit, as a job sees it) and ``load_before`` (the
    1-minute load average when it started: was the machine busy?).

    Args:
        mode: ``"whole"``, ``"regional"`` or ``"eager"`` (see :func:`compile_model`).
        cache_dir: the child's ``TORCHINDUCTOR_CACHE_DIR`` (empty for a cold compile).
        *extra: more command-line arguments (``"--save-artifacts", path``, ...).
        workdir: an existing folder for the result file ``result_<label>.json``.
        deadline_s: seconds the child may take (>= 1).
        size_args: the model's sizes as command-line arguments (``["--n-layer", "8", ...]``).
        label: names the result file and the error messages (default: ``mode``).

    Raises:
        ValueError: an unknown mode or a deadline below 1 s.
        RuntimeError: the child failed (its stderr is quoted) or ran past the backstop.
    """
    import importlib.util
    import subprocess

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int) or deadline_s < 1:
        raise ValueError(f"deadline_s must be a positive int (seconds), got {deadline_s!r}")
    label = label or mode
    out = Path(workdir) / f"result_{label}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--cache-dir",
           str(cache_dir), "--out", str(out), "--deadline-s", str(deadline_s), *size_args, *extra]
    spec = importlib.util.find_spec("utils")
    utils_root = str(Path(spec.origin).resolve().parent.parent) if spec and spec.origin else ""
    pythonpath = os.pathsep.join(filter(None, [utils_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "TRITON_CACHE_DIR": str(Path(cache_dir) / "triton"), "PYTHONPATH": pythonpath}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, timeout=deadline_s + 30, capture_output=True, text=True,
                       env=env, cwd=Path(__file__).resolve().parent)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"compile probe '{label}' failed with exit code {exc.returncode}.\n"
                           f"command: {' '.join(cmd)}\n--- its stderr (end) ---\n"
                           f"{exc.stderr[-4000:]}") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"compile probe '{label}' did not finish within {deadline_s + 30} s "
                           f"and was killed (command: {' '.join(cmd)}). A busy machine? Raise "
                           "the deadline, or run it by hand to see where it stalls.") from None
    result = json.loads(out.read_text(encoding="utf-8"))
    result["process_s"] = time.perf_counter() - t0
    result["load_before"] = load
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.deadline_s and hasattr(signal, "SIGALRM"):
        def expired(signum, frame):
            raise TimeoutError(f"compile probe passed its deadline of {args.deadline_s} s")
        signal.signal(signal.SIGALRM, expired)
        signal.alarm(args.deadline_s)
    cache = Path(args.cache_dir).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    # Set before torch is imported, so this process and its compile workers see it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    files_before = dir_bytes(cache)[1]

    import torch
    from torch._dynamo.utils import counters

    import utils

    import_s = time.perf_counter() - _T0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    utils.set_tf32(args.tf32 == "on")
    device = utils.pick_device(args.device)
    cfg = utils.GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = utils.lm_batch(cfg, args.batch, device=device)

    # One eager step first, so the compiled first call is charged only for compiling.
    eager_first_s = utils.first_call_s(make_step(model, opt, x, y, args.workload), device=device)

    loaded = None
    if args.load_artifacts:
        info = torch.compiler.load_cache_artifacts(Path(args.load_artifacts).read_bytes())
        if info is not None:  # CacheInfo: which caches received how many entries
            kinds = getattr(info, "artifacts", None)
            loaded = ({k: len(v) for k, v in kinds.items()} if isinstance(kinds, dict)
                      else str(info))

    step = make_step(compile_model(model, args.mode, args.backend), opt, x, y, args.workload)
    first_s = utils.first_call_s(step, device=device)
    second_s = utils.first_call_s(step, device=device)

    saved_bytes = None
    if args.save_artifacts:
        art = torch.compiler.save_cache_artifacts()
        if art is not None:
            Path(args.save_artifacts).write_bytes(art[0])
            saved_bytes = len(art[0])

    size, files = dir_bytes(cache)
    # Where the compiled calls' time went (compile_times(); internal phase names, absent ones left out).
    phases = utils.compiletools.compile_phase_seconds(
        ["_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
         "create_aot_dispatcher_function", "compile_fx_inner", "compile_file"])
    result = {
        "mode": args.mode,
        "backend": args.backend,
        "tf32": str(utils.tf32_state()),
        "device": str(device),
        "torch": torch.__version__,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "threads": torch.get_num_threads(),
        "cache_dir": str(cache),
        "cache_files_before": files_before,
        "import_s": import_s,
        "eager_first_step_s": eager_first_s,
        "first_compiled_step_s": first_s,
        "second_compiled_step_s": second_s,
        "workload": args.workload,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "ops_captured": int(counters["stats"]["calls_captured"]),
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "phases": phases,
        "cache_bytes": size,
        "cache_files": files,
        "artifacts_saved_bytes": saved_bytes,
        "artifacts_loaded": loaded,
        "script_s": time.perf_counter() - _T0,
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
