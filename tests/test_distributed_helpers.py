"""utils.distributed.slowest_rank_timing and assert_grads_close (notebooks 05/01 and 05/06)."""

import pytest
import torch

import utils
import utils.distributed as ud


def test_slowest_rank_timing_takes_each_steps_slowest_rank():
    ranks = [{"amp": {"times_ms": {"bf16": [1.0, 5.0, 2.0]}}},
             {"amp": {"times_ms": {"bf16": [3.0, 1.0, 2.5]}}}]
    t = ud.slowest_rank_timing(ranks, ("amp", "times_ms", "bf16"), "2 x cpu (gloo)")
    assert isinstance(t, utils.Timing)
    assert t.label == "bf16"
    assert t.median_ms == 3.0  # the median of [3.0, 5.0, 2.5]
    assert t.device == "2 x cpu (gloo)"


def test_slowest_rank_timing_refuses_uneven_or_missing_steps():
    with pytest.raises(ValueError, match="different numbers of steps"):
        ud.slowest_rank_timing([{"t": [1.0, 2.0]}, {"t": [1.0]}], ("t",), "cpu")
    with pytest.raises(ValueError):
        ud.slowest_rank_timing([], ("t",), "cpu")
    with pytest.raises(KeyError):
        ud.slowest_rank_timing([{"t": [1.0]}], ("u",), "cpu")


def test_assert_grads_close_passes_reordered_sums_and_fails_a_wrong_gradient():
    torch.manual_seed(0)
    ref = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    # the same gradients summed in another order: fp32 rounding only
    parts = {n: [g * 0.25 for _ in range(4)] for n, g in ref.items()}
    reordered = {n: ((p[3] + p[2]) + p[1]) + p[0] for n, p in parts.items()}
    err = ud.assert_grads_close(reordered, ref, "reordered", "cpu")
    assert 0.0 <= err < 1e-5
    wrong = {**ref, "b": ref["b"] * (1 + 1e-3)}
    with pytest.raises(AssertionError, match="bad step, b"):
        ud.assert_grads_close(wrong, ref, "bad step", "cpu")
    with pytest.raises(AssertionError, match="names differ"):
        ud.assert_grads_close({"w": ref["w"]}, ref, "missing", "cpu")


def test_ddp_train_reference_grads_is_one_plain_step_on_the_global_batch():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "05-distributed" / "scripts" / "ddp_train.py"
    spec = importlib.util.spec_from_file_location("ddp_train", script)
    ddp_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_train)
    cfg = utils.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    loss, grads = ddp_train.reference_grads(cfg, 2, 3, torch.device("cpu"), init)
    x, y = utils.lm_batch(cfg, 2 * 3, device="cpu", seed=ddp_train.CHECK_SEED)  # 3 ranks x 2
    expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    assert grads.keys() == dict(model.named_parameters()).keys()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_assert_grads_close_fails_on_nan_dtype_and_shape():
    ref = {"w": torch.ones(4)}
    for bad in (torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.ones(4, dtype=torch.float64),
                torch.ones(2, 2)):
        with pytest.raises(AssertionError):
            ud.assert_grads_close({"w": bad}, ref, "bad", "cpu")


def _ranks(*per_rank_steps, key_value=(1.0, 2.0)):
    return [{"configs": {"a": {"step_ms_all": steps, "peak": v},
                         "b": {"step_ms_all": [2 * t for t in steps], "peak": v}}}
            for steps, v in zip(per_rank_steps, key_value)]


def test_worst_rank_value_is_the_largest_over_the_ranks():
    from utils.distributed import worst_rank_value

    assert worst_rank_value(_ranks([1, 2, 3], [1, 2, 3]), "a", "peak") == 2.0
    with pytest.raises(ValueError):
        worst_rank_value([], "a", "peak")


def test_step_stats_takes_the_slowest_rank_and_its_spread():
    from utils.distributed import step_stats

    median, spread = step_stats(_ranks([10, 10, 10, 10], [20, 20, 24, 20]), "a")
    assert median == 20 and spread > 0     # the slower rank's, with its spread
    with pytest.raises(ValueError, match="two step times"):
        step_stats(_ranks([10], [11]), "a")


def test_compare_step_times_says_whether_it_beats_the_noise():
    from utils.distributed import compare_step_times

    ratio, verdict = compare_step_times(_ranks([10, 10.1, 9.9, 10], [10, 10, 10, 10.2]), "a", "b")
    assert ratio == pytest.approx(2.0, rel=0.02) and verdict.startswith("slower by more")
    noisy = [{"configs": {"a": {"step_ms_all": [5, 10, 15, 10]},
                          "b": {"step_ms_all": [5, 11, 15, 11]}}}]
    ratio, verdict = compare_step_times(noisy, "a", "b")
    assert ratio == pytest.approx(1.1) and verdict.startswith("within the step-to-step spread")
