"""Helpers of the 01-torch-compile notebooks: utils.break_even (the calls after which a one-off
cost, such as a compile, has paid for itself) and a profile that records itself in the ledger."""

import math

import pytest

import utils
from utils import compiletools as ct
from utils.timing import Timing


def _timing(median_ms):
    return Timing.from_times("t", [median_ms] * 5, calls_per_block=1, device="cpu",
                             method="test")


def test_one_off_cost_over_the_time_saved_per_call():
    # 2 s paid once, 10 ms -> 6 ms per call: 4 ms saved per call, so 500 calls
    assert utils.break_even(2.0, 10.0, 6.0) == pytest.approx(500.0)
    assert utils.break_even(2.0, _timing(10.0), _timing(6.0)) == pytest.approx(500.0)
    assert utils.break_even(0.0, 10.0, 6.0) == 0.0


def test_never_pays_when_the_second_is_not_faster():
    assert utils.break_even(1.0, 5.0, 5.0) == math.inf
    assert utils.break_even(1.0, _timing(5.0), _timing(7.5)) == math.inf


@pytest.mark.parametrize("args", [(-1.0, 10.0, 6.0), (math.nan, 10.0, 6.0), (1.0, 0.0, 6.0),
                                  (1.0, 10.0, -2.0), (1.0, math.inf, 6.0)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        utils.break_even(*args)


def test_a_step_profile_records_its_standard_fields():
    profile = ct.StepProfile(label="eager", unit="CPU ops", steps=2, kernels_per_step=10.0,
                             kernels_by_category={"other": 4.0}, busy_ms_per_step=1.5,
                             kernel_ms_by_category={"matmul": 0.75, "attention": 0.0,
                                                    "other": 0.25},
                             wall_ms_per_step=2.0, median_gap_us=3.0)
    ledger = utils.Ledger("tests/profile", smoke=True)
    first = ledger.record("gpt_eager", profile)
    got = {name: (m.value, m.unit) for name, m in ledger.measurements.items()}
    assert got == {"gpt_eager_kernels_per_step": (10.0, "CPU ops"),
                   "gpt_eager_other_share": (0.25, "fraction"),
                   "gpt_eager_idle_fraction": (0.25, "fraction"),
                   "gpt_eager_median_gap_us": (3.0, "us")}
    assert first.name == "gpt_eager_kernels_per_step"
