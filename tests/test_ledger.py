import json

import pytest

import utils
from utils.ledger import MET, NOT_APPLICABLE, NOT_MET


@pytest.fixture
def env():
    return utils.get_env("cpu")


def test_round_trip(results_tmp, env):
    led = utils.Ledger("00-foundations/01_x", smoke=False, env=env, strict=False)
    led.record("step_ms", 12.5, "ms", note="median")
    led.expect("bf16_speedup", 2.1, at_least=1.8, description="bf16 >= 1.8x")
    led.expect("mem_ratio", 0.7, at_most=0.65)
    path = led.save()
    assert path.parent == results_tmp and path.name == "00-foundations__01_x.json"
    back = utils.Ledger.load(path)
    assert back.to_dict() == led.to_dict()
    assert back["step_ms"] == 12.5
    assert back.expectations["bf16_speedup"].status == MET
    assert back.expectations["mem_ratio"].status == NOT_MET
    assert back.env["torch_version"] == env.torch_version


def test_statuses(env, capsys):
    led = utils.Ledger("m/n", smoke=False, env=env)
    assert led.expect("a", 2.0, at_least=1.5).status == MET
    assert led.expect("b", 1.0, at_least=1.5).status == NOT_MET
    na = led.expect("c", 1.0, at_least=1.5, applies=False, reason="needs CUDA sm80+")
    assert na.status == NOT_APPLICABLE and "sm80" in na.reason
    assert "NOT MET" in capsys.readouterr().out


def test_smoke_marks_expectations_not_applicable_and_never_fails(results_tmp, env, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT", raising=False)
    led = utils.Ledger("m/smoke", smoke=True, env=env)
    e = led.expect("speedup", 0.5, at_least=1.8)
    assert e.status == NOT_APPLICABLE and "smoke" in e.reason
    assert led.expect("saving", 0.5, at_most=0.6, in_smoke=True).status == MET
    led.finish()  # does not raise


def test_full_size_miss_fails_after_saving(results_tmp, env, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT", raising=False)
    led = utils.Ledger("m/full", smoke=False, env=env)
    led.expect("speedup", 1.1, at_least=1.8)
    with pytest.raises(utils.ExpectationNotMet, match="speedup"):
        led.finish()
    saved = json.loads((results_tmp / "m__full.json").read_text())
    assert saved["expectations"][0]["status"] == NOT_MET


def test_strict_can_be_switched_off(env, monkeypatch):
    monkeypatch.setenv("COURSE_STRICT", "0")
    assert utils.Ledger("m/x", smoke=False, env=env).strict is False
    monkeypatch.setenv("COURSE_STRICT", "1")
    assert utils.Ledger("m/x", smoke=True, env=env).strict is True


def test_autosave_keeps_every_record(results_tmp, env):
    led = utils.Ledger("m/auto", smoke=True, env=env, autosave=True)
    led.record("first", 1.0)
    assert utils.Ledger.load(results_tmp / "m__auto.json")["first"] == 1.0


def test_bad_input(env):
    led = utils.Ledger("m/bad", smoke=True, env=env)
    with pytest.raises(ValueError, match="NaN"):
        led.record("x", float("nan"))
    with pytest.raises(TypeError, match="number"):
        led.record("x", "fast")
    with pytest.raises(ValueError, match="exactly one"):
        led.expect("x", 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        led.expect("x", 1.0, at_least=1, at_most=2)
    with pytest.raises(ValueError):
        utils.Ledger("", smoke=True, env=env)
    with pytest.raises(FileNotFoundError):
        utils.Ledger.load("/nonexistent/ledger.json")


def test_expectation_not_measured_here(tmp_path):
    led = utils.Ledger("m/nb", smoke=False, env={}, strict=True, autosave=False)
    e = led.expect("fp16_loss", None, at_most=0.05, applies=False, reason="fp16 runs on CUDA only")
    assert e.status == "not applicable" and "not measured" in e.line()
    assert "fp16_loss" not in led.measurements
    led.finish()  # not applicable never fails, even strict
    with pytest.raises(ValueError, match="no value"):
        led.expect("x", None, at_least=1.0)
    with pytest.raises(ValueError, match="no value"):
        led.expect("x", None, at_least=1.0, applies=False)


def test_a_shared_run_is_recorded_and_not_strict(results_tmp, monkeypatch):
    monkeypatch.setenv("COURSE_SHARED_JOBS", "3")
    monkeypatch.delenv("COURSE_STRICT", raising=False)
    led = utils.Ledger("00-x/01_y", smoke=False, env={"device_name": "GPU"})
    assert led.shared and led.shared_jobs == 3 and not led.strict
    led.expect("speedup", 1.0, at_least=2.0, unit="x")
    led.finish()                                   # a missed claim does not fail a shared run
    back = utils.Ledger.load(led.default_path())
    assert back.shared_jobs == 3
    assert "3 notebooks ran at once" in back.to_markdown()
    monkeypatch.delenv("COURSE_SHARED_JOBS")
    alone = utils.Ledger("00-x/01_y", smoke=False, env={"device_name": "GPU"})
    assert not alone.shared and alone.strict


def test_ledgers_name_their_commit(results_tmp, monkeypatch):
    monkeypatch.setenv("COURSE_COMMIT", "abc123")
    led = utils.Ledger("00-x/01_y", smoke=True, env={"device_name": "CPU"})
    assert led.commit == "abc123"
    assert utils.Ledger.from_dict(led.to_dict()).commit == "abc123"
    old = led.to_dict()
    del old["commit"], old["shared_jobs"]           # a ledger from before these fields
    back = utils.Ledger.from_dict(old)
    assert back.commit == "" and back.shared_jobs == 1


def test_result_objects_record_their_standard_fields_with_units():
    import torch

    led = utils.Ledger("00-x/01_y", smoke=True, env={"device_name": "cpu"})
    fast = utils.Timing.from_times("eager", [2.0, 2.0, 2.2, 1.8], 10, "cpu", "test")
    slow = utils.Timing.from_times("compiled (default)", [1.0, 1.0, 1.1, 0.9], 10, "cpu", "test")
    first = led.record("step", fast)
    assert first.name == "step_ms" and first.value == fast.median_ms and first.unit == "ms"
    assert led["step_iqr_ms"] == pytest.approx(fast.iqr_ms)
    led.record("speedup", utils.compare(fast, slow))
    assert led.measurements["speedup_compiled_default"].unit == "x"
    assert led["speedup_compiled_default"] == pytest.approx(2.0)
    mem = utils.measure_peak_memory(lambda: torch.ones(1000), device="cpu")
    led.record("alloc", mem)
    assert led["alloc_peak_bytes"] == 4000 and led.measurements["alloc_peak_bytes"].unit == "bytes"
    assert "alloc_allocator_peak_reserved_bytes" not in led.measurements   # None on a CPU
    with pytest.raises(ValueError, match="brings its own units"):
        led.record("step", fast, "ms")
    with pytest.raises(TypeError, match="must be a number"):
        led.record("bad", "fast")


def test_the_ledgers_scalar_is_not_called_measurement():
    # torch.utils.benchmark.Measurement is a timer's result (utils.Timing keeps one); the
    # ledger's scalar is a Record, so one name has one meaning in the course
    assert not hasattr(utils, "Measurement")
    led = utils.Ledger("00-x/01_y", smoke=True, env={"device_name": "cpu"})
    assert isinstance(led.record("n", 3, "items"), utils.Record)
