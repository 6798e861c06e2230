"""utils.ladder: the speedup ladder's settings, model helpers, step, FLOPs, runner and plots."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import utils
from utils import ladder as L

TINY = utils.GPTConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16)


def tiny_batch(step: int, batch: int = 8, cfg: utils.GPTConfig = TINY):
    return utils.lm_batch(cfg, batch, device="cpu", seed=step)


# ----------------------------------------------------------------------------- TrainConfig

def test_train_config_validates_its_fields():
    with pytest.raises(ValueError, match="amp"):
        L.TrainConfig(amp="fp8")
    with pytest.raises(ValueError, match="compile"):
        L.TrainConfig(compile="fast")
    with pytest.raises(ValueError, match="accum_steps"):
        L.TrainConfig(accum_steps=0)
    with pytest.raises(ValueError, match="vocab_multiple"):
        L.TrainConfig(vocab_multiple=-128)
    with pytest.raises(TypeError, match="tf32"):
        L.TrainConfig(tf32="yes")
    with pytest.raises(ValueError, match="169545"):
        L.TrainConfig(compile="reduce-overhead", accum_steps=2)
    L.TrainConfig(compile="max-autotune-no-cudagraphs", accum_steps=2)  # no CUDA graphs: fine


def test_train_config_properties():
    assert L.TrainConfig().ceiling_kind == "fp32"
    assert L.TrainConfig(tf32=True).ceiling_kind == "tf32"
    assert L.TrainConfig(tf32=True, amp="bf16").ceiling_kind == "bf16"
    assert L.TrainConfig(amp="fp16").amp_dtype is torch.float16
    assert L.TrainConfig().amp_dtype is None
    assert L.TrainConfig(compile="reduce-overhead").uses_cuda_graphs
    assert not L.TrainConfig(compile="default").uses_cuda_graphs
    a, b = L.TrainConfig(), L.TrainConfig(sdpa=True, accum_steps=4)
    assert b.changes_from(a) == {"sdpa": True, "accum_steps": 4}
    assert "hand-written attention" in a.describe() and "SDPA" in b.describe()


def test_flags_round_trip_through_argparse():
    parser = argparse.ArgumentParser()
    L.TrainConfig.add_arguments(parser)
    cfg = L.TrainConfig(tf32=True, amp="bf16", sdpa=True, compile="default", fused_adamw=True,
                        vocab_multiple=128, accum_steps=2)
    args = parser.parse_args(cfg.to_flags())
    assert L.TrainConfig().with_args(args) == cfg
    # flags not given leave the base alone
    none_given = parser.parse_args([])
    assert cfg.with_args(none_given) == cfg
    assert cfg.with_args(parser.parse_args(["--amp", "fp32", "--compile", "none"])) == \
        dataclasses.replace(cfg, amp=None, compile=None)
    with pytest.raises(ValueError, match="CUDA graphs"):
        L.TrainConfig(accum_steps=4).with_args(parser.parse_args(["--compile", "reduce-overhead"]))


def test_the_ladder_is_cumulative_and_well_formed():
    names = [r.name for r in L.LADDER]
    assert names[0] == "fp32 eager" and names[-1] == "CUDA graphs" and len(set(names)) == len(names)
    cfg = L.TrainConfig(accum_steps=4)
    for rung in L.LADDER:
        cfg = rung.apply(cfg)  # every combination along the way is valid
    assert cfg == L.TrainConfig(tf32=True, amp="bf16", sdpa=True, compile="reduce-overhead",
                                fused_adamw=True, vocab_multiple=128, accum_steps=1)
    assert [r.name for r in L.LADDER if r.needs_cuda] == ["CUDA graphs"]
    assert "fp16 autocast + GradScaler" in [r.name for r in L.default_ladder("fp16")]
    with pytest.raises(ValueError, match="amp"):
        L.default_ladder("fp32")
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        L.Rung("bad", {"flash": True})


def test_rung_keys_are_short_unique_and_typed_on_command_lines():
    keys = [r.key for r in L.LADDER]
    assert keys == ["fp32", "tf32", "amp", "sdpa", "micro-batch", "compile", "fused-adamw",
                    "pad-vocab", "cuda-graphs"]
    assert [r.key for r in L.default_ladder("fp16")] == keys, "the same keys whatever the dtype"
    assert L.Rung("My Rung (v2)", {}).key == "my-rung-v2", "derived from the name"
    with pytest.raises(ValueError, match="key"):
        L.Rung("x", {}, key="Has Space")
    # what the review found wrong: the CPU runs AdamW's per-parameter loop, and CUDA graphs
    # replay only the compiled model and loss
    assert "loop on a CPU" in L.LADDER[0].why
    assert "stay eager" in L.LADDER[-1].why and "whole step" not in L.LADDER[-1].why


def test_padded_size():
    assert L.padded_size(50257, 128) == 50304
    assert L.padded_size(128, 128) == 128 and L.padded_size(1, 128) == 128
    assert L.padded_size(757, 1) == 757
    with pytest.raises(ValueError):
        L.padded_size(0, 128)
    with pytest.raises(ValueError):
        L.padded_size(10, 0)


# ----------------------------------------------------------------------------- the model side

def test_handwritten_attention_matches_sdpa_forward_and_backward():
    torch.manual_seed(0)
    model = utils.TinyGPT(TINY)
    x, y = tiny_batch(0)
    twin = copy.deepcopy(model)
    assert L.set_attention(twin, False) == TINY.n_layer
    assert all(type(b.attn) is L.HandwrittenCausalSelfAttention for b in twin.blocks)
    loss_sdpa = L.LossModule(model, TINY.vocab_size)(x, y)
    loss_manual = L.LossModule(twin, TINY.vocab_size)(x, y)
    torch.testing.assert_close(loss_manual, loss_sdpa, rtol=1e-5, atol=1e-6)
    loss_sdpa.backward()
    loss_manual.backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    assert L.set_attention(twin, True) == TINY.n_layer
    assert L.set_attention(utils.SmallCNN(width=4), True) == 0
    with pytest.raises(TypeError):
        L.set_attention(model, "sdpa")


def test_gpt_model_fn_same_weights_and_a_padding_that_changes_nothing():
    fn = L.gpt_model_fn(TINY, seed=3)
    a, b = fn(L.TrainConfig()), fn(L.TrainConfig())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert isinstance(a.blocks[0].attn, L.HandwrittenCausalSelfAttention)
    assert type(fn(L.TrainConfig(sdpa=True)).blocks[0].attn) is not L.HandwrittenCausalSelfAttention
    padded = fn(L.TrainConfig(sdpa=True, vocab_multiple=64))
    assert padded.tok_emb.weight.shape[0] == 64 and padded.head.weight is padded.tok_emb.weight
    assert torch.equal(padded.tok_emb.weight[: TINY.vocab_size], a.tok_emb.weight)
    assert not padded.tok_emb.weight[TINY.vocab_size:].any()
    x, y = tiny_batch(1)
    ref = L.LossModule(fn(L.TrainConfig(sdpa=True)), TINY.vocab_size)(x, y)
    loss = L.LossModule(padded, TINY.vocab_size)(x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0.0)
    loss.backward()
    assert padded.tok_emb.weight.grad[TINY.vocab_size:].abs().max().item() == 0.0
    # the negative control: without the cut, the extra (zero) logits enter the softmax
    uncut = L.LossModule(padded, 64)(x, y)
    assert (uncut - ref).item() > 0.5 * math.log(64 / TINY.vocab_size)
    # ... and the silent way to make that mistake is refused
    assert padded.real_vocab_size == TINY.vocab_size and a.real_vocab_size == TINY.vocab_size
    with pytest.raises(ValueError, match="padded from 61 to 64"):
        L.LossModule(padded, None)
    with pytest.raises(ValueError, match="padded"):
        L.Trainer(padded, L.TrainConfig(), device="cpu")  # num_classes forgotten
    L.LossModule(a, None)  # an unpadded model needs no num_classes
    L.LossModule(utils.SmallCNN(width=4), None)  # nor a model without the tag


def test_loss_module_needs_enough_logits():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="fewer than"):
        L.LossModule(model, 5)(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        L.LossModule(model, 0)


# ----------------------------------------------------------------------------- the step

def _params_after_one_step(cfg: L.TrainConfig, fused: bool = False) -> list[torch.Tensor]:
    fn = L.gpt_model_fn(TINY, seed=0)
    trainer = L.Trainer(fn(cfg), cfg, device="cpu", num_classes=TINY.vocab_size, lr=1e-2)
    x, y = tiny_batch(0)
    loss = trainer.step(x, y)
    assert loss.shape == () and torch.isfinite(loss) and trainer.steps_done == 1
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_same_step_as_one_big_micro_batch():
    one = _params_after_one_step(L.TrainConfig(accum_steps=1))
    four = _params_after_one_step(L.TrainConfig(accum_steps=4))
    for p, q in zip(one, four):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    fused = _params_after_one_step(L.TrainConfig(accum_steps=4, fused_adamw=True))
    for p, q in zip(four, fused):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_trainer_amp_paths_on_cpu_and_its_errors():
    for amp in ("bf16", "fp16"):
        cfg = L.TrainConfig(amp=amp, sdpa=True, accum_steps=2)
        trainer = L.Trainer(L.gpt_model_fn(TINY)(cfg), cfg, device="cpu",
                            num_classes=TINY.vocab_size, warmup_steps=2)
        losses = [trainer.step(*tiny_batch(i)).item() for i in range(3)]
        assert all(math.isfinite(v) for v in losses)
        assert (trainer.scaler is not None) == (amp == "fp16")
        state = trainer.state_dict()
        assert state["step"] == 3 and state["train_config"]["amp"] == amp
        assert ("scaler" in state) == (amp == "fp16")
    trainer = L.Trainer(nn.Linear(4, 3), L.TrainConfig(accum_steps=3), device="cpu")
    with pytest.raises(ValueError, match="accum_steps=3"):
        trainer.step(torch.randn(4, 4), torch.randint(3, (4,)))
    with pytest.raises(ValueError, match="CUDA"):
        L.Trainer(nn.Linear(4, 3), L.TrainConfig(compile="reduce-overhead"), device="cpu")
    with pytest.raises(TypeError):
        L.Trainer(nn.Linear(4, 3), {"amp": "bf16"}, device="cpu")


# ----------------------------------------------------------------------------- FLOPs, ceilings

def test_count_step_flops_matches_the_formula_and_leaves_the_model_alone():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = copy.deepcopy(model.state_dict())
    n = 10
    x, y = torch.randn(n, 8), torch.randint(4, (n,))
    flops = L.count_step_flops(model, x, y)
    # forward 2N(8*16 + 16*4); backward: layer 2 dW and dX (2 x 2N*16*4), layer 1 dW only
    assert flops == 2 * n * (8 * 16 + 16 * 4) + 4 * n * 16 * 4 + 2 * n * 8 * 16
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("seq_len", [TINY.block_size, TINY.block_size // 2])
@pytest.mark.parametrize("sdpa", [False, True])
def test_counted_flops_are_6n_plus_full_attention_less_the_1d_parameters(sdpa, seq_len):
    """The counter (the capstone's MFU numerator) against utils.flops.gpt_flops, to the FLOP:
    every matmul forward and backward plus attention over the full T x T square is 6N+attn
    (nanoGPT's convention) less 6 FLOPs per token for each bias and LayerNorm parameter, which
    6N counts as if it were a matmul weight."""
    cfg = dataclasses.replace(TINY, n_layer=2)
    model = L.gpt_model_fn(cfg, seed=0)(L.TrainConfig(sdpa=sdpa))
    x, y = utils.lm_batch(cfg, 4, device="cpu", seed=0)
    x, y = x[:, :seq_len], y[:, :seq_len]
    counted = L.count_step_flops(model, x, y, num_classes=cfg.vocab_size)
    gf = utils.flops.gpt_flops(cfg, seq_len=seq_len)
    d, layers = cfg.n_embd, cfg.n_layer
    n_1d = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    assert n_1d == layers * 13 * d + 2 * d  # qkv, proj, fc, fc2 biases + two LayerNorms; ln_f
    assert gf.n_params == utils.count_parameters(model) - model.pos_emb.weight.numel()
    tokens = x.numel()
    assert counted == tokens * (6 * (gf.n_params - n_1d) + 12 * layers * d * seq_len)
    assert counted == tokens * (gf.per_token("6N+attn") - 6 * n_1d)


def test_measure_ceilings_tflops_on_cpu(monkeypatch):
    ceil = L.measure_ceilings_tflops(("fp32", "tf32", "bf16"), "cpu", n=64,
                                     min_run_time_s=0.02, rounds=2)
    assert set(ceil) == {"fp32", "tf32", "bf16"} and all(v > 0 for v in ceil.values())
    # no TF32 on a CPU: the tf32 matmul is the fp32 one, measured once, the same ceiling
    assert not L.tf32_exists("cpu") and ceil["tf32"] == ceil["fp32"]
    calls = []

    def fake(dev, dtype, n, min_run_time_s):
        calls.append((dtype, n))
        return 1.0 + len(calls)

    monkeypatch.setattr(L, "measure_matmul_tflops", fake)
    out = L.measure_ceilings_tflops(("tf32",), "cpu", quick=True, rounds=2)
    assert list(out) == ["tf32"] and out["tf32"] == 3.0, "fp32 measured for it, best round kept"
    assert calls == [(torch.float32, L.QUICK_CEILING_N_CPU)] * 2
    calls.clear()
    L.measure_ceilings_tflops(("bf16",), "cpu", rounds=1)
    assert calls == [(torch.bfloat16, None)], "not quick: utils.measure_matmul_tflops' defaults"
    assert L.ceiling_matmul_size("cpu", quick=False) is None
    with pytest.raises(ValueError, match="kinds"):
        L.measure_ceilings_tflops(("fp64",), "cpu", n=64)
    with pytest.raises(ValueError, match="rounds"):
        L.measure_ceilings_tflops(("fp32",), "cpu", n=64, rounds=0)


# ----------------------------------------------------------------------------- the runner

CEIL = {"fp32": 0.05, "tf32": 0.05, "bf16": 0.05, "fp16": 0.05}


def test_run_ladder_eager_rungs_and_a_cuda_rung_skipped_on_cpu(capsys):
    fn = L.gpt_model_fn(TINY, seed=0)
    base = L.TrainConfig(accum_steps=2)
    flops = L.count_step_flops(fn(base), *tiny_batch(0), num_classes=TINY.vocab_size)
    rungs = (L.Rung("fp32 eager", {}), L.Rung("tf32", {"tf32": True}), L.Rung("bf16", {"amp": "bf16"}),
             L.Rung("graphs", {"compile": "reduce-overhead", "accum_steps": 1}, needs_cuda=True),
             L.Rung("sdpa", {"sdpa": True}))
    seen = []

    def predict(rung, cfg, prev):
        seen.append((rung.name, None if prev is None else prev.name, len(ran_before)))
        return L.predict_rung(cfg, prev, flops_per_step=flops, ceilings=CEIL,
                              attention_swap_ms=0.0)

    ran_before = []

    def batch(step):
        if step == 0:
            ran_before.append(step)  # a rung's first step: its prediction came before it
        return tiny_batch(step)

    results = L.run_ladder(fn, batch, steps=4, flops_per_step=flops, ceilings=CEIL,
                           base=base, rungs=rungs, device="cpu", num_classes=TINY.vocab_size,
                           lr=1e-2, warmup_steps=2, loss_window=2, min_run_time_s=0.05,
                           progress=False, profile=True, predict=predict)
    assert [r.name for r in results] == ["fp32 eager", "tf32", "bf16", "graphs", "sdpa"]
    # predicted before each rung that ran, from the last rung that ran, and kept with it
    assert seen == [("fp32 eager", None, 0), ("tf32", "fp32 eager", 1), ("bf16", "tf32", 2),
                    ("sdpa", "bf16", 3)]
    out = capsys.readouterr().out
    assert "fp32 eager, predicted before it runs: >= " in out and "FLOP bound" in out
    assert results[0].prediction.bound and results[0].predicted_ms == pytest.approx(
        results[0].flop_bound_ms)
    assert results[1].predicted_ms == pytest.approx(results[0].median_ms)  # no TF32: no gain
    assert results[3].prediction is None and results[4].predicted_ms == results[2].median_ms
    assert all(r.profile is not None and r.profile.kernels_per_step > 0
               for r in results if r.ran)
    # the SDPA rung names the kernel that ran, read from the profiler; the others none
    assert results[4].sdpa_backend == "FLASH_ATTENTION (CPU)" and "cpu" in results[4].sdpa_run
    assert not any(r.sdpa_backend for r in results[:4])
    skipped = results[3]
    assert not skipped.ran and "CUDA" in skipped.skipped_reason
    assert "SKIPPED" in out
    # the rung after a skipped one builds on the last rung that ran
    assert results[4].config == L.TrainConfig(tf32=True, amp="bf16", sdpa=True, accum_steps=2)
    # TF32 on a CPU: it runs, and says it is the same computation
    assert results[1].ran and "no TF32" in results[1].noop_reason
    assert results[1].losses == results[0].losses
    assert not any(r.noop_reason for r in results if r.name != "tf32")
    fp32 = results[0]
    assert fp32.ran and len(fp32.losses) == 4 and fp32.items_per_step == 8 * TINY.block_size
    assert fp32.items_per_s == pytest.approx(fp32.items_per_step / (fp32.median_ms / 1e3))
    assert fp32.mfu == pytest.approx(fp32.achieved_tflops / CEIL["fp32"])
    assert fp32.final_loss == pytest.approx(sum(fp32.losses[-2:]) / 2)
    assert fp32.peak_bytes > 0 and fp32.warmup_s > 0 and fp32.graphs_compiled == 0
    assert fp32.fx_cache_hits == 0 and fp32.first_loss == fp32.losses[0]
    # same weights, same batches: the first losses agree across rungs
    for r in (results[2], results[4]):
        assert r.losses[0] == pytest.approx(fp32.losses[0], rel=1e-3)
    assert skipped.items_per_s is None and skipped.mfu is None and skipped.final_loss is None
    table = L.ladder_table(results, ("bf16", CEIL["bf16"]))
    assert "not run here" in table and "vs bf16" in table and "no-op here" in table
    assert "predicted" in table and ">=" in table.splitlines()[1]
    assert "SDPA ran FLASH_ATTENTION (CPU)" in table.splitlines()[-1]
    assert "sheet" not in table
    sheet = L.ladder_table(results, datasheet={"fp32": CEIL["fp32"] * 2, "bf16": None})
    assert "sheet" in sheet.splitlines()[0]
    assert f"{results[0].mfu / 2:.1%}" in sheet.splitlines()[1]      # against twice the ceiling
    assert sheet.splitlines()[3].split()[9] == "-"                     # bf16: no datasheet figure
    baseline_row = table.splitlines()[1]
    assert "-x" not in baseline_row and " 1.00x " in baseline_row
    assert {"ms/step", "this", "warm-up"} <= set(L.TABLE_COLUMNS)
    fig = L.plot_ladder(results, reference=("bf16", CEIL["bf16"]), drift=0.05, loss_tol=0.02)
    assert len(fig.axes) == 4
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "1" in labels and len(labels) >= 2, labels
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_run_rung_compiled_counts_one_graph():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 8, generator=g), torch.randint(4, (8,), generator=g)

    r = L.run_rung("compiled", L.TrainConfig(compile="default", accum_steps=2),
                   lambda cfg: copy.deepcopy(model), batch, steps=3, flops_per_step=1000,
                   ceilings=CEIL, device="cpu", num_classes=4, min_run_time_s=0.02,
                   item_name="row")
    assert r.ran and r.graphs_compiled == 1 and len(r.losses) == 3
    assert isinstance(r.fx_cache_hits, int) and 0 <= r.fx_cache_hits <= 2  # forward, backward
    assert r.peak_bytes is None and "not measured" in r.memory_method  # CPU tracker: eager only
    assert r.items_per_step == 8 and r.item_name == "row"


def _tiny_mlp_batch(step, rows=8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randint(4, (rows,), generator=g)


_TORCH_COMPILE = torch.compile


def _compile_with(monkeypatch, backend):
    """Make the Trainer's torch.compile use ``backend`` (fast, no code generation)."""
    monkeypatch.setattr(torch, "compile",
                        lambda model, mode=None, dynamic=None: _TORCH_COMPILE(
                            model, backend=backend, dynamic=dynamic))


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def test_graph_count_catches_a_break_a_late_recompile_and_a_silent_eager_fallback(monkeypatch):
    """The capstone claims one Dynamo graph per compiled rung, at most and at least: the count
    must see a graph break, a recompile during the timing (the old window ended before it),
    and a backend failure that torch.compile suppresses (eager speed, no graph)."""
    _compile_with(monkeypatch, "eager")
    kw = dict(steps=2, flops_per_step=1000, ceilings=CEIL, device="cpu", num_classes=4,
              min_run_time_s=0.01, item_name="row")
    cfg = L.TrainConfig(compile="default")
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    one = L.run_rung("one", cfg, lambda c: copy.deepcopy(mlp), _tiny_mlp_batch, **kw)
    assert one.graphs_compiled == 1
    broken = L.run_rung("break", cfg, lambda c: _Breaks(), _tiny_mlp_batch, **kw)
    assert broken.graphs_compiled >= 2
    # the timed batch (step `steps`) has another shape: dynamic=False compiles again
    late = L.run_rung("late", cfg, lambda c: copy.deepcopy(mlp),
                      lambda step: _tiny_mlp_batch(step, rows=8 if step < 2 else 6), **kw)
    assert late.graphs_compiled == 2

    def failing_backend(gm, example_inputs):
        raise RuntimeError("a backend that cannot compile")

    _compile_with(monkeypatch, failing_backend)
    with torch._dynamo.config.patch(suppress_errors=True):
        fallback = L.run_rung("fallback", cfg, lambda c: copy.deepcopy(mlp), _tiny_mlp_batch, **kw)
    assert fallback.ran and all(math.isfinite(v) for v in fallback.losses)
    assert fallback.graphs_compiled == 0, "an eager fallback compiles no graph"


def _profile(wall=100.0, matmul=60.0, other=20.0, busy=90.0, kernels=800.0):
    from utils.compiletools import StepProfile
    return StepProfile("p", "GPU kernels", 1, kernels, {"matmul": kernels / 2},
                       busy, {"matmul": matmul, "attention": 0.0, "optimizer": 5.0,
                              "copy": 0.0, "other": other}, wall, 1.0)


def _ran(cfg, ms=100.0, profile=None, flops=1e12, ceilings=None):
    ceilings = ceilings or {"fp32": 10.0, "tf32": 80.0, "bf16": 160.0}
    return L.RungResult("prev", cfg, ran=True, median_ms=ms, items_per_step=1,
                        flops_per_step=int(flops), ceiling_kind=cfg.ceiling_kind,
                        ceiling_tflops=ceilings[cfg.ceiling_kind], profile=profile)


def test_predict_rung_models_by_hand():
    ceil = {"fp32": 10.0, "tf32": 80.0, "bf16": 160.0}
    kw = dict(flops_per_step=1e12, ceilings=ceil)
    base = L.TrainConfig(accum_steps=4)
    # the baseline: a bound, FLOPs / ceiling (1e12 FLOP at 10 TFLOP/s: 100 ms)
    p = L.predict_rung(base, None, **kw)
    assert p.bound and p.ms == pytest.approx(100.0) and str(p).startswith(">= 100 ms/step")
    # TF32: Amdahl over the profiled matmul share, 60 of 100 ms, sped up 8x
    prev = _ran(base, profile=_profile())
    p = L.predict_rung(dataclasses.replace(base, tf32=True), prev, **kw)
    assert not p.bound and p.ms == pytest.approx(100 - 60 * (1 - 10 / 80)) and "Amdahl" in p.model
    # without a profile the share is the MFU: 1e12 FLOP in 200 ms at 10 TFLOP/s is 50%
    p = L.predict_rung(dataclasses.replace(base, tf32=True), _ran(base, ms=200.0), **kw)
    assert p.ms == pytest.approx(200 - 100 * (1 - 10 / 80))
    # bf16 from TF32: the ratio of those two ceilings
    tf32 = dataclasses.replace(base, tf32=True)
    p = L.predict_rung(dataclasses.replace(tf32, amp="bf16"), _ran(tf32, profile=_profile()), **kw)
    assert p.ms == pytest.approx(100 - 60 * (1 - 80 / 160))
    # SDPA: the two attentions timed alone by the caller; without them, no prediction
    assert L.predict_rung(dataclasses.replace(base, sdpa=True), prev, **kw) is None
    p = L.predict_rung(dataclasses.replace(base, sdpa=True), prev, attention_swap_ms=30.0, **kw)
    assert p.ms == pytest.approx(70.0)
    p = L.predict_rung(dataclasses.replace(base, sdpa=True), prev, attention_swap_ms=-5.0, **kw)
    assert p.ms == pytest.approx(105.0) and "+ 5 ms" in p.formula
    # one micro-batch instead of 4: 3/4 of 800 launches at 5 us = 3 ms, under 10 ms idle
    one = dataclasses.replace(base, accum_steps=1)
    p = L.predict_rung(one, prev, launch_us=5.0, **kw)
    assert p.ms == pytest.approx(100 - 0.75 * 800 * 5e-3)
    busy = _ran(base, profile=_profile(busy=99.0))       # a busy device hides its launches
    assert L.predict_rung(one, busy, launch_us=5.0, **kw).ms == pytest.approx(99.0)
    assert L.predict_rung(one, prev, **kw) is None       # no launch cost measured
    # compile: half the elementwise kernels' 20 of 100 ms (the assumption, FUSION_SAVES)
    p = L.predict_rung(dataclasses.replace(one, compile="default"), _ran(one, profile=_profile()),
                       **kw)
    assert p.ms == pytest.approx(100 - L.FUSION_SAVES * 20) and "assumed" in p.formula
    # CUDA graphs after a compiled rung: 800 launches x 5 us = 4 ms, at most the idle 10 ms
    comp = dataclasses.replace(one, compile="default")
    p = L.predict_rung(dataclasses.replace(comp, compile="reduce-overhead"),
                       _ran(comp, profile=_profile()), launch_us=5.0, **kw)
    assert p.ms == pytest.approx(96.0)
    # fused AdamW: (80 - 28) B x 1e6 parameters at 100 GB/s = 0.52 ms
    p = L.predict_rung(dataclasses.replace(comp, fused_adamw=True), _ran(comp), copy_gbs=100.0,
                       n_params=10**6, **kw)
    assert p.ms == pytest.approx(100 - 1e6 * 52 / 100e9 * 1e3)
    assert L.ADAMW_BYTES_PER_PARAM == {"foreach": 80, "fused": 28}
    # padding: the extra rows' FLOPs at the ceiling (1e9 FLOP at 10 TFLOP/s: 0.1 ms more)
    p = L.predict_rung(dataclasses.replace(comp, vocab_multiple=128), _ran(comp),
                       extra_flops_per_step=1e9, **kw)
    assert p.ms == pytest.approx(100.1)
    # two kinds of change at once have no model; an unknown ceiling is an error
    assert L.predict_rung(dataclasses.replace(base, sdpa=True, accum_steps=1), prev,
                          attention_swap_ms=1.0, launch_us=5.0, **kw) is None
    with pytest.raises(ValueError, match="ceiling"):
        L.predict_rung(L.TrainConfig(amp="fp16"), None, **kw)
    with pytest.raises(ValueError, match="finite"):
        L.Prediction(float("nan"), "x", "y")


def test_run_rung_argument_errors():
    fn = L.gpt_model_fn(TINY)
    kw = dict(flops_per_step=1, device="cpu")
    with pytest.raises(ValueError, match="ceiling"):
        L.run_rung("x", L.TrainConfig(amp="bf16"), fn, tiny_batch, steps=2, ceilings={"fp32": 1.0},
                   **kw)
    with pytest.raises(ValueError, match="loss_window"):
        L.run_rung("x", L.TrainConfig(), fn, tiny_batch, steps=2, ceilings=CEIL, loss_window=3,
                   **kw)
    with pytest.raises(ValueError, match="steps"):
        L.run_rung("x", L.TrainConfig(), fn, tiny_batch, steps=0, ceilings=CEIL, **kw)
    with pytest.raises(ValueError, match="unique"):
        L.run_ladder(fn, tiny_batch, steps=1, ceilings=CEIL, rungs=(L.Rung("a", {}),
                                                                    L.Rung("a", {})), **kw)
    with pytest.raises(ValueError, match="reference"):
        L.ladder_table([L.RungResult("a", L.TrainConfig(), ran=False)], ("bf16", 0.0))


# ----------------------------------------------------------------------------- verdicts, ticks

def _result(name: str, ms: float, iqr: float = 0.0, noop: str = "", ran: bool = True):
    return L.RungResult(name, L.TrainConfig(), ran=ran, median_ms=ms if ran else None,
                        iqr_ms=iqr if ran else None, items_per_step=10, noop_reason=noop,
                        losses=(1.0,), skipped_reason="" if ran else "needs CUDA")


def test_rung_verdicts_read_changes_against_the_noise():
    results = [_result("base", 100.0, iqr=1.0), _result("same", 100.0, noop="no TF32 here"),
               _result("faster", 80.0), _result("noisy", 75.0, iqr=15.0),
               _result("slower", 100.0), _result("graphs", 0, ran=False), _result("flat", 98.0)]
    v = {x.name: x for x in L.rung_verdicts(results, floor=0.03)}
    assert v["base"].verdict == "baseline" and v["base"].factor is None
    assert v["same"].verdict == "no-op here"
    assert v["faster"].verdict == "pays" and v["faster"].factor == pytest.approx(1.25)
    # 80 -> 75 ms is x1.07, but the rung's own spread is 20%: not a result
    assert v["noisy"].verdict == "does not pay" and v["noisy"].band == pytest.approx(0.2)
    assert v["slower"].verdict == "slower" and v["slower"].band == pytest.approx(0.2)  # 75 -> 100
    assert v["graphs"].verdict == "not run" and v["graphs"].factor is None
    # the rung after one that did not run is read against the last rung that ran
    assert v["flat"].verdict == "does not pay" and v["flat"].factor == pytest.approx(100 / 98)
    # a drift of the baseline over the run widens every band
    v = {x.name: x for x in L.rung_verdicts(results, floor=0.03, drift=0.3)}
    assert v["faster"].verdict == "does not pay" and v["faster"].band == pytest.approx(0.3)
    with pytest.raises(ValueError, match="baseline"):
        L.rung_verdicts([_result("graphs", 0, ran=False)])
    with pytest.raises(ValueError, match="drift"):
        L.rung_verdicts(results, drift=-0.1)


def test_log_ticks_are_round_and_include_one():
    assert L._log_ticks(0.86, 1.7) == [0.9, 1.0, 1.1, 1.25, 1.5]
    many = L._log_ticks(0.05, 200)
    assert 1.0 in many and len(many) <= 10 and many == sorted(many)
    assert L._log_ticks(0.97, 1.03) == [1.0]


def test_weight_decay_only_on_matrices():
    model = utils.TinyGPT(utils.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2,
                                          n_embd=16))
    trainer = L.Trainer(model, L.TrainConfig(), device="cpu", weight_decay=0.1)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    named = dict(model.named_parameters())
    assert any(p is named["tok_emb.weight"] for p in decay["params"])      # the tied embedding
    assert any(p is named["blocks.0.ln1.weight"] for p in no_decay["params"])
    assert any(p is named["blocks.0.attn.qkv.bias"] for p in no_decay["params"])
    # every parameter once (the head's weight is the embedding's)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(named)
    with pytest.raises(ValueError, match="weight_decay"):
        L.decay_groups(model, -1.0)


# ----------------------------------------------------------------------------- beyond the ladder

def test_loss_fp8_and_the_bounded_autotune_mode_as_settings_and_flags():
    with pytest.raises(ValueError, match="loss"):
        L.TrainConfig(loss="fused")
    with pytest.raises(TypeError, match="fp8"):
        L.TrainConfig(fp8="yes")
    with pytest.raises(ValueError, match="169545"):  # the course's mode records CUDA graphs too
        L.TrainConfig(compile="max-autotune-gemm", accum_steps=2)
    assert L.TrainConfig(compile="max-autotune-gemm").uses_cuda_graphs
    assert L.TrainConfig(amp="bf16", fp8=True).ceiling_kind == "bf16"
    plain, extra = L.TrainConfig(), L.TrainConfig(loss="chunked", fp8=True)
    assert "chunked linear + cross-entropy" in extra.describe() and "FP8" in extra.describe()
    assert "chunked" not in plain.describe() and "FP8" not in plain.describe()
    parser = argparse.ArgumentParser()
    L.TrainConfig.add_arguments(parser)
    cfg = L.TrainConfig(amp="bf16", compile="max-autotune-gemm", loss="chunked", fp8=True)
    assert L.TrainConfig().with_args(parser.parse_args(cfg.to_flags())) == cfg
    assert cfg.with_args(parser.parse_args(["--loss", "plain", "--no-fp8"])) == \
        dataclasses.replace(cfg, loss="plain", fp8=False)
    # torch's modes by name, the course's as options that this torch's Inductor knows
    assert L.compile_kwargs("max-autotune") == {"mode": "max-autotune"}
    assert L.compile_kwargs("max-autotune-gemm") == {
        "options": {"max_autotune_gemm": True, "triton.cudagraphs": True}}
    # reduce-overhead-tuned: max-autotune's options less the matmul autotuning, so the same
    # CUDA graphs as reduce-overhead and the tuning of the kernels Inductor writes
    tuned = L.compile_kwargs("reduce-overhead-tuned")["options"]
    ma = torch._inductor.list_mode_options("max-autotune")
    ro = torch._inductor.list_mode_options("reduce-overhead")
    assert tuned == {k: v for k, v in ma.items() if k != "max_autotune"}
    assert ro.items() <= tuned.items() and tuned["coordinate_descent_tuning"] is True
    assert L.TrainConfig(compile="reduce-overhead-tuned").uses_cuda_graphs
    with pytest.raises(ValueError, match="169545"):
        L.TrainConfig(compile="reduce-overhead-tuned", accum_steps=2)
    for mode in L.TRAIN_COMPILE_MODES:
        torch.compile(nn.Linear(2, 2), **L.compile_kwargs(mode))  # unknown options raise here
    with pytest.raises(ValueError, match="max-autotune-gemm"):
        L.compile_kwargs("fastest")
    assert "max-autotune-gemm" not in L.COMPILE_MODES, "torch.compile(mode=...) does not know it"


def _loss_and_grads(model, loss_module, x, y):
    model.zero_grad(set_to_none=True)
    loss = loss_module(x, y)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("vocab_multiple", [1, 64])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(vocab_multiple):
    """The chunked rung computes the same function: the loss and every gradient, fp32 and under
    bf16 autocast, with a padded vocabulary too (the loss sees the real classes only)."""
    fn = L.gpt_model_fn(TINY, seed=1)
    model = fn(L.TrainConfig(sdpa=True, vocab_multiple=vocab_multiple))
    x, y = tiny_batch(2)
    with torch.no_grad():  # the head's input, exactly as TinyGPT's forward computes it
        torch.testing.assert_close(model.head(L.gpt_hidden_states(model, x)), model(x),
                                   rtol=0, atol=0)
    for dtype in (torch.float32, torch.bfloat16):
        amp = (torch.autocast("cpu", dtype=dtype) if dtype != torch.float32
               else contextlib.nullcontext())
        with amp:
            plain = _loss_and_grads(model, L.LossModule(model, TINY.vocab_size), x, y)
            chunked = _loss_and_grads(model, L.LossModule(model, TINY.vocab_size, loss="chunked"),
                                      x, y)
        for a, e in zip(chunked, plain):
            torch.testing.assert_close(a, e, **utils.tolerance(dtype, "cpu", scale=e).kwargs())
    if vocab_multiple > 1:  # the padded rows get no gradient, as in the plain loss
        assert model.tok_emb.weight.grad[TINY.vocab_size:].abs().max().item() == 0.0
    # the negative control: chunks over the padded rows put their (zero) logits in the softmax
    uncut = L.LossModule(model, model.head.out_features, loss="chunked")(x, y)
    if vocab_multiple > 1:
        assert (uncut - plain[0]).item() > 0.5 * math.log(64 / TINY.vocab_size)
    with pytest.raises(ValueError, match="TinyGPT-like"):
        L.LossModule(nn.Linear(4, 3), loss="chunked")
    with pytest.raises(ValueError, match="num_classes"):
        utils.chunked_linear_cross_entropy(torch.randn(4, 16), model.head.weight,
                                           torch.zeros(4, dtype=torch.long), chunk_tokens=2,
                                           num_classes=model.head.out_features + 1)
    with pytest.raises(ValueError, match="loss"):
        L.LossModule(model, TINY.vocab_size, loss="fused")


def test_a_chunked_step_equals_a_plain_step_and_compiles_to_one_graph():
    """A training step with the chunked loss (two micro-batches) gives the plain step's loss and
    gradients; the compiled chunked step is one Dynamo graph (aot_eager: Dynamo and AOTAutograd
    trace the chunk loop and its custom backward, without generating code, which takes minutes
    on a CPU)."""
    fn = L.gpt_model_fn(TINY, seed=0)
    after = {}
    for loss in L.LOSSES:
        cfg = L.TrainConfig(sdpa=True, accum_steps=2, loss=loss)
        trainer = L.Trainer(fn(cfg), cfg, device="cpu", num_classes=TINY.vocab_size, lr=1e-2)
        mean_loss = trainer.step(*tiny_batch(0))  # the gradients stay in .grad after the step
        after[loss] = [mean_loss] + [p.grad.clone() for p in trainer.model.parameters()]
    for a, e in zip(after["chunked"], after["plain"]):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu", scale=e).kwargs())
    # compiled (a padded vocabulary: its rows masked in the chunks): one graph, and the same loss
    # and gradients as eager
    model = fn(L.TrainConfig(sdpa=True, vocab_multiple=64))
    module = L.LossModule(model, TINY.vocab_size, loss="chunked")
    x, y = tiny_batch(1)
    eager = _loss_and_grads(model, module, x, y)
    torch.compiler.reset()
    before = L._graphs_compiled()
    compiled = _loss_and_grads(model, torch.compile(module, backend="aot_eager", dynamic=False),
                               x, y)
    assert L._graphs_compiled() - before == 1, "the chunk loop must not break the graph"
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu", scale=e).kwargs())
    torch.compiler.reset()


def _saved_for_backward(loss_module, x, y):
    """The loss, and the (dtype, shape) of every tensor autograd saved for its backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_module(x, y)
    return loss, saved


@pytest.mark.parametrize("loss", L.LOSSES)
def test_a_bf16_residual_stream_halves_what_the_stream_saves_and_keeps_the_loss(loss):
    """bf16_residual: the stream between the blocks is bf16, so no fp32 tensor of the stream's
    shape is saved for backward (under autocast alone, the layer norms' fp32 inputs are); the
    loss and the gradients stay within bf16's rounding of the fp32 stream's. Compiled, the same,
    and torch.compile guards on the setting: a second LossModule with it, compiled without a
    reset, does not reuse the first one's graph (a forward hook would have been reused)."""
    with pytest.raises(ValueError, match="amp='bf16'"):
        L.TrainConfig(bf16_residual=True)
    with pytest.raises(ValueError, match="amp='bf16'"):
        L.TrainConfig(amp="fp16", bf16_residual=True)
    with pytest.raises(TypeError, match="bf16_residual"):
        L.TrainConfig(amp="bf16", bf16_residual=1)
    cfg = L.TrainConfig(amp="bf16", sdpa=True, loss=loss, bf16_residual=True)
    assert "bf16 residual stream" in cfg.describe()
    assert "residual" not in dataclasses.replace(cfg, bf16_residual=False).describe()
    parser = argparse.ArgumentParser()
    L.TrainConfig.add_arguments(parser)
    assert L.TrainConfig().with_args(parser.parse_args(cfg.to_flags())) == cfg
    with pytest.raises(ValueError, match="TinyGPT-like"):
        L.LossModule(nn.Linear(4, 3), residual_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="floating-point"):
        L.LossModule(utils.TinyGPT(TINY), residual_dtype=torch.int8)
    long = torch.zeros(1, TINY.block_size + 1, dtype=torch.long)  # refused as TinyGPT refuses it
    with pytest.raises(ValueError, match="exceeds"):
        L.LossModule(utils.TinyGPT(TINY), residual_dtype=torch.bfloat16)(long, long)
    with pytest.raises(ValueError, match=r"\(batch, time\)"):
        L.gpt_hidden_states(utils.TinyGPT(TINY), long[0])

    model = L.gpt_model_fn(TINY, seed=2)(cfg)
    x, y = tiny_batch(3)
    rows = x.numel()
    results = {}
    for compiled in (False, True):
        torch.compiler.reset()
        for dtype in (None, torch.bfloat16):  # the second compiled without a reset between
            module = L.LossModule(model, TINY.vocab_size, loss=loss, residual_dtype=dtype)
            run = torch.compile(module, backend="aot_eager", dynamic=False) if compiled else module
            model.zero_grad(set_to_none=True)
            value, saved = _saved_for_backward(run, x, y)
            value.backward()
            stream = [(d, s) for d, s in saved if s and s[-1] == TINY.n_embd
                      and math.prod(s[:-1]) == rows]  # (B, T, C) or (B * T, C)
            stream_fp32 = [s for d, s in stream if d == torch.float32]
            stream_bf16 = [s for d, s in stream if d == torch.bfloat16]
            results[compiled, dtype] = [value.detach()] + [p.grad.clone()
                                                           for p in model.parameters()]
            if dtype is None:  # autocast alone: the layer norms' inputs are saved in fp32
                assert len(stream_fp32) >= 2 * TINY.n_layer, saved
            else:
                assert stream_fp32 == [] and len(stream_bf16) >= 2 * TINY.n_layer, saved
    torch.compiler.reset()
    for compiled in (False, True):
        base, cast = results[compiled, None], results[compiled, torch.bfloat16]
        assert not torch.equal(base[0], cast[0]), "the cast must change the rounding"
        torch.testing.assert_close(cast[0], base[0], rtol=1e-3, atol=0)
        for a, e in zip(cast[1:], base[1:]):  # within bf16's rounding (8 bits of mantissa)
            assert ((a - e).norm() / e.norm().clamp_min(1e-12)).item() < 2 ** -5
    for a, e in zip(results[True, torch.bfloat16], results[False, torch.bfloat16]):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.bfloat16, "cpu", scale=e).kwargs())


def test_compiled_a_bf16_stream_is_saved_in_bf16_under_cudas_rule_for_layer_norms(monkeypatch):
    """CUDA's autocast runs layer_norm in fp32: it casts a bf16 input up, and eagerly that fp32
    copy is what layer_norm saves for backward, so there the bf16 stream saves nothing. Compiled
    by Inductor (as the rung always is on a GPU), the bf16 input is saved and cast again in
    backward. A CPU's autocast leaves layer_norm in its input's dtype, so CUDA's rule is applied
    here by hand."""
    original = F.layer_norm

    def cudas_rule(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        with torch.autocast("cpu", enabled=False):
            return original(input.float(), normalized_shape, weight, bias, eps)

    monkeypatch.setattr(F, "layer_norm", cudas_rule)
    model = L.gpt_model_fn(TINY, seed=4)(L.TrainConfig(sdpa=True))
    x, y = tiny_batch(5)
    dtypes = {}
    for compiled in (False, True):
        for dtype in (None, torch.bfloat16):
            torch.compiler.reset()
            module = L.LossModule(model, TINY.vocab_size, residual_dtype=dtype)
            run = torch.compile(module, dynamic=False) if compiled else module
            loss, saved = _saved_for_backward(run, x, y)
            loss.backward()
            dtypes[compiled, dtype] = {d for d, s in saved if s and s[-1] == TINY.n_embd
                                       and math.prod(s[:-1]) == x.numel()}
    torch.compiler.reset()
    # (B, T, C)-shaped tensors saved in bf16 are there in every case: the matmuls' bf16 inputs
    assert torch.float32 in dtypes[False, None] and torch.float32 in dtypes[True, None]
    assert torch.float32 in dtypes[False, torch.bfloat16], "eagerly, the up-cast copy is saved"
    assert torch.float32 not in dtypes[True, torch.bfloat16], dtypes


GPT2 = dict(block_size=1024, n_layer=12, n_head=12, n_embd=768)


@pytest.mark.parametrize("vocab", [8257, 50304])
def test_fp8_filter_picks_the_blocks_linears_of_gpt2_and_leaves_the_head(vocab):
    with torch.device("meta"):  # no memory: only the modules' shapes are read
        model = utils.TinyGPT(utils.GPTConfig(vocab_size=vocab, **GPT2))
    names = L.fp8_linear_names(model)
    per_block = ["attn.qkv", "attn.proj", "mlp.0", "mlp.2"]
    assert names == [f"blocks.{i}.{n}" for i in range(12) for n in per_block]
    keep = L.fp8_module_filter(model)
    assert not keep(model.head, "head"), "the tied output head stays in the autocast dtype"
    assert not keep(model.tok_emb, "tok_emb") and not keep(model.ln_f, "ln_f")
    # a width that is not a multiple of 16 leaves every layer out (torch._scaled_mm needs it)
    with torch.device("meta"):
        odd = utils.TinyGPT(utils.GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=5,
                                            n_embd=200))
    assert L.fp8_linear_names(odd) == []


def test_fp8_filter_leaves_out_heads_by_name_and_by_a_tied_embedding():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.body = nn.Linear(32, 32)
            self.odd = nn.Linear(32, 24)
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.out = nn.Linear(32, 64, bias=False)
            self.out.weight = self.emb.weight  # tied under a name no rule knows

    assert L.fp8_linear_names(Net()) == ["body"]


def test_fp8_is_refused_where_it_cannot_pay_with_the_reason(monkeypatch):
    assert "8.9" in L.fp8_unavailable_reason("cpu") and "CPU" in L.fp8_unavailable_reason("cpu")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(L, "pick_device", lambda device=None: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "A100-SXM4-80GB is sm80" in L.fp8_unavailable_reason("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def missing():
        raise ModuleNotFoundError("No module named 'torchao'")

    monkeypatch.setattr(L, "_torchao_float8", missing)
    reason = L.fp8_unavailable_reason("cuda")
    assert "torchao" in reason and "bundle-wheels.sh torchao" in reason and "\n" not in reason
    monkeypatch.setattr(L, "_torchao_float8", lambda: object())
    assert L.fp8_unavailable_reason("cuda") == ""


def test_fp8_trainer_converts_the_filtered_layers_and_steps_on_the_cpu():
    """torch emulates the FP8 matmuls on a CPU (slowly): enough to check the plumbing and that
    the loss stays that of the same model (e4m3 keeps 3 mantissa bits: a few % per value)."""
    pytest.importorskip("torchao.float8")
    fn = L.gpt_model_fn(TINY, seed=0)
    x, y = tiny_batch(0)
    cfg = L.TrainConfig(amp="bf16", sdpa=True)
    ref = L.Trainer(fn(cfg), cfg, device="cpu", num_classes=TINY.vocab_size).step(x, y)
    f8 = L.Trainer(fn(cfg), dataclasses.replace(cfg, fp8=True), device="cpu",
                   num_classes=TINY.vocab_size)
    assert f8.fp8_layers == L.fp8_linear_names(fn(cfg)) and len(f8.fp8_layers) == 4
    assert type(f8.model.blocks[0].mlp[0]).__name__ == "Float8Linear"
    assert type(f8.model.head) is nn.Linear and f8.model.head.weight is f8.model.tok_emb.weight
    loss = f8.step(x, y)
    assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
    # a checkpoint of the FP8 model loads into the plain one: the same parameter names
    plain = fn(cfg)
    plain.load_state_dict(f8.model.state_dict())
