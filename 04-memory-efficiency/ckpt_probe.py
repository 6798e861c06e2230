"""Checkpoint experiments that need a process of their own.

Notebooks ``05_checkpoints_and_loading`` (``write``) and ``08_loading_large_models`` (``load``)
run this script with ``subprocess``:

``write``
    Saves a checkpoint of about ``--mib`` MiB (random fp32 tensors and a step
    counter), either with a plain ``torch.save(state, path)`` or with
    ``utils.checkpoint.atomic_save``. ``--throttle-mib-s`` slows every write
    to that rate (a stand-in for a slow or network file system), so that the
    notebook can kill the process in the middle of the save, as a crash, a
    pre-empted job or the out-of-memory killer would. The script prints one
    ``saving`` line when the write starts and ``saved`` when it is done.

``load``
    Loads a ``utils.TinyGPT`` checkpoint (a ``state_dict``) into a model and
    reports this process's peak resident memory, from the operating system's
    own accounting (``VmHWM`` in ``/proc/self/status``, or ``ru_maxrss``),
    above what it held after importing torch. Three recipes, each changing one
    thing from the one before:

    - ``--mode plain``, the usual recipe: build the model (its memory is
      allocated and initialised), then
      ``model.load_state_dict(torch.load(path, weights_only=True))``, which
      copies the loaded tensors into it;
    - ``--mode meta``: build the model on the meta device (no memory), load the
      file as usual and hand the loaded tensors to the model with
      ``load_state_dict(..., assign=True)`` (no copy);
    - ``--mode mmap``: the same, with ``torch.load(..., mmap=True)``: the
      tensors are views of the file mapped into memory, read when first touched.

    Each then runs the model once on one token (its first output: every weight
    is read) and reads every weight again (a checksum), timed separately, and
    prints a JSON result as the last line of stdout. On Linux the result also
    splits resident memory into anonymous pages (``RssAnon``: memory the
    process allocated) and file-backed pages (``RssFile``: pages of mapped
    files, which the kernel can drop and read again), before the load, after
    it, after the first output and at the end; elsewhere ``"rss"`` is ``null``.

``make``
    Writes a TinyGPT ``state_dict`` of the given size for ``load``.

A fresh process per measurement matters: a process's peak memory only grows,
and an allocator keeps freed memory for reuse, so a second load measured in the
same process would be flattered (or blamed) by the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: the course's utils package
    sys.path.insert(0, str(REPO))


#: The load recipes, each changing one thing from the one before (see the module docstring).
LOAD_MODES = ("plain", "meta", "mmap")


def rss_breakdown() -> dict[str, int] | None:
    """This process's resident memory by kind, in bytes, from ``/proc/self/status`` (Linux):
    ``anon`` (``RssAnon``: allocated memory), ``file`` (``RssFile``: pages of mapped files)
    and ``shmem`` (``RssShmem``). ``None`` where the kernel does not report them."""
    keys = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            fields = {keys[k]: int(v.split()[0]) * 1024 for k, _, v in
                      (line.partition(":") for line in fh) if k in keys}
    except OSError:
        return None
    return fields if len(fields) == len(keys) else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="save a checkpoint (optionally slowly, to be killed)")
    w.add_argument("--path", required=True)
    w.add_argument("--mib", type=float, default=64.0, help="approximate size of the tensors")
    w.add_argument("--step", type=int, default=2)
    w.add_argument("--atomic", action="store_true", help="use utils.checkpoint.atomic_save")
    w.add_argument("--throttle-mib-s", type=float, default=None,
                   help="write at most this many MiB per second")
    for name in ("load", "make"):
        q = sub.add_parser(name)
        q.add_argument("--path", required=True)
        q.add_argument("--n-layer", type=int, default=4)
        q.add_argument("--n-embd", type=int, default=256)
        q.add_argument("--n-head", type=int, default=4)
        q.add_argument("--vocab-size", type=int, default=8192)
        q.add_argument("--block-size", type=int, default=256)
        if name == "load":
            q.add_argument("--mode", choices=LOAD_MODES, required=True)
    args = p.parse_args(argv)
    for name in ("mib", "throttle_mib_s", "n_layer", "n_embd", "n_head", "vocab_size",
                 "block_size"):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


class Throttled:
    """A file object that passes writes on at most ``rate`` bytes per second."""

    CHUNK = 256 * 1024

    def __init__(self, f, rate_bytes_s: float) -> None:
        self.f, self.rate = f, rate_bytes_s

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.CHUNK):
            piece = view[i:i + self.CHUNK]
            self.f.write(piece)
            self.f.flush()  # let the file grow on disk as it is written
            time.sleep(len(piece) / self.rate)
        return len(view)

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name):
        return getattr(self.f, name)


def cmd_write(args: argparse.Namespace) -> int:
    import torch

    from utils.checkpoint import atomic_save

    if args.throttle_mib_s:
        real_save, rate = torch.save, args.throttle_mib_s * 2**20

        def slow_save(obj, f, *a, **k):
            if hasattr(f, "write"):
                return real_save(obj, Throttled(f, rate), *a, **k)
            with open(f, "wb") as fh:  # what torch.save(obj, path) does: truncate, then write
                return real_save(obj, Throttled(fh, rate), *a, **k)

        torch.save = slow_save  # both ways of saving now write through the slow "disk"
    n = max(1, int(args.mib * 2**20 / 4 / 8))
    g = torch.Generator().manual_seed(args.step)
    state = {"step": args.step,
             "model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)}}
    print(f"saving step {args.step} ({'atomic_save' if args.atomic else 'torch.save'}) "
          f"to {args.path}", flush=True)
    if args.atomic:
        atomic_save(state, args.path)
    else:
        torch.save(state, args.path)
    print("saved", flush=True)
    return 0


def _config(args: argparse.Namespace):
    import utils

    return utils.GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                           n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)


def cmd_make(args: argparse.Namespace) -> int:
    import torch

    import utils
    from utils.checkpoint import atomic_save

    torch.manual_seed(0)
    model = utils.TinyGPT(_config(args))
    path = atomic_save(model.state_dict(), args.path)
    print(json.dumps({"path": str(path), "file_bytes": path.stat().st_size,
                      "param_bytes": utils.tensor_bytes(model.parameters())}))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    import torch

    import utils
    from utils.memtools import host_memory, reset_peak_host_memory

    cfg = _config(args)
    torch.set_num_threads(1)
    # Warm up this recipe's code path once at a tiny size: the first meta-device model, the first
    # torch.load, the first load_state_dict and the first forward pass import modules and build
    # tables (tens of MiB) that have nothing to do with the checkpoint's size. Only this
    # recipe's path: the plain recipe need not pay for the meta device's first use.
    tiny = utils.GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=1, n_embd=8)
    warm = Path(args.path).with_name(Path(args.path).name + ".warmup.pt")
    torch.save(utils.TinyGPT(tiny).state_dict(), warm)
    if args.mode == "plain":
        m = utils.TinyGPT(tiny)
        m.load_state_dict(torch.load(warm, weights_only=True, map_location="cpu"))
    else:
        with torch.device("meta"):
            m = utils.TinyGPT(tiny)
        m.load_state_dict(torch.load(warm, weights_only=True, mmap=args.mode == "mmap",
                                     map_location="cpu"), assign=True)
        m.head.weight = m.tok_emb.weight
    with torch.no_grad():
        m.eval()(torch.zeros(1, 1, dtype=torch.long))
        sum(float(p.sum()) for p in m.parameters())
    del m
    warm.unlink()
    reset = reset_peak_host_memory()
    before = host_memory()
    rss = {"before": rss_breakdown()}
    t0 = time.perf_counter()
    if args.mode == "plain":
        model = utils.TinyGPT(cfg)  # allocated and initialised, then overwritten
        model.load_state_dict(torch.load(args.path, weights_only=True, map_location="cpu"))
    else:
        with torch.device("meta"):
            model = utils.TinyGPT(cfg)  # shapes only: no memory, no initialisation
        state = torch.load(args.path, weights_only=True, mmap=args.mode == "mmap",
                           map_location="cpu")
        model.load_state_dict(state, assign=True)
        del state
        # assign=True put the file's tensors in place one key at a time: the tied head and
        # embedding are now two Parameters (sharing storage); tie them again.
        model.head.weight = model.tok_emb.weight
    load_s = time.perf_counter() - t0
    rss["loaded"] = rss_breakdown()
    # The first output: one token through the model reads every weight (the tied head is the
    # whole embedding). With mmap=True the file's pages are read here, on first touch, not in
    # the load above: compare load_s + first_output_s between the recipes, not load_s alone.
    t1 = time.perf_counter()
    with torch.no_grad():
        model.eval()(torch.zeros(1, 1, dtype=torch.long))
    first_output_s = time.perf_counter() - t1
    rss["first_output"] = rss_breakdown()
    t2 = time.perf_counter()
    with torch.no_grad():  # reads every weight (an fp32 sum: an fp64 one would copy each weight)
        checksum = sum(float(p.sum()) for p in model.parameters())
    checksum_s = time.perf_counter() - t2
    after = host_memory()
    rss["end"] = rss_breakdown()
    base = before.rss_bytes if (reset and before.rss_bytes is not None) else before.peak_rss_bytes
    result = {
        "mode": args.mode,
        "file_bytes": os.path.getsize(args.path),
        "param_bytes": utils.tensor_bytes(model.parameters()),
        "rss_before_bytes": before.rss_bytes,
        "peak_rss_bytes": after.peak_rss_bytes,
        "rss_after_bytes": after.rss_bytes,
        "peak_above_start_bytes": after.peak_rss_bytes - base,
        "peak_reset": reset,
        "load_s": load_s,
        "first_output_s": first_output_s,
        "checksum_s": checksum_s,
        "checksum": checksum,
        "rss": rss if all(v is not None for v in rss.values()) else None,
        "tied": model.head.weight is model.tok_emb.weight,
        "n_parameters": len(list(model.parameters())),
        "method": after.method,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"write": cmd_write, "load": cmd_load, "make": cmd_make}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
