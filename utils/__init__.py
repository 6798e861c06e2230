"""Shared tools of the PyTorch Optimization Track.

Every notebook imports this package for its environment report, timing,
memory probes, FLOP counting, reference models, synthetic data, plots and the
results ledger. The public surface is what ``__all__`` lists, plus :mod:`utils.distributed`
(launching ``torchrun`` workers and setting one up).
"""

from .data import (CPUHeavyImages, CUDAPrefetcher, MarkovTokens, SyntheticImages, SyntheticTokens,
                   worker_init)
from .env import EnvInfo, Gate, get_env, needs, pick_device, print_env, resolve_smoke, synchronize
from .flops import (
    Ceilings,
    FlopCount,
    RooflinePoint,
    achieved_gbs,
    achieved_tflops,
    count_flops,
    measure_bandwidth_gbs,
    measure_ceilings,
    measure_matmul_tflops,
    mfu,
    MFUReport,
    mfu_report,
    datasheet_peak_tflops,
    plot_roofline,
)
from .ledger import Expectation, ExpectationNotMet, Ledger, Record, results_dir
from .memory import (
    MemoryBreakdown,
    MemoryResult,
    TensorMemoryTracker,
    format_bytes,
    measure_peak_memory,
    memory_breakdown,
    tensor_bytes,
)
from .models import MLP, GPTConfig, SmallCNN, SmallLSTM, TinyGPT, count_parameters
from .precision import (
    Tolerance,
    TF32State,
    loosest_tolerance,
    tf32_in_effect,
    tolerance,
    fp32_matmul_precision,
    fp32_matmul_precision_state,
    matmul_precision_label,
    set_tf32,
    tf32,
    tf32_state,
)
from .amp import (
    AtenOpCounter,
    CPUPrecisionSupport,
    LossGap,
    TimeBreakdown,
    TimingJob,
    best_of_rounds,
    count_aten_ops,
    cpu_precision_support,
    dtype_name,
    fp8_matmul,
    fp8_matmul_api,
    loss_gap,
    rel_error,
    time_breakdown,
)
from .plots import memory_bars, plain_log_ticks, speedup_bars, sweep_plot, use_style
from .training import first_call_s, image_batch, lm_batch, train_step
from .widgets import explorer
from .kernels import (ByteCount, KernelCount, count_bytes, count_kernels, enable_cpu_kernel_profile,
                      kernel_names, kernel_source)
from .attention import (BackendStatus, SDPARun, sdpa_backend_status, sdpa_backend_used,
                        sdpa_backends)
from .timing import (
    NoisyMeasurementWarning,
    SpeedupTable,
    Timing,
    benchmark,
    cold_l2_benchmark,
    compare,
)

from . import distributed  # noqa: E402  (torchrun launch and worker helpers: utils.distributed)
from . import ladder  # noqa: E402  (the capstone's speedup ladder: utils.ladder)
from . import compiletools  # noqa: E402  (module 01's compile helpers: utils.compiletools)
from . import collectives  # noqa: E402  (counting collectives: utils.collectives)
from . import sizes  # noqa: E402  (sizes derived from the machine: utils.sizes)
from .sizes import Sizes, format_table, size_table  # noqa: E402  (a notebook's size table)
from . import losses  # noqa: E402  (memory-lean losses: utils.losses)
from .losses import chunked_linear_cross_entropy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # env
    "EnvInfo", "Gate", "get_env", "needs", "pick_device", "print_env", "resolve_smoke",
    "synchronize",
    # timing
    "Timing", "SpeedupTable", "NoisyMeasurementWarning", "benchmark", "cold_l2_benchmark",
    "compare",
    # memory
    "MemoryResult", "MemoryBreakdown", "TensorMemoryTracker", "measure_peak_memory",
    "memory_breakdown", "tensor_bytes", "format_bytes",
    # flops
    "FlopCount", "Ceilings", "RooflinePoint", "count_flops", "measure_matmul_tflops",
    "measure_bandwidth_gbs", "measure_ceilings", "achieved_tflops", "achieved_gbs", "mfu",
    "MFUReport", "mfu_report", "datasheet_peak_tflops",
    "plot_roofline",
    # models and data
    "MLP", "SmallCNN", "GPTConfig", "TinyGPT", "SmallLSTM", "count_parameters", "SyntheticImages",
    "SyntheticTokens", "MarkovTokens", "CPUHeavyImages", "CUDAPrefetcher", "worker_init",
    # precision
    "TF32State", "tf32_state", "set_tf32", "tf32", "fp32_matmul_precision",
    "fp32_matmul_precision_state", "matmul_precision_label", "Tolerance", "tolerance",
    "loosest_tolerance", "tf32_in_effect",
    # mixed-precision helpers (utils.amp)
    "dtype_name", "rel_error", "CPUPrecisionSupport", "cpu_precision_support", "AtenOpCounter",
    "count_aten_ops", "fp8_matmul_api", "fp8_matmul", "LossGap", "loss_gap", "TimingJob",
    "best_of_rounds", "TimeBreakdown", "time_breakdown",
    # size tables and plain tables (utils.sizes)
    "Sizes", "size_table", "format_table",
    # losses (utils.losses)
    "chunked_linear_cross_entropy",
    # training
    "lm_batch", "image_batch", "train_step", "first_call_s",
    # plots and widgets
    "explorer", "use_style", "speedup_bars", "memory_bars", "sweep_plot", "plain_log_ticks",
    # kernels and attention backends
    "ByteCount", "KernelCount", "count_bytes", "count_kernels", "enable_cpu_kernel_profile",
    "kernel_names", "kernel_source",
    "BackendStatus", "sdpa_backend_status", "sdpa_backends", "SDPARun", "sdpa_backend_used",
    # ledger
    "Ledger", "Record", "Expectation", "ExpectationNotMet", "results_dir",
]
