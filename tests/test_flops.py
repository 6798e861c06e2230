import pytest
import torch

import utils


@pytest.mark.parametrize("m,n,k", [(3, 5, 7), (64, 128, 32), (1, 1, 1)])
def test_matmul_flops_are_exact(m, n, k):
    a, b = torch.randn(m, k), torch.randn(k, n)
    fc = utils.count_flops(torch.mm, a, b)
    assert fc.total_flops == 2 * m * n * k
    assert int(fc) == 2 * m * n * k
    assert fc.by_operator == {"aten.mm": 2 * m * n * k}


def test_backward_counts_twice_the_forward_matmul():
    w = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)

    def step():
        (x @ w).sum().backward()

    assert utils.count_flops(step).total_flops == 3 * 2 * 8 * 16 * 32


def test_throughput_arithmetic():
    assert utils.achieved_tflops(2e12, 0.5) == pytest.approx(4.0)
    assert utils.achieved_gbs(1e9, 0.25) == pytest.approx(4.0)
    assert utils.mfu(30.0, 60.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        utils.achieved_tflops(1.0, 0.0)
    with pytest.raises(ValueError):
        utils.mfu(1.0, 0)


def test_measured_ceilings_are_real_numbers():
    c = utils.measure_ceilings("cpu", smoke=True)
    assert c.matmul_tflops > 0 and c.bandwidth_gbs > 0
    assert c.ridge_flops_per_byte == pytest.approx(c.matmul_tflops * 1e3 / c.bandwidth_gbs)


def test_roofline_plot():
    import matplotlib

    matplotlib.use("Agg")
    c = utils.Ceilings("cpu", "float32", 1.0, 100.0, 1024, 1 << 20)
    pts = [utils.RooflinePoint("add", 1e6, 12e6, 1e-3), utils.RooflinePoint("mm", 2e9, 12e6, 1e-2)]
    ax = utils.plot_roofline(pts, c)
    assert ax.get_xscale() == "log" and len(ax.collections) == 2
    assert pts[0].intensity == pytest.approx(1 / 12)
    with pytest.raises(ValueError):
        utils.plot_roofline([], c)


def test_attention_is_counted_on_cpu_too():
    """CPU SDPA runs a kernel torch < 2.15 has no FLOP formula for: it must not count as 0."""
    b, h, seq, d = 2, 3, 64, 16
    q, k, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))
    fwd = utils.count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert fwd.total_flops == 2 * (2 * b * h * seq * seq * d)  # QK^T and PV
    assert any("attention" in op for op in fwd.by_operator)

    def fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    both = utils.count_flops(fwd_bwd)
    assert both.total_flops > 2 * fwd.total_flops  # the backward's matmuls are counted too


def test_datasheet_peaks_are_dense_and_only_for_known_parts():
    assert utils.datasheet_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert utils.datasheet_peak_tflops("NVIDIA H200", "tf32") == pytest.approx(494.7)
    assert utils.datasheet_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    # variants with other clocks are absent rather than guessed
    assert utils.datasheet_peak_tflops("NVIDIA H100 PCIe", "bf16") is None
    assert utils.datasheet_peak_tflops("NVIDIA H200 NVL", "bf16") is None
    assert utils.datasheet_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None
    with pytest.raises(ValueError, match="precision"):
        utils.datasheet_peak_tflops("NVIDIA H100 80GB HBM3", "int8")


def test_mfu_report_labels_both_ceilings():
    r = utils.mfu_report(flops=3e12, seconds=1.0, measured_ceiling_tflops=6.0, precision="fp32",
                         device="cpu")
    assert r.vs_measured == pytest.approx(0.5) and r.datasheet_peak_tflops is None
    text = str(r)
    assert "50.0% of the fp32 matmul ceiling measured here" in text
    assert "no datasheet peak" in text
    peaked = utils.MFUReport(400.0, 800.0, 989.4, "bf16", "NVIDIA H100 80GB HBM3")
    assert peaked.vs_datasheet == pytest.approx(400 / 989.4)
    assert "of the datasheet peak (989.4 TFLOP/s dense, NVIDIA H100 80GB HBM3)" in str(peaked)


def test_ceiling_sizes_grow_for_gpus_and_two_byte_dtypes():
    from utils.flops import _default_sizes

    cuda = torch.device("cuda")
    assert max(_default_sizes(cuda, torch.bfloat16)) > 4096  # a bf16 Hopper needs big matmuls
    assert max(_default_sizes(cuda, torch.float32)) >= 8192
    assert _default_sizes(torch.device("cpu"), torch.float32) == (2048,)
    c = utils.measure_ceilings("cpu", smoke=True)
    assert c.matmul_size == 1024


# -- GPT FLOPs by formula ----------------------------------------------------------------------

def test_gpt_flops_counts_gpt2_small_by_hand():
    cfg = utils.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    f = utils.flops.gpt_flops(cfg)
    # GPT-2 small has 124,439,808 parameters, 786,432 of them position embeddings.
    assert f.n_params == 124_439_808 - 1024 * 768
    assert f.n_params + 1024 * 768 == utils.count_parameters(_meta_gpt(cfg))
    assert f.per_token("6N") == 6 * f.n_params
    assert f.per_token("6N+attn") == 6 * f.n_params + 12 * 12 * 768 * 1024
    assert f.per_token("6N+causal") == 6 * f.n_params + 6 * 12 * 768 * 1024
    # the padded head is hardware work, not model work
    padded = utils.flops.gpt_flops(cfg, padded_vocab=50304)
    assert padded.per_token("6N+attn") == f.per_token("6N+attn")
    assert padded.hardware_per_token() - f.hardware_per_token() == 6 * (50304 - 50257) * 768
    assert f.hardware_per_token(causal_kernel=False) == f.per_token("6N+attn")
    assert f.hardware_per_token(attention_recompute=True) == \
        f.hardware_per_token() + 2 * 12 * 768 * 1024 / 2
    assert f.hardware_per_token(full_recompute=True) == pytest.approx(
        f.hardware_per_token() + 2 * f.n_params + 4 * 12 * 768 * 1024 / 2)


def _meta_gpt(cfg):
    with torch.device("meta"):
        return utils.TinyGPT(cfg)


def test_gpt_flops_agree_with_the_counted_matmuls():
    # torch's FLOP counter counts matmuls only: the formula's N also holds biases and norms,
    # which do no matmul; take them out. TinyGPT's fused attention (SDPA) recomputes the
    # scores in its backward, and the counter counts that matmul too: it counts hardware
    # FLOPs, the formula's attention_recompute. Then the two agree exactly.
    cfg = utils.GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    f = utils.flops.gpt_flops(cfg)
    model = utils.TinyGPT(cfg)
    x = torch.randint(0, 300, (3, 32))
    counted = utils.count_flops(lambda: torch.nn.functional.cross_entropy(
        model(x).flatten(0, 1), x.flatten()).backward()).total_flops
    d, layers = 32, 2
    not_matmul = layers * (2 * d + 3 * d + d + 2 * d + 4 * d + d) + 2 * d   # biases and norms
    per_token = f.hardware_per_token(causal_kernel=False, attention_recompute=True) \
        - 6 * not_matmul
    assert counted == 3 * 32 * per_token


@pytest.mark.parametrize("bad", [dict(seq_len=0), dict(seq_len=33), dict(padded_vocab=10)])
def test_gpt_flops_rejects_bad_sizes(bad):
    cfg = utils.GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(ValueError):
        utils.flops.gpt_flops(cfg, **bad)
    with pytest.raises(ValueError, match="unknown convention"):
        utils.flops.gpt_flops(cfg).per_token("7N")
