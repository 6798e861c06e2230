import random
import time

import pytest
import torch

import utils
from utils.timing import NoisyMeasurementWarning


def test_known_cost_is_timed_within_tolerance():
    # time.sleep(0.02) costs 20 ms plus a little scheduler slack.
    t = utils.benchmark(time.sleep, 0.02, min_run_time_s=0.25, warmup=1)
    assert 19.5 <= t.median_ms <= 26.0, t
    assert t.n_blocks >= 5
    assert t.iqr_ms >= 0
    assert t.device == "cpu"


def test_blocks_are_sized_for_many_measurements():
    t = utils.benchmark(torch.add, torch.ones(64), torch.ones(64), min_run_time_s=0.2)
    assert t.calls_per_block > 1  # a microsecond op is timed in blocks of many calls
    assert t.n_blocks >= 10
    assert len(t.times_ms) == t.n_blocks


def test_speedup_of_known_costs():
    slow = utils.benchmark(time.sleep, 0.02, label="20ms", min_run_time_s=0.2)
    fast = utils.benchmark(time.sleep, 0.01, label="10ms", min_run_time_s=0.2)
    table = utils.compare(slow, fast)
    assert table.rows[0].speedup == pytest.approx(1.0)
    assert 1.6 <= table.speedup("10ms") <= 2.2
    assert "10ms" in table.to_markdown() and "speedup" in str(table)


def test_noisy_measurement_warns():
    # Each call costs 0.5 ms or 6 ms at random, so the sum over a block of calls
    # varies widely whatever the block size (a fixed alternation would cancel
    # out in blocks of an even number of calls).
    rng = random.Random(0)

    def jittery():
        time.sleep(rng.choice([0.0005, 0.006]))

    with pytest.warns(NoisyMeasurementWarning, match="IQR"):
        t = utils.benchmark(jittery, min_run_time_s=0.1, warmup=0, min_blocks=8)
    assert t.noisy


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="callable"):
        utils.benchmark(42)
    with pytest.raises(ValueError, match="min_run_time_s"):
        utils.benchmark(time.sleep, 0, min_run_time_s=0)
    with pytest.raises(ValueError, match="min_run_time_s"):
        utils.benchmark(time.sleep, 0, min_run_time_s=-1)
    with pytest.raises(ValueError, match="warmup"):
        utils.benchmark(time.sleep, 0, warmup=-2)
    with pytest.raises(ValueError, match="device"):
        utils.benchmark(time.sleep, 0, device="abacus")


def test_compare_validates():
    t = utils.benchmark(time.sleep, 0.001, label="a", min_run_time_s=0.05, warn_if_noisy=False)
    with pytest.raises(ValueError):
        utils.compare(t)
    with pytest.raises(ValueError, match="unique"):
        utils.compare(t, t)
    with pytest.raises(TypeError):
        utils.compare(t, 3.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cold_l2_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        utils.cold_l2_benchmark(time.sleep, 0, device=None)


@pytest.mark.gpu
def test_cuda_timing_is_synchronised():
    a = torch.randn(4096, 4096, device="cuda")
    t = utils.benchmark(torch.mm, a, a, device="cuda", min_run_time_s=0.3)
    flops = 2 * 4096**3
    # Without synchronisation the "time" would be the launch (~10 us), i.e. far
    # beyond any GPU's peak; a synchronised fp32 matmul stays below 1000 TFLOP/s.
    assert utils.achieved_tflops(flops, t.median_s) < 1000
    cold = utils.cold_l2_benchmark(torch.mm, a, a, n_iter=20)
    assert cold.median_ms > 0 and cold.calls_per_block == 1
    warm = utils.cold_l2_benchmark(torch.mm, a, a, n_iter=20, flush_l2=False)
    assert "L2 warm" in warm.method and "L2 flushed" in cold.method


def test_the_clock_synchronises_the_device_being_timed(monkeypatch):
    """torch.utils.benchmark's clock syncs the *current* CUDA device; ours syncs the one given."""
    from utils import timing

    synced = []
    monkeypatch.setattr(timing, "synchronize", lambda dev: synced.append(dev))
    clock = timing._device_clock(torch.device("cuda", 1))
    clock()
    assert synced == [torch.device("cuda", 1)]
    assert timing._device_clock(torch.device("cpu")) is time.perf_counter  # nothing to wait for


def test_benchmark_reads_the_clock_of_its_device(monkeypatch):
    from utils import timing

    asked = []
    real = timing._device_clock
    monkeypatch.setattr(timing, "_device_clock", lambda dev: asked.append(dev) or real(dev))
    t = utils.benchmark(torch.add, torch.ones(8), torch.ones(8), device="cpu", min_run_time_s=0.01)
    assert asked == [torch.device("cpu")] and t.device == "cpu"


@pytest.mark.gpu
def test_benchmark_on_a_second_gpu_waits_for_that_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(4096, 4096, device="cuda:1")
    with torch.cuda.device(0):  # the current device is another GPU
        t = utils.benchmark(torch.mm, x, x, device="cuda:1", min_run_time_s=0.2)
    # 2*4096^3 FLOPs cannot finish faster than on a 2000 TFLOP/s GPU: an unsynchronised
    # clock would time only the launch
    assert t.median_s > 2 * 4096**3 / 2000e12
