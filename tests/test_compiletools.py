"""utils.compiletools: settings, compile counting, and the profiler summary of a step."""

from __future__ import annotations

import pytest
import torch

import utils
from conftest import FIXTURES
from utils import compiletools as ct
from utils.compiletools import KernelEvent


# -- classify_kernel ---------------------------------------------------------------------

@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "matmul"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "matmul"),
    ("ampere_sgemm_128x64_tn", "matmul"),
    ("cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4", "matmul"),
    ("triton_tem_fused_addmm_gelu_0", "matmul"),                 # Inductor matmul template
    ("aten::addmm", "matmul"),
    ("aten::linear", "matmul"),
    ("aten::convolution", "matmul"),
    ("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw", "matmul"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("triton_poi_fused_add_gelu_1", "other"),
    ("triton_red_fused_native_layer_norm_0", "other"),
    ("triton_per_fused__log_softmax_nll_loss_2", "other"),
    # a fused C++ kernel named after the ops around attention is still a fused pointwise kernel
    ("graph_0_cpp_fused__scaled_dot_product_flash_attention_for_cpu_backward_sum_4", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>", "other"),
    ("aten::native_layer_norm", "other"),
    ("aten::_fused_adamw_", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
])
def test_classify_kernel(name, category):
    assert ct.classify_kernel(name) == category


def _h100_names():
    path = FIXTURES / "kernels" / "h100_smallcnn_step.tsv"
    rows = [line.split("\t", 1) for line in path.read_text().splitlines()
            if line and not line.startswith("#")]
    return [(name, category) for category, name in rows]


@pytest.mark.parametrize("name, category", _h100_names(),
                         ids=[n[:60] for n, _ in _h100_names()])
def test_classify_kernel_on_real_h100_names(name, category):
    # Full names from the first H100 run. Templated elementwise kernels carry "{lambda" in
    # their arguments: read as the optimizer word "lamb", they were counted as optimizer work.
    assert ct.classify_kernel(name) == category


@pytest.mark.parametrize("name, base", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, "
     "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, "
     "at::native::AUnaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> "
     ">, std::array<char*, 2ul>)", "at::native::vectorized_elementwise_kernel"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 4, true, false>(float*)",
     "anonymous::softmax_warp_forward"),
    ("triton_poi_fused_add_gelu_1", "triton_poi_fused_add_gelu_1"),
    ("Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD"),
])
def test_kernel_base_name(name, base):
    assert ct.kernel_base_name(name) == base


@pytest.mark.parametrize("arguments", ["{lambda(float)#1}", "FusedAdamMathFunctor<float>",
                                       "at::native::SGDFunctor", "flash_attention_traits"])
def test_template_arguments_never_decide_the_category(arguments):
    name = f"void at::native::elementwise_kernel<128, 2, {arguments}>(int, {arguments})"
    assert ct.classify_kernel(name) == "other"
    assert ct.classify_kernel("void lamb_update_kernel<float>(float*)") == "optimizer"


def test_profiler_user_annotations_are_not_kernels():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from utils.profiling import gpu_kernel_events

    def ev(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation)

    events = [ev("Optimizer.zero_grad#AdamW.zero_grad", DeviceType.CUDA, True),
              ev("forward", DeviceType.CUDA, True),
              ev("forward", DeviceType.CPU),
              ev("ampere_sgemm_128x64_tn", DeviceType.CUDA),
              ev("Memset (Device)", DeviceType.CUDA)]
    assert [e.name for e in gpu_kernel_events(events)] == ["ampere_sgemm_128x64_tn",
                                                           "Memset (Device)"]


def test_classify_kernel_rejects_non_strings():
    with pytest.raises(TypeError):
        ct.classify_kernel(3)


# -- summarize_kernels -------------------------------------------------------------------

def _events():
    # two steps; times in microseconds. Step 1: gemm 0-10, gelu 12-14 (gap 2), flash 14-20.
    # Step 2: gemm 30-40 overlapping a concurrent gelu 35-45 (no gap), then adam 50-52 (gap 5).
    return [
        KernelEvent("ampere_sgemm_128x64_tn", 0, 10),
        KernelEvent("triton_poi_fused_gelu_0", 12, 14),
        KernelEvent("flash_fwd_kernel", 14, 20),
        KernelEvent("ampere_sgemm_128x64_tn", 30, 40),
        KernelEvent("triton_poi_fused_gelu_0", 35, 45),
        KernelEvent("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 50, 52),
    ]


def test_summarize_kernels_counts_busy_time_and_gaps():
    p = ct.summarize_kernels(list(reversed(_events())), label="x", steps=2, wall_ms=0.2,
                             launch_calls=12, graph_launches=0)
    assert p.kernels_per_step == 3
    assert p.kernels_by_category == {"matmul": 1, "attention": 0.5, "optimizer": 0.5,
                                     "copy": 0, "other": 1}
    # busy = union of intervals: [0,10] + [12,20] + [30,45] + [50,52] = 10 + 8 + 15 + 2 = 35 us
    assert p.busy_ms_per_step == pytest.approx(35e-3 / 2)
    # gaps between consecutive kernels: 2, 0, 10, 0, 5 -> median 2
    assert p.median_gap_us == pytest.approx(2.0)
    assert p.wall_ms_per_step == pytest.approx(0.1)
    assert p.idle_fraction == pytest.approx(1 - 17.5e-3 / 0.1)
    assert p.launch_calls_per_step == 6 and p.graph_launches_per_step == 0
    total = 10 + 2 + 6 + 10 + 10 + 2
    assert p.share("matmul") == pytest.approx(20 / total)
    assert p.share("other") == pytest.approx(12 / total)
    assert sum(p.share(c) for c in ct.KERNEL_CATEGORIES) == pytest.approx(1.0)
    assert "x" in p.row() and "launches" in p.row()
    assert p.top_kernels[0][0] in ("ampere_sgemm_128x64_tn", "triton_poi_fused_gelu_0")


def test_summarize_kernels_empty_and_bad_arguments():
    p = ct.summarize_kernels([], label="none", steps=1, wall_ms=1.0, unit="CPU ops")
    assert p.kernels_per_step == 0 and p.busy_ms_per_step == 0 and p.median_gap_us == 0
    assert p.share("matmul") == 0 and p.idle_fraction == 1.0
    assert p.launch_calls_per_step is None and "launches" not in p.row()
    with pytest.raises(ValueError):
        ct.summarize_kernels([], label="x", steps=0, wall_ms=1.0)
    with pytest.raises(ValueError):
        ct.summarize_kernels([], label="x", steps=1, wall_ms=-1.0)
    with pytest.raises(ValueError):
        p.share("gemm")


# -- settings, caches, limits --------------------------------------------------------------

def test_compile_settings_sets_and_reports():
    env = utils.get_env("cpu")
    threads = torch.get_num_threads()
    bench = torch.backends.cudnn.benchmark
    try:
        with utils.tf32(False):                       # restores TF32 exactly afterwards
            s = ct.compile_settings(env, tf32=True, cudnn_benchmark=True, cpu_threads=1)
            assert s.tf32.matmul and s.tf32.conv and s.cudnn_benchmark and s.cpu_threads == 1
            assert torch.get_num_threads() == 1 and "TF32: matmul on" in str(s)
            s = ct.compile_settings(env, tf32=None, cudnn_benchmark=None, cpu_threads=None)
            assert s.tf32.matmul and s.cudnn_benchmark         # None left them alone
            s = ct.compile_settings(env, tf32=False, cudnn_benchmark=False)
            assert not s.tf32.matmul and not s.cudnn_benchmark
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = bench
        ct._set_cpu_kernel_records(False)


def test_compile_settings_rejects_bad_arguments():
    env = utils.get_env("cpu")
    with pytest.raises(TypeError):
        ct.compile_settings({"device": "cpu"})
    with pytest.raises(ValueError):
        ct.compile_settings(env, cpu_threads=0)
    with pytest.raises(TypeError):
        ct.compile_settings(env, tf32="yes")


def test_recompile_limit_name_and_fresh_cache(tmp_path):
    name = ct.recompile_limit_name()
    assert isinstance(getattr(torch._dynamo.config, name), int)
    with ct.fresh_cache(dir=str(tmp_path)):
        pass


# -- counting what the compiler did --------------------------------------------------------

def test_compile_counts_follow_the_backend():
    def f(x):
        return torch.sin(x) * 2 + 1

    ct.reset_compile_state()
    torch.compile(f, backend="eager")(torch.randn(8))
    c = ct.compile_counts()
    assert c.graphs == 1 and c.aot_graphs == 0 and c.inductor_graphs == 0
    assert c.dynamo_attempts in (None, 1) and c.restarts in (None, 0)

    ct.reset_compile_state()
    torch.compile(f, backend="aot_eager")(torch.randn(8, requires_grad=True))
    c = ct.compile_counts()
    assert c.graphs == 1 and c.aot_graphs == 1 and c.aot_graphs_ok == 1 and c.inductor_graphs == 0
    phases = ct.compile_phase_seconds()
    assert phases and all(v >= 0 for v in phases.values())
    assert set(ct.compile_phase_seconds(["bytecode_tracing", "no such phase"])) <= {"bytecode_tracing"}
    ct.reset_compile_state()
    assert ct.compile_counts().graphs == 0 and ct.compile_phase_seconds() == {}


# -- profile_step --------------------------------------------------------------------------

def test_profile_step_counts_top_level_cpu_ops():
    a, b = torch.randn(16, 16), torch.randn(16, 16)

    def step():
        y = a @ b.t()            # aten::matmul (its aten::mm is nested); t() is a view
        return y.relu() + 1      # aten::relu, aten::add

    p = ct.profile_step(step, steps=2, device="cpu", label="toy")
    assert p.unit == "CPU ops" and p.steps == 2
    assert p.kernels_by_category["matmul"] == 1
    assert p.kernels_by_category["other"] == 2
    assert p.kernels_per_step == 3
    assert p.launch_calls_per_step is None
    assert 0 <= p.idle_fraction <= 1 and p.wall_ms_per_step > 0


def test_profile_step_sees_inductor_cpp_kernels(tmp_path):
    def f(x):
        return torch.nn.functional.gelu(x) * 0.5 + x

    x = torch.randn(64, 64)
    ct.reset_compile_state()
    try:
        ct._set_cpu_kernel_records(True)
        with ct.fresh_cache(dir=str(tmp_path)):
            g = torch.compile(f)
            g(x)
        eager = ct.profile_step(f, x, steps=2, device="cpu")
        compiled = ct.profile_step(g, x, steps=2, device="cpu")
    finally:
        ct._set_cpu_kernel_records(False)
        ct.reset_compile_state()
    assert eager.kernels_by_category["other"] == 3        # gelu, mul, add
    assert compiled.kernels_by_category["other"] == 1     # one fused C++ kernel
    assert any("cpp_fused" in name for name, _ in compiled.top_kernels)


def test_profile_step_rejects_bad_arguments():
    with pytest.raises(TypeError):
        ct.profile_step("not callable")
    with pytest.raises(ValueError):
        ct.profile_step(lambda: None, steps=0)
    with pytest.raises(ValueError):
        ct.profile_step(lambda: None, warmup=-1)


def test_profile_step_keeps_the_profiler_library_lines_out_of_the_output(capfd):
    """The profiler's native library writes start/stop lines to fd 2; a notebook must not show them."""

    def step():
        return torch.ones(8).sum()

    ct.profile_step(step, steps=1)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err, err
