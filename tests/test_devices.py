"""Devices carry an index: every utils function that takes a device accepts "cuda", "cuda:0"
and torch.device forms, and passes an indexed device to the CUDA APIs.

The first GPU run failed in 04/04 because ``utils.pick_device`` returned ``cuda`` without an
index and ``torch.cuda.get_per_process_memory_fraction`` refuses that ("Expected a
torch.device with a specified index"). These tests run on a CPU with the CUDA APIs faked, and
the fakes refuse every index-less device, as the strictest of torch's APIs do.
"""

from __future__ import annotations

import inspect
import importlib
import pkgutil
from types import SimpleNamespace

import pytest
import torch

import utils
from utils import ladder, memory, memtools, precision, timing

FORMS = [None, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)]
FORM_IDS = ["None", "str-cuda", "str-cuda:0", "device-cuda", "device-cuda-0"]


class FakeCuda:
    """Stand-ins for the torch.cuda functions utils calls; each records the devices it got."""

    def __init__(self, n_gpus: int = 1, current: int = 0) -> None:
        self.n_gpus, self.current = n_gpus, current
        self.calls: list[tuple[str, object]] = []
        self.fraction = 1.0

    def strict(self, api: str, device: object) -> int:
        """torch's ``_get_device_index(device, optional=False)``: an index or an error."""
        self.calls.append((api, device))
        if device is None:
            return self.current
        if isinstance(device, int):
            index = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda" or dev.index is None:
                raise ValueError("Expected a torch.device with a specified index or an integer, "
                                 f"but got:{device}")
            index = dev.index
        if not 0 <= index < self.n_gpus:
            raise ValueError(f"invalid device index {index}")
        return index

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        c = torch.cuda
        props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0,
                                total_memory=80 * 2**30, L2_cache_size=50 * 2**20,
                                multi_processor_count=132)
        patches = {
            "is_available": lambda: True,
            "device_count": lambda: self.n_gpus,
            "current_device": lambda: self.current,
            "get_device_capability": lambda device=None: (self.strict("get_device_capability",
                                                                      device), (9, 0))[1],
            "get_device_properties": lambda device=None: (self.strict("get_device_properties",
                                                                      device), props)[1],
            "get_device_name": lambda device=None: (self.strict("get_device_name", device),
                                                    props.name)[1],
            "is_bf16_supported": lambda including_emulation=True: True,
            "synchronize": lambda device=None: self.strict("synchronize", device) and None,
            "memory_allocated": lambda device=None: (self.strict("memory_allocated", device), 0)[1],
            "max_memory_allocated": lambda device=None: (self.strict("max_memory_allocated",
                                                                     device), 0)[1],
            "memory_reserved": lambda device=None: (self.strict("memory_reserved", device), 0)[1],
            "max_memory_reserved": lambda device=None: (self.strict("max_memory_reserved",
                                                                    device), 0)[1],
            "reset_peak_memory_stats": lambda device=None: self.strict("reset_peak_memory_stats",
                                                                       device) and None,
            "empty_cache": lambda: None,
            "get_per_process_memory_fraction": lambda device=None: (
                self.strict("get_per_process_memory_fraction", device), self.fraction)[1],
            "set_per_process_memory_fraction": self._set_fraction,
            "set_device": lambda device: self.strict("set_device", device) and None,
        }
        for name, fn in patches.items():
            monkeypatch.setattr(c, name, fn)
        return self

    def _set_fraction(self, fraction: float, device: object = None) -> None:
        self.strict("set_per_process_memory_fraction", device)
        self.fraction = fraction


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda().install(monkeypatch)


# -- pick_device ---------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_pick_device_names_the_index(fake_cuda, form):
    assert utils.pick_device(form) == torch.device("cuda", 0)


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    FakeCuda(n_gpus=2, current=1).install(monkeypatch)
    assert utils.pick_device() == torch.device("cuda", 1)
    assert utils.pick_device("cuda") == torch.device("cuda", 1)
    assert utils.pick_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        utils.pick_device("cuda:2")


def test_cpu_stays_cpu(fake_cuda):
    assert utils.pick_device("cpu") == torch.device("cpu")


# -- every function that takes a device, with each form ----------------------------------------

def _oom_above(limit):
    def trial(batch):
        if batch > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (batch {batch})")
    return trial


CALLS = {
    "env.synchronize": lambda d: utils.synchronize(d),
    "env.get_env": lambda d: utils.get_env(d),
    "env.print_env": lambda d: utils.print_env(d),
    "memory.MemoryMeter": lambda d: memory.MemoryMeter(d).__enter__().__exit__(None, None, None),
    "memory.measure_peak_memory": lambda d: utils.measure_peak_memory(lambda: None, device=d),
    "memtools.find_max_batch": lambda d: memtools.find_max_batch(
        _oom_above(5), device=d, budget_bytes=2**30),
    "memtools.memory_budget": lambda d: memtools.memory_budget(2**30, device=d).__enter__()
    .__exit__(None, None, None),
    "timing.benchmark": lambda d: utils.benchmark(lambda: None, device=d, min_run_time_s=0.01,
                                                 warmup=1, warn_if_noisy=False),
    "precision.tf32_in_effect": lambda d: precision.tf32_in_effect(d),
    "distributed.assert_grads_close": lambda d: __import__("utils.distributed").distributed
    .assert_grads_close({"w": torch.ones(3)}, {"w": torch.ones(3)}, "ranks", d),
    "ladder.fp8_unavailable_reason": lambda d: ladder.fp8_unavailable_reason(d),
    "precision.tolerance": lambda d: precision.tolerance(torch.float32, d),
    "precision.arithmetic": lambda d: precision.arithmetic(torch.float32, d),
    "precision.check_close": lambda d: precision.check_close(torch.ones(3), torch.ones(3),
                                                             torch.float32, d),
    "precision.worst_excess": lambda d: precision.worst_excess([torch.ones(3)], [torch.ones(3)],
                                                               torch.float32, d),
}


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_form_is_accepted(fake_cuda, capsys, name, form):
    CALLS[name](form)
    assert fake_cuda.calls, f"{name} called no CUDA API: the fake did not see it run on CUDA"
    for api, device in fake_cuda.calls:
        assert device is None or isinstance(device, int) or torch.device(device).index == 0, \
            (api, device)


def test_find_max_batch_restores_the_fraction_and_finds_the_batch(fake_cuda):
    fake_cuda.fraction = 0.9
    result = memtools.find_max_batch(_oom_above(5), device="cuda", budget_bytes=2**30)
    assert result.max_batch == 5 and result.first_failing == 6
    assert fake_cuda.fraction == 0.9
    assert result.device == "cuda:0"


def test_find_max_batch_keeps_the_first_error(fake_cuda, monkeypatch):
    # A trial that fails for another reason: the error the reader sees is the trial's, even
    # when restoring the allocator's limit fails as well.
    def broken(batch):
        raise KeyError("the trial's own error")

    real = fake_cuda._set_fraction
    calls = []

    def failing_restore(fraction, device=None):
        calls.append(fraction)
        if len(calls) > 1:
            raise RuntimeError("restore failed")
        real(fraction, device)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", failing_restore)
    with pytest.raises(KeyError, match="the trial's own error"):
        memtools.find_max_batch(broken, device="cuda", budget_bytes=2**30)


# Functions whose device parameter goes to work on the device itself (tensors, kernels,
# profiler traces), which a CPU cannot run with a fake: each must normalise its device with
# pick_device (or hand it to a function that does) before any CUDA API sees it.
RUN_ON_DEVICE = {
    "amp.best_of_rounds", "amp.time_breakdown", "compiletools.profile_step",
    "data.CUDAPrefetcher", "data.stack_batches", "distributed.step_times_ms", "flops.mfu_report",
    "flops.measure_matmul_tflops", "flops.measure_bandwidth_gbs", "flops.measure_ceilings",
    "kernels.count_kernels", "kernels.kernels_and_times", "ladder.Trainer", "ladder.tf32_exists", "ladder.ceiling_matmul_size",
    "ladder.measure_ceilings_tflops", "ladder.run_rung", "ladder.run_ladder",
    "ladder.fp8_mlp_sweep", "ladder.attention_inputs", "ladder.gpt_ladder_predictor",
    "ladder.matmul_arithmetic", "ladder.record_ceilings", "ladder.same_model_table",
    "ladder.speedup_report", "ladder.worst_first_loss_by_arithmetic",
    "memtools.record_memory", "memtools.saved_tensor_hook_faults", "profiling.profile_calls", "timing.cold_l2_benchmark",
    "timing.first_call", "timing.per_call_ms", "timing.BackgroundLoad", "loaders.time_loader",
    "training.lm_batch", "training.image_batch", "training.first_call_s",
    "attention.sdpa_backend_used", "attention.random_qkv", "cli.native_bf16",
}
# Result records and helpers that hold a device's name but pass it to no CUDA API.
RECORDS = {"attention.SDPARun", "cli.resolve_size", "cli.size_tier", "amp.TimeBreakdown", "distributed.WorkerInfo", "distributed.slowest_rank_timing", "env.EnvInfo", "env.pick_device",
           "flops.Ceilings", "kernels.KernelCount", "memory.MemoryResult",
           "memtools.MemoryTimeline", "memtools.timeline_from_snapshot", "memtools.BatchSearch",
           "profiling.ProfiledCalls", "timing.Timing"}
SKIP_MODULES = {"__main__", "course"}  # the course's machinery (utils.course) takes no device


def _functions_taking_a_device():
    found = {}
    for info in pkgutil.iter_modules(utils.__path__):
        if info.name in SKIP_MODULES:
            continue
        mod = importlib.import_module(f"utils.{info.name}")
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            if "device" in params:
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_function_that_takes_a_device_is_covered():
    found = _functions_taking_a_device()
    uncovered = sorted(set(found) - set(CALLS) - RUN_ON_DEVICE - RECORDS)
    assert not uncovered, ("a utils function takes a device and no test checks that it accepts "
                           f"every form: {uncovered}; add it to CALLS (or RUN_ON_DEVICE)")


@pytest.mark.parametrize("name", sorted(RUN_ON_DEVICE))
def test_device_work_goes_through_pick_device(name):
    found = _functions_taking_a_device()
    assert name in found, f"{name} no longer takes a device: update the list"
    obj = found[name]
    src = inspect.getsource(obj)
    callees = ("pick_device(", "profile_calls(", "run_rung(", "Trainer(", "measure_matmul_tflops(",
               "measure_ceilings_tflops(", "benchmark(", "MemoryMeter(", "synchronize(",
               # each of these is in this list itself and normalises its device
               "tf32_exists(", "matmul_arithmetic(", "mfu_report(")
    assert any(c in src for c in callees), \
        f"{name} uses its device without utils.pick_device: an index-less 'cuda' would reach CUDA"
