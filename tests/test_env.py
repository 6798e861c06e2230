import json

import pytest
import torch

import utils
from utils.env import resolve_smoke


def test_pick_device_default_and_cpu():
    assert utils.pick_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert utils.pick_device().type == expected


@pytest.mark.parametrize("bad", ["gpu0", "tpu", "quantum:3", 42])
def test_pick_device_rejects_unknown(bad):
    with pytest.raises(ValueError, match="device"):
        utils.pick_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_pick_device_cuda_without_gpu_says_so():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        utils.pick_device("cuda")


def test_env_fingerprint_is_json_and_complete():
    env = utils.get_env("cpu")
    fp = env.fingerprint()
    json.dumps(fp)
    for key in ("device_name", "torch_version", "cuda_version", "bf16_supported",
                "tf32_supported", "flash_attention_supported", "gpu_count", "cpu_threads"):
        assert key in fp
    assert fp["torch_version"] == torch.__version__
    assert fp["cpu_threads"] == torch.get_num_threads()


def test_print_env_prints_the_essentials(capsys):
    env = utils.print_env("cpu")
    out = capsys.readouterr().out
    for word in ("device", "torch", "compute capability", "FlashAttention", "CPU threads", "bf16"):
        assert word in out
    assert env.device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip path")
def test_needs_skips_loudly_without_cuda(capsys):
    gate = utils.needs(cuda=True, what="the CUDA-events cell")
    assert not gate
    assert "SKIPPED the CUDA-events cell" in capsys.readouterr().out
    assert "CUDA GPU" in gate.reason
    assert not utils.needs(min_capability=(8, 0), quiet=True)
    assert not utils.needs(min_gpus=2, quiet=True)
    assert "2 GPUs" in utils.needs(min_gpus=2, quiet=True).reason


def test_needs_nothing_passes():
    assert utils.needs()


def test_needs_validates_arguments():
    with pytest.raises(ValueError):
        utils.needs(min_gpus=-1)
    with pytest.raises(ValueError):
        utils.needs(min_capability=(8,))


def test_resolve_smoke_precedence(monkeypatch):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    assert resolve_smoke(None) is (not torch.cuda.is_available())
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert resolve_smoke(None) is False
    monkeypatch.setenv("COURSE_SMOKE", "yes")
    assert resolve_smoke(None) is True
    assert resolve_smoke(False) is False  # an explicit parameter beats the variable
    monkeypatch.setenv("COURSE_SMOKE", "maybe")
    with pytest.raises(ValueError, match="COURSE_SMOKE"):
        resolve_smoke(None)


def test_quiet_native_stderr_hides_fd_2_only_inside_and_survives_an_error(capfd):
    import os

    from utils.env import quiet_native_stderr

    with quiet_native_stderr():
        os.write(2, b"hidden")
    with pytest.raises(RuntimeError, match="raised inside"):
        with quiet_native_stderr():
            os.write(2, b"also hidden")
            raise RuntimeError("raised inside")
    os.write(2, b"shown")
    assert capfd.readouterr().err == "shown"


def test_print_env_names_tf32_overrides(capsys, monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    env = utils.print_env("cpu")
    out = capsys.readouterr().out
    assert "TF32 override" in out and "NVIDIA_TF32_OVERRIDE=0" in out
    assert env.tf32_overrides == {"NVIDIA_TF32_OVERRIDE": "0"}
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)
    utils.print_env("cpu")
    assert "TF32 override" not in capsys.readouterr().out
