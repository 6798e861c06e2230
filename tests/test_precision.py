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


def test_fp32_matmul_precision_sets_every_backend_and_restores():
    before = utils.fp32_matmul_precision_state()
    with utils.fp32_matmul_precision("bf16") as inside:
        if "cuda" in inside:  # the per-backend API (torch 2.9+)
            assert inside["cuda"] == "tf32"  # CUDA has no bf16 mode for fp32 matmuls
            assert inside.get("mkldnn", "bf16") == "bf16"
        else:
            assert inside == {"global": "medium"}
    assert utils.fp32_matmul_precision_state() == before
    with utils.fp32_matmul_precision("ieee") as inside:
        assert inside.get("cuda", "ieee") == "ieee" or inside == {"global": "highest"}
        x = torch.randn(16, 16)
        torch.testing.assert_close(x @ torch.eye(16), x, rtol=0, atol=0)
    assert utils.fp32_matmul_precision_state() == before


def test_fp32_matmul_precision_never_mixes_apis():
    # torch.get_float32_matmul_precision() raises on current torch once the old and new
    # APIs have been mixed: after our blocks it must still answer.
    with utils.fp32_matmul_precision("tf32"), utils.tf32(False):
        pass
    assert torch.get_float32_matmul_precision() == "highest"


def test_fp32_matmul_precision_rejects_unknown_settings():
    with pytest.raises(ValueError, match="setting must be one of"):
        with utils.fp32_matmul_precision("high"):
            pass


def test_the_old_settings_stay_readable():
    """torch reads the old global setting in places (Inductor's bmm templates read
    torch.backends.cuda.matmul.allow_tf32); if the per-backend setting disagrees with it,
    that read raises "mix of the legacy and new APIs". Setting only
    torch.backends.cuda.matmul.fp32_precision caused exactly that."""
    for on in (True, False):
        with utils.tf32(on) as s:
            assert s.matmul is on
            assert torch.backends.cuda.matmul.allow_tf32 is on  # raised before the fix
            assert torch.get_float32_matmul_precision() == ("high" if on else "highest")
    for setting in ("ieee", "tf32", "bf16"):
        with utils.fp32_matmul_precision(setting):
            torch.get_float32_matmul_precision()
            torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - must not raise


def test_cudnn_switches_stay_in_step_for_export():
    """torch keeps one combined cuDNN flag beside conv's and RNN's and raises on reading it
    unless all agree; torch.export reads it. Setting conv alone broke export."""

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    for matmul, conv in [(False, False), (True, False), (False, True), (True, True)]:
        with utils.tf32(matmul, conv=conv) as s:
            assert s.conv is conv and torch.backends.cudnn.allow_tf32 is conv
            torch.export.export(Double(), (torch.randn(3),))


def test_reports_survive_a_per_backend_switch_set_alone():
    """get_env and measure_ceilings read the matmul setting; user code that set one
    per-backend switch alone makes torch's own reading raise, and a report must not."""
    if utils.tf32_state().api != "fp32_precision":
        pytest.skip("this torch has no per-backend switches")
    with utils.tf32(False):
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert "cuda=tf32" in utils.matmul_precision_label()
        assert utils.get_env("cpu").float32_matmul_precision == utils.matmul_precision_label()
    assert utils.matmul_precision_label() == torch.get_float32_matmul_precision()


# -- the environment's TF32 overrides ------------------------------------------------------

def test_tf32_overrides_are_read_and_described():
    env = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "PATH": "/bin"}
    got = precision.tf32_overrides(env)
    assert got == {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    text = precision.describe_tf32_overrides(got)
    assert "NVIDIA_TF32_OVERRIDE=0" in text and "full fp32" in text
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in text and "whatever torch's settings say" in text
    assert precision.tf32_overrides({}) == {} and precision.describe_tf32_overrides({}) == ""


@pytest.mark.parametrize("matmul, env, cc, expected", [
    (False, {}, (9, 0), False),
    (True, {}, (9, 0), True),
    (True, {}, (7, 5), False),                                        # no TF32 before sm80
    (False, {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, (9, 0), True),  # on behind the settings
    (True, {"NVIDIA_TF32_OVERRIDE": "0"}, (9, 0), False),             # off behind the settings
    (True, {"NVIDIA_TF32_OVERRIDE": "1"}, (9, 0), True),              # only 0 changes anything
])
def test_tf32_in_effect(matmul, env, cc, expected):
    assert precision.tf32_in_effect("cuda:0", matmul=matmul, capability=cc,
                                    environ=env) is expected


def test_tf32_is_never_in_effect_on_a_cpu():
    with utils.tf32(True):
        assert precision.tf32_in_effect("cpu") is False
        assert precision.arithmetic(torch.float32, "cpu") == "fp32"


# -- tolerances -----------------------------------------------------------------------------

def test_tolerance_follows_the_arithmetic():
    fp32 = precision.tolerance(torch.float32, "cpu", tf32=False)
    tf32 = precision.tolerance(torch.float32, "cpu", tf32=True)
    bf16 = precision.tolerance(torch.bfloat16, "cpu")
    fp16 = precision.tolerance(torch.float16, "cpu")
    assert (fp32.arithmetic, tf32.arithmetic, bf16.arithmetic) == ("fp32", "tf32", "bf16")
    assert fp32.rtol < tf32.rtol == fp16.rtol < bf16.rtol
    # each is a small multiple of its arithmetic's unit roundoff, never a round guess
    for tol in (tf32, bf16, fp16):
        assert tol.rtol == 8 * precision.UNIT_ROUNDOFF[tol.arithmetic]
    assert precision.loosest_tolerance(torch.float32) == tf32


def test_tolerance_scales_atol_with_the_values():
    small = torch.full((100,), 0.01)
    tol = precision.tolerance(torch.float32, "cpu", tf32=True, scale=small)
    assert tol.atol == pytest.approx(tol.rtol * 0.01)
    # 01's old TF32 tolerance, atol=1e-2 on values of size 0.01, passed a 100% error;
    # a tolerance scaled to the values fails a 10% error.
    assert tol.excess(small * 1.1, small) > 10
    torch.testing.assert_close(small * (1 + tol.rtol / 2), small, **tol.kwargs())


def test_tolerance_under_tf32_on_a_gpu_node():
    # The same call on an sm90 GPU with TF32 allowed gives TF32's tolerance (test_devices
    # runs it with the CUDA APIs faked; here the state is given).
    tol = precision.tolerance(torch.float32, "cuda:0", tf32=True)
    assert tol.arithmetic == "tf32"


def test_excess_measures_in_units_of_the_tolerance():
    tol = precision.Tolerance(rtol=0.0, atol=1e-3, arithmetic="fp32")
    e = torch.zeros(4)
    assert tol.excess(e + 5e-4, e) == pytest.approx(0.5)
    assert tol.excess(e + 2e-2, e) == pytest.approx(20)
    with pytest.raises(ValueError, match="shapes differ"):
        tol.excess(torch.zeros(3), e)


@pytest.mark.parametrize("bad", [dict(dtype=torch.int64), dict(scale=0.0), dict(scale=-1.0),
                                 dict(factor=0), dict(scale=float("inf"))])
def test_tolerance_rejects_bad_input(bad):
    kwargs = {"dtype": torch.float32, **bad}
    with pytest.raises(ValueError):
        precision.tolerance(kwargs.pop("dtype"), "cpu", **kwargs)


def test_loss_tolerance_by_arithmetic():
    assert precision.loss_tolerance("fp32") < precision.loss_tolerance("tf32")
    assert precision.loss_tolerance("bf16") == precision.loss_tolerance("fp16")
    with pytest.raises(ValueError, match="unknown arithmetic"):
        precision.loss_tolerance("int8")


@pytest.mark.parametrize("conv, env, expected", [
    (True, {}, True), (False, {}, False),
    (False, {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, False),   # cuBLAS only
    (True, {"NVIDIA_TF32_OVERRIDE": "0"}, False),
])
def test_tf32_for_cudnn_convolutions(conv, env, expected):
    assert precision.tf32_in_effect("cuda:0", matmul=conv, capability=(9, 0), environ=env,
                                    op="conv") is expected
    with utils.tf32(matmul=False, conv=True):
        assert precision.tolerance(torch.float32, "cpu", op="conv").arithmetic == "fp32"
    with pytest.raises(ValueError, match="op must be"):
        precision.tf32_in_effect("cpu", op="attention")


def test_norm_excess_judges_the_whole_tensor():
    e = torch.ones(400)
    tol = precision.tolerance(torch.float32, "cpu", tf32=True, scale=e)
    # one element off by 5x what the elementwise rule allows it; the tensor as a whole close
    a = e.clone()
    a[7] += 10 * tol.rtol
    assert tol.excess(a, e) > 1 and tol.norm_excess(a, e) < 1
    assert tol.norm_excess(e * 1.1, e) == pytest.approx(0.1 / tol.rtol)   # a 10% error fails
    assert tol.norm_excess(torch.zeros(3), torch.zeros(3)) == 0.0
    assert tol.norm_excess(torch.ones(3), torch.zeros(3)) == float("inf")
