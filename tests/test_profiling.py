"""utils.profiling: the one profiling loop behind count_kernels, time_breakdown and profile_step."""

import os

import pytest
import torch

from utils.profiling import check_count, profile_calls


def test_profile_calls_warms_up_then_traces_exactly_the_profiled_calls():
    seen = []

    def run():
        seen.append(1)
        return torch.ones(16).exp()

    traced = profile_calls(run, device="cpu", calls=3, warmup=2)
    assert len(seen) == 5
    assert sum(e.name == "aten::exp" for e in traced.events) == 3  # the warm-up is not traced
    assert traced.device == torch.device("cpu") and traced.wall_ms > 0


def test_profile_calls_keeps_the_library_lines_off_fd_2_but_not_the_work_s(capfd):
    def run():
        os.write(2, b"the work's own line")
        return torch.ones(4).sum()

    profile_calls(run, device="cpu")
    err = capfd.readouterr().err
    assert "the work's own line" in err
    assert "profiler_start" not in err and "profiler_stop" not in err, err


def test_profile_calls_stops_the_profiler_when_the_work_raises():
    def boom():
        raise RuntimeError("inside the profiled call")

    with pytest.raises(RuntimeError, match="inside the profiled call"):
        profile_calls(boom, device="cpu")
    traced = profile_calls(lambda: torch.ones(2).neg(), device="cpu")  # a new profile starts
    assert any(e.name == "aten::neg" for e in traced.events)


def test_profile_calls_and_check_count_reject_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        profile_calls(torch.ones(2), device="cpu")
    with pytest.raises(ValueError, match="calls must be a positive int"):
        profile_calls(lambda: None, device="cpu", calls=0)
    with pytest.raises(ValueError, match=r"warmup must be an int >= 0"):
        profile_calls(lambda: None, device="cpu", warmup=-1)
    for bad in (True, 1.0, "2"):
        with pytest.raises(ValueError, match="steps"):
            check_count("steps", bad, 1)
    check_count("warmup", 0, 0)
