"""CUDA caching-allocator experiments, one fresh process per allocator setting.

Notebook ``01_anatomy_of_training_memory`` runs this script with ``subprocess``,
once per setting of ``PYTORCH_ALLOC_CONF`` (its older name, still read, is
``PYTORCH_CUDA_ALLOC_CONF``). The caching allocator reads that variable once,
when CUDA memory is first used; a process that changes it later keeps the old
setting, which is why every setting gets a process of its own (``--set-late``
shows exactly that).

Experiments (``--experiment``):

``holes``
    For each size in ``--block-mib``: allocate one block of ``--blocks`` times
    the largest of those sizes and free it (the allocator caches it), carve
    tensors of that size out of it, free every other one (holes of that size
    between live tensors), call ``torch.cuda.empty_cache()``, then ask for one
    tensor three holes long. Reports allocated and reserved memory, segments and
    the allocator's counters after each stage: what fragmentation looks like,
    and what ``empty_cache`` can and cannot give back. By default the tensors
    share the freed block's one segment, and a segment with a live tensor in it
    is never returned; expandable segments return the 20 MiB granules (large
    pool) that lie wholly inside a hole, so holes shorter than a granule give
    nothing back.
``varlen``
    Train ``utils.TinyGPT`` for ``--steps`` steps whose sequence length changes
    every step (the same seeded lengths in every process): the peak allocated
    against the peak reserved memory, cudaMalloc calls and retries, and the step
    time.

Without CUDA the script says so in its JSON result (``"cuda": false``) and
exits 0: there is no caching allocator to measure on a CPU.

Example::

    PYTORCH_ALLOC_CONF=expandable_segments:True python alloc_probe.py --experiment holes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", choices=("holes", "varlen"), required=True)
    p.add_argument("--blocks", type=int, default=16,
                   help="holes: the freed block is this many times the largest --block-mib (even)")
    p.add_argument("--block-mib", type=int, nargs="+", default=[4, 20],
                   help="holes: tensor (and hole) sizes, MiB; each divides the largest")
    p.add_argument("--steps", type=int, default=30, help="varlen: training steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--set-late", default=None,
                   help="set PYTORCH_ALLOC_CONF to this *after* CUDA memory is in use (it is "
                        "ignored: the allocator has read its settings already)")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    for name in ("blocks", "steps", "batch", "n_layer", "n_embd", "n_head", "vocab_size",
                 "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.block_mib) < 1 or any(max(args.block_mib) % b for b in args.block_mib):
        p.error("--block-mib sizes must be >= 1 and each must divide the largest")
    if args.blocks % 2:
        p.error("--blocks must be even (every other tensor is freed; the last one stays)")
    return args


def allocator_view(torch) -> dict:
    """What the allocator says about itself now."""
    s = torch.cuda.memory_stats()
    segments = torch.cuda.memory._snapshot()["segments"]
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "segments": len(segments),
        "expandable_segments": sum(bool(seg.get("is_expandable")) for seg in segments),
        "inactive_split_bytes": s.get("inactive_split_bytes.all.current", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        "num_device_alloc": s.get("num_device_alloc"),  # cudaMalloc calls (newer torch)
        "num_device_free": s.get("num_device_free"),
        "oversize_allocations": s.get("oversize_allocations.current"),
    }


def settings(torch) -> dict:
    """The allocator settings as the process sees them."""
    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        raw = read() if read is not None else None
    except RuntimeError:
        raw = None
    snapshot_settings = torch.cuda.memory._snapshot().get("allocator_settings")  # newer torch
    return {
        "env": {v: os.environ.get(v) for v in CONF_VARS if os.environ.get(v) is not None},
        "allocator_settings": raw,
        "snapshot_allocator_settings": snapshot_settings,
        # the one setting the notebook checks, as the allocator itself reports it
        "snapshot_expandable_segments": (snapshot_settings or {}).get("expandable_segments"),
        "backend": torch.cuda.get_allocator_backend(),
        "max_split_size": torch.cuda.memory_stats().get("max_split_size"),
    }


def exp_holes(torch, args, device) -> dict:
    region = args.blocks * max(args.block_mib) * MIB
    runs = {}
    for hole_mib in args.block_mib:
        stages = {}
        block = torch.empty(region, dtype=torch.uint8, device=device)
        del block  # cached whole, as a large freed temporary is
        stages["block freed"] = allocator_view(torch)
        tensors = [torch.empty(hole_mib * MIB, dtype=torch.uint8, device=device)
                   for _ in range(region // (hole_mib * MIB))]
        torch.cuda.synchronize()
        stages["tensors"] = allocator_view(torch)
        tensors = tensors[1::2]  # free every other tensor: holes between live tensors
        stages["half freed"] = allocator_view(torch)
        torch.cuda.empty_cache()
        stages["empty_cache()"] = allocator_view(torch)
        big = torch.empty(3 * hole_mib * MIB, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        stages["3-hole request"] = allocator_view(torch)
        del big, tensors
        torch.cuda.empty_cache()
        stages["all freed"] = allocator_view(torch)
        runs[str(hole_mib)] = {"tensors": region // (hole_mib * MIB), "stages": stages}
    return {"region_bytes": region, "runs": runs}


def exp_varlen(torch, args, device) -> dict:
    import utils
    from utils.distributed import step_times_ms

    cfg = utils.GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    lo = max(8, args.block_size // 8)
    lengths = [int(v) for v in torch.randint(lo, args.block_size + 1, (args.steps + 1,),
                                             generator=g)]
    batches = [utils.lm_batch(cfg, args.batch, seq_len=t, device=device, seed=i)
               for i, t in enumerate(lengths)]
    utils.train_step(model, opt, *batches[0])  # optimizer state, cuBLAS workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    it = iter(batches[1:])
    times = step_times_ms(lambda: utils.train_step(model, opt, *next(it)), args.steps, device)
    s = torch.cuda.memory_stats()
    view = allocator_view(torch)
    return {
        "seq_lengths": lengths[1:],
        "median_step_ms": statistics.median(times),
        "peak_allocated_bytes": s["allocated_bytes.all.peak"],
        "peak_reserved_bytes": s["reserved_bytes.all.peak"],
        "end": view,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    result: dict = {"experiment": args.experiment, "torch": torch.__version__,
                    "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        result["reason"] = "no CUDA device: the caching allocator exists on CUDA only"
        result["env"] = {v: os.environ.get(v) for v in CONF_VARS if os.environ.get(v)}
    else:
        torch.cuda.init()
        # The current device, with its index: some CUDA APIs refuse a device without one.
        device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(MIB, device=device)  # CUDA memory has been used: the settings are read
        if args.set_late is not None:
            os.environ["PYTORCH_ALLOC_CONF"] = args.set_late
            result["set_late"] = args.set_late
        torch.cuda.empty_cache()
        result["settings"] = settings(torch)
        result["gpu"] = torch.cuda.get_device_name()
        try:
            result.update(exp_holes(torch, args, device) if args.experiment == "holes"
                          else exp_varlen(torch, args, device))
            result["oom"] = None
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) as exc:
            # report it; the notebook says what it means
            result["oom"] = str(exc).splitlines()[0]
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
