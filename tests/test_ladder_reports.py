"""utils.ladder's reporting functions (the capstone's tables, records and summaries, issue 26),
the GPT predictor and its attention helpers, and utils.SectionClock; each checked by hand."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import utils
from utils import ladder as L

TINY = utils.GPTConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16)
CEIL = {"fp32": 10.0, "tf32": 10.0, "bf16": 40.0}


def _ledger():
    return utils.Ledger("tests/reports", smoke=True, env={"device": "cpu"}, strict=False)


def _rung(name, cfg=None, ms=100.0, *, ran=True, losses=(2.0, 1.5, 1.0), prediction=None,
          peak=None, warmup=1.0, graphs=None, hits=None, sdpa="", noop="", flops=1e12, iqr=0.0):
    cfg = cfg or L.TrainConfig()
    if not ran:
        return L.RungResult(name, cfg, ran=False, skipped_reason="needs CUDA")
    return L.RungResult(name, cfg, ran=True, median_ms=ms, iqr_ms=iqr, items_per_step=1000,
                        flops_per_step=int(flops), ceiling_kind=cfg.ceiling_kind,
                        ceiling_tflops=CEIL[cfg.ceiling_kind], peak_bytes=peak, warmup_s=warmup,
                        graphs_compiled=graphs, fx_cache_hits=hits, losses=tuple(losses),
                        loss_window=2, prediction=prediction, sdpa_backend=sdpa, noop_reason=noop)


BF16 = L.TrainConfig(amp="bf16", tf32=True)


def test_rung_key_is_the_rule_the_claims_registry_uses():
    assert L.rung_key("bf16 autocast") == "bf16_autocast"
    assert L.rung_key("vocab padded to 128") == "vocab_padded_to_128"
    assert L.rung_key("  SDPA (flash)!") == "sdpa_flash"
    for rung in L.default_ladder("bf16"):
        assert L.rung_key(rung.name) == re.sub(r"[^a-z0-9]+", "_", rung.name.lower()).strip("_")
    with pytest.raises(ValueError, match="letter or a digit"):
        L.rung_key("--")


def test_record_rungs_records_every_rung_that_ran_with_its_units():
    pred = L.Prediction(40.0, "Amdahl over the matmuls", "100 - 60")
    results = [_rung("fp32 eager", ms=100.0, peak=1000),
               _rung("CUDA graphs", ran=False),
               _rung("bf16 autocast", BF16, ms=25.0, prediction=pred, sdpa="FLASH_ATTENTION")]
    led = _ledger()
    L.record_rungs(led, results, convention="6N+attn", datasheet={"bf16": 100.0, "fp32": None},
                   device_name="GPU X")
    m = led.measurements
    assert m["fp32_eager_ms_per_step"].value == 100.0 and m["fp32_eager_peak_bytes"].value == 1000
    assert m["bf16_autocast_speedup_vs_fp32"].value == pytest.approx(4.0)
    assert m["bf16_autocast_tokens_per_s"].value == pytest.approx(1000 / 0.025)
    assert m["bf16_autocast_tokens_per_s"].unit == "tokens/s"
    assert m["bf16_autocast_predicted_ms_per_step"].value == 40.0
    assert "SDPA ran FLASH_ATTENTION" in m["bf16_autocast_ms_per_step"].note
    # 1e12 FLOP in 25 ms: 40 TFLOP/s, all of the 40 TFLOP/s bf16 ceiling, 40% of a 100 peak
    assert m["bf16_autocast_mfu"].value == pytest.approx(1.0)
    assert m["bf16_autocast_mfu_vs_datasheet"].value == pytest.approx(0.4)
    assert "GPU X" in m["bf16_autocast_mfu_vs_datasheet"].note
    assert "fp32_eager_mfu_vs_datasheet" not in m and "fp32_eager_predicted_ms_per_step" not in m
    assert not any(k.startswith("cuda_graphs") for k in m), "a rung that did not run: nothing"
    with pytest.raises(ValueError, match="baseline"):
        L.record_rungs(led, [_rung("a", ran=False)], convention="x")


def test_verdict_lines_say_what_each_rung_did():
    results = [_rung("base", ms=100.0), _rung("same", ms=101.0, noop="no TF32 here"),
               _rung("graphs", ran=False), _rung("faster", ms=50.0)]
    lines = L.verdict_lines(results, L.rung_verdicts(results, floor=0.03))
    assert len(lines) == 3
    assert lines[0].endswith("no-op here (band 3%): no TF32 here, so x0.99 is two timings of the "
                             "same step")
    assert "not run here (needs CUDA); the next rung builds on 'same'" in lines[1]
    assert "x2.02 over 'same': pays (band 3%)" in lines[2]
    with pytest.raises(ValueError, match="verdicts"):
        L.verdict_lines(results, [])


def test_warmup_and_memory_summaries():
    comp = L.TrainConfig(compile="default")
    results = [_rung("eager", ms=100.0, peak=1000, warmup=0.5),
               _rung("compiled", comp, ms=50.0, warmup=7.0, graphs=1, hits=2, peak=500),
               _rung("fused", dataclasses.replace(comp, fused_adamw=True), warmup=3.0, graphs=1,
                     hits=0, peak=600),
               _rung("no memory", comp, warmup=1.0, graphs=1, hits=0)]
    text = L.warmup_summary(results, wall_s=40.0)
    assert ("compiled rungs: 3, their first steps (compile included) took 11 s of the ladder's "
            "40 s") in text
    assert "compiled: 7.0 s, 2 hit(s); fused: 3.0 s, 0 hit(s)" in text
    assert "hit" not in L.warmup_summary(results[:3] + [_rung("x", comp, hits=None)], 1.0)
    mem = L.memory_summary(results)
    assert "largest drop -50% (compiled), largest rise +20% (fused)" in mem
    assert mem.endswith("measured for 3 of the 4 rungs that ran")
    assert L.memory_summary(results[:1]) == ""


def test_prediction_table_sets_each_prediction_beside_its_measurement():
    results = [_rung("base", ms=120.0, prediction=L.Prediction(100.0, "FLOP bound", "1 / 10",
                                                                bound=True)),
               _rung("tf32", ms=80.0, prediction=L.Prediction(64.0, "Amdahl over the matmuls",
                                                               "120 - 56")),
               _rung("none", ms=70.0), _rung("graphs", ran=False)]
    text = L.prediction_table(results)
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()}
    assert ">=100.00" in rows["base"] and "1.20" in rows["base"]
    assert "64.00" in rows["tf32"] and "1.25" in rows["tf32"]
    assert "(no model input)" in rows["none"] and "graphs" not in rows
    assert "  tf32: 120 - 56" in text


def test_realised_gains_by_hand():
    rungs = L.default_ladder("bf16")[:4]          # fp32 eager, TF32, bf16 autocast, SDPA
    cfgs = [L.TrainConfig()]
    for r in rungs[1:]:
        cfgs.append(r.apply(cfgs[-1]))
    results = [_rung("fp32 eager", cfgs[0], ms=100.0),
               # predicted 100 -> 60 (gain 40), measured 80 (gain 20): half realised
               _rung("TF32 matmuls", cfgs[1], ms=80.0, prediction=L.Prediction(60.0, "m", "f")),
               # predicted a 5% gain: below min_gain, not claimed
               _rung("bf16 autocast", cfgs[2], ms=70.0, prediction=L.Prediction(76.0, "m", "f")),
               # predicted 70 -> 35, measured 70 -> 77: a loss, realised -0.2
               _rung("SDPA", cfgs[3], ms=77.0, prediction=L.Prediction(35.0, "m", "f"))]
    results = [dataclasses.replace(r, name=rung.name) for r, rung in zip(results, rungs)]
    led = _ledger()
    got = L.realised_gains(rungs, results, ledger=led)
    assert got == pytest.approx({rungs[1].name: 0.5, rungs[3].name: -0.2})
    assert led.measurements[f"{L.rung_key(rungs[1].name)}_predicted_gain_realised"].value == 0.5
    assert L.realised_gains(rungs, results, keys=("amp",)) == {}
    with pytest.raises(ValueError, match="rungs"):
        L.realised_gains(rungs[:2], results)


def test_same_model_table_and_the_loss_differences():
    results = [_rung("fp32", losses=(2.0, 1.5, 1.0, 1.0)),
               _rung("tf32", L.TrainConfig(tf32=True), losses=(2.002, 1.5, 1.02, 1.0)),
               _rung("bf16", BF16, losses=(2.02, 1.6, 1.0, 0.98)),
               _rung("bf16 b", BF16, losses=(2.01, 1.5, 1.0, 1.0)),
               _rung("graphs", ran=False)]
    first, final = L.loss_rel_diffs(results)
    assert first["tf32"] == pytest.approx(0.001) and first["bf16"] == pytest.approx(0.01)
    assert final["bf16"] == pytest.approx(0.01) and final["fp32"] == 0.0   # last 2 steps' mean
    assert L.matmul_arithmetic(results[1], "cpu") == "fp32", "no TF32 on a CPU"
    assert L.matmul_arithmetic(results[2], "cpu") == "bf16"
    worst = L.worst_first_loss_by_arithmetic(results, "cpu")
    assert list(worst) == ["fp32", "bf16"]
    assert worst["fp32"] == ("tf32", pytest.approx(0.001)) and worst["bf16"][0] == "bf16"
    tol = {"fp32": 1e-6, "bf16": 1e-4}
    text = L.same_model_table(results, tol, loss_tol=0.02, device="cpu")
    row = next(line for line in text.splitlines() if line.startswith("bf16 "))
    assert "bf16" in row and "1.0e-02" in row and "1e-04" in row and "1.00%" in row
    tf32_row = next(line for line in text.splitlines() if line.startswith("tf32"))
    assert tf32_row.endswith("2.00%"), "the worst step: 1.02 against 1.0 at step 3"
    assert "against 2%" in text and "graphs" not in text
    with pytest.raises(ValueError, match="no tolerance for 'bf16'"):
        L.same_model_table(results, {"fp32": 1e-6}, loss_tol=0.02, device="cpu")


def test_mfu_by_convention_by_hand():
    gf = utils.flops.gpt_flops(TINY, padded_vocab=64)
    best = _rung("best", BF16, ms=2.0)
    tokens = 8 * 16
    got = L.mfu_by_convention(best, gf, tokens_per_step=tokens, ceiling_tflops=40.0,
                              peak_tflops=80.0, fused_attention=True)
    assert list(got) == [*utils.flops.GPT_FLOP_CONVENTIONS, "hardware"]
    tf = tokens * gf.per_token("6N+attn") / 2e-3 / 1e12
    assert got["6N+attn"] == pytest.approx((tf, tf / 40.0, tf / 80.0))
    hw = tokens * gf.hardware_per_token(causal_kernel=True, attention_recompute=True) / 2e-3 / 1e12
    assert got["hardware"][0] == pytest.approx(hw)
    no_peak = L.mfu_by_convention(best, gf, tokens_per_step=tokens, ceiling_tflops=40.0)
    assert no_peak["6N"][2] is None
    led = _ledger()
    text = L.record_mfu_by_convention(led, best, gf, tokens_per_step=tokens, ceilings=CEIL,
                                      datasheet={"bf16": 80.0}, device_name="GPU X")
    m = led.measurements
    assert m["best_rung_mfu[6N+attn]"].value == pytest.approx(tf / 40.0)
    assert m["best_rung_mfu_vs_datasheet[6N+causal]"].value == pytest.approx(
        tokens * gf.per_token("6N+causal") / 2e-3 / 1e12 / 80.0)
    assert m["best_rung_hfu"].value == pytest.approx(
        tokens * gf.hardware_per_token(causal_kernel=False) / 2e-3 / 1e12 / 40.0)
    assert "best_rung_mfu_vs_datasheet[hardware]" not in m and "64 head rows" in text
    with pytest.raises(ValueError, match="did not run"):
        L.mfu_by_convention(_rung("x", ran=False), gf, tokens_per_step=1, ceiling_tflops=1.0)


def test_record_flops_by_convention_and_ceilings():
    gf = utils.flops.gpt_flops(TINY, padded_vocab=64)
    led = _ledger()
    text = L.record_flops_by_convention(led, gf, tokens_per_step=100, counted=1e6)
    for conv in utils.flops.GPT_FLOP_CONVENTIONS:
        assert led.measurements[f"flops_per_step[{conv}]"].value == 100 * gf.per_token(conv)
    assert "counted" in text and "61 head rows" not in text and "64 head rows" in text
    text = L.record_ceilings(led, {"fp32": 1.5, "tf32": 1.5, "bf16": 3.0}, how="one 512^3 matmul",
                             datasheet={"bf16": 6.0}, device_name="GPU X", device="cpu")
    assert led.measurements["ceiling_bf16_tflops"].value == 3.0
    assert "one 512^3 matmul" in led.measurements["ceiling_fp32_tflops"].note
    assert "datasheet dense peak 6 (50% of it)" in text and "no datasheet peak" not in text
    assert "no TF32" in text
    text = L.record_ceilings(led, {"fp32": 1.5}, how="x", device="cpu")
    assert "no datasheet peak for a CPU" in text and "no TF32" not in text


def test_speedup_report_factors_the_speedup():
    base = _rung("fp32 eager", ms=100.0)                    # 10 TFLOP/s: MFU 100% of fp32's 10
    best = _rung("best", BF16, ms=5.0, sdpa="MATH")         # 200 TFLOP/s vs 40: MFU 500%
    text = L.speedup_report(best, base, CEIL, reference_kind="bf16", flops_label="counted",
                            device="cpu")
    assert "best rung: best (" in text and "SDPA ran MATH" in text
    assert "20.00x fp32 eager's" in text and "FLOPs: counted" in text
    assert "= 4.00 x 5.00 = 20.00" in text
    # 10x at the baseline's MFU (100%) over a ceiling ratio of 4: 250% of the bf16 ceiling
    assert "10x at 250%, 6x at 150% (measured: 500%)" in text
    with pytest.raises(ValueError, match="no ceiling"):
        L.speedup_report(best, base, {"fp32": 1.0}, reference_kind="bf16")


def test_speedup_claim_gates_on_the_measured_ceiling_ratio():
    assert L.speedup_claim(is_cuda=True, bf16_gpu=True, compute_capability=(9, 0),
                           ceiling_ratio=13.0) == (10.0, True, "")
    assert L.speedup_claim(is_cuda=True, bf16_gpu=True, compute_capability=(9, 0),
                           ceiling_ratio=10.0) == (6.0, True, "")
    assert L.speedup_claim(is_cuda=True, bf16_gpu=True, compute_capability=(8, 0),
                           ceiling_ratio=15.0) == (6.0, True, "")
    t, applies, why = L.speedup_claim(is_cuda=True, bf16_gpu=True, compute_capability=(8, 9),
                                      ceiling_ratio=4.0)
    assert (t, applies) == (6.0, False) and "4.0 (below 8)" in why and "1.5x" in why
    t, applies, why = L.speedup_claim(is_cuda=False, bf16_gpu=False, compute_capability=None,
                                      ceiling_ratio=1.2)
    assert not applies and "has no GPU" in why
    with pytest.raises(ValueError, match="positive"):
        L.speedup_claim(is_cuda=False, bf16_gpu=False, compute_capability=None, ceiling_ratio=0)


def test_rungs_table_lists_the_ladder_and_its_top_rung():
    text = L.rungs_table(L.default_ladder("bf16"), L.TrainConfig(accum_steps=4))
    assert "[needs CUDA]" in text and "sdpa=True" in text and "(the baseline)" in text
    top = L.TrainConfig(accum_steps=4)
    for rung in L.default_ladder("bf16"):
        top = rung.apply(top)
    assert f"top rung   : {top.describe()}" in text and " ".join(top.to_flags()) in text


def test_attention_helpers_compute_the_same_function_both_ways():
    cfg = L.TrainConfig(accum_steps=2)
    q, k, v, g = L.attention_inputs(cfg, batch=4, n_head=2, seq_len=8, head_dim=4, device="cpu")
    assert q.shape == (2, 2, 8, 4) and q.requires_grad and not g.requires_grad
    hand = L.attention_fwd_bwd(cfg, q, k, v, g, False)
    fused = L.attention_fwd_bwd(cfg, q, k, v, g, True)
    math_ = L.attention_fwd_bwd(cfg, q, k, v, g, True, "MATH")
    for a, b, c in zip(hand, fused, math_):
        torch.testing.assert_close(a, b, **utils.tolerance(torch.float32, "cpu", scale=b).kwargs())
        torch.testing.assert_close(c, b, **utils.tolerance(torch.float32, "cpu", scale=b).kwargs())
    # causal: the first position attends to itself only
    torch.testing.assert_close(hand[0][..., 0, :], v[..., 0, :].detach())
    bf = dataclasses.replace(cfg, amp="bf16")
    assert L.attention_inputs(bf, batch=4, n_head=2, seq_len=8, head_dim=4,
                              device="cpu")[0].dtype is torch.bfloat16
    with pytest.raises(ValueError, match="micro-batches"):
        L.attention_inputs(L.TrainConfig(accum_steps=3), batch=4, n_head=2, seq_len=8, head_dim=4)
    with pytest.raises(ValueError, match="sdpa=True"):
        L.attention_fwd_bwd(cfg, q, k, v, g, False, "MATH")
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        L.attention_fwd_bwd(cfg, q, k, v, g, True, "FASTEST")


def test_gpt_ladder_predictor_feeds_predict_rung_what_the_shapes_give():
    flops = 1e9
    ceil = {"fp32": 1.0, "tf32": 1.0, "bf16": 2.0}
    predict = L.gpt_ladder_predictor(TINY, batch=4, flops_per_step=flops, ceilings=ceil,
                                     copy_gbs=10.0, launch_us=5.0, n_params=1000, device="cpu",
                                     min_run_time_s=0.01)
    base = L.TrainConfig(accum_steps=2)
    assert predict(None, base, None).bound, "the baseline: the FLOP bound"
    prev = L.RungResult("prev", base, ran=True, median_ms=50.0, items_per_step=64,
                        flops_per_step=int(flops), ceiling_kind="fp32", ceiling_tflops=1.0)
    p = predict(None, dataclasses.replace(base, sdpa=True), prev)
    assert p.model == "attention swapped" and math.isfinite(p.ms)
    sdpa = dataclasses.replace(base, sdpa=True)
    prev = dataclasses.replace(prev, config=sdpa)
    p = predict(None, dataclasses.replace(sdpa, vocab_multiple=16), prev)
    # 61 -> 64 rows: 6 x 3 x 16 x 64 tokens more FLOPs at 1 TFLOP/s
    want = L.predict_rung(dataclasses.replace(sdpa, vocab_multiple=16), prev, flops_per_step=flops,
                          ceilings=ceil, extra_flops_per_step=6 * 3 * 16 * 64)
    assert p.model == "padded rows' FLOPs" and p.ms == pytest.approx(want.ms) and p.ms > 50.0


def test_section_clock_books_each_section_and_records_it(monkeypatch):
    now = iter([10.0, 12.5, 13.0, 20.0])
    monkeypatch.setattr(utils.timing.time, "perf_counter", lambda: next(now))
    clock = utils.SectionClock()
    assert clock.lap("1. data") == 2.5
    clock.lap("2. Model, rungs")
    clock.lap("1. data")
    assert clock.seconds == {"1. data": 9.5, "2. Model, rungs": 0.5} and clock.total_s == 10.0
    assert "1. data 10 s" in clock.report() and "budget" not in clock.report()
    assert "(OVER it)" in clock.report(budget_s=5) and "(within it)" in clock.report(budget_s=60)
    led = _ledger()
    clock.record(led)
    assert led.measurements["section_wall_s_2_model_rungs"].value == 0.5
    assert led.measurements["notebook_wall_s"].value == 10.0
    with pytest.raises(ValueError, match="name"):
        clock.lap("")


def test_ledger_key_is_the_one_rule_for_rungs_and_sections():
    assert utils.ledger_key("3. Correctness before timing") == "3_correctness_before_timing"
    assert L.rung_key("SDPA (flash)") == utils.ledger_key("SDPA (flash)") == "sdpa_flash"
    with pytest.raises(ValueError, match="letter or a digit"):
        utils.ledger_key(" - ")
