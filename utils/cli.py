"""What the course's command-line benchmarks share: models, data, devices, progress, tables.

``01-torch-compile/compile_benchmark.py`` and ``02-mixed-precision/amp_training.py`` run
headless on a cluster node, where a batch log is read after the fact. Both take the same
models (:data:`MODELS`, or one the user names as ``package.module:factory``), pick the device
and the size the same way as the notebooks (smoke size on a CPU, full size on a GPU), show a
progress bar on a terminal and plain lines in a log, print plain-text tables, and turn a bad
option or missing hardware into one clear line and exit status 2 (:class:`UsageError`), never
a traceback. The measuring is not here: it is :func:`utils.benchmark`,
:func:`utils.measure_peak_memory`, :class:`utils.ladder.Trainer` and :class:`utils.Ledger`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .data import MarkovTokens, SyntheticImages
from .env import pick_device, resolve_smoke
from .models import GPTConfig, SmallCNN, SmallLSTM, TinyGPT

__all__ = [
    "MODELS",
    "FAMILIES",
    "UsageError",
    "Workload",
    "build_workload",
    "factory_workload",
    "unique_name",
    "split_list",
    "resolve_device",
    "resolve_size",
    "native_bf16",
    "size_tier",
    "progress",
    "say",
    "text_table",
    "short_error",
    "add_size_and_output_args",
]

#: The built-in models, by the name a command line uses, with the family a claim is about.
MODELS = {"tinygpt": "transformer", "smallcnn": "cnn", "lstm": "rnn"}
#: Words for the families, for tables and help texts.
FAMILIES = {"transformer": "utils.TinyGPT, a GPT-2-style decoder",
            "cnn": "utils.SmallCNN, a ResNet-flavoured CNN for images",
            "rnn": "utils.SmallLSTM, an LSTM language model on nn.LSTM",
            "custom": "a model from --model"}


class UsageError(Exception):
    """A bad option, or hardware the request needs and this machine lacks: the script prints
    the message (no traceback) and exits with status 2."""


@dataclass
class Workload:
    """One model and its data, on the CPU: every run copies the model from here, so that all
    runs start from the same weights and see the same batches.

    Attributes:
        name: the name on the command line (``tinygpt``, or the ``--model`` spec).
        family: ``transformer``, ``cnn``, ``rnn`` or ``custom``.
        describe: the model and batch in words, for the printout.
        model: the initial weights (CPU, train mode).
        batches: ``(inputs, targets)`` pairs on the CPU; step ``i`` uses ``batches[i % n]``.
            ``targets`` is ``None`` for a model that can only be run forward.
        num_classes: the classes the logits cover (``None``: all of the last dimension).
        lr: AdamW's learning rate for this model.
        item: what one row of a batch is called (``token``, ``image``, ``row``).
        items_per_batch: rows of a batch times positions (tokens per batch for a language model).
    """

    name: str
    family: str
    describe: str
    model: nn.Module
    batches: list[tuple[torch.Tensor, torch.Tensor | None]]
    num_classes: int | None = None
    lr: float = 1e-3
    item: str = "row"
    items_per_batch: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def trains(self) -> bool:
        return self.batches[0][1] is not None

    def batch(self, i: int, device: torch.device,
              float_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batch ``i`` (cycling) on ``device``; floating-point inputs cast to ``float_dtype``
        when given (a model converted to bf16 takes bf16 images)."""
        x, y = self.batches[i % len(self.batches)]
        x = x.to(device)
        if float_dtype is not None and x.is_floating_point():
            x = x.to(float_dtype)
        return x, (y.to(device) if y is not None else None)


def _stack(dataset: Any, n_batches: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches * batch`` items as batches, each with its own storage."""
    out = []
    for b in range(n_batches):
        xs, ys = zip(*(dataset[b * batch + i] for i in range(batch)))
        y = torch.as_tensor(ys) if isinstance(ys[0], int) else torch.stack(ys)
        out.append((torch.stack(xs), y))
    return out


def build_workload(name: str, sizes: dict[str, Any], *, n_batches: int = 1,
                   seed: int = 0) -> Workload:
    """A built-in model (:data:`MODELS`) with the sizes given, its initial weights drawn from
    ``seed``, and ``n_batches`` batches of data it can learn: :class:`utils.MarkovTokens`
    for the language models, :class:`utils.SyntheticImages` for the CNN.

    ``sizes`` keys: for ``tinygpt`` ``vocab``, ``seq``, ``layers``, ``heads``, ``width``,
    ``batch``; for ``lstm`` ``vocab``, ``seq``, ``layers``, ``width``, ``hidden``, ``batch``;
    for ``smallcnn`` ``width``, ``image``, ``batch``; and ``lr`` for each.

    Raises:
        UsageError: an unknown name.
    """
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}: the built-in models are "
                         f"{', '.join(MODELS)}; name your own with --model package.module:factory")
    if not isinstance(n_batches, int) or n_batches < 1:
        raise ValueError(f"n_batches must be a positive int, got {n_batches!r}")
    s = dict(sizes)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        if name == "tinygpt":
            cfg = GPTConfig(vocab_size=s["vocab"], block_size=s["seq"], n_layer=s["layers"],
                            n_head=s["heads"], n_embd=s["width"])
            model: nn.Module = TinyGPT(cfg)
            what = (f"TinyGPT: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, "
                    f"vocabulary {cfg.vocab_size}; batch {s['batch']} x {s['seq']} tokens")
        elif name == "lstm":
            model = SmallLSTM(vocab_size=s["vocab"], n_embd=s["width"], hidden=s["hidden"],
                              n_layer=s["layers"])
            what = (f"SmallLSTM: {s['layers']} nn.LSTM layer(s), hidden {s['hidden']}, embedding "
                    f"{s['width']}, vocabulary {s['vocab']}; batch {s['batch']} x {s['seq']} "
                    "tokens")
        else:
            model = SmallCNN(width=s["width"])
            what = (f"SmallCNN: width {s['width']}; batch {s['batch']} x 3 x {s['image']} x "
                    f"{s['image']} images")
    if name == "smallcnn":
        data = SyntheticImages(n=n_batches * s["batch"], image_size=s["image"], seed=seed)
        return Workload(name, MODELS[name], what, model, _stack(data, n_batches, s["batch"]),
                        num_classes=data.num_classes, lr=s["lr"], item="image",
                        items_per_batch=s["batch"])
    tokens = MarkovTokens(n=n_batches * s["batch"], seq_len=s["seq"], vocab_size=s["vocab"],
                          seed=seed)
    return Workload(name, MODELS[name], what, model, _stack(tokens, n_batches, s["batch"]),
                    num_classes=s["vocab"], lr=s["lr"], item="token",
                    items_per_batch=s["batch"] * s["seq"],
                    extra={"loss_floor_nats": tokens.entropy_nats,
                           "uniform_nats": tokens.uniform_nats})


def _load_callable(spec: str) -> Callable[..., Any]:
    """``package.module:name`` or ``path/to/file.py:name`` -> the object it names."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"--model {spec!r}: expected package.module:factory or "
                         "path/to/file.py:factory")
    try:
        if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
            path = Path(module_part).expanduser()
            if not path.is_file():
                raise UsageError(f"--model {spec!r}: no file {path}")
            mod_name = "_course_model_" + path.stem
            spec_obj = importlib.util.spec_from_file_location(mod_name, path)
            if spec_obj is None or spec_obj.loader is None:
                raise UsageError(f"--model {spec!r}: cannot import {path}")
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[mod_name] = module
            spec_obj.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # as `python -m` would: the current folder first
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_part)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to read
        raise UsageError(f"--model {spec!r}: importing {module_part!r} failed: "
                         f"{short_error(exc)}") from None
    if not hasattr(module, attr):
        raise UsageError(f"--model {spec!r}: {module_part!r} has no {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise UsageError(f"--model {spec!r}: {attr!r} is not callable")
    return obj


def factory_workload(spec: str, *, smoke: bool, lr: float = 1e-3) -> Workload:
    """A user's model from ``--model package.module:factory`` (or ``path/to/file.py:factory``).

    The factory is called with no arguments, or with ``smoke=`` if it takes a ``smoke``
    parameter, and returns ``(model, inputs, targets)``: the model with its initial weights,
    one batch of inputs, and class-index targets for cross-entropy shaped like the logits
    without their last dimension (``None`` for a model that is only run forward). Every
    training step uses that batch: a model that learns memorises it, so its loss falls.

    Raises:
        UsageError: the spec cannot be imported, or the factory returns something else.
    """
    factory = _load_callable(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    try:
        made = factory(smoke=smoke) if "smoke" in params else factory()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"--model {spec!r}: the factory raised {short_error(exc)}") from None
    if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module)
            and isinstance(made[1], torch.Tensor)
            and (made[2] is None or isinstance(made[2], torch.Tensor))):
        raise UsageError(f"--model {spec!r}: the factory must return (model, inputs, targets): "
                         "an nn.Module, a tensor of inputs and a tensor of class-index targets "
                         f"(or None); it returned {type(made).__name__}")
    model, x, y = made
    model = model.cpu().train()
    n_params = sum(p.numel() for p in model.parameters())
    what = (f"{type(model).__name__} from {spec}: {n_params:,} parameters; inputs "
            f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}")
    return Workload(spec.rpartition(":")[2], "custom", what, model,
                    [(x.cpu(), None if y is None else y.cpu())],
                    lr=lr, items_per_batch=int(x.shape[0]) if x.dim() else 1)


def unique_name(name: str, taken: Any) -> str:
    """``name``, or ``name#2``, ``name#3``, ... if ``taken`` (a container) already holds it."""
    out, i = name, 2
    while out in taken:
        out, i = f"{name}#{i}", i + 1
    return out


def split_list(text: str | None, allowed: Sequence[str], what: str) -> list[str] | None:
    """``"a,b"`` -> ``["a", "b"]``, each checked against ``allowed`` (``all`` = every one);
    ``None`` stays ``None`` (the default applies).

    Raises:
        UsageError: an unknown or repeated name.
    """
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(allowed)
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise UsageError(f"--{what}: unknown {', '.join(map(repr, bad)) or 'empty list'}; "
                         f"choose from {', '.join(allowed)} (comma-separated) or all")
    if len(set(names)) != len(names):
        raise UsageError(f"--{what}: {text!r} names one twice")
    return names


def resolve_device(text: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``None`` (a GPU if there is one), as an
    indexed device.

    Raises:
        UsageError: an unknown device, or one this machine does not have.
    """
    try:
        return pick_device(text)
    except ValueError as exc:
        raise UsageError(f"--device {text}: {exc}") from None


def resolve_size(smoke_flag: bool, full_flag: bool, device: torch.device) -> bool:
    """Whether to run at smoke size: ``--smoke``/``--full``, else ``COURSE_SMOKE=1/0``, else
    smoke size on a CPU and full size on a GPU (the device this run uses, not just any GPU).

    Raises:
        UsageError: an unreadable ``COURSE_SMOKE``.
    """
    if smoke_flag or full_flag:
        return smoke_flag
    if os.environ.get("COURSE_SMOKE", "").strip():
        try:
            return resolve_smoke(None)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return device.type != "cuda"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CPU (autocast runs bf16 on every
    CPU; fast with AVX512-BF16 or AMX), or a CUDA GPU of sm80 or newer (asked of that GPU,
    not of the current one; emulation on older GPUs does not count)."""
    device = pick_device(device)  # an index: asked of that GPU
    if device.type != "cuda":
        return True
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def size_tier(smoke: bool, device: torch.device) -> str:
    """The column of a script's size table: ``smoke``, ``cpu`` (full size on a CPU: it runs,
    slowly; the speed claims are about GPUs) or ``gpu``."""
    if smoke:
        return "smoke"
    return "gpu" if device.type == "cuda" else "cpu"


def progress(total: int, desc: str, *, enabled: bool = True):
    """A tqdm bar on a terminal; nothing in a batch log (the script prints a line per result
    instead), so the log holds no carriage-return redraws."""
    from tqdm.auto import tqdm

    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="run", disable=not (enabled and tty),
                file=sys.stderr, leave=False)


def say(line: str = "", bar: Any = None) -> None:
    """Print a line, above the progress bar when one is shown, and flush it (a batch log
    then shows it at once)."""
    if bar is not None and not getattr(bar, "disable", True):
        bar.write(line, file=sys.stdout)
    else:
        print(line)
    sys.stdout.flush()


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
               right: Sequence[int] = ()) -> str:
    """A plain-text table, columns padded to their widest cell; columns in ``right`` are
    right-aligned (numbers)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters, for a table or a log."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def add_size_and_output_args(parser: Any, *, ledger_file: str, smoke_what: str,
                             run_time_default: str, module: str) -> tuple[Any, Any]:
    """The "size and device" and "output" option groups both command-line benchmarks take.

    Args:
        parser: the script's ``argparse.ArgumentParser``.
        ledger_file: the ledger's default file name (``<module>__<script>.json``).
        smoke_what: what ``--smoke`` runs, in the help text ("small models, short timings").
        run_time_default: ``--min-run-time``'s defaults, in the help text.
        module: the module whose notebooks time the same way (for ``--threads``' help).

    Returns:
        The two groups, for a script to add options of its own to.
    """
    size = parser.add_argument_group("size and device")
    sz = size.add_mutually_exclusive_group()
    sz.add_argument("--smoke", action="store_true",
                    help=f"{smoke_what} (default on a CPU; COURSE_SMOKE=1 too)")
    sz.add_argument("--full", action="store_true",
                    help="full-size models (default on a GPU; COURSE_SMOKE=0 too)")
    size.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: the GPU if there is one)")
    size.add_argument("--min-run-time", type=float, default=None, metavar="S",
                      help=f"seconds each timing runs for (default: {run_time_default})")
    size.add_argument("--threads", type=int, default=None, metavar="N",
                      help=f"CPU threads for torch (default on a CPU: 1, as {module}'s "
                           "notebooks time; on a GPU node: torch's own choice)")
    out = parser.add_argument_group("output")
    out.add_argument("--results", default=None, metavar="PATH",
                     help=f"the ledger (JSON) to write (default: {ledger_file} in results/local/ "
                          "or $COURSE_RESULTS_DIR); none writes none")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar, even on a terminal (a line per result is printed "
                          "either way)")
    return size, out

