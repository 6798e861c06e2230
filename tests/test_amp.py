"""utils.amp: the helpers the mixed-precision notebooks share."""

import math

import pytest
import torch
import torch.nn.functional as F

import utils
from utils import amp


def test_dtype_name():
    assert [utils.dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == \
        ["fp32", "bf16", "fp16"]
    assert utils.dtype_name(torch.int64) == "int64" and utils.dtype_name(None) == "-"
    with pytest.raises(TypeError, match="torch.dtype"):
        utils.dtype_name("float32")


def test_rel_error():
    ref = torch.tensor([3.0, 4.0])
    assert utils.rel_error(ref, ref) == 0.0
    assert utils.rel_error(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    assert utils.rel_error(ref.bfloat16(), ref) == 0.0  # 3 and 4 are exact in bf16
    with pytest.raises(ValueError, match="shapes differ"):
        utils.rel_error(ref, ref[:1])
    with pytest.raises(ValueError, match="all zeros"):
        utils.rel_error(ref, torch.zeros(2))


def test_cpu_precision_support_reads_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 amx_fp16\n")
    s = utils.cpu_precision_support(str(info))
    assert s.flags_readable and s.bf16_native and s.fp16_native and not s.amx_bf16
    assert "avx512_bf16: yes" in str(s)
    missing = utils.cpu_precision_support(str(tmp_path / "absent"))
    assert not missing.flags_readable and not missing.bf16_native
    assert "not readable" in str(missing)


def test_op_counter_sees_autocast_casts_and_host_syncs():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ops = utils.count_aten_ops(lin, x)
    assert out.dtype == torch.bfloat16
    assert ops.casts == 3  # weight, bias and input cast to bf16
    assert ops.total("addmm") == 1 and ("addmm", "bf16") in ops.counts
    _, plain = utils.count_aten_ops(lin, x)
    assert plain.casts == 0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, inf_ops = utils.count_aten_ops(lin, x)  # seen as `to`, not `_to_copy`, here
    assert inf_ops.casts == 3
    _, same = utils.count_aten_ops(lambda: x.to(torch.float32).double().to(torch.float64))
    assert same.casts == 1  # only the conversion that changed the dtype
    _, syncs = utils.count_aten_ops(lambda: [bool(t.sum() > 0) for t in x])
    assert syncs.host_syncs == 4
    _, none = utils.count_aten_ops(lambda: torch.stack([t.sum() > 0 for t in x]).any())
    assert none.host_syncs == 0
    with pytest.raises(TypeError):
        utils.count_aten_ops(3)


def test_host_read_counter_counts_the_reads_the_aten_ops_miss():
    x = torch.randn(4, 3)
    p = torch.nn.Parameter(torch.randn(2))
    originals = {n: torch.Tensor.__dict__.get(n) for n in amp.HOST_READ_METHODS}
    with amp.HostReadCounter() as reads:
        x.sum().item()
        x.tolist()
        x.cpu().numpy()                      # two calls: .cpu() and .numpy()
        bool(x.sum() > 0)
        float(x.sum()), int(x[0, 0] > 0)
        x.to("cpu"), x.to(device=torch.device("cpu")), p.tolist()
        x.to(torch.float16), x.to(torch.float64, copy=True)   # dtype changes only: not reads
        stacked = torch.stack([t.sum() for t in x])           # stays a tensor: not a read
    assert dict(reads.calls) == {"item": 1, "tolist": 2, "cpu": 1, "numpy": 1, "__bool__": 1,
                                 "__float__": 1, "__int__": 1, "to": 2}, reads.calls
    assert reads.total == 10 and str(reads).startswith("10 host read(s): __bool__ 1")
    assert stacked.shape == (4,) and x.sum().item() == pytest.approx(float(x.sum()))
    assert {n: torch.Tensor.__dict__.get(n) for n in amp.HOST_READ_METHODS} == originals
    # the aten-level count sees only two of those reads' kind: .item() and bool()
    _, ops = utils.count_aten_ops(lambda: (x.sum().tolist(), x.cpu().numpy()))
    assert ops.host_syncs == 0


def test_host_read_counter_restores_the_methods_on_error_and_refuses_reentry():
    originals = {n: torch.Tensor.__dict__.get(n) for n in amp.HOST_READ_METHODS}
    counter = amp.HostReadCounter()
    with pytest.raises(KeyError):
        with counter:
            torch.ones(2).tolist()
            raise KeyError("inside")
    assert counter.total == 1
    assert {n: torch.Tensor.__dict__.get(n) for n in amp.HOST_READ_METHODS} == originals
    assert torch.ones(1).item() == 1.0 and bool(torch.ones(1))
    with counter:
        with pytest.raises(RuntimeError, match="already counting"):
            counter.__enter__()
    assert {n: torch.Tensor.__dict__.get(n) for n in amp.HOST_READ_METHODS} == originals


def test_time_breakdown_diff_lines_says_when_nothing_got_faster():
    a = amp.TimeBreakdown("cpu", "CPU op time", (("matmul / conv", 3.16), ("optimizer", 0.44),
                                                 ("other", 2.01)), calls=3)
    b = amp.TimeBreakdown("cpu", "CPU op time", (("matmul / conv", 3.95), ("optimizer", 0.44),
                                                 ("other", 6.96)), calls=3)
    text = a.diff_lines(b)
    assert "nothing got faster; the largest addition: other (+4.95 ms)" in text
    assert "largest saving" not in text and "total 5.61 -> 11.35 ms" in text
    back = b.diff_lines(a)
    assert "the largest saving: other; nothing got slower" in back
    assert "nothing got faster; nothing got slower" in a.diff_lines(a)


def _quantize(x):
    scale = (x.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max).reshape(())
    return (x / scale).to(torch.float8_e4m3fn), scale


def test_fp8_matmul_public_api_where_torch_has_it():
    has_public = hasattr(F, "scaled_mm")
    assert utils.fp8_matmul_api() == ("torch.nn.functional.scaled_mm" if has_public
                                      else "torch._scaled_mm")
    torch.manual_seed(0)
    a, b = torch.randn(32, 64), torch.randn(64, 48)
    a8, sa = _quantize(a)
    b8, sb = _quantize(b)
    try:
        out = utils.fp8_matmul(a8, b8.t().contiguous().t(), sa, sb)
    except (RuntimeError, NotImplementedError) as exc:  # no CPU kernel in this build
        pytest.skip(f"no fp8 matmul on this CPU build: {exc}")
    ref = (a8.double() * sa.double()) @ (b8.double() * sb.double())
    assert out.dtype == torch.bfloat16
    assert utils.rel_error(out, ref) < 2 * torch.finfo(torch.bfloat16).eps


def test_fp8_matmul_rejects_wrong_inputs():
    a8, sa = _quantize(torch.randn(4, 4))
    with pytest.raises(TypeError, match="float8"):
        utils.fp8_matmul(a8.float(), a8, sa, sa)
    with pytest.raises(TypeError, match="scale_b"):
        utils.fp8_matmul(a8, a8, sa, torch.tensor([1.0, 2.0]))


def test_loss_gap_share_of_the_drop():
    ref = [10.0, 8.0, 6.0, 4.0, 2.0, 2.0]
    g = utils.loss_gap([10.0, 9.0, 8.0, 7.0, 6.0, 5.0], ref, last=2)
    assert g.ref_drop == pytest.approx(10.0 - 2.0)
    assert g.gap_of_drop == pytest.approx((5.5 - 2.0) / 8.0)
    assert utils.loss_gap(ref, ref, last=2).gap_of_drop == 0.0
    stalled = utils.loss_gap([10.0] * 6, ref, last=2)
    assert stalled.gap_of_drop == pytest.approx(1.0)


def test_loss_gap_on_a_log_scale():
    ref = [1.0, 1e-1, 1e-2, 1e-3]
    g = utils.loss_gap([1.0, 1e-1, 1e-1, 1e-1], ref, last=1, log=True)
    assert g.gap_of_drop == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="positive"):
        utils.loss_gap([1.0, 0.0], [1.0, 0.5], last=1, log=True)


def test_loss_gap_refuses_meaningless_comparisons():
    with pytest.raises(ValueError, match="did not learn"):
        utils.loss_gap([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], last=1)
    with pytest.raises(ValueError, match="diverged"):
        utils.loss_gap([1.0, math.nan, 1.0], [2.0, 1.0, 0.5], last=1)
    with pytest.raises(ValueError, match="more than last"):
        utils.loss_gap([1.0], [1.0], last=1)
    assert utils.loss_gap(torch.tensor([3.0, 2.0]), torch.tensor([3.0, 1.0]),
                          last=1).gap_of_drop == pytest.approx(0.5)


def test_best_of_rounds_keeps_the_fastest_and_enters_contexts_each_round():
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    x = torch.randn(64, 64)
    jobs = {"mm": utils.TimingJob("mm", torch.mm, (x, x)),
            "mm in ctx": utils.TimingJob("mm in ctx", torch.mm, (x, x), context=Ctx)}
    best = utils.best_of_rounds(jobs, rounds=2, device="cpu", min_run_time_s=0.01)
    assert set(best) == set(jobs) and len(entered) == 2
    assert best["mm"].label == "mm" and best["mm"].median_ms > 0
    with pytest.raises(ValueError, match="at least one job"):
        utils.best_of_rounds({})
    with pytest.raises(ValueError, match="rounds"):
        utils.best_of_rounds(jobs, rounds=0)
    with pytest.raises(TypeError, match="TimingJob"):
        utils.best_of_rounds({"x": (torch.mm, x, x)})


def test_time_breakdown_categories():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 8, (64,))
    b = utils.time_breakdown(utils.train_step, model, opt, x, y, device="cpu", calls=2)
    assert b.clock == "CPU op time" and b.calls == 2
    assert b.ms("matmul / conv") > 0 and b.ms("optimizer") > 0
    assert b.total_ms == pytest.approx(sum(ms for _, ms in b.ms_by_category))
    assert 0 < b.share("matmul / conv") < 1
    cast = utils.time_breakdown(utils.train_step, model, opt, x, y, device="cpu", calls=1,
                                amp_dtype=torch.bfloat16)
    assert cast.ms("casts and copies") > 0  # autocast's casts
    assert "total (CPU op time)" in str(b)
    with pytest.raises(KeyError, match="no category"):
        b.ms("gpu magic")
    with pytest.raises(ValueError, match="calls"):
        utils.time_breakdown(utils.train_step, model, opt, x, y, calls=0)


def test_category_prefix_matching():
    assert amp._category("_foreach_addcdiv_", amp.OP_CATEGORIES) == "optimizer"
    assert amp._category("addmm", amp.OP_CATEGORIES) == "matmul / conv"
    assert amp._category("_to_copy", amp.OP_CATEGORIES) == "casts and copies"
    assert amp._category("gelu", amp.OP_CATEGORIES) == "other"


def test_time_breakdown_rounds_keep_the_smallest():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    b = utils.time_breakdown(model, x, device="cpu", calls=1, warmup=0, rounds=3)
    assert b.calls == 3 and b.ms("matmul / conv") > 0
    with pytest.raises(ValueError, match="rounds"):
        utils.time_breakdown(model, x, rounds=0)


def test_loss_gap_says_whether_the_reference_learned():
    # 02/04 on the H100: fp32 fell 9.100 -> 9.022 (0.9% of its loss) and a "gap as a share of
    # the drop" of 1.45 came from dividing by almost nothing.
    hardly = utils.loss_gap([9.1, 9.0, 8.909, 8.909], [9.100, 9.06, 9.022, 9.022], last=2)
    assert hardly.ref_drop_share == pytest.approx(0.0086, abs=1e-3)
    assert not hardly.reference_learned(0.2)
    learned = utils.loss_gap([9.0, 5.0, 3.0, 3.0], [9.0, 5.0, 3.1, 3.1], last=2)
    assert learned.reference_learned(0.2) and learned.gap_of_drop < 0.05
    with pytest.raises(ValueError, match="min_share"):
        learned.reference_learned(1.5)
