"""The speedup ladder: one training loop, the course's techniques as composable settings.

A :class:`TrainConfig` is a handful of flags (TF32, autocast, SDPA, ``torch.compile``,
fused AdamW, a padded vocabulary, gradient accumulation; beyond the ladder, the chunked
linear + cross-entropy loss and FP8 linear layers). :data:`LADDER` turns them on
one rung at a time, the way a practitioner speeds up a real training loop, and
:func:`run_ladder` trains any model on any batch function once per rung: the same
initial weights, the same batches, a loss curve over a fixed number of steps, then
ms/step, items/s, peak memory and MFU against a measured matmul ceiling. Before each
rung runs, :func:`predict_rung` can state its step time from the rung before it and the
machine's measured costs (matmul ceilings, copy bandwidth, kernel-launch cost), so that
the table shows the prediction beside the measurement. The reporting functions
(:func:`record_rungs`, :func:`verdict_lines`, :func:`prediction_table`,
:func:`same_model_table`, :func:`speedup_report`, :func:`record_mfu_by_convention`, ...)
turn the results into the tables, summaries and ledger records the capstone prints.

The split of work between the runner and your code:

* the runner applies what touches the training loop: TF32, autocast (with a
  ``GradScaler`` for fp16), ``torch.compile`` (model and loss together), fused AdamW,
  gradient accumulation, CUDA graphs;
* ``model_fn(config)`` builds the model, and applies what only it can know about:
  the attention kernel (:func:`set_attention` for :class:`utils.TinyGPT`) and the
  vocabulary size (:func:`padded_size`). :func:`gpt_model_fn` does both for TinyGPT.

Example (a few lines for your own model)::

    base = utils.ladder.TrainConfig(accum_steps=4)
    results = utils.ladder.run_ladder(lambda cfg: MyNet(), lambda step: my_batch(step),
                                      base=base, steps=20, flops_per_step=flops,
                                      ceilings=utils.ladder.measure_ceilings_tflops(...),
                                      num_classes=10, item_name="image")
    print(utils.ladder.ladder_table(results))
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import sdpa_backend_used
from .compiletools import StepProfile, profile_step
from .env import needs, pick_device, synchronize
from .flops import count_flops, measure_matmul_tflops
from .losses import chunked_linear_cross_entropy
from .ledger import ledger_key
from .memory import format_bytes, measure_peak_memory, tensor_bytes
from .models import CausalSelfAttention, GPTConfig, TinyGPT
from .precision import tf32 as tf32_context
from .sizes import format_table
from .timing import benchmark
from .training import first_call_s

__all__ = [
    "AMP_DTYPES",
    "COMPILE_MODES",
    "TRAIN_COMPILE_MODES",
    "compile_kwargs",
    "LOSSES",
    "LOSS_CHUNKS",
    "TrainConfig",
    "Rung",
    "LADDER",
    "default_ladder",
    "RungResult",
    "HandwrittenCausalSelfAttention",
    "set_attention",
    "padded_size",
    "gpt_model_fn",
    "LossModule",
    "gpt_hidden_states",
    "decay_groups",
    "FP8_MIN_CAPABILITY",
    "FP8_INSTALL_HINT",
    "fp8_unavailable_reason",
    "fp8_module_filter",
    "fp8_linear_names",
    "convert_to_fp8",
    "Fp8SweepPoint",
    "fp8_mlp_sweep",
    "fp8_pays_from",
    "Trainer",
    "count_step_flops",
    "measure_ceilings_tflops",
    "ceiling_matmul_size",
    "tf32_exists",
    "QUICK_CEILING_N_CPU",
    "QUICK_CEILING_N_CUDA",
    "run_rung",
    "run_ladder",
    "Prediction",
    "predict_rung",
    "ADAMW_BYTES_PER_PARAM",
    "FUSION_SAVES",
    "ladder_table",
    "TABLE_COLUMNS",
    "Verdict",
    "rung_verdicts",
    "plot_ladder",
    "attention_inputs",
    "attention_fwd_bwd",
    "gpt_ladder_predictor",
    "rung_key",
    "rungs_table",
    "record_flops_by_convention",
    "record_rungs",
    "verdict_lines",
    "warmup_summary",
    "memory_summary",
    "prediction_table",
    "realised_gains",
    "matmul_arithmetic",
    "loss_rel_diffs",
    "same_model_table",
    "mfu_by_convention",
    "speedup_report",
    "speedup_claim",
    "worst_first_loss_by_arithmetic",
    "record_mfu_by_convention",
    "record_ceilings",
]

AMP_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: ``torch.compile``'s own modes; ``reduce-overhead`` and ``max-autotune`` with CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Modes the course adds, as ``torch.compile`` options. ``max-autotune-gemm``: max-autotune
#: bounded to the matmuls (Inductor's ``max_autotune_gemm``: each distinct matmul shape of the
#: step is timed against Triton templates on its first call), without ``max-autotune``'s
#: coordinate-descent tuning of every generated kernel, which is most of its compile time;
#: with CUDA graphs, as ``max-autotune``. ``reduce-overhead-tuned``: ``reduce-overhead`` plus
#: one of max-autotune's settings, Inductor's coordinate-descent tuning of every Triton kernel it
#: generates (block sizes and warps, searched from its heuristic's choice); the matmuls stay
#: with the vendor library (cuBLAS), as in ``reduce-overhead``.
_COURSE_COMPILE_OPTIONS: dict[str, dict[str, Any]] = {
    "max-autotune-gemm": {"max_autotune_gemm": True, "triton.cudagraphs": True},
    "reduce-overhead-tuned": {"coordinate_descent_tuning": True, "triton.cudagraphs": True},
}
#: The compile modes a :class:`TrainConfig` may use: torch's and the course's.
TRAIN_COMPILE_MODES = COMPILE_MODES + tuple(_COURSE_COMPILE_OPTIONS)
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune") + tuple(
    mode for mode, options in _COURSE_COMPILE_OPTIONS.items() if options.get("triton.cudagraphs"))
#: The losses a :class:`TrainConfig` may use: ``plain`` (the head's logits, then
#: ``F.cross_entropy``) or ``chunked`` (:func:`utils.losses.chunked_linear_cross_entropy`: the
#: head and the loss as one function, the logits never whole).
LOSSES = ("plain", "chunked")
#: Chunks per micro-batch of the chunked loss, as module 04 cuts it: the logits exist an
#: eighth at a time, and a compiled step unrolls eight chunks.
LOSS_CHUNKS = 8
#: pytorch/pytorch#169545: CUDA graphs (cudagraph trees) overwrite a gradient buffer that
#: the previous micro-batch's backward left in ``.grad``, so accumulation is wrong or fails.
_CUDA_GRAPHS_ACCUM_ISSUE = "https://github.com/pytorch/pytorch/issues/169545"


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def compile_kwargs(mode: str) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments for a mode of :data:`TRAIN_COMPILE_MODES`:
    ``{"mode": mode}`` for torch's own, ``{"options": {...}}`` for the course's.

    Raises:
        ValueError: an unknown mode.
    """
    if mode in _COURSE_COMPILE_OPTIONS:
        return {"options": dict(_COURSE_COMPILE_OPTIONS[mode])}
    if mode in COMPILE_MODES:
        return {"mode": mode}
    raise ValueError(f"compile mode must be one of {', '.join(TRAIN_COMPILE_MODES)}, got {mode!r}")


# ----------------------------------------------------------------------------- the settings

@dataclass(frozen=True)
class TrainConfig:
    """What a training step does, as flags; every rung of the ladder is one of these.

    Attributes:
        tf32: allow TF32 for fp32 matmuls and cuDNN convolutions (:func:`utils.tf32`).
        amp: ``None`` (fp32), ``"bf16"`` (autocast) or ``"fp16"`` (autocast with a
            ``torch.amp.GradScaler``).
        sdpa: attention through ``F.scaled_dot_product_attention`` (one fused kernel:
            cuDNN's, FlashAttention or memory-efficient attention on a GPU, whichever SDPA
            picks; its own flash-style kernel on a CPU) instead of a hand-written
            softmax(QK^T)V. Applied by ``model_fn``.
        compile: ``None`` (eager) or a ``torch.compile`` mode from :data:`COMPILE_MODES`;
            the model and the loss are compiled together, with ``dynamic=False``.
        fused_adamw: ``torch.optim.AdamW(..., fused=True)``: one kernel for the whole update.
        vocab_multiple: pad the vocabulary (embedding and head rows) to a multiple of
            this; 1 leaves it alone. Applied by ``model_fn``; the extra rows never get a
            target, and the loss only sees the real classes.
        accum_steps: micro-batches per optimizer step. The batch a step sees stays the
            same; a smaller ``accum_steps`` means a larger micro-batch.
        loss: ``"plain"`` (the head's logits, then ``F.cross_entropy``) or ``"chunked"``
            (:func:`utils.losses.chunked_linear_cross_entropy` in :data:`LOSS_CHUNKS` chunks,
            its gradients computed in forward: the same loss and gradients, the logits never
            whole, the head's matmul run once, as in the plain loss; under fp16 the function
            computes the logits again in backward instead). The chunked loss needs a
            TinyGPT-like model (:func:`gpt_hidden_states`).
        fp8: the linear layers :func:`fp8_module_filter` picks run their matmuls in FP8
            (torchao's float8 training, dynamic tensorwise scaling: :func:`convert_to_fp8`),
            applied by the :class:`Trainer` before compiling. Pays only on CUDA sm89+
            (:func:`fp8_unavailable_reason`); elsewhere torch emulates the FP8 matmuls, slowly.
            The rung's MFU stays against its autocast dtype's ceilings (no FP8 ceiling is
            measured), so it can pass what that dtype's matmuls allow.
        bf16_residual: the residual stream between the blocks in bf16, not fp32
            (:class:`LossModule`'s ``residual_dtype``, set by the :class:`Trainer`). Under
            autocast the stream is otherwise fp32: the sum of fp32 embeddings and the blocks'
            bf16 outputs, which every residual add and layer norm reads and writes at 4 bytes
            an element, forward and backward; in bf16, at 2. CUDA's autocast still runs the
            layer norms in fp32, casting their input up: eagerly that fp32 copy is what they
            save for backward, compiled Inductor saves the bf16 input instead (a CPU's autocast
            leaves layer norms in their input's dtype). llm.c keeps its activations in bf16 too.
            Needs ``amp="bf16"`` and a TinyGPT-like model (:func:`gpt_hidden_states`).

    Raises:
        ValueError: an unknown ``amp``, ``compile`` or ``loss`` value, a count below 1,
            CUDA graphs combined with gradient accumulation (see
            :data:`_CUDA_GRAPHS_ACCUM_ISSUE`), or ``bf16_residual`` without ``amp="bf16"``.
    """

    tf32: bool = False
    amp: str | None = None
    sdpa: bool = False
    compile: str | None = None
    fused_adamw: bool = False
    vocab_multiple: int = 1
    accum_steps: int = 1
    loss: str = "plain"
    fp8: bool = False
    bf16_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("tf32", "sdpa", "fused_adamw", "fp8", "bf16_residual"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainConfig.{name} must be True or False, "
                                f"got {getattr(self, name)!r}")
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f"TrainConfig.amp must be None (fp32), 'bf16' or 'fp16', "
                             f"got {self.amp!r}")
        if self.compile is not None and self.compile not in TRAIN_COMPILE_MODES:
            raise ValueError(f"TrainConfig.compile must be None (eager) or one of "
                             f"{', '.join(TRAIN_COMPILE_MODES)}, got {self.compile!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig.loss must be one of {', '.join(LOSSES)}, "
                             f"got {self.loss!r}")
        _positive_int("TrainConfig.vocab_multiple", self.vocab_multiple)
        _positive_int("TrainConfig.accum_steps", self.accum_steps)
        if self.uses_cuda_graphs and self.accum_steps > 1:
            raise ValueError(
                f"TrainConfig: compile={self.compile!r} records CUDA graphs, which do not "
                f"work with gradient accumulation (accum_steps={self.accum_steps}): a graph "
                "replay overwrites the gradient buffer the previous micro-batch left in "
                f".grad ({_CUDA_GRAPHS_ACCUM_ISSUE}). Use accum_steps=1, or "
                "compile='max-autotune-no-cudagraphs' / 'default'.")
        if self.bf16_residual and self.amp != "bf16":
            raise ValueError(
                f"TrainConfig: bf16_residual keeps the residual stream between the blocks in "
                f"bf16, which needs amp='bf16' (autocast), got amp={self.amp!r}: without "
                "bf16 autocast the layers after it would get bf16 inputs for weights of "
                "another dtype")

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or ``None`` for fp32."""
        return AMP_DTYPES[self.amp] if self.amp else None

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.compile in _CUDA_GRAPH_MODES

    @property
    def ceiling_kind(self) -> str:
        """Which matmul ceiling this configuration's matmuls run against:
        ``"bf16"``, ``"fp16"``, ``"tf32"`` or ``"fp32"`` (with ``fp8``, still its autocast
        dtype's: no FP8 ceiling is measured)."""
        if self.amp:
            return self.amp
        return "tf32" if self.tf32 else "fp32"

    def changes_from(self, other: "TrainConfig") -> dict[str, Any]:
        """The fields that differ from ``other``, with this config's values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}

    def describe(self) -> str:
        """One line: ``fp32, TF32 off, hand-written attention, eager, AdamW, vocab as is, accum 4``."""
        parts = [f"{self.amp or 'fp32'}" + (" autocast" if self.amp else ""),
                 f"TF32 {'on' if self.tf32 else 'off'}",
                 "SDPA" if self.sdpa else "hand-written attention",
                 f"compile={self.compile}" if self.compile else "eager",
                 "fused AdamW" if self.fused_adamw else "AdamW",
                 f"vocab padded to x{self.vocab_multiple}" if self.vocab_multiple > 1
                 else "vocab as is",
                 f"accum {self.accum_steps}"]
        if self.loss != "plain":  # beyond the ladder: named only when on
            parts.append(f"{self.loss} linear + cross-entropy")
        if self.fp8:
            parts.append("FP8 linears (torchao)")
        if self.bf16_residual:
            parts.append("bf16 residual stream")
        return ", ".join(parts)

    # -- the same settings as command-line flags (train.py) ---------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field to ``parser``; each defaults to ``None`` (not given).

        :meth:`from_args` then applies the flags that were given on top of a base config.
        """
        g = parser.add_argument_group("ladder settings (each overrides the chosen rung)")
        g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                       help="TF32 for fp32 matmuls (CUDA sm80+; no effect elsewhere)")
        g.add_argument("--amp", choices=("fp32", *AMP_DTYPES), default=None,
                       help="autocast dtype; fp32 = no autocast; fp16 adds a GradScaler")
        g.add_argument("--attention", choices=("manual", "sdpa"), default=None,
                       help="hand-written softmax(QK^T)V, or scaled_dot_product_attention")
        g.add_argument("--compile", choices=("none", *TRAIN_COMPILE_MODES), default=None,
                       help="torch.compile mode for the model and its loss; none = eager. "
                            "max-autotune and max-autotune-no-cudagraphs time Triton "
                            "alternatives for every matmul shape and coordinate-descent-tune "
                            "every generated kernel on the first step (minutes of compilation "
                            "on a GPU); max-autotune-gemm bounds that to the matmuls (with CUDA "
                            "graphs), reduce-overhead-tuned to the generated kernels (CUDA "
                            "graphs and coordinate-descent tuning, the matmuls left to cuBLAS). "
                            "The first step's time, printed apart, is what it cost")
        g.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.optim.AdamW(fused=True)")
        g.add_argument("--vocab-multiple", type=int, default=None, metavar="N",
                       help="pad the vocabulary to a multiple of N (1: as is)")
        g.add_argument("--accum-steps", type=int, default=None, metavar="K",
                       help="micro-batches per optimizer step (the batch per step is fixed)")
        g.add_argument("--loss", choices=LOSSES, default=None,
                       help="plain: the head's logits, then cross-entropy; chunked: the head "
                            f"and the loss as one function, 1/{LOSS_CHUNKS} of the tokens' logits "
                            "at a time, gradients computed in forward "
                            "(utils.chunked_linear_cross_entropy, module 04): the same loss and "
                            "FLOPs, less memory (under fp16 the head's matmul runs once more)")
        g.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                       help="the transformer blocks' linear layers in FP8 (torchao's float8 "
                            "training; the head and the embedding stay as they are); needs a "
                            "CUDA GPU of compute capability 8.9+ and torchao: " + FP8_INSTALL_HINT)
        g.add_argument("--bf16-residual", action=argparse.BooleanOptionalAction, default=None,
                       help="the residual stream between the transformer blocks in bf16 (with "
                            "--amp bf16): its adds and layer norms read and write it at 2 bytes "
                            "an element, not 4 (on CUDA the layer norms still compute in fp32)")

    def with_args(self, args: argparse.Namespace) -> "TrainConfig":
        """This config with the flags of :meth:`add_arguments` that were given applied.

        Raises:
            ValueError: the resulting combination is invalid (the message says why).
        """
        changes: dict[str, Any] = {}
        if getattr(args, "tf32", None) is not None:
            changes["tf32"] = args.tf32
        if getattr(args, "amp", None) is not None:
            changes["amp"] = None if args.amp == "fp32" else args.amp
        if getattr(args, "attention", None) is not None:
            changes["sdpa"] = args.attention == "sdpa"
        if getattr(args, "compile", None) is not None:
            changes["compile"] = None if args.compile == "none" else args.compile
        if getattr(args, "fused_adamw", None) is not None:
            changes["fused_adamw"] = args.fused_adamw
        if getattr(args, "vocab_multiple", None) is not None:
            changes["vocab_multiple"] = args.vocab_multiple
        if getattr(args, "accum_steps", None) is not None:
            changes["accum_steps"] = args.accum_steps
        if getattr(args, "loss", None) is not None:
            changes["loss"] = args.loss
        if getattr(args, "fp8", None) is not None:
            changes["fp8"] = args.fp8
        if getattr(args, "bf16_residual", None) is not None:
            changes["bf16_residual"] = args.bf16_residual
        return dataclasses.replace(self, **changes)

    def to_flags(self) -> list[str]:
        """The command-line flags that reproduce this config exactly (for train.py)."""
        return [("--tf32" if self.tf32 else "--no-tf32"),
                "--amp", self.amp or "fp32",
                "--attention", "sdpa" if self.sdpa else "manual",
                "--compile", self.compile or "none",
                ("--fused-adamw" if self.fused_adamw else "--no-fused-adamw"),
                "--vocab-multiple", str(self.vocab_multiple),
                "--accum-steps", str(self.accum_steps),
                "--loss", self.loss,
                ("--fp8" if self.fp8 else "--no-fp8"),
                ("--bf16-residual" if self.bf16_residual else "--no-bf16-residual")]


@dataclass(frozen=True)
class Rung:
    """One step up the ladder: a name, the settings it changes, and what it needs.

    Attributes:
        name: a label for tables and plots.
        changes: :class:`TrainConfig` fields and their new values.
        needs_cuda: the rung only makes sense on a CUDA GPU; elsewhere it is shown as
            not run, with the reason, and the next rung builds on the one before it.
        language_model_only: the rung changes the attention or the vocabulary, so it
            changes nothing in a model without them (a CNN).
        why: one line on what the rung changes.
        key: a short name without spaces, for command lines (``train.py --rung sdpa``);
            empty: derived from ``name`` (lower case, runs of other characters as ``-``).
    """

    name: str
    changes: Mapping[str, Any]
    needs_cuda: bool = False
    language_model_only: bool = False
    why: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a rung needs a name")
        if not self.key:
            object.__setattr__(self, "key", re.sub(r"[^a-z0-9]+", "-", self.name.lower())
                               .strip("-"))
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", self.key):
            raise ValueError(f"rung {self.name!r}: key {self.key!r} must be lower-case letters, "
                             "digits, '-' or '_' (it is typed on command lines)")
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(self.changes) - known)
        if unknown:
            raise ValueError(f"rung {self.name!r} changes unknown TrainConfig field(s) "
                             f"{unknown}; fields are {sorted(known)}")

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(cfg, **dict(self.changes))


def default_ladder(amp: str = "bf16") -> tuple[Rung, ...]:
    """The course's ladder, cumulative, from fp32 eager to CUDA graphs.

    The larger micro-batch comes right after SDPA, which frees the ``T x T`` attention
    matrices that made small micro-batches necessary; the compiled rungs then all see
    the same shapes, which keeps the compile count low. CUDA graphs come last: they
    need one micro-batch per step (see :class:`TrainConfig`).

    Args:
        amp: the autocast rung's dtype: ``"bf16"`` (CPUs and sm80+ GPUs), or ``"fp16"``
            (older GPUs; the runner adds a GradScaler).
    """
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {list(AMP_DTYPES)}, got {amp!r}")
    amp_name = "bf16 autocast" if amp == "bf16" else "fp16 autocast + GradScaler"
    return (
        Rung("fp32 eager", {}, key="fp32",
             why="fp32 matmuls, hand-written attention, default AdamW (foreach on CUDA, "
                 "a per-parameter loop on a CPU)"),
        Rung("TF32 matmuls", {"tf32": True}, key="tf32",
             why="fp32 matmuls on tensor cores with a 10-bit mantissa (sm80+ GPUs only)"),
        Rung(amp_name, {"amp": amp}, key="amp",
             why="matmuls in 16-bit, the loss and the weights in fp32"),
        Rung("SDPA", {"sdpa": True}, language_model_only=True, key="sdpa",
             why="F.scaled_dot_product_attention: one fused kernel (SDPA picks which; the "
                 "rung records it) that never writes the T x T score matrix"),
        Rung("bigger micro-batch", {"accum_steps": 1}, key="micro-batch",
             why="one large micro-batch instead of accumulating small ones (same batch/step)"),
        Rung("torch.compile", {"compile": "default"}, key="compile",
             why="the model and the loss compiled together into generated kernels"),
        Rung("fused AdamW", {"fused_adamw": True}, key="fused-adamw",
             why="AdamW(fused=True): the optimizer update in one kernel"),
        Rung("vocab padded to 128", {"vocab_multiple": 128}, language_model_only=True,
             key="pad-vocab", why="embedding and head rows padded to a multiple of 128"),
        Rung("CUDA graphs", {"compile": "reduce-overhead"}, needs_cuda=True, key="cuda-graphs",
             why="compile mode reduce-overhead: the compiled forward and backward each replayed "
                 "as a CUDA graph; zero_grad, the AdamW step and the scheduler stay eager"),
    )


LADDER: tuple[Rung, ...] = default_ladder()


# ----------------------------------------------------------------------------- the model side

class HandwrittenCausalSelfAttention(CausalSelfAttention):
    """:class:`utils.TinyGPT`'s attention written out: ``softmax(Q K^T / sqrt(d)) V``.

    The same parameters and the same function as the SDPA version, but it writes the
    ``(batch, heads, T, T)`` score and probability matrices to memory, as a first
    implementation does. :func:`set_attention` switches a model between the two.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, p=self.dropout)
        y = probs @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def set_attention(model: nn.Module, sdpa: bool) -> int:
    """Make every TinyGPT attention layer of ``model`` use SDPA (``True``) or the
    hand-written version (``False``), in place; the parameters are untouched.

    Returns:
        How many attention layers were switched (0 for a model without them).
    """
    if not isinstance(sdpa, bool):
        raise TypeError(f"sdpa must be True or False, got {sdpa!r}")
    target = CausalSelfAttention if sdpa else HandwrittenCausalSelfAttention
    n = 0
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.__class__ = target
            n += 1
    return n


def padded_size(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (GPT-2: ``padded_size(50257, 128) == 50304``)."""
    _positive_int("n", n)
    _positive_int("multiple", multiple)
    return -(-n // multiple) * multiple


def gpt_model_fn(gpt_cfg: GPTConfig, seed: int = 0) -> Callable[[TrainConfig], TinyGPT]:
    """A ``model_fn`` for :func:`run_ladder`: TinyGPT with the same initial weights every time.

    The weights are drawn once (seed ``seed``, on the CPU, without touching the global
    random state). For a config
    with ``vocab_multiple > 1`` the embedding (tied to the head) gets zero rows up to
    the padded size: they are never an input (no token id reaches them) and the loss
    never sees their logits (:class:`LossModule` keeps the real classes only), so they
    get no gradient and stay zero. The attention follows ``config.sdpa``.

    Every model it returns carries its real vocabulary size as ``model.real_vocab_size``,
    so that :class:`LossModule` refuses a padded model without ``num_classes`` (a loss
    over the padded logits trains a different model, and only slightly worse).
    """
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        template = TinyGPT(gpt_cfg)

    def model_fn(cfg: TrainConfig) -> TinyGPT:
        vocab = padded_size(gpt_cfg.vocab_size, cfg.vocab_multiple)
        if vocab == gpt_cfg.vocab_size:
            model = copy.deepcopy(template)
        else:
            with torch.random.fork_rng(devices=[]):  # its own draws are overwritten below
                model = TinyGPT(dataclasses.replace(gpt_cfg, vocab_size=vocab))
            state = template.state_dict()
            emb = torch.zeros(vocab, gpt_cfg.n_embd)
            emb[: gpt_cfg.vocab_size] = state["tok_emb.weight"]
            state["tok_emb.weight"] = state["head.weight"] = emb
            model.load_state_dict(state)
        set_attention(model, cfg.sdpa)
        model.real_vocab_size = gpt_cfg.vocab_size  # type: ignore[assignment]
        return model

    template.real_vocab_size = gpt_cfg.vocab_size  # type: ignore[assignment]
    model_fn.template = template  # type: ignore[attr-defined]
    return model_fn


_GPT_PARTS = ("tok_emb", "pos_emb", "blocks", "ln_f", "head")


def gpt_hidden_states(model: nn.Module, idx: torch.Tensor, *,
                      residual_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:class:`utils.TinyGPT`'s forward pass up to its head's input: the final layer norm's
    output, ``(B, T, C)``. ``model.head(gpt_hidden_states(model, idx))`` is ``model(idx)``.

    Args:
        residual_dtype: cast the residual stream (the embeddings' sum) to this dtype before
            the first block. Under autocast of the same dtype every block keeps it there:
            each adds its attention's and its MLP's output, autocast matmuls' results of that
            dtype, to it; the layer norms read it (CUDA's autocast runs them in fp32, a CPU's
            in the input's dtype). ``None``: as the model does (under autocast, an fp32
            stream).

    Raises:
        ValueError: a model without TinyGPT's parts (``tok_emb``, ``pos_emb``, ``blocks``,
            ``ln_f``, ``head``), or ``idx`` that is not ``(batch, time)`` or is longer than the
            position embeddings, as :class:`utils.TinyGPT`'s forward refuses them.
    """
    missing = [a for a in _GPT_PARTS if not hasattr(model, a)]
    if missing:
        raise ValueError(f"{type(model).__name__} is not a TinyGPT-like model: it has no "
                         f"{', '.join(missing)}")
    if idx.dim() != 2:
        raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
    if idx.size(1) > model.pos_emb.num_embeddings:
        raise ValueError(f"sequence length {idx.size(1)} exceeds the model's "
                         f"{model.pos_emb.num_embeddings} positions")
    h = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.size(1), device=idx.device))
    if residual_dtype is not None:
        h = h.to(residual_dtype)
    for block in model.blocks:
        h = block(h)
    return model.ln_f(h)


class LossModule(nn.Module):
    """``model`` and its mean cross-entropy in one module, so that they compile together.

    Logits beyond ``num_classes`` (a padded vocabulary's extra rows) are cut off before
    the loss: it is computed over the real classes only, exactly as without padding.

    With ``loss="chunked"`` the head and the loss are one function,
    :func:`utils.losses.chunked_linear_cross_entropy` with the head's first ``num_classes``
    rows as the classes (the matmuls keep the padded head's aligned shape), in ``chunks``
    chunks of the micro-batch's tokens, its gradients computed in forward
    (``grads_in_forward=True``; under fp16 it computes the logits again in backward): the
    same loss and gradients, and no tensor of all the logits (the model must be TinyGPT-like:
    :func:`gpt_hidden_states`, and a head without bias).

    With ``residual_dtype`` (``torch.bfloat16`` for :attr:`TrainConfig.bf16_residual`) the
    model's residual stream is cast to it before the first block (:func:`gpt_hidden_states`;
    the model must be TinyGPT-like). It is an attribute of this module, read in ``forward``:
    ``torch.compile`` guards on it, where it would not guard on a hook.

    Raises:
        ValueError: ``num_classes`` is not a positive int, or it is ``None`` for a model
            that says it is padded (a ``real_vocab_size`` attribute, set by
            :func:`gpt_model_fn`, below its head's size): pass the real size, or the
            padded size on purpose to put every logit into the softmax. An unknown ``loss``,
            ``chunks`` below 1, or a chunked loss or a ``residual_dtype`` for a model that is
            not TinyGPT-like (or a ``residual_dtype`` that is not a floating-point dtype).
    """

    def __init__(self, model: nn.Module, num_classes: int | None = None, *,
                 loss: str = "plain", chunks: int = LOSS_CHUNKS,
                 residual_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        _positive_int("chunks", chunks)
        missing = [a for a in _GPT_PARTS if not hasattr(model, a)]
        if residual_dtype is not None:
            if not (isinstance(residual_dtype, torch.dtype) and residual_dtype.is_floating_point):
                raise ValueError(f"residual_dtype must be a floating-point torch.dtype or None, "
                                 f"got {residual_dtype!r}")
            if missing:
                raise ValueError(f"a residual_dtype needs a TinyGPT-like model (its parts "
                                 f"{', '.join(_GPT_PARTS)}); {type(model).__name__} has no "
                                 f"{', '.join(missing)}")
        self.residual_dtype = residual_dtype
        if loss == "chunked":
            head = getattr(model, "head", None)
            if missing or not isinstance(head, nn.Linear) or head.bias is not None:
                raise ValueError(
                    f"the chunked loss needs a TinyGPT-like model (its parts {', '.join(_GPT_PARTS)}"
                    f" and a linear head without bias); {type(model).__name__} has "
                    + (f"no {', '.join(missing)}" if missing else "another head"))
        self.loss = loss
        self.chunks = chunks
        if num_classes is not None:
            _positive_int("num_classes", num_classes)
        else:
            real = getattr(model, "real_vocab_size", None)
            head = getattr(getattr(model, "head", None), "out_features", None)
            if real is not None and head is not None and head != real:
                raise ValueError(
                    f"this model's vocabulary is padded from {real} to {head} rows: pass "
                    f"num_classes={real} so that the loss sees the real vocabulary only "
                    f"(num_classes={head} puts the padded logits into the softmax on purpose)")
        self.model = model
        self.num_classes = num_classes

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.loss == "chunked":
            weight = self.model.head.weight
            if self.num_classes is not None and weight.shape[0] < self.num_classes:
                raise ValueError(f"the model's head has {weight.shape[0]} rows, fewer than "
                                 f"num_classes={self.num_classes}")
            n = targets.numel()
            # the real classes only, as below; the padded rows stay in the matmuls' shape
            hidden = gpt_hidden_states(self.model, inputs, residual_dtype=self.residual_dtype)
            return chunked_linear_cross_entropy(hidden, weight, targets,
                                                chunk_tokens=-(-n // self.chunks),
                                                num_classes=self.num_classes,
                                                grads_in_forward=True)
        if self.residual_dtype is not None:
            logits = self.model.head(gpt_hidden_states(self.model, inputs,
                                                       residual_dtype=self.residual_dtype))
        else:
            logits = self.model(inputs)
        if self.num_classes is not None and logits.shape[-1] != self.num_classes:
            if logits.shape[-1] < self.num_classes:
                raise ValueError(f"the model gives {logits.shape[-1]} logits per row, fewer than "
                                 f"num_classes={self.num_classes}")
            logits = logits[..., : self.num_classes]
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups as GPT-2's reference recipes make them: weight decay on the
    matrices (every parameter of two or more dimensions: linear weights, embeddings), none on
    biases and normalisation weights, which decay would only pull towards zero.

    Raises:
        ValueError: a negative weight decay.
    """
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- FP8

#: FP8 tensor-core matmuls (``torch._scaled_mm``) need compute capability 8.9 (Ada, Hopper)
#: or newer.
FP8_MIN_CAPABILITY = (8, 9)
#: How to get torchao, for error messages.
FP8_INSTALL_HINT = ("install the course as the README says (torchao is a dependency, pinned in "
                    "constraints.txt); for a GPU machine without a registry, carry its wheel: "
                    "bash ../shared/gpu/bundle-wheels.sh torchao")


def _torchao_float8() -> Any:
    """``torchao.float8``, imported on first use (its import is slow, and a torchao that does not fit this torch must not stop the other rungs)."""
    import torchao.float8

    return torchao.float8


def fp8_unavailable_reason(device: str | torch.device | None = None) -> str:
    """Why FP8 training cannot pay on ``device`` (one line), or ``""`` where it can: a CUDA
    GPU of compute capability :data:`FP8_MIN_CAPABILITY` or newer, with torchao importable."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return (f"FP8 training needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper "
                f"or later); this run is on the {dev.type.upper()}")
    cap = torch.cuda.get_device_capability(dev)
    if cap < FP8_MIN_CAPABILITY:
        return (f"FP8 training needs compute capability 8.9 or newer; "
                f"{torch.cuda.get_device_name(dev)} is sm{cap[0]}{cap[1]}")
    try:
        _torchao_float8()
    except Exception as exc:  # ImportError, or a torchao that does not fit this torch
        first = str(exc).splitlines()[0] if str(exc) else ""
        return (f"FP8 training needs torchao, which does not import here ({type(exc).__name__}: "
                f"{first}); {FP8_INSTALL_HINT}")
    return ""


def _is_embedding_weight(model: nn.Module, weight: torch.Tensor) -> bool:
    return any(isinstance(m, nn.Embedding) and m.weight is weight for m in model.modules())


def fp8_module_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The ``module_filter_fn`` for torchao's ``convert_to_float8_training`` on ``model``:
    which linear layers get FP8 matmuls.

    Selected: every ``nn.Linear`` whose input and output sizes are multiples of 16 (what
    ``torch._scaled_mm`` requires; torchao's own filters check the same). Left as they are: the
    output head (a layer named ``head``, ``lm_head`` or ``output``, or one whose weight is an
    embedding's, as TinyGPT ties them): the logits decide the loss, FP8's rounding costs most
    there, and the chunked loss reads the head's weight itself. Smaller layers are not left
    out for speed: torchao's ``_auto_filter_for_recipe`` would also leave out layers too small
    to gain (at width 768: the attention's output projection and the MLP's second layer); the
    FP8 rung measures this filter.
    """
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if fqn.rsplit(".", 1)[-1] in ("head", "lm_head", "output"):
            return False
        if _is_embedding_weight(model, module.weight):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The names of the layers :func:`fp8_module_filter` selects in ``model``, in order."""
    keep = fp8_module_filter(model)
    return [name for name, m in model.named_modules() if name and keep(m, name)]


def convert_to_fp8(model: nn.Module) -> list[str]:
    """Swap the linear layers :func:`fp8_module_filter` selects for torchao's ``Float8Linear``
    (dynamic tensorwise scaling, torchao's default recipe), in place; the parameters stay the
    same objects. Call it before ``torch.compile`` and before building the optimizer.

    Returns:
        The names of the converted layers.

    Raises:
        ImportError: torchao is not installed (:data:`FP8_INSTALL_HINT`).
    """
    try:
        f8 = _torchao_float8()
    except ImportError as exc:
        raise ImportError(f"FP8 training needs torchao: {FP8_INSTALL_HINT} ({exc})") from exc
    f8.convert_to_float8_training(model, module_filter_fn=fp8_module_filter(model))
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


@dataclass(frozen=True)
class Fp8SweepPoint:
    """One width of :func:`fp8_mlp_sweep`: a transformer MLP's forward and backward, timed with
    bf16 linears and with torchao's FP8 linears.

    Attributes:
        width: the model width ``d`` (the MLP is ``d -> 4d -> d``).
        tokens: rows of the input (batch x sequence).
        flops: matmul FLOPs of one forward and backward, ``48 * tokens * d**2`` (each of the
            two linears: ``2 * tokens * d * 4d`` forward, twice that backward).
        bf16_ms, fp8_ms: median time of one forward and backward.
    """

    width: int
    tokens: int
    flops: float
    bf16_ms: float
    fp8_ms: float

    @property
    def speedup(self) -> float:
        """bf16's time over FP8's: above 1, FP8 pays at this width."""
        return self.bf16_ms / self.fp8_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def ledger_fields(self) -> dict[str, tuple[float, str]]:
        return {f"d{self.width}_bf16_tflops": (self.tflops(self.bf16_ms), "TFLOP/s"),
                f"d{self.width}_fp8_tflops": (self.tflops(self.fp8_ms), "TFLOP/s"),
                f"d{self.width}_speedup": (self.speedup, "x")}


def fp8_mlp_sweep(widths: Sequence[int], *, tokens: int, device: str | torch.device | None = None,
                  compile: bool = True, min_run_time_s: float = 0.3, seed: int = 0,
                  progress: Callable[[str], None] | None = None,
                  on_point: Callable[[Fp8SweepPoint], None] | None = None) -> list[Fp8SweepPoint]:
    """Does FP8 pay, and from which width? Time a GPT block's MLP (``Linear(d, 4d)``, GELU,
    ``Linear(4d, d)``, no bias) forward and backward (the input's gradient included, as inside a
    model) under bf16 autocast, once as it is and once converted with :func:`convert_to_fp8`,
    at each width.

    FP8's matmuls run at up to twice bf16's rate, but every FP8 linear first finds each input's
    largest magnitude and casts it (dynamic tensorwise scaling): memory-bound work that grows
    with ``tokens * d``, while the matmuls grow with ``tokens * d**2``. So FP8 pays from some
    width on; this measures where, on this GPU. Each model is compiled on its own
    (``torch.compiler.reset()`` first, so ten compiles of the same ``forward`` never reach
    Dynamo's recompile limit and fall back to eager).

    Args:
        widths: the widths ``d`` to time (multiples of 16, as ``torch._scaled_mm`` needs).
        tokens: the input's rows (a multiple of 16).
        device: where to run; FP8 pays only on a CUDA GPU of compute capability 8.9+ (torch
            emulates FP8 matmuls on a CPU, slowly: enough for a test).
        compile: ``torch.compile`` each model (how the capstone's rungs run).
        min_run_time_s: measuring time per model (:func:`utils.benchmark`).
        progress: called with a line as each width ends.
        on_point: called with each width's point as it ends (to save what was measured before
            a time limit stops the sweep).

    Raises:
        ValueError: a width or ``tokens`` that is not a positive multiple of 16.
        ImportError: torchao is not installed.
    """
    dev = pick_device(device)
    bad = [w for w in [*widths, tokens] if not isinstance(w, int) or w < 16 or w % 16]
    if bad or not widths:
        raise ValueError(f"widths and tokens must be positive multiples of 16 (FP8 matmuls need "
                         f"them), got widths={list(widths)}, tokens={tokens}")
    points = []
    for width in widths:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, width, generator=gen).to(dev).requires_grad_(True)
        grad = torch.randn(tokens, width, generator=gen).to(dev)
        times = {}
        for kind in ("bf16", "fp8"):
            torch.manual_seed(seed)
            mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(),
                                nn.Linear(4 * width, width, bias=False)).to(dev)
            if kind == "fp8":
                convert_to_fp8(mlp)
            if compile:
                torch.compiler.reset()
                run = torch.compile(mlp, dynamic=False)
            else:
                run = mlp

            def step(run=run, mlp=mlp):
                mlp.zero_grad(set_to_none=True)
                x.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    out = run(x)
                out.backward(grad)

            times[kind] = benchmark(step, device=dev, label=f"{kind} d={width}",
                                    min_run_time_s=min_run_time_s, warn_if_noisy=False).median_ms
            del run, mlp
        point = Fp8SweepPoint(width=width, tokens=tokens, flops=48.0 * tokens * width**2,
                              bf16_ms=times["bf16"], fp8_ms=times["fp8"])
        points.append(point)
        if progress is not None:
            progress(f"d={width}: bf16 {point.bf16_ms:.3f} ms, FP8 {point.fp8_ms:.3f} ms, "
                     f"FP8 {point.speedup:.2f}x")
        if on_point is not None:
            on_point(point)
        del x, grad
    if compile:
        torch.compiler.reset()
    return points


def fp8_pays_from(points: Sequence[Fp8SweepPoint], *, min_speedup: float = 1.1) -> int | None:
    """The smallest width from which FP8 is at least ``min_speedup`` times bf16's speed at
    every larger width measured, or ``None`` where it never is."""
    ordered = sorted(points, key=lambda p: p.width)
    for i, point in enumerate(ordered):
        if all(p.speedup >= min_speedup for p in ordered[i:]):
            return point.width
    return None


# ----------------------------------------------------------------------------- the step

class Trainer:
    """A model, its AdamW and the training step a :class:`TrainConfig` describes.

    ``step(inputs, targets)`` takes one optimizer step on the whole batch: it splits the
    batch into ``accum_steps`` equal micro-batches, runs each forward (under autocast,
    compiled or not) and backward with the loss divided by ``accum_steps`` (so the
    gradient is the mean over the batch, as one large micro-batch would give), then
    steps AdamW (through the GradScaler for fp16) and the warm-up schedule. It returns
    the batch's mean loss, detached.

    With ``cfg.fp8`` the model's linear layers are converted first (:func:`convert_to_fp8`;
    ``fp8_layers`` lists them), with ``cfg.loss == "chunked"`` the loss is the chunked one
    (:class:`LossModule`).

    Args:
        model: the model, already on ``device`` (its forward gives logits).
        cfg: the settings. TF32 is not set here: wrap the calls in ``utils.tf32(cfg.tf32)``
            (:func:`run_rung` does).
        device: where the model is.
        num_classes: the real number of classes (the unpadded vocabulary).
        lr, betas, weight_decay: AdamW's settings; the decay applies to matrices only
            (:func:`decay_groups`).
        warmup_steps: linear learning-rate warm-up over this many steps (0: none).
        wrap: applied to the :class:`LossModule` before compiling, e.g.
            ``lambda m: DistributedDataParallel(m, device_ids=[rank])``; a wrapper with
            ``no_sync()`` skips the gradient all-reduce on all but the last micro-batch.
        max_grad_norm: clip the gradients' total norm to this before every optimizer step
            (``torch.nn.utils.clip_grad_norm_``); ``None`` (the default) clips nothing. With
            fp16's GradScaler the gradients are unscaled first (``scaler.unscale_``), so the
            norm is the true one, not the scale times it.

    Raises:
        ValueError: CUDA graphs asked for on a device that is not CUDA, or a
            ``max_grad_norm`` that is not a positive number.
        ImportError: ``cfg.fp8`` without torchao.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, *, device: str | torch.device,
                 num_classes: int | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 warmup_steps: int = 0, wrap: Callable[[nn.Module], nn.Module] | None = None,
                 max_grad_norm: float | None = None) -> None:
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
        self.device = pick_device(device)
        if cfg.uses_cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"compile={cfg.compile!r} records CUDA graphs: it needs a CUDA "
                             f"device, not {self.device}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                              and 0 < max_grad_norm < math.inf):
            raise ValueError(f"max_grad_norm must be a positive number or None, "
                             f"got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.cfg = cfg
        self.model = model
        self.fp8_layers: list[str] = convert_to_fp8(model) if cfg.fp8 else []
        self.loss_module: nn.Module = LossModule(
            model, num_classes, loss=cfg.loss,
            residual_dtype=torch.bfloat16 if cfg.bf16_residual else None)
        if wrap is not None:
            self.loss_module = wrap(self.loss_module)
        self.forward: Callable[..., torch.Tensor] = self.loss_module
        if cfg.compile:
            self.forward = torch.compile(self.loss_module, dynamic=False,
                                         **compile_kwargs(cfg.compile))
        extra = {"fused": True} if cfg.fused_adamw else {}
        self.optimizer = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr,
                                           betas=betas, **extra)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
        self.scaler = (torch.amp.GradScaler(self.device.type) if cfg.amp == "fp16" else None)
        self.steps_done = 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.cfg.amp_dtype)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch ``(inputs, targets)``; returns its mean loss.

        Raises:
            ValueError: the batch does not split into ``accum_steps`` equal micro-batches.
        """
        k = self.cfg.accum_steps
        n = inputs.shape[0]
        if n % k or targets.shape[0] != n:
            raise ValueError(f"a batch of {n} rows (targets: {targets.shape[0]}) does not split "
                             f"into accum_steps={k} equal micro-batches")
        if self.cfg.uses_cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=inputs.device)
        no_sync = getattr(self.loss_module, "no_sync", None)
        for i, (x, y) in enumerate(zip(inputs.chunk(k), targets.chunk(k))):
            last = i == k - 1
            sync = contextlib.nullcontext() if (last or no_sync is None) else no_sync()
            with sync:
                with self._autocast():
                    loss = self.forward(x, y)
                scaled = loss / k
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            total = total + loss.detach()  # an eager copy: safe from a CUDA-graph replay
        if self.max_grad_norm is not None:
            if self.scaler is not None:
                # The gradients hold scale x their value: unscale them in place first, or the
                # clip would compare the scaled norm with the threshold (and cut every step).
                # scaler.step() then sees them unscaled and does not unscale them again.
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.steps_done += 1
        return total / k

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler (and scaler) state for a checkpoint."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "step": self.steps_done,
                 "train_config": dataclasses.asdict(self.cfg)}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state


# ----------------------------------------------------------------------------- FLOPs and ceilings

def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def count_step_flops(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     num_classes: int | None = None) -> int:
    """FLOPs of one training step's forward and backward on ``(inputs, targets)``, counted
    once with :func:`utils.count_flops` on the ``meta`` device (no memory, no compute).

    Count with the baseline model (fp32, hand-written attention, unpadded vocabulary):
    every rung computes the same function, so the same FLOPs serve for every rung's
    MFU. The optimizer's elementwise update is not a matmul and is not counted.
    """
    meta_model = copy.deepcopy(model).to("meta")
    module = LossModule(meta_model, num_classes)
    x, y = _to_meta(inputs), _to_meta(targets)

    def fwd_bwd() -> None:
        module(x, y).backward()

    return count_flops(fwd_bwd).total_flops


#: The matmul size of a *quick* ceiling on a CPU (smoke-size notebooks, train.py's tiny
#: preset): a 2048-wide fp32 matmul, the default, takes seconds per call on one slow core.
QUICK_CEILING_N_CPU = 512
#: The same on a GPU: large enough to keep the tensor cores busy, quick to time.
QUICK_CEILING_N_CUDA = 4096


def tf32_exists(device: str | torch.device | None = None) -> bool:
    """Whether fp32 matmuls on ``device`` can run as TF32 (CUDA sm80+); elsewhere turning
    TF32 on changes nothing, and a "tf32" matmul is the fp32 one."""
    dev = pick_device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)


def ceiling_matmul_size(device: str | torch.device | None = None,
                        quick: bool = False) -> int | None:
    """The matmul size :func:`measure_ceilings_tflops` uses: ``None`` (the defaults of
    :func:`utils.measure_matmul_tflops`: the best of sizes big enough for the device) or,
    when ``quick``, :data:`QUICK_CEILING_N_CPU` / :data:`QUICK_CEILING_N_CUDA`."""
    if not quick:
        return None
    return QUICK_CEILING_N_CUDA if pick_device(device).type == "cuda" else QUICK_CEILING_N_CPU


def measure_ceilings_tflops(kinds: Sequence[str] = ("fp32", "tf32", "bf16"),
                            device: str | torch.device | None = None, *, quick: bool = False,
                            n: int | None = None, min_run_time_s: float = 0.3,
                            rounds: int = 2) -> dict[str, float]:
    """Measured TFLOP/s of square matmuls on this machine, per kind of matmul.

    The one ceiling routine of the capstone: the notebook and ``train.py`` both call it,
    so that their MFUs are against the same measurement.

    ``"fp32"`` runs with TF32 off, ``"tf32"`` is an fp32 matmul with TF32 allowed,
    ``"bf16"`` and ``"fp16"`` are 16-bit matmuls (with fp32 accumulation). Where TF32
    does not exist (:func:`tf32_exists`: CPUs, GPUs before sm80) the "tf32" matmul *is*
    the fp32 one, so it is not measured twice: ``"tf32"`` gets the fp32 figure, and two
    rungs that differ only in TF32 are measured against the same ceiling.

    Each kind is measured with :func:`utils.measure_matmul_tflops` in ``rounds``
    interleaved rounds and the fastest round is kept: other work on a shared machine only
    ever slows a matmul down, and a ceiling that is too low would inflate every MFU
    measured against it.

    Args:
        kinds: which matmuls to measure.
        device: where (default: :func:`utils.pick_device`).
        quick: a small matmul (:func:`ceiling_matmul_size`), for smoke-size runs.
        n: the matmul size; overrides ``quick`` (default: :func:`ceiling_matmul_size`).
        min_run_time_s: time per size and round.
        rounds: interleaved rounds; the best is kept.

    Raises:
        ValueError: an unknown kind, or ``rounds`` below 1.
    """
    known = ("fp32", "tf32", "bf16", "fp16")
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty selection of {known}, got {list(kinds)}")
    _positive_int("rounds", rounds)
    dev = pick_device(device)
    size = n if n is not None else ceiling_matmul_size(dev, quick)
    same_as_fp32 = "tf32" in kinds and not tf32_exists(dev)
    measured = [k for k in dict.fromkeys(kinds) if not (k == "tf32" and same_as_fp32)]
    if same_as_fp32 and "fp32" not in measured:
        measured.insert(0, "fp32")
    out: dict[str, float] = {}
    for _ in range(rounds):
        for kind in measured:
            dtype = AMP_DTYPES.get(kind, torch.float32)
            with tf32_context(kind == "tf32"):
                tflops = measure_matmul_tflops(dev, dtype, size, min_run_time_s)
            out[kind] = max(out.get(kind, 0.0), tflops)
    if same_as_fp32:
        out["tf32"] = out["fp32"]
    return {k: out[k] for k in kinds}


# ----------------------------------------------------------------------------- one rung

@dataclass(frozen=True)
class RungResult:
    """What one rung measured (or why it did not run).

    Times are per optimizer step (all micro-batches); ``items`` are what the targets
    count: tokens for a language model, images for a classifier. ``graphs_compiled`` and
    ``fx_cache_hits`` count what Dynamo compiled during the rung and how many of the
    compiled graphs (forward and backward count apart) Inductor found in its on-disk
    cache; ``noop_reason`` says why the rung computes exactly what the rung before it
    computed on this machine (TF32 where TF32 does not exist), empty otherwise.

    ``prediction`` is the step time stated before the rung ran (:func:`predict_rung`, through
    :func:`run_ladder`'s ``predict``), ``profile`` one profiled step of the rung (kernels by
    category, idle time; ``run_rung(profile=True)``), and ``sdpa_backend`` the attention
    backend SDPA really ran in the forward and backward of a rung with ``config.sdpa``, read from
    the profiler by :func:`utils.sdpa_backend_used` (``sdpa_run`` says it with the kernels).
    """

    name: str
    config: TrainConfig
    ran: bool
    skipped_reason: str = ""
    median_ms: float | None = None
    iqr_ms: float | None = None
    items_per_step: int = 0
    item_name: str = "token"
    flops_per_step: int = 0
    ceiling_kind: str = ""
    ceiling_tflops: float | None = None
    peak_bytes: int | None = None
    memory_method: str = ""
    warmup_s: float | None = None
    graphs_compiled: int | None = None
    fx_cache_hits: int | None = None
    losses: tuple[float, ...] = field(default=(), repr=False)
    loss_window: int = 1
    noop_reason: str = ""
    prediction: "Prediction | None" = None
    profile: StepProfile | None = field(default=None, repr=False)
    sdpa_backend: str = ""
    sdpa_run: str = ""

    def ledger_fields(self) -> dict[str, tuple[float | None, str]]:
        """What ``Ledger.record(name, rung)`` records: the step time, its IQR, throughput,
        achieved TFLOP/s, MFU against the rung's ceiling, peak memory and graphs compiled
        (fields the rung did not measure are left out)."""
        return {"ms": (self.median_ms, "ms"), "iqr_ms": (self.iqr_ms, "ms"),
                f"{self.item_name}s_per_s": (self.items_per_s, f"{self.item_name}s/s"),
                "tflops": (self.achieved_tflops, "TFLOP/s"), "mfu": (self.mfu, "fraction"),
                "peak_bytes": (self.peak_bytes, "bytes"),
                "graphs_compiled": (self.graphs_compiled, "graphs")}

    @property
    def predicted_ms(self) -> float | None:
        """The step time predicted before the rung ran, or ``None``."""
        return None if self.prediction is None else self.prediction.ms

    @property
    def flop_bound_ms(self) -> float | None:
        """The shortest step its FLOPs allow at the measured ceiling: FLOPs / ceiling."""
        if not self.flops_per_step or not self.ceiling_tflops:
            return None
        return self.flops_per_step / (self.ceiling_tflops * 1e12) * 1e3

    @property
    def items_per_s(self) -> float | None:
        """Throughput: items (tokens, images) per second."""
        if not self.ran or not self.median_ms:
            return None
        return self.items_per_step / (self.median_ms / 1e3)

    @property
    def achieved_tflops(self) -> float | None:
        if not self.ran or not self.median_ms or not self.flops_per_step:
            return None
        return self.flops_per_step / (self.median_ms / 1e3) / 1e12

    @property
    def mfu(self) -> float | None:
        """Achieved TFLOP/s over the measured ceiling of the rung's own matmul kind."""
        a = self.achieved_tflops
        return None if a is None or not self.ceiling_tflops else a / self.ceiling_tflops

    def mfu_against(self, ceiling_tflops: float) -> float | None:
        """MFU against another ceiling (e.g. the bf16 one for every rung)."""
        if not (isinstance(ceiling_tflops, (int, float)) and ceiling_tflops > 0):
            raise ValueError(f"ceiling_tflops must be positive, got {ceiling_tflops!r}")
        a = self.achieved_tflops
        return None if a is None else a / ceiling_tflops

    @property
    def first_loss(self) -> float | None:
        """The loss of the first step: the initial weights on batch 0, before any update."""
        return self.losses[0] if self.losses else None

    @property
    def final_loss(self) -> float | None:
        """Mean loss over the last ``loss_window`` steps of the curve."""
        if not self.losses:
            return None
        w = self.losses[-self.loss_window:]
        return sum(w) / len(w)


def _graphs_compiled() -> int | None:
    """Dynamo's count of graphs compiled so far in this process (None if unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return int(counters["stats"]["unique_graphs"])


def _fx_cache_hits() -> int | None:
    """Inductor's count of FX graphs loaded from its cache so far (None if unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return None
    return int(counters["inductor"].get("fxgraph_cache_hit", 0))


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def _free_device_memory(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _forward_backward(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One micro-batch's forward and backward, as ``trainer.step`` runs them (for a probe)."""
    k = trainer.cfg.accum_steps
    x, y = inputs.chunk(k)[0], targets.chunk(k)[0]
    if trainer.cfg.uses_cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer._autocast():
        loss = trainer.forward(x, y)
    loss.backward()


def run_rung(name: str, cfg: TrainConfig, model_fn: Callable[[TrainConfig], nn.Module],
             batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *, steps: int,
             flops_per_step: int, ceilings: Mapping[str, float],
             device: str | torch.device | None = None, num_classes: int | None = None,
             lr: float = 1e-3, warmup_steps: int = 0, weight_decay: float = 0.1,
             loss_window: int = 1, min_run_time_s: float = 1.0, item_name: str = "token",
             on_step: Callable[[], None] | None = None, profile: bool = False,
             probe_sdpa: bool = True) -> RungResult:
    """Train a fresh model for ``steps`` steps under ``cfg``, then time and measure it.

    1. ``torch.compiler.reset()`` for a compiled rung, so its compile count is its own;
       a fresh model from ``model_fn(cfg)`` and its :class:`Trainer`.
    2. The loss curve: steps ``0 .. steps-1`` on ``batch_fn(0) .. batch_fn(steps-1)``.
       The first step is timed apart (``warmup_s``: compilation, allocation, autotuning).
       With CUDA graphs (cudagraph trees) the first call of the compiled function is a
       warm-up run and the graphs are recorded on a later call, so recording lands in the
       loss-curve steps, not in ``warmup_s``.
    3. Step time with :func:`utils.benchmark` on the next batch, ``batch_fn(steps)``.
    4. Peak memory. On CUDA: the allocator's peak over the whole rung, above what was
       allocated before it (weights, gradients, optimizer state, activations, CUDA-graph
       pools). On a CPU: weights and optimizer state plus a step's own peak, measured with
       :func:`utils.measure_peak_memory` on eager rungs only (its tensor tracker does not
       see inside compiled kernels).
    5. With ``profile``, one more step under the profiler (:func:`utils.compiletools.profile_step`:
       kernels per category, busy and idle time), for :func:`predict_rung`. With ``cfg.sdpa``
       and ``probe_sdpa``, one more forward and backward of a micro-batch, read by
       :func:`utils.sdpa_backend_used`: which attention kernel SDPA really ran.

    ``graphs_compiled`` counts the Dynamo graphs compiled from the first step to the last
    call of the rung (the loss curve, the timing and the probes), so that a recompile at any
    of them counts. Everything runs inside ``utils.tf32(cfg.tf32)``, restored afterwards.

    Raises:
        ValueError: bad counts, a batch that does not split into ``cfg.accum_steps``, or a
            ceiling missing for ``cfg.ceiling_kind``.
    """
    _positive_int("steps", steps)
    _positive_int("loss_window", loss_window)
    if loss_window > steps:
        raise ValueError(f"loss_window ({loss_window}) must not exceed steps ({steps})")
    if cfg.ceiling_kind not in ceilings:
        raise ValueError(f"no measured ceiling for {cfg.ceiling_kind!r} matmuls (rung {name!r});"
                         f" ceilings has {sorted(ceilings)}: measure it with "
                         "measure_ceilings_tflops")
    dev = pick_device(device)
    if cfg.compile:
        torch.compiler.reset()
    _free_device_memory(dev)
    with tf32_context(cfg.tf32):
        start_bytes = 0
        if dev.type == "cuda":
            synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            start_bytes = torch.cuda.memory_allocated(dev)
        trainer = Trainer(model_fn(cfg).to(dev), cfg, device=dev, num_classes=num_classes,
                          lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps)
        graphs_before, hits_before = _graphs_compiled(), _fx_cache_hits()
        x0, y0 = batch_fn(0)
        first: list[torch.Tensor] = []
        warmup_s = first_call_s(lambda: first.append(trainer.step(x0, y0)), device=dev)
        losses = first
        if on_step:
            on_step()
        for i in range(1, steps):
            losses.append(trainer.step(*batch_fn(i)))
            if on_step:
                on_step()
        loss_values = tuple(float(v) for v in torch.stack(losses).float().cpu())
        xt, yt = batch_fn(steps)
        items = int(yt.numel())
        timing = benchmark(trainer.step, xt, yt, label=name, device=dev,
                           min_run_time_s=min_run_time_s, warmup=1, warn_if_noisy=False)
        if dev.type == "cuda":
            synchronize(dev)
            peak: int | None = torch.cuda.max_memory_allocated(dev) - start_bytes
            method = "CUDA allocator peak over the rung (weights, optimizer state, step)"
        elif cfg.compile is None:
            persistent = tensor_bytes(trainer.model.parameters()) + tensor_bytes(
                v for st in trainer.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
            # the step clears the gradients the timing left: clear them before the meter
            # starts, or it counts their release against the step's own peak
            trainer.optimizer.zero_grad(set_to_none=True)
            peak = persistent + measure_peak_memory(trainer.step, xt, yt, device=dev).peak_bytes
            method = "weights + optimizer state + one step's tracked tensors"
        else:
            peak = None
            method = "not measured: the CPU tensor tracker does not see inside compiled kernels"
        step_profile = (profile_step(trainer.step, xt, yt, steps=1, warmup=0, label=name,
                                     device=dev) if profile else None)
        sdpa = (sdpa_backend_used(_forward_backward, trainer, xt, yt, device=dev)
                if cfg.sdpa and probe_sdpa else None)
        graphs_after, hits_after = _graphs_compiled(), _fx_cache_hits()
    del trainer, first, losses
    if cfg.compile:
        torch.compiler.reset()  # drop the compiled code and any CUDA-graph memory pool with it
    _free_device_memory(dev)
    return RungResult(
        name=name, config=cfg, ran=True, median_ms=timing.median_ms, iqr_ms=timing.iqr_ms,
        items_per_step=items, item_name=item_name, flops_per_step=int(flops_per_step),
        ceiling_kind=cfg.ceiling_kind, ceiling_tflops=float(ceilings[cfg.ceiling_kind]),
        peak_bytes=peak, memory_method=method, warmup_s=warmup_s,
        graphs_compiled=_delta(graphs_before, graphs_after),
        fx_cache_hits=_delta(hits_before, hits_after), losses=loss_values,
        loss_window=loss_window, profile=step_profile,
        sdpa_backend="" if sdpa is None else sdpa.backend,
        sdpa_run="" if sdpa is None else str(sdpa))


def run_ladder(model_fn: Callable[[TrainConfig], nn.Module],
               batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *,
               steps: int, flops_per_step: int, ceilings: Mapping[str, float],
               base: TrainConfig | None = None, rungs: Sequence[Rung] = LADDER,
               device: str | torch.device | None = None, progress: bool = True,
               previous: RungResult | None = None,
               predict: Callable[[Rung, TrainConfig, RungResult | None],
                                 "Prediction | None"] | None = None,
               **rung_kwargs: Any) -> list[RungResult]:
    """Climb ``rungs`` from ``base``: each rung adds its changes to the last rung that ran.

    A rung that needs CUDA on a machine without it is not run: it gets a result with
    ``ran=False`` and the reason, and the next rung builds on the one before it. A rung
    that only turns TF32 on, on a device without TF32, runs (its timing shows the run-to-run
    noise of the same computation) and says so in ``noop_reason``.
    ``rung_kwargs`` go to :func:`run_rung` (``num_classes``, ``lr``, ``warmup_steps``,
    ``loss_window``, ``min_run_time_s``, ``item_name``, ``profile``, ...).

    Args:
        previous: the last rung that ran before these (a ladder climbed in several calls):
            ``base`` defaults to its config, and ``predict`` sees it before the first rung.
        predict: ``predict(rung, config, last_ran)``, called before each rung that runs, with
            the last result that ran before it (``None`` before the first): a
            :class:`Prediction` (e.g. from :func:`predict_rung`), printed before the rung runs
            and kept in its result, or ``None``.

    Returns:
        One :class:`RungResult` per rung, in order; the first is the baseline.
    """
    if not rungs:
        raise ValueError("run_ladder needs at least one rung")
    names = [r.name for r in rungs]
    if len(set(names)) != len(names):
        raise ValueError(f"rung names must be unique, got {names}")
    dev = pick_device(device)
    if base is None and previous is not None:
        base = previous.config
    current = base if base is not None else TrainConfig()
    results: list[RungResult] = []
    last_ran = previous
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps * len(rungs), desc="ladder", unit="step")
    try:
        for rung in rungs:
            candidate = rung.apply(current)
            if rung.needs_cuda and dev.type != "cuda":
                reason = (needs(cuda=True, quiet=True, what=f"rung {rung.name!r}").reason
                          or f"SKIPPED rung {rung.name!r}: it runs on {dev}, and needs CUDA.")
                print(reason)
                results.append(RungResult(name=rung.name, config=candidate, ran=False,
                                          skipped_reason=reason.split(": ", 1)[-1].rstrip(".")))
                if bar is not None:
                    bar.update(steps)
                continue
            prediction = predict(rung, candidate, last_ran) if predict is not None else None
            if prediction is not None:
                line = f"{rung.name}, predicted before it runs: {prediction}"
                if bar is not None:
                    bar.write(line)
                else:
                    print(line)
            if bar is not None:
                bar.set_postfix_str(rung.name)
            result = run_rung(rung.name, candidate, model_fn, batch_fn, steps=steps,
                              flops_per_step=flops_per_step, ceilings=ceilings, device=dev,
                              on_step=(bar.update if bar is not None else None), **rung_kwargs)
            if set(candidate.changes_from(current)) == {"tf32"} and not tf32_exists(dev):
                result = dataclasses.replace(
                    result, noop_reason=f"no TF32 on {dev.type}: the same fp32 matmuls")
            if prediction is not None:
                result = dataclasses.replace(result, prediction=prediction)
            results.append(result)
            current = candidate
            last_ran = result
    finally:
        if bar is not None:
            bar.close()
    return results


# ----------------------------------------------------------------------------- predictions

#: Bytes per fp32 parameter one AdamW step reads and writes, as 03-fused-operations/01 counts
#: them (and checks against the operators torch runs): the default implementation, ``foreach``
#: on CUDA and the per-parameter loop on a CPU, makes the same eight passes over memory (80 B;
#: 72 B for a parameter without weight decay, which skips the decay pass); ``fused=True`` makes
#: one (28 B: reads p, g, m, v; writes p, m, v).
ADAMW_BYTES_PER_PARAM = {"foreach": 80, "fused": 28}
#: The share of the step's elementwise kernel time (outside matmuls, attention and the
#: optimizer) that :func:`predict_rung` assumes Inductor's fusion removes: an assumption, not a
#: measurement (two elementwise kernels fused into one read and write half the bytes).
FUSION_SAVES = 0.5


@dataclass(frozen=True)
class Prediction:
    """A rung's step time, stated before the rung runs, and the model that gave it.

    Attributes:
        ms: predicted milliseconds per optimizer step.
        model: the model's name, e.g. ``"Amdahl over the matmuls"``.
        formula: the formula with its numbers, printed beside the prediction.
        bound: ``True`` when ``ms`` is a lower bound (no step can be faster), not an estimate.
    """

    ms: float
    model: str
    formula: str
    bound: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.ms, (int, float)) and math.isfinite(self.ms)):
            raise ValueError(f"a prediction needs a finite ms, got {self.ms!r}")

    def __str__(self) -> str:
        return f"{'>= ' if self.bound else ''}{self.ms:.3g} ms/step ({self.model}: {self.formula})"


def _profiled_share(prev: RungResult, category: str) -> float | None:
    """The share of ``prev``'s profiled step (wall time) that ``category``'s kernels took."""
    p = prev.profile
    if p is None or p.wall_ms_per_step <= 0:
        return None
    return min(p.kernel_ms_by_category.get(category, 0.0) / p.wall_ms_per_step, 1.0)


def _idle_ms(prev: RungResult) -> float | None:
    """The time of ``prev``'s step its device sat idle under the profiler, scaled to its step."""
    if prev.profile is None or prev.median_ms is None:
        return None
    return prev.profile.idle_fraction * prev.median_ms


def predict_rung(cfg: TrainConfig, prev: RungResult | None, *, flops_per_step: float,
                 ceilings: Mapping[str, float], copy_gbs: float | None = None,
                 launch_us: float | None = None, n_params: int | None = None,
                 attention_swap_ms: float | None = None,
                 extra_flops_per_step: float | None = None) -> Prediction | None:
    """The step time of ``cfg``, predicted from the last rung that ran (``prev``) and the
    machine's measured costs, before ``cfg`` runs.

    One simple, stated model per setting, with ``t`` the step time of ``prev``:

    * the baseline (``prev`` is ``None``): a lower bound, ``FLOPs / C``, with ``C`` the
      measured ceiling of its matmul arithmetic;
    * ``tf32`` / ``amp`` (a faster matmul arithmetic): Amdahl over the matmuls,
      ``t - f t (1 - C_old / C_new)``: the matmuls, a share ``f`` of ``prev``'s profiled step
      (without a profile: its MFU, the share their FLOPs take at the ceiling), speed up by
      the ratio of the measured ceilings; nothing else changes. At most ``C_new / C_old``;
    * ``sdpa``: ``t - attention_swap_ms``, the hand-written attention's time less SDPA's per
      step, which the caller times alone at the rung's shapes;
    * ``accum_steps`` (fewer, larger micro-batches: the same FLOPs and bytes): the launches of
      the micro-batches that no longer run, ``(1 - k_new / k_old) x kernels x launch cost``,
      at most the time ``prev``'s device sat idle (a busy GPU hides its launches);
    * ``compile`` from eager: Inductor fuses the elementwise work; the model assumes it saves
      :data:`FUSION_SAVES` of the kernel time outside the matmuls, attention and optimizer
      (on a CPU the optimizer's per-parameter operators count as elementwise work there);
    * ``compile`` to a CUDA-graph mode from a compiled rung: the launches of the step's kernels
      vanish, ``kernels x launch cost``, at most the idle time;
    * ``fused_adamw``: the bytes no longer moved, ``n_params x (80 - 28) B / copy bandwidth``
      (:data:`ADAMW_BYTES_PER_PARAM`);
    * ``vocab_multiple``: the padded rows' FLOPs at the ceiling, ``t + extra / C``; whatever an
      aligned shape buys is what the measurement adds.

    Args:
        cfg: the rung about to run.
        prev: the last rung that ran before it (its ``profile`` feeds the kernel-time models).
        flops_per_step / ceilings: as for :func:`run_rung`.
        copy_gbs: the machine's measured copy bandwidth, GB/s (fused AdamW).
        launch_us: the measured cost of one kernel launch, microseconds.
        n_params: the parameters AdamW updates.
        attention_swap_ms: the hand-written attention's time less SDPA's, per optimizer step.
        extra_flops_per_step: the FLOPs the padded rows add per step.

    Returns:
        The :class:`Prediction`, or ``None`` where its model lacks an input (a profile, a
        measured cost) or several kinds of setting changed at once.
    """
    if cfg.ceiling_kind not in ceilings:
        raise ValueError(f"no measured ceiling for {cfg.ceiling_kind!r}; ceilings has "
                         f"{sorted(ceilings)}")
    c_new = ceilings[cfg.ceiling_kind]
    if prev is None:
        ms = flops_per_step / (c_new * 1e12) * 1e3
        return Prediction(ms, "FLOP bound", f"{flops_per_step / 1e9:.4g} GFLOP / {c_new:.3g} "
                          f"TFLOP/s ({cfg.ceiling_kind} ceiling)", bound=True)
    if not prev.ran or prev.median_ms is None:
        raise ValueError(f"prev ({prev.name!r}) must be a rung that ran")
    t = prev.median_ms
    changed = set(cfg.changes_from(prev.config))
    if not changed:
        return Prediction(t, "no change", f"the same settings as {prev.name!r}")
    if changed <= {"tf32", "amp"}:
        c_old = ceilings[prev.ceiling_kind]
        share = _profiled_share(prev, "matmul")
        src = f"the matmul kernels' share of the profiled {prev.name} step"
        if share is None:
            share, src = min(prev.mfu or 0.0, 1.0), f"the MFU of {prev.name}"
        ms = t - share * t * (1 - c_old / c_new)
        return Prediction(ms, "Amdahl over the matmuls",
                          f"{t:.3g} ms - {share:.0%} x {t:.3g} ms x (1 - {c_old:.3g} / {c_new:.3g} "
                          f"TFLOP/s), {share:.0%} = {src}; {prev.ceiling_kind} -> "
                          f"{cfg.ceiling_kind} ceilings")
    if changed == {"sdpa"}:
        if attention_swap_ms is None:
            return None
        return Prediction(t - attention_swap_ms, "attention swapped",
                          f"{t:.3g} ms {'-' if attention_swap_ms >= 0 else '+'} "
                          f"{abs(attention_swap_ms):.3g} ms (the old attention's time "
                          f"{'less' if attention_swap_ms >= 0 else 'below'} the new one's per "
                          "step, each timed alone)")
    if changed == {"accum_steps"}:
        idle = _idle_ms(prev)
        if launch_us is None or idle is None:
            return None
        frac = 1 - cfg.accum_steps / prev.config.accum_steps
        kernels = prev.profile.kernels_per_step
        saving = frac * kernels * launch_us / 1e3
        if saving > 0:
            saving = min(saving, idle)
        return Prediction(t - saving, "launches saved",
                          f"{t:.3g} ms - min({frac:.2f} x {kernels:.0f} kernels x {launch_us:.3g} "
                          f"us, {idle:.3g} ms idle)")
    if changed == {"compile"}:
        if cfg.compile is not None and prev.config.compile is None:
            other = _profiled_share(prev, "other")
            if other is None or cfg.uses_cuda_graphs:  # fusion and graphs at once: no split
                return None
            return Prediction(t - FUSION_SAVES * other * t, "elementwise work fused",
                              f"{t:.3g} ms - {FUSION_SAVES:g} x {other:.0%} x {t:.3g} ms, "
                              f"{other:.0%} = the elementwise kernels' share of the profiled "
                              f"{prev.name} step, {FUSION_SAVES:g} assumed")
        if cfg.uses_cuda_graphs and prev.config.compile and not prev.config.uses_cuda_graphs:
            idle = _idle_ms(prev)
            if launch_us is None or idle is None:
                return None
            kernels = prev.profile.kernels_per_step
            saving = min(kernels * launch_us / 1e3, idle)
            return Prediction(t - saving, "launches replayed",
                              f"{t:.3g} ms - min({kernels:.0f} kernels x {launch_us:.3g} us, "
                              f"{idle:.3g} ms idle)")
        return None
    if changed == {"fused_adamw"}:
        if copy_gbs is None or n_params is None:
            return None
        sign = 1 if cfg.fused_adamw else -1
        saved = ADAMW_BYTES_PER_PARAM["foreach"] - ADAMW_BYTES_PER_PARAM["fused"]
        saving = sign * n_params * saved / (copy_gbs * 1e9) * 1e3
        return Prediction(t - saving, "optimizer bytes saved",
                          f"{t:.3g} ms {'-' if sign > 0 else '+'} {n_params / 1e6:.3g} M params x "
                          f"{saved} B / {copy_gbs:.3g} GB/s")
    if changed == {"vocab_multiple"}:
        if extra_flops_per_step is None:
            return None
        extra_ms = extra_flops_per_step / (c_new * 1e12) * 1e3
        return Prediction(t + extra_ms, "padded rows' FLOPs",
                          f"{t:.3g} ms + {extra_flops_per_step / 1e9:.3g} GFLOP / {c_new:.3g} "
                          f"TFLOP/s")
    return None


# ----------------------------------------------------------------------------- reading results

def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _check_reference(reference: tuple[str, float] | None) -> None:
    if reference is None:
        return
    if not (isinstance(reference, tuple) and len(reference) == 2
            and isinstance(reference[1], (int, float)) and reference[1] > 0):
        raise ValueError(f"reference must be (name, ceiling TFLOP/s > 0), got {reference!r}")


@dataclass(frozen=True)
class Verdict:
    """What one rung did to the step time, read against the noise of the measurement.

    Attributes:
        name: the rung.
        verdict: ``"baseline"``, ``"pays"``, ``"does not pay"`` (within ``band``),
            ``"slower"``, ``"no-op here"`` (the rung computes what the rung before it did,
            see :attr:`RungResult.noop_reason`) or ``"not run"``.
        factor: the step-time ratio over the last rung that ran before it (above 1:
            faster); ``None`` for the baseline and a rung that did not run.
        band: the relative change below which the rung is called ``"does not pay"``:
            the largest of the floor, the drift of the baseline over the run, and the
            timing spread (IQR / median) of this rung and the one before it.
    """

    name: str
    verdict: str
    factor: float | None
    band: float


def rung_verdicts(results: Sequence[RungResult], floor: float = 0.03,
                  drift: float = 0.0) -> list[Verdict]:
    """One :class:`Verdict` per rung: did it pay, against a band that the noise sets?

    Args:
        results: :func:`run_ladder`'s results, baseline first.
        floor: the smallest band (3%: a change below it is too small to matter).
        drift: how much the same configuration's step time moved over the run, as a
            fraction (e.g. ``abs(again.median_ms / baseline.median_ms - 1)`` for the
            baseline timed again at the end); on a shared machine it can exceed the spread
            inside one measurement.

    Raises:
        ValueError: no results, a negative floor or drift, or a baseline that did not run.
    """
    if not results:
        raise ValueError("rung_verdicts needs at least one result")
    if floor < 0 or drift < 0:
        raise ValueError(f"floor and drift must be >= 0, got {floor!r}, {drift!r}")
    if not results[0].ran:
        raise ValueError("the first rung is the baseline and must have run")

    def spread(r: RungResult) -> float:
        return (r.iqr_ms or 0.0) / r.median_ms if r.median_ms else 0.0

    out: list[Verdict] = []
    prev: RungResult | None = None
    for r in results:
        if not r.ran:
            out.append(Verdict(r.name, "not run", None, max(floor, drift)))
            continue
        if prev is None:
            out.append(Verdict(r.name, "baseline", None, max(floor, drift, spread(r))))
        else:
            band = max(floor, drift, spread(r), spread(prev))
            factor = prev.median_ms / r.median_ms
            word = ("no-op here" if r.noop_reason else "pays" if factor > 1 + band
                    else "slower" if factor < 1 - band else "does not pay")
            out.append(Verdict(r.name, word, factor, band))
        prev = r
    return out


#: What the columns of :func:`ladder_table` mean.
TABLE_COLUMNS = {
    "ms/step": "median time of one optimizer step (all its micro-batches), utils.benchmark",
    "<items>/s": "tokens (or images) per second: the step's targets / ms per step",
    "total": "speedup over the first rung (the baseline): its ms/step / this rung's",
    "this": "speedup over the last rung that ran before it: what this rung added",
    "peak mem": "peak memory of the rung (the memory panel's title says how it was measured)",
    "predicted": "ms/step predicted before the rung ran (utils.ladder.predict_rung; >= a bound)",
    "MFU": "model FLOPs per second / the measured matmul ceiling of the rung's own dtype",
    "vs <ref>": "the same FLOP/s against one reference ceiling (e.g. bf16) for every rung",
    "sheet": "the same FLOP/s against the datasheet's dense peak for the rung's own dtype "
             "(GPUs in utils.DATASHEET_TFLOPS only)",
    "warm-up": "the first step, apart: compilation, allocation, autotuning",
    "graphs": "Dynamo graphs compiled during the rung (0 for eager)",
    "loss": "the final loss: the mean of the loss curve's last loss_window steps",
}


def ladder_table(results: Sequence[RungResult],
                 reference: tuple[str, float] | None = None,
                 datasheet: Mapping[str, float | None] | None = None) -> str:
    """A text table: one row per rung, speedups against the first (baseline) rung.

    The columns are described in :data:`TABLE_COLUMNS`; the ``predicted`` column appears when
    a rung carries a prediction, the ``sheet`` column when ``datasheet`` (the dense peak per
    matmul kind, e.g. from :func:`utils.datasheet_peak_tflops`) has a figure for a rung. A rung
    that is a no-op on this machine is marked, a rung that did not run says why, and a rung
    whose SDPA backend differs from the rung before it names the backend that ran.
    """
    if not results:
        raise ValueError("ladder_table needs at least one result")
    _check_reference(reference)
    base = results[0]
    unit = f"{base.item_name}s/s"
    show_pred = any(r.prediction is not None for r in results)
    sheet = {k: v for k, v in (datasheet or {}).items() if v}
    show_sheet = any(r.ceiling_kind in sheet for r in results if r.ran)
    head = (f"{'rung':<27} {'ms/step':>9} " + (f"{'predicted':>10} " if show_pred else "")
            + f"{unit:>12} {'total':>7} {'this':>6} {'peak mem':>10} "
            f"{'MFU':>6} " + (f"{'vs ' + reference[0]:>7} " if reference else "")
            + (f"{'sheet':>6} " if show_sheet else "")
            + f"{'warm-up':>8} {'graphs':>6} {'loss':>7}")
    lines = [head]
    prev = None
    for r in results:
        if not r.ran:
            lines.append(f"{r.name:<27} not run here: {r.skipped_reason}")
            continue
        total = (base.median_ms / r.median_ms) if (base.ran and r.median_ms) else None
        this = (prev.median_ms / r.median_ms) if (prev is not None and r.median_ms) else None
        mem = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "n/a"
        vs_ref = f"{_fmt(r.mfu_against(reference[1]), '7.1%')} " if reference else ""
        this_s = f"{this:5.2f}x" if this is not None else f"{'-':>6}"
        pred = ""
        if show_pred:
            p = r.prediction
            pred = (f"{'-':>10} " if p is None else
                    f"{('>=' if p.bound else '') + format(p.ms, '.1f'):>10} ")
        vs_sheet = ""
        if show_sheet:
            peak = sheet.get(r.ceiling_kind)
            vs_sheet = f"{_fmt(r.mfu_against(peak) if peak else None, '6.1%'):>6} "
        notes = []
        if r.noop_reason:
            notes.append(f"no-op here: {r.noop_reason}")
        if r.sdpa_backend and (prev is None or prev.sdpa_backend != r.sdpa_backend):
            notes.append(f"SDPA ran {r.sdpa_backend}")
        lines.append(
            f"{r.name:<27} {_fmt(r.median_ms, '9.1f')} {pred}{_fmt(r.items_per_s, '12,.0f')} "
            f"{_fmt(total, '6.2f')}x {this_s} {mem:>10} {_fmt(r.mfu, '6.1%')} "
            f"{vs_ref}{vs_sheet}{_fmt(r.warmup_s, '7.1f')}s "
            f"{'-' if r.graphs_compiled is None else r.graphs_compiled:>6} "
            f"{_fmt(r.final_loss, '7.4f')}" + (f"  ({'; '.join(notes)})" if notes else ""))
        prev = r
    return "\n".join(lines)


# ----------------------------------------------------------------------------- a GPT's predictions

def attention_inputs(cfg: TrainConfig, *, batch: int, n_head: int, seq_len: int, head_dim: int,
                     device: str | torch.device | None = None,
                     seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` (requiring gradients) and an output gradient for one layer's attention at
    ``cfg``'s micro-batch (``batch // cfg.accum_steps`` sequences of ``batch`` per step), in
    the dtype q, k and v have inside ``cfg``'s step (its autocast dtype, or fp32)."""
    if batch % cfg.accum_steps:
        raise ValueError(f"batch {batch} does not split into {cfg.accum_steps} micro-batches")
    dev = pick_device(device)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch // cfg.accum_steps, n_head, seq_len, head_dim)
    q, k, v, g = (torch.randn(shape, generator=gen).to(dev, cfg.amp_dtype or torch.float32)
                  for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), g


def attention_fwd_bwd(cfg: TrainConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      g: torch.Tensor, sdpa: bool,
                      backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """One layer's causal attention forward and backward as ``cfg``'s step computes it, under
    its autocast: SDPA (only ``backend`` allowed, a name of :func:`utils.sdpa_backends`, if one
    is given), or the hand-written ``softmax(QK^T / sqrt(d)) V`` of
    :class:`HandwrittenCausalSelfAttention`. Returns ``(output, dq, dk, dv)``."""
    if backend is not None and not sdpa:
        raise ValueError("a backend is an SDPA backend: pass sdpa=True with it")
    from .attention import sdpa_backends

    if backend is not None:
        from torch.nn.attention import sdpa_kernel

        known = sdpa_backends()
        if backend not in known:
            raise ValueError(f"unknown SDPA backend {backend!r}: one of {', '.join(known)}")
        allowed: Any = sdpa_kernel([known[backend]])
    else:
        allowed = contextlib.nullcontext()
    with torch.autocast(q.device.type, dtype=cfg.amp_dtype or torch.bfloat16,
                        enabled=cfg.amp_dtype is not None), allowed:
        if sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            t = q.size(-2)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return (out, *torch.autograd.grad(out, (q, k, v), g.to(out.dtype)))


def gpt_ladder_predictor(gpt_cfg: GPTConfig, *, batch: int, flops_per_step: float,
                         ceilings: Mapping[str, float], copy_gbs: float | None = None,
                         launch_us: float | None = None, n_params: int | None = None,
                         device: str | torch.device | None = None,
                         min_run_time_s: float = 0.1) -> Callable[..., Prediction | None]:
    """:func:`run_ladder`'s ``predict`` for a :class:`utils.TinyGPT` ladder: :func:`predict_rung`
    with the machine's measured costs, and what only the model's shapes give:

    * for a rung that changes only ``sdpa``, ``attention_swap_ms``: the two attentions
      (:func:`attention_fwd_bwd`) timed alone at the rung's micro-batch and arithmetic, their
      difference times the layers and the micro-batches of a step;
    * for a rung that changes only ``vocab_multiple``, ``extra_flops_per_step``: the head's three
      matmuls over the extra rows, ``6 x rows x d x tokens``.

    Args:
        gpt_cfg: the model's config (its ``block_size`` is the sequence length of a batch).
        batch: sequences per optimizer step.
        flops_per_step, ceilings, copy_gbs, launch_us, n_params: as for :func:`predict_rung`.
        min_run_time_s: each attention timing's ``utils.benchmark`` run time.
    """
    tokens = batch * gpt_cfg.block_size
    head_dim = gpt_cfg.n_embd // gpt_cfg.n_head

    def predict(rung: Rung, cfg: TrainConfig, prev: RungResult | None) -> Prediction | None:
        extra: dict[str, float] = {}
        changed = set(cfg.changes_from(prev.config)) if prev is not None else set()
        if changed == {"sdpa"}:
            qkvg = attention_inputs(cfg, batch=batch, n_head=gpt_cfg.n_head,
                                    seq_len=gpt_cfg.block_size, head_dim=head_dim, device=device)
            with tf32_context(cfg.tf32):
                ms = {s: benchmark(attention_fwd_bwd, cfg, *qkvg, s, device=device,
                                   min_run_time_s=min_run_time_s, warn_if_noisy=False).median_ms
                      for s in (False, True)}
            extra["attention_swap_ms"] = ((ms[prev.config.sdpa] - ms[cfg.sdpa])
                                          * gpt_cfg.n_layer * cfg.accum_steps)
        if changed == {"vocab_multiple"}:
            v = gpt_cfg.vocab_size
            rows = padded_size(v, cfg.vocab_multiple) - padded_size(v, prev.config.vocab_multiple)
            extra["extra_flops_per_step"] = 6 * rows * gpt_cfg.n_embd * tokens
        return predict_rung(cfg, prev, flops_per_step=flops_per_step, ceilings=ceilings,
                            copy_gbs=copy_gbs, launch_us=launch_us, n_params=n_params, **extra)

    return predict


# ----------------------------------------------------------------------------- reporting a ladder

def rung_key(name: str) -> str:
    """The ledger key of a rung's name: lower case, each run of other characters one ``_``
    (``"bf16 autocast"`` -> ``"bf16_autocast"``, ``"vocab padded to 128"`` ->
    ``"vocab_padded_to_128"``)."""
    return ledger_key(name)


def _ran(results: Sequence[RungResult]) -> list[RungResult]:
    if not results or not results[0].ran:
        raise ValueError("the results need a baseline (their first rung) that ran")
    return [r for r in results if r.ran]


def rungs_table(rungs: Sequence[Rung], base: TrainConfig) -> str:
    """The ladder before it runs: per rung its name, ``--rung`` key, the :class:`TrainConfig`
    fields it changes and what it does (``[needs CUDA]`` where it runs on CUDA only), then the
    bottom and top rungs' settings and the top rung's ``train.py`` flags."""
    rows: list[list[Any]] = [["rung", "--rung key", "TrainConfig change", "what it does"]]
    cfg = base
    for rung in rungs:
        cfg = rung.apply(cfg)
        changes = ", ".join(f"{k}={v}" for k, v in dict(rung.changes).items()) or "(the baseline)"
        rows.append([rung.name, rung.key, changes,
                     rung.why + ("  [needs CUDA]" if rung.needs_cuda else "")])
    return (format_table(rows, header_rule=True)
            + f"\n\nbottom rung: {base.describe()}\ntop rung   : {cfg.describe()}"
            + f"\ntrain.py flags of the top rung: {' '.join(cfg.to_flags())}")


def record_flops_by_convention(ledger: Any, flops: Any, *, tokens_per_step: int,
                               counted: float | None = None) -> str:
    """A step's FLOPs in every convention of :data:`utils.flops.GPT_FLOP_CONVENTIONS`, recorded
    as ``flops_per_step[<convention>]``, beside the ``counted`` FLOPs (if given) and the
    hardware FLOPs with the hand-written attention (the full ``T x T``, masked) and with a
    causal, flash-style kernel that recomputes the scores in backward (with ``flops``'s padded
    vocabulary); returns the table, in GFLOP per step."""
    from .flops import GPT_FLOP_CONVENTIONS

    full = flops.per_token("6N+attn") * tokens_per_step
    rows: list[list[Any]] = [["FLOPs", "GFLOP/step", "what"]]
    for conv, what in GPT_FLOP_CONVENTIONS.items():
        per_step = tokens_per_step * flops.per_token(conv)
        rows.append([conv, per_step / 1e9, what])
        ledger.record(f"flops_per_step[{conv}]", per_step, "FLOP", note=what)
    if counted is not None:
        rows.append(["counted", counted / 1e9, f"utils.count_flops: {1 - counted / full:.2%} "
                                               "below 6N+attn"])
    unpadded = dataclasses.replace(flops, padded_vocab=flops.vocab_size)
    rows.append(["hardware", tokens_per_step * unpadded.hardware_per_token(causal_kernel=False)
                 / 1e9, "hand-written attention (the full T x T, masked)"])
    rows.append(["hardware", tokens_per_step * flops.hardware_per_token(
        causal_kernel=True, attention_recompute=True) / 1e9,
        f"causal flash-style kernel, scores recomputed in backward, "
        f"{flops.padded_vocab} head rows"])
    return format_table(rows, header_rule=True, floatfmt=",.4g")


def record_rungs(ledger: Any, results: Sequence[RungResult], *, convention: str,
                 datasheet: Mapping[str, float | None] | None = None,
                 device_name: str = "") -> None:
    """Record every rung that ran in ``ledger`` under :func:`rung_key` of its name.

    Per rung ``k``: ``k_ms_per_step`` (noting the SDPA backend that ran),
    ``k_predicted_ms_per_step`` (with a prediction), ``k_<item>s_per_s``,
    ``k_speedup_vs_fp32`` (over the first rung, the baseline), ``k_mfu`` (against the rung's
    own measured ceiling), ``k_mfu_vs_datasheet`` (where ``datasheet`` has the rung's matmul
    kind), ``k_warmup_s`` and ``k_peak_bytes`` (where measured). ``convention`` names the FLOP
    count in the MFUs' notes; ``device_name`` the GPU in the datasheet's.
    """
    ran = _ran(results)
    base = ran[0]
    sheet = {k: v for k, v in (datasheet or {}).items() if v}
    for r in ran:
        k = rung_key(r.name)
        ledger.record(f"{k}_ms_per_step", r.median_ms, "ms",
                      note=f"SDPA ran {r.sdpa_backend}" if r.sdpa_backend else "")
        p = r.prediction
        if p is not None:
            ledger.record(f"{k}_predicted_ms_per_step", p.ms, "ms",
                          note=f"stated before the rung ran{', a lower bound' if p.bound else ''}: "
                               f"{p.model}, {p.formula}")
        ledger.record(f"{k}_{r.item_name}s_per_s", r.items_per_s, f"{r.item_name}s/s")
        ledger.record(f"{k}_speedup_vs_fp32", base.median_ms / r.median_ms, "x")
        ledger.record(f"{k}_mfu", r.mfu, "fraction",
                      note=f"{convention} FLOPs / the {r.ceiling_kind} matmul ceiling "
                           "measured here")
        peak = sheet.get(r.ceiling_kind)
        if peak:
            ledger.record(f"{k}_mfu_vs_datasheet", r.mfu_against(peak), "fraction",
                          note=f"{convention} FLOPs / the datasheet's dense {r.ceiling_kind} peak, "
                               f"{peak:g} TFLOP/s ({device_name})")
        if r.warmup_s is not None:
            ledger.record(f"{k}_warmup_s", r.warmup_s, "s")
        if r.peak_bytes is not None:
            ledger.record(f"{k}_peak_bytes", r.peak_bytes, "bytes")


def verdict_lines(results: Sequence[RungResult], verdicts: Sequence[Verdict]) -> list[str]:
    """One line per rung after the baseline: its factor over the rung before it and its
    :class:`Verdict` with the band, why a no-op is one, or why a rung did not run."""
    if len(results) != len(verdicts):
        raise ValueError(f"{len(results)} results but {len(verdicts)} verdicts")
    lines: list[str] = []
    prev: RungResult | None = None
    for r, v in zip(results, verdicts):
        if not r.ran:
            after = f"; the next rung builds on {prev.name!r}" if prev is not None else ""
            lines.append(f"{r.name:<27} not run here ({r.skipped_reason}){after}")
            continue
        if v.factor is not None and prev is not None:
            line = (f"{r.name:<27} x{v.factor:.2f} over {prev.name!r}: {v.verdict} "
                    f"(band {v.band:.0%})")
            if v.verdict == "no-op here":
                line += f": {r.noop_reason}, so x{v.factor:.2f} is two timings of the same step"
            lines.append(line)
        prev = r
    return lines


def warmup_summary(results: Sequence[RungResult], wall_s: float) -> str:
    """What the compiled rungs' first steps (compilation included) took of the ladder's
    ``wall_s`` seconds, and per compiled rung its warm-up and the FX graphs Inductor loaded
    from its on-disk cache (where counted)."""
    compiled = [r for r in results if r.ran and r.config.compile]
    warm = sum(r.warmup_s or 0.0 for r in compiled)
    text = (f"compiled rungs: {len(compiled)}, their first steps (compile included) took "
            f"{warm:.0f} s of the ladder's {wall_s:.0f} s")
    hits = [r.fx_cache_hits for r in compiled]
    if compiled and None not in hits:
        text += ("\nper compiled rung, warm-up and the FX graphs (forward, backward) loaded from "
                 "Inductor's on-disk cache: "
                 + "; ".join(f"{r.name}: {_fmt(r.warmup_s, '.1f')} s, {r.fx_cache_hits} hit(s)"
                             for r in compiled))
    return text


def memory_summary(results: Sequence[RungResult]) -> str:
    """The largest drop and the largest rise of peak memory from one measured rung to the next
    (saying how many of the rungs that ran were measured, where not all were), or ``""`` with
    fewer than two measured rungs."""
    ran = [r for r in results if r.ran]
    mem = [r for r in ran if r.peak_bytes]
    moves = [(b.peak_bytes / a.peak_bytes - 1, b.name) for a, b in zip(mem, mem[1:])]
    if not moves:
        return ""
    (down, d_name), (up, u_name) = min(moves), max(moves)
    return (f"peak memory, rung over the rung before it: largest drop {down:+.0%} ({d_name}), "
            f"largest rise {up:+.0%} ({u_name})"
            + (f"; measured for {len(mem)} of the {len(ran)} rungs that ran" if len(mem) < len(ran)
               else ""))


def prediction_table(results: Sequence[RungResult]) -> str:
    """Each rung's prediction (stated before it ran) beside its measurement, then each model's
    formula with this machine's numbers. ``>=`` marks a bound."""
    rows: list[list[Any]] = [["rung", "model", "predicted ms", "measured ms", "measured/pred"]]
    for r in _ran(results):
        p = r.prediction
        if p is None:
            rows.append([r.name, "(no model input)", "-", r.median_ms, None])
        else:
            rows.append([r.name, p.model, ("" if not p.bound else ">=") + f"{p.ms:.2f}",
                         r.median_ms, r.median_ms / p.ms])
    text = format_table(rows, header_rule=True, floatfmt=".2f")
    formulas = [f"  {r.name}: {r.prediction.formula}" for r in results
                if r.ran and r.prediction is not None]
    if formulas:
        text += "\n\nthe models, with this machine's numbers (ms per optimizer step):\n"
        text += "\n".join(formulas)
    return text


def realised_gains(rungs: Sequence[Rung], results: Sequence[RungResult],
                   keys: Sequence[str] = ("tf32", "amp", "sdpa"),
                   min_gain: float = 0.1, ledger: Any = None) -> dict[str, float]:
    """(measured gain) / (predicted gain) over the rung before, for the rungs whose
    :attr:`Rung.key` is in ``keys`` and whose predicted gain is at least ``min_gain`` of the
    rung before's step time (a smaller gain drowns in the noise). Keyed by rung name; with a
    ``ledger``, each is recorded as ``<rung_key(name)>_predicted_gain_realised``.

    ``rungs`` and ``results`` go together, one result per rung (:func:`run_ladder`'s order).
    """
    if len(rungs) != len(results):
        raise ValueError(f"{len(rungs)} rungs but {len(results)} results")
    out: dict[str, float] = {}
    prev: RungResult | None = None
    for rung, r in zip(rungs, results):
        if not r.ran:
            continue
        p = r.prediction
        if p is not None and prev is not None and rung.key in keys:
            gain = prev.median_ms - p.ms
            if gain >= min_gain * prev.median_ms and gain > 0:
                out[r.name] = (prev.median_ms - r.median_ms) / gain
                if ledger is not None:
                    ledger.record(f"{rung_key(r.name)}_predicted_gain_realised", out[r.name],
                                  "fraction", note="(measured gain) / (predicted gain) over the "
                                                   "rung before")
        prev = r
    return out


def matmul_arithmetic(result: RungResult, device: str | torch.device | None = None) -> str:
    """What a rung's matmuls compute in: its ceiling kind (``"fp32"``, ``"tf32"``, ``"bf16"``,
    ``"fp16"``), with TF32 as ``"fp32"`` on a device that has no TF32."""
    kind = result.config.ceiling_kind
    return "fp32" if kind == "tf32" and not tf32_exists(device) else kind


def loss_rel_diffs(results: Sequence[RungResult]) -> tuple[dict[str, float], dict[str, float]]:
    """Per rung that ran: ``|first loss - the baseline's| / the baseline's`` and the same for
    the final loss (the mean of the last ``loss_window`` steps), keyed by rung name."""
    ran = _ran(results)
    base = ran[0]
    if not base.losses:
        raise ValueError("the baseline has no loss curve")
    first = {r.name: abs(r.first_loss - base.first_loss) / base.first_loss for r in ran}
    final = {r.name: abs(r.final_loss - base.final_loss) / base.final_loss for r in ran}
    return first, final


def same_model_table(results: Sequence[RungResult], first_tol: Mapping[str, float], *,
                     loss_tol: float, device: str | torch.device | None = None) -> str:
    """Each rung's first and final loss against the baseline's (the first rung), with the
    tolerances they are held to, and the worst single step (shown, not checked); the columns
    explained above the table. ``first_tol`` maps a matmul arithmetic
    (:func:`matmul_arithmetic`) to the first loss's relative tolerance."""
    first, final = loss_rel_diffs(results)
    ran = _ran(results)
    ref = torch.tensor(ran[0].losses)
    window = ran[0].loss_window
    rows: list[list[Any]] = [["rung", "matmuls", "first loss", "rel diff", "tolerance",
                              "final loss", "rel diff", "worst step"]]
    for r in ran:
        kind = matmul_arithmetic(r, device)
        if kind not in first_tol:
            raise ValueError(f"first_tol has no tolerance for {kind!r} ({r.name})")
        c = torch.tensor(r.losses)
        n = min(len(c), len(ref))
        worst = ((c[:n] - ref[:n]).abs() / ref[:n]).max().item()
        rows.append([r.name, kind, f"{r.first_loss:.5f}", f"{first[r.name]:.1e}",
                     f"{first_tol[kind]:.0e}", f"{r.final_loss:.4f}", f"{final[r.name]:.2%}",
                     f"{worst:.2%}"])
    legend = ("the columns: matmuls, the arithmetic of the rung's matmuls; first loss, step 1's "
              "loss (initial weights, batch 0);\n  rel diff, |this rung's - the baseline's| / the "
              "baseline's, first against the tolerance for the rung's matmuls, then the final "
              f"loss's against {loss_tol:.0%};\n  final loss, the mean of the last {window} steps; "
              "worst step, the largest relative difference at any one step (shown, not checked)")
    return legend + "\n\n" + format_table(rows, header_rule=True)


def record_mfu_by_convention(ledger: Any, result: RungResult, flops: Any, *,
                             tokens_per_step: int, ceilings: Mapping[str, float],
                             datasheet: Mapping[str, float | None] | None = None,
                             device_name: str = "", fused_attention: bool = False,
                             prefix: str = "best_rung") -> str:
    """:func:`mfu_by_convention` for ``result`` against its own matmul kind's ceiling (and the
    datasheet's peak for that kind, where known), recorded in ``ledger`` as
    ``<prefix>_mfu[<convention>]``, ``<prefix>_mfu_vs_datasheet[<convention>]`` and
    ``<prefix>_hfu`` (hardware FLOPs over the measured ceiling); returns the table."""
    kind = result.config.ceiling_kind
    if kind not in ceilings:
        raise ValueError(f"no {kind!r} ceiling in {sorted(ceilings)}")
    peak = (datasheet or {}).get(kind) or None
    mfus = mfu_by_convention(result, flops, tokens_per_step=tokens_per_step,
                             ceiling_tflops=ceilings[kind], peak_tflops=peak,
                             fused_attention=fused_attention)
    for conv, (_, vs_ceiling, vs_peak) in mfus.items():
        what = f"{result.name}, {conv} FLOPs"
        ledger.record(f"{prefix}_hfu" if conv == "hardware" else f"{prefix}_mfu[{conv}]",
                      vs_ceiling, "fraction", note=f"{what} / the {kind} ceiling measured here")
        if vs_peak is not None and conv != "hardware":
            ledger.record(f"{prefix}_mfu_vs_datasheet[{conv}]", vs_peak, "fraction",
                          note=f"{what} / {peak:g} TFLOP/s dense {kind} ({device_name})")
    rows: list[list[Any]] = [["FLOPs", "TFLOP/s", f"of the {kind} ceiling", "of the datasheet's"]]
    rows += [[conv, tf, f"{m:.1%}", None if s is None else f"{s:.1%}"]
             for conv, (tf, m, s) in mfus.items()]
    attention = ("causal, scores recomputed in backward" if fused_attention
                 else "over the full T x T")
    return (format_table(rows, header_rule=True)
            + f"\n(hardware: what the device executed, attention {attention}, "
              f"{flops.padded_vocab} head rows)")


def record_ceilings(ledger: Any, ceilings: Mapping[str, float], *, how: str,
                    datasheet: Mapping[str, float | None] | None = None,
                    device_name: str = "", device: str | torch.device | None = None) -> str:
    """Record each measured matmul ceiling as ``ceiling_<kind>_tflops`` (noting ``how`` it was
    measured) and return one line per kind, with the datasheet's dense peak beside it where
    ``datasheet`` knows one (or a line saying MFU is against the measured ceilings only), and
    a line saying so where ``device`` has no TF32 (its tf32 ceiling is the fp32 one)."""
    sheet = {k: v for k, v in (datasheet or {}).items() if v}
    lines = []
    for kind, tflops in ceilings.items():
        peak = sheet.get(kind)
        lines.append(f"{kind:<5} matmul ceiling, measured on this machine ({how}): "
                     f"{tflops:8.3g} TFLOP/s"
                     + (f"; datasheet dense peak {peak:g} ({tflops / peak:.0%} of it)" if peak
                        else ""))
        ledger.record(f"ceiling_{kind}_tflops", tflops, "TFLOP/s", note=f"measured, {how}")
    if not sheet:
        lines.append(f"no datasheet peak for {device_name or 'a CPU'} in utils.DATASHEET_TFLOPS: "
                     "MFU is against the measured ceilings only")
    if "tf32" in ceilings and not tf32_exists(device):
        lines.append("This device has no TF32: the tf32 ceiling is the fp32 one (the same matmul, "
                     "measured once), and the TF32 rung runs the baseline's matmuls.")
    return "\n".join(lines)


def speedup_report(best: RungResult, baseline: RungResult, ceilings: Mapping[str, float], *,
                   reference_kind: str, flops_label: str = "",
                   targets: Sequence[float] = (10, 6),
                   device: str | torch.device | None = None) -> str:
    """The best rung against the baseline, in words: its throughput and speedup, its MFU and the
    baseline's (:func:`utils.mfu_report`: the measured ceiling and, on a GPU the course knows,
    the datasheet's peak), the speedup factored into (ceiling ratio) x (MFU ratio), and the MFU
    against the ``reference_kind`` ceiling that each speedup in ``targets`` would need at the
    baseline's MFU. Every rung does the same FLOPs, so the factorisation is exact."""
    from .flops import mfu_report

    for r in (best, baseline):
        if not r.ran or not r.median_ms:
            raise ValueError(f"{r.name!r} did not run")
    kind, base_kind = best.config.ceiling_kind, baseline.config.ceiling_kind
    missing = {kind, base_kind, reference_kind} - set(ceilings)
    if missing:
        raise ValueError(f"no ceiling for {sorted(missing)} in {sorted(ceilings)}")
    unit = f"{best.item_name}s/s"
    speedup = baseline.median_ms / best.median_ms
    lines = [f"best rung: {best.name} ({best.config.describe()})"
             + (f"; SDPA ran {best.sdpa_backend}" if best.sdpa_backend else ""),
             f"  {best.items_per_s:,.0f} {unit}, {speedup:.2f}x {baseline.name}'s "
             f"{baseline.items_per_s:,.0f}"]
    if flops_label:
        lines.append(f"  FLOPs: {flops_label}")
    lines.append("  best rung MFU: " + str(mfu_report(best.flops_per_step, best.median_ms / 1e3,
                                                      ceilings[kind], kind, device)))
    ref_mfu = best.mfu_against(ceilings[reference_kind])
    if kind != reference_kind:
        lines.append(f"  against the {reference_kind} ceiling: {ref_mfu:.1%}")
    lines.append("  baseline MFU : " + str(mfu_report(
        baseline.flops_per_step, baseline.median_ms / 1e3, ceilings[base_kind], base_kind, device)))
    ceil_factor = ceilings[kind] / ceilings[base_kind]
    mfu_factor = best.mfu / baseline.mfu
    ratio = ceilings[reference_kind] / ceilings[base_kind]
    need = ", ".join(f"{t:g}x at {t * baseline.mfu / ratio:.0%}" for t in targets)
    lines += ["", f"speedup = ceiling ratio x MFU ratio = {ceil_factor:.2f} x {mfu_factor:.2f} = "
                  f"{ceil_factor * mfu_factor:.2f}",
              f"measured {reference_kind} / {base_kind} ceiling ratio: {ratio:.1f}x; at the "
              "baseline's "
              f"MFU ({baseline.mfu:.0%} of its ceiling), the best rung needs, against the "
              f"{reference_kind} ceiling: {need} (measured: {ref_mfu:.0%})"]
    return "\n".join(lines)


def speedup_claim(*, is_cuda: bool, bf16_gpu: bool, compute_capability: tuple[int, int] | None,
                  ceiling_ratio: float, amp: str = "bf16") -> tuple[float, bool, str]:
    """The threshold of the claim "the best rung's tokens/s over fp32 eager's", and whether it
    applies here, gated on the **measured** ``amp`` / fp32 matmul ceiling ratio (the speedup is
    that ratio times an MFU ratio, so a GPU whose 16-bit tensor cores are a few times its fp32
    rate cannot reach it): 10x on an sm90+ GPU where the ratio is at least 12 (H100-class), 6x on
    an sm80+ GPU (``bf16_gpu``) where it is at least 8; elsewhere recorded only.

    Returns:
        ``(threshold, applies, reason)``; ``reason`` says why the claim does not apply ("" where
        it does).
    """
    if not ceiling_ratio > 0:
        raise ValueError(f"ceiling_ratio must be positive, got {ceiling_ratio!r}")
    if not (is_cuda and bf16_gpu):
        return 10.0, False, ("a claim about sm80+ GPUs (bf16 tensor cores), recorded only; this "
                             "machine " + ("has an older GPU" if is_cuda else "has no GPU"))
    if (compute_capability or (0, 0)) >= (9, 0) and ceiling_ratio >= 12:
        return 10.0, True, ""
    if ceiling_ratio >= 8:
        return 6.0, True, ""
    return 6.0, False, (f"this GPU's measured {amp}/fp32 ceiling ratio is {ceiling_ratio:.1f} "
                        f"(below 8): 6x would need the best rung's MFU at "
                        f"{6 / ceiling_ratio:.1f}x the baseline's; recorded only")


def worst_first_loss_by_arithmetic(results: Sequence[RungResult],
                                   device: str | torch.device | None = None
                                   ) -> dict[str, tuple[str, float]]:
    """For each matmul arithmetic (:func:`matmul_arithmetic`) among the rungs after the
    baseline: the rung whose first loss is furthest from the baseline's, and that relative
    difference, ``{arithmetic: (rung name, difference)}`` in ladder order."""
    first, _ = loss_rel_diffs(results)
    out: dict[str, tuple[str, float]] = {}
    for r in _ran(results)[1:]:
        kind = matmul_arithmetic(r, device)
        if kind not in out or first[r.name] > out[kind][1]:
            out[kind] = (r.name, first[r.name])
    return out


def mfu_by_convention(result: RungResult, flops: Any, *, tokens_per_step: int,
                      ceiling_tflops: float, peak_tflops: float | None = None,
                      fused_attention: bool = False
                      ) -> dict[str, tuple[float, float, float | None]]:
    """A rung's FLOP/s in every convention of :data:`utils.flops.GPT_FLOP_CONVENTIONS`, and its
    hardware FLOP/s (``"hardware"``: what the device executed, padded rows and, with
    ``fused_attention``, a causal kernel that recomputes the scores in backward).

    Args:
        result: the rung (its median step time).
        flops: :func:`utils.flops.gpt_flops` of the model, with the rung's padded vocabulary.
        tokens_per_step: tokens of one optimizer step.
        ceiling_tflops: the measured ceiling of the rung's matmul kind.
        peak_tflops: the datasheet's dense peak for that kind, or ``None``.

    Returns:
        ``{convention: (TFLOP/s, share of the ceiling, share of the peak or None)}``.
    """
    from .flops import GPT_FLOP_CONVENTIONS

    if not result.ran or not result.median_ms:
        raise ValueError(f"{result.name!r} did not run: it has no FLOP/s")
    if not ceiling_tflops > 0:
        raise ValueError(f"ceiling_tflops must be positive, got {ceiling_tflops!r}")
    step_s = result.median_ms / 1e3
    per_token = {c: flops.per_token(c) for c in GPT_FLOP_CONVENTIONS}
    per_token["hardware"] = flops.hardware_per_token(causal_kernel=fused_attention,
                                                     attention_recompute=fused_attention)
    out = {}
    for conv, ft in per_token.items():
        tf = tokens_per_step * ft / step_s / 1e12
        out[conv] = (tf, tf / ceiling_tflops, tf / peak_tflops if peak_tflops else None)
    return out


GAIN_COLOR, FLAT_COLOR, LOSS_COLOR, SKIP_COLOR = "#2ca02c", "#8c8c8c", "#d62728", "#ffffff"
NOOP_COLOR = "#d9d9d9"
#: Round tick values for a log axis of speedups, from fine to coarse; the finest set that
#: puts few enough ticks on the axis wins.
_TICK_LEVELS = (
    (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5,
     3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0),
    (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 15.0,
     20.0, 30.0, 50.0, 100.0),
    (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0, 30.0, 50.0, 100.0),
    (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0),
)


def _log_ticks(lo: float, hi: float, most: int = 9) -> list[float]:
    """Round values between ``lo`` and ``hi``, 1 always among them, for a log axis."""
    for level in _TICK_LEVELS:
        ticks = sorted({t for t in level if lo <= t <= hi} | {1.0})
        if len(ticks) <= most:
            return ticks
    return ticks


def plot_ladder(results: Sequence[RungResult], title: str = "", flat_band: float = 0.03,
                reference: tuple[str, float] | None = None, drift: float = 0.0,
                loss_tol: float | None = None) -> Any:
    """The ladder in one figure: a waterfall of speedups, MFU, loss differences and memory.

    The waterfall (log scale) draws each rung as a bar from the speedup before it to the
    speedup after it, coloured by :func:`rung_verdicts` (``flat_band`` is its floor,
    ``drift`` its baseline drift): green when it paid, grey when the change is within the
    band (it does not pay here), red when it made the step slower, light grey and hatched
    when it is a no-op on this machine, and an empty hatched bar, labelled, for a rung
    that did not run.

    The MFU panel shows each rung against its own ceiling, and against ``reference``
    (``(name, TFLOP/s)``) when given. The loss panel shows each rung's loss curve as a
    relative difference from the baseline's, step by step, with ``+-loss_tol`` when given.

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    from .plots import use_style

    if not results:
        raise ValueError("plot_ladder needs at least one result")
    _check_reference(reference)
    base = results[0]
    verdicts = rung_verdicts(results, flat_band, drift)
    use_style()
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    names = [r.name for r in results]
    xs = list(range(len(results)))

    # 1. waterfall of cumulative speedup
    ax = axes[0, 0]
    level = 1.0
    span = [1 / 1.05, 1.05]
    for i, (r, v) in enumerate(zip(results, verdicts)):
        if not r.ran:
            ax.bar(i, level * 1.1 - level / 1.1, bottom=level / 1.1, color=SKIP_COLOR,
                   edgecolor="black", hatch="//", lw=0.8)
            ax.annotate("not run\nhere", (i, level * 1.1), ha="center", va="bottom", fontsize=7)
            span += [level / 1.1, level * 1.25]
            continue
        new = base.median_ms / r.median_ms
        color, hatch = {"pays": (GAIN_COLOR, None), "slower": (LOSS_COLOR, None),
                        "no-op here": (NOOP_COLOR, "\\\\")}.get(v.verdict, (FLAT_COLOR, None))
        lo, hi = (1 / 1.03, 1.03) if i == 0 else (min(level, new), max(level, new))
        ax.bar(i, hi - lo, bottom=lo, color=color, hatch=hatch, edgecolor="black", lw=0.5)
        label = "1x" if i == 0 else f"x{v.factor:.2f}" + ("\nno-op" if v.verdict == "no-op here"
                                                            else "")
        ax.annotate(label, (i, hi), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
        if i + 1 < len(results):
            ax.plot([i + 0.4, i + 0.6], [new, new], color="black", lw=0.6)
        span += [lo, hi * 1.15]
        level = new
    ax.set_yscale("log")
    lo, hi = min(span) / 1.04, max(span)
    ax.set_ylim(lo, hi)
    ticks = _log_ticks(lo, hi)
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.axhline(1.0, color="black", ls="--", lw=0.8)
    ax.set_xticks(xs, names, rotation=35, ha="right")
    ax.set_ylabel(f"speedup vs {base.name} (log)")
    ax.set_title(f"each rung's contribution (green: pays; grey: within the noise band, at least "
                 f"{flat_band:.0%}; red: slower)", fontsize=9)

    # 2. MFU
    ax = axes[0, 1]
    ran = [r for r in results if r.ran]
    mfu = [100 * (r.mfu or 0) for r in ran]
    pos = [names.index(r.name) for r in ran]
    ax.bar(pos, mfu, color="#1f77b4", label="vs the rung's own ceiling")
    top = max(mfu, default=1.0)
    if reference:
        ref_mfu = [100 * (r.mfu_against(reference[1]) or 0) for r in ran]
        ax.plot(pos, ref_mfu, "o", color="#ff7f0e", label=f"vs the {reference[0]} ceiling")
        top = max([top, *ref_mfu])
    for i, r in enumerate(results):
        if not r.ran:
            ax.annotate("not run\nhere", (i, 0.02 * top), ha="center", fontsize=7)
    ax.set_ylim(0, 1.35 * top if top > 0 else 1)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_xticks(xs, names, rotation=35, ha="right")
    ax.set_ylabel("MFU (%)")
    ax.set_title("model FLOPs utilisation (measured ceilings)")

    # 3. loss curves, as a difference from the baseline's
    ax = axes[1, 0]
    ref = base.losses
    for r in ran[1:]:
        n = min(len(r.losses), len(ref))
        diff = [100 * (r.losses[j] - ref[j]) / ref[j] for j in range(n)]
        ax.plot(range(1, n + 1), diff, marker=".", lw=1.2, label=r.name)
    ax.axhline(0.0, color="black", lw=1.5, label=base.name)
    if loss_tol is not None:
        for sign in (1, -1):
            ax.axhline(sign * 100 * loss_tol, color=LOSS_COLOR, ls=":", lw=1)
        ax.annotate(f"+-{loss_tol:.0%}: the final-loss tolerance", (1, 100 * loss_tol),
                    fontsize=7, color=LOSS_COLOR, va="bottom")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss - {base.name}'s loss (% of it)")
    ax.set_title("loss curves: same initial weights, same batches")
    ax.legend(fontsize=7, ncol=2, loc="lower right")

    # 4. memory
    ax = axes[1, 1]
    mem = [(names.index(r.name), r.peak_bytes / 2**20) for r in ran if r.peak_bytes is not None]
    if mem:
        ax.bar([p for p, _ in mem], [m for _, m in mem], color="#9467bd")
    top = max((m for _, m in mem), default=1.0)
    for i, r in enumerate(results):
        if not r.ran or r.peak_bytes is None:
            ax.annotate("not run\nhere" if not r.ran else "not\nmeasured", (i, 0.02 * top),
                        ha="center", fontsize=7)
    ax.set_xticks(xs, names, rotation=35, ha="right")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory: " + (base.memory_method or ""), fontsize=8)

    fig.suptitle(title or "the speedup ladder")
    fig.tight_layout()
    return fig
