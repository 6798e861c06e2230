"""Shared tools of the PyTorch Optimization Track.

Every notebook imports this package for its environment report, timing,
memory probes, FLOP counting, reference models, synthetic data, plots and the
results ledger. The public surface is what ``__all__`` lists, plus the submodules a module
uses as a whole (:mod:`utils.distributed`, :mod:`utils.ladder`, :mod:`utils.compiletools`,
:mod:`utils.collectives`, :mod:`utils.sizes`, :mod:`utils.losses`, :mod:`utils.plots` ...).

Names are imported when first used (PEP 562), so ``python -m utils release`` and ``grade``,
which do not need PyTorch, start without importing it; ``utils.benchmark`` in a notebook
imports :mod:`utils.timing` (and torch) the first time it is read.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Each public name and the submodule that defines it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "env": ("EnvInfo", "Gate", "get_env", "needs", "pick_device", "print_env",
            "resolve_smoke", "synchronize"),
    "timing": ("Timing", "SpeedupTable", "NoisyMeasurementWarning", "benchmark",
               "cold_l2_benchmark", "compare", "first_call", "break_even", "torch_threads",
               "per_call_ms", "BackgroundLoad", "MachineLoad", "machine_load", "SectionClock"),
    "memory": ("MemoryResult", "MemoryBreakdown", "TensorMemoryTracker",
               "measure_peak_memory", "memory_breakdown", "tensor_bytes", "format_bytes"),
    "flops": ("FlopCount", "Ceilings", "RooflinePoint", "OpCost", "op_cost", "count_flops",
              "measure_matmul_tflops", "measure_bandwidth_gbs", "measure_ceilings",
              "achieved_tflops", "achieved_gbs", "mfu", "MFUReport", "mfu_report",
              "datasheet_peak_tflops", "plot_roofline"),
    "models": ("MLP", "SmallCNN", "GPTConfig", "TinyGPT", "SmallLSTM",
               "count_parameters"),
    "data": ("SyntheticImages", "SyntheticTokens", "MarkovTokens", "CPUHeavyImages",
             "CUDAPrefetcher", "worker_init", "stack_batches"),
    "precision": ("TF32State", "tf32_state", "set_tf32", "tf32",
                  "fp32_matmul_precision", "fp32_matmul_precision_state",
                  "matmul_precision_label", "Tolerance", "tolerance",
                  "loosest_tolerance", "tf32_in_effect", "check_close", "worst_excess",
                  "max_rel_diff"),
    "amp": ("dtype_name", "rel_error", "CPUPrecisionSupport", "cpu_precision_support",
            "AtenOpCounter", "count_aten_ops", "round_to_tf32", "fp8_quantize",
            "fp8_matmul_api", "fp8_matmul",
            "LossGap", "Applicability", "loss_gap", "TimingJob", "best_of_rounds",
            "TimeBreakdown", "time_breakdown", "amdahl_bound"),
    "sizes": ("Sizes", "size_table", "format_table"),
    "loaders": ("LoaderTiming", "time_loader"),
    "losses": ("chunked_linear_cross_entropy",),
    "training": ("lm_batch", "image_batch", "train_step", "first_call_s", "grad_snapshot",
                 "param_snapshot", "params_equal", "total_norm", "cudnn_benchmark", "AttachedOps"),
    "widgets": ("explorer",),
    "plots": ("use_style", "speedup_bars", "memory_bars", "sweep_plot",
              "plain_log_ticks", "curves_plot", "fit_slope"),
    "kernels": ("ByteCount", "KernelCount", "count_bytes", "count_kernels",
                "enable_cpu_kernel_profile", "kernel_names", "kernel_source", "kernel_excerpt",
                "library_calls", "kernels_and_times"),
    "attention": ("BackendStatus", "sdpa_backend_status", "sdpa_backends", "SDPARun",
                  "sdpa_backend_used", "random_qkv", "attention_step"),
    "ledger": ("Ledger", "Record", "Expectation", "ExpectationNotMet", "results_dir",
               "ledger_key"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
#: Submodules a notebook or script reads as a whole (``utils.ladder.run_ladder``).
_SUBMODULES = frozenset({
    "amp", "attention", "checkpoint", "cli", "collectives", "compiletools", "data",
    "course", "distributed", "env", "flops", "kernels", "ladder", "ledger", "loaders", "losses",
    "memory", "memtools", "models", "plots", "precision", "profiling", "sizes", "timing", "training",
    "widgets",
})

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value   # the next read is a plain attribute
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | _SUBMODULES)
