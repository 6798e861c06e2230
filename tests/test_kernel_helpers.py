"""utils.kernel_excerpt, utils.library_calls (reading the code Inductor generated) and
utils.kernels_and_times."""

from __future__ import annotations

import warnings

import pytest
import torch

import utils

SAMPLE = '''
cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
#include "/tmp/torchinductor/cpp_prefix.h"
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0] + 1.0f;
}
\'\'\')

triton_poi_fused_gelu_1 = async_compile.triton('triton_poi_fused_gelu_1', \'\'\'
import triton
import triton.language as tl

@triton_heuristics.pointwise(size_hints={'x': 1024}, filename=__file__)
@triton.jit
def triton_poi_fused_gelu_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + x0)
    tl.store(out_ptr0 + x0, tmp0)
\'\'\', device_str='cuda')

def call(args):
    buf0 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    extern_kernels.addmm(arg0_1, arg1_1, arg2_1, alpha=1, beta=1, out=buf0)
    extern_kernels.mm(buf0, arg3_1, out=buf1)
    cpp_fused_add_0(buf1, buf2)
'''


def test_kernel_excerpt_starts_at_the_signature_and_clips():
    cpp = utils.kernel_excerpt(SAMPLE, "cpp_fused_add_0")
    assert cpp.startswith('extern "C"') and "#include" not in cpp and cpp.endswith("}")
    tri = utils.kernel_excerpt(SAMPLE, "triton_poi_fused_gelu_1", max_lines=2, width=30)
    lines = tri.splitlines()
    assert lines[0] == "def triton_poi_fused_gelu_1(in"   # past imports and decorators
    assert len(lines) == 2 and all(len(ln) <= 30 for ln in lines)
    with pytest.raises(ValueError, match="no kernel"):
        utils.kernel_excerpt(SAMPLE, "missing")
    with pytest.raises(ValueError, match="max_lines"):
        utils.kernel_excerpt(SAMPLE, "cpp_fused_add_0", max_lines=0)


def test_library_calls_in_order_and_generated_kernels_not_counted():
    assert utils.library_calls(SAMPLE) == ["addmm", "mm"]
    assert utils.library_calls("def call(args):\n    triton_poi_fused_0.run(buf0)\n") == []
    with pytest.raises(TypeError):
        utils.library_calls(None)


def test_kernels_and_times_counts_and_times_every_version_in_order():
    x = torch.randn(64, 64)

    def written_out(t):
        return (t * 2) + 1

    versions = {"two ops": written_out, "one op": torch.relu}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", utils.NoisyMeasurementWarning)  # a short run on a busy CPU
        kernels, times = utils.kernels_and_times(versions, x, device="cpu", min_run_time_s=0.02)
    assert list(kernels) == list(times) == ["two ops", "one op"]
    assert kernels["two ops"].per_call == 2 and kernels["one op"].per_call == 1
    assert times["one op"].label == "one op" and times["one op"].median_ms > 0
    with pytest.raises(ValueError, match="at least one"):
        utils.kernels_and_times({}, x)


def test_kernels_and_times_warns_from_the_callers_line(monkeypatch):
    def noisy_benchmark(fn, *args, label=None, **kwargs):
        warnings.warn(f"{label}: noisy", utils.NoisyMeasurementWarning, stacklevel=2)
        return "timing"

    monkeypatch.setattr("utils.kernels.benchmark", noisy_benchmark)
    with pytest.warns(utils.NoisyMeasurementWarning, match="relu: noisy") as record:
        utils.kernels_and_times({"relu": torch.relu}, torch.ones(4), device="cpu")
    assert record[0].filename == __file__
