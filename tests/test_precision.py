"""utils.tf32: the current TF32 API where torch has it, restored exactly afterwards."""

import pytest
import torch

import utils
from utils import precision


def test_tf32_switches_and_restores_exactly():
    raw = precision._raw()
    with utils.tf32(True) as on:
        assert on.matmul and on.conv and utils.tf32_state() == on
        with utils.tf32(False) as off:
            assert not off.matmul and not off.conv
        assert utils.tf32_state() == on
    assert precision._raw() == raw


def test_matmul_and_conv_apart():
    with utils.tf32(matmul=True, conv=False) as s:
        assert s.matmul and not s.conv
        assert "matmul on, cuDNN conv off" in str(s)


def test_uses_the_new_api_where_torch_has_it():
    state = utils.tf32_state()
    has_new = hasattr(torch.backends.cuda.matmul, "fp32_precision") or precision._new_api()
    assert state.api == ("fp32_precision" if has_new else "allow_tf32")
    if state.api == "fp32_precision":
        with utils.tf32(True):
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        with utils.tf32(False):
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_bad_settings_are_type_errors():
    with pytest.raises(TypeError, match="matmul must be True or False"):
        utils.set_tf32("yes")
