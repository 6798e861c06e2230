"""utils.kernels: counting kernels with the profiler, reading generated code."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import utils
from utils.kernels import _aten_op_kind


def test_eager_chain_counts_one_pass_per_operator():
    x, b = torch.randn(64, 32), torch.randn(32)
    kc = utils.count_kernels(lambda: F.gelu(x + b) * 2.0, device="cpu")
    assert kc.per_call == 3
    assert kc.by_name == {"aten::add": 1, "aten::gelu": 1, "aten::mul": 1}
    assert kc.device == "cpu" and "profiler" in kc.method


def test_composites_are_not_counted_but_their_parts_are():
    x = torch.randn(64, 32)
    # dropout is a composite: it runs bernoulli_, div_ and mul, each a pass over the data
    kc = utils.count_kernels(F.dropout, x, 0.5, True, device="cpu")
    assert "aten::dropout" not in kc.by_name
    assert kc.by_name.get("aten::bernoulli_") == 1 and kc.by_name.get("aten::mul") == 1
    # linear is a composite of a view (t) and addmm: one kernel
    lin = torch.nn.Linear(32, 16)
    assert utils.count_kernels(lin, x, device="cpu").by_name == {"aten::addmm": 1}


def test_views_and_allocations_are_not_kernels():
    x = torch.randn(8, 4)
    kc = utils.count_kernels(lambda: x.t().unsqueeze(0)[:, :2].expand(3, 2, 8), device="cpu")
    assert kc.kernels == 0
    assert utils.count_kernels(lambda: torch.empty(100), device="cpu").kernels == 0


def test_calls_scale_the_total_not_the_per_call_count():
    x = torch.randn(16)
    kc = utils.count_kernels(torch.sin, x, device="cpu", calls=4, warmup=0)
    assert kc.kernels == 4 and kc.calls == 4 and kc.per_call == 1
    assert kc.top(1) == [("aten::sin", 4)]
    assert "per call" in str(kc)


def test_fused_optimizer_runs_fewer_kernels_than_the_for_loop():
    params = [torch.randn(10, requires_grad=True) for _ in range(6)]
    for p in params:
        p.grad = torch.randn(10)
    loop = utils.count_kernels(torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False).step,
                               device="cpu")
    fused = utils.count_kernels(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True).step,
                                device="cpu")
    assert loop.per_call >= len(params)  # at least one pass per tensor
    assert fused.per_call < loop.per_call / 2


def test_op_kinds():
    assert _aten_op_kind("aten::add") == "compute"
    assert _aten_op_kind("aten::dropout") == "composite"
    assert _aten_op_kind("aten::transpose") == "view"
    assert _aten_op_kind("aten::empty_strided") == "no-data"
    assert _aten_op_kind("aten::not_an_op_at_all") == "unknown"


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        utils.count_kernels(torch.randn(3))
    with pytest.raises(ValueError, match="calls"):
        utils.count_kernels(torch.sin, torch.randn(3), calls=0)
    with pytest.raises(ValueError, match="warmup"):
        utils.count_kernels(torch.sin, torch.randn(3), warmup=-1)


SAMPLE = '''
from torch._inductor.async_compile import AsyncCompile
async_compile = AsyncCompile()

cpp_fused_add_relu_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0, float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0];
}
\'\'\')

triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', \'\'\'
@triton.jit
def triton_poi_fused_mul_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + x0)
\'\'\', device_str='cuda')

def call(args):
    pass
'''


def test_kernel_names_and_source_from_a_generated_module():
    assert utils.kernel_names(SAMPLE) == ["cpp_fused_add_relu_0", "triton_poi_fused_mul_1"]
    cpp = utils.kernel_source(SAMPLE, "cpp_fused_add_relu_0")
    assert cpp.startswith('extern "C" void kernel') and cpp.rstrip().endswith("}")
    tri = utils.kernel_source(SAMPLE, "triton_poi_fused_mul_1")
    assert tri.startswith("@triton.jit") and "tl.load" in tri and "device_str" not in tri
    with pytest.raises(ValueError, match="no kernel"):
        utils.kernel_source(SAMPLE, "missing")
    with pytest.raises(TypeError):
        utils.kernel_names(["not", "a", "string"])


@pytest.fixture
def kernel_profile():
    import torch._inductor.config as cfg

    old = cfg.cpp.enable_kernel_profile
    yield
    cfg.cpp.enable_kernel_profile = old


def test_compiled_chain_is_one_kernel_on_cpu(kernel_profile):
    from torch._inductor.utils import run_and_get_code

    def add_layer_norm(x, r):
        return F.layer_norm(x + r, (x.shape[-1],))

    x, r = torch.randn(32, 64), torch.randn(32, 64)
    eager = utils.count_kernels(add_layer_norm, x, r, device="cpu")
    assert eager.per_call == 2  # add, native_layer_norm

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hidden = utils.count_kernels(torch.compile(add_layer_norm), x, r, device="cpu")
    assert hidden.kernels == 0 and any("enable_kernel_profile" in str(w.message) for w in caught)

    assert utils.enable_cpu_kernel_profile() is True
    torch._dynamo.reset()
    compiled = torch.compile(add_layer_norm)
    out, sources = run_and_get_code(compiled, x, r)
    torch.testing.assert_close(out, add_layer_norm(x, r), rtol=1e-5, atol=1e-5)
    kc = utils.count_kernels(compiled, x, r, device="cpu")
    assert kc.per_call == 1, kc
    names = utils.kernel_names(sources[0])
    assert len(names) == 1 and names[0] in next(iter(kc.by_name))
    assert "void" in utils.kernel_source(sources[0], names[0])
    torch._dynamo.reset()


def test_count_bytes_sums_inputs_and_outputs_of_each_op():
    x, b = torch.randn(64, 32), torch.randn(32)
    bc = utils.count_bytes(lambda: (x + b) * 2.0)
    # add: read x (8 KiB) and b (128 B), write 8 KiB; mul: read 8 KiB, write 8 KiB
    assert bc.bytes_touched == 4 * x.nbytes + b.nbytes
    assert bc.ops == ("add", "mul")
    assert "2 ops" in str(bc)


def test_count_bytes_skips_views():
    x = torch.randn(16, 8)
    assert utils.count_bytes(lambda: x.t()[:4].unsqueeze(0)).bytes_touched == 0
    # a reshape that cannot be a view copies: one read and one write of the data
    assert utils.count_bytes(lambda: x.t().reshape(4, 32)).bytes_touched == x.nbytes * 2
    with pytest.raises(TypeError):
        utils.count_bytes(42)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_are_counted_from_the_device_trace():
    x = torch.randn(1024, device="cuda")
    kc = utils.count_kernels(lambda: torch.sin(x) * 2.0, device="cuda")
    assert kc.per_call == 2 and kc.device.startswith("cuda") and "CUDA" in kc.method
    assert utils.count_kernels(lambda: x.view(32, 32).t(), device="cuda").kernels == 0
    with pytest.raises(RuntimeError, match="on the CPU"):
        utils.count_kernels(torch.sin, torch.randn(1024), device="cuda")
    compiled = torch.compile(lambda t: torch.sin(t) * 2.0 + 1.0)
    assert utils.count_kernels(compiled, x, device="cuda").per_call == 1
