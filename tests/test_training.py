"""utils.training: the shared training step, batches and first-call timing."""

import time

import pytest
import torch

import utils


def test_lm_batch_shapes_and_shift():
    cfg = utils.GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16)
    x, y = utils.lm_batch(cfg, 3, device="cpu", seed=1)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.is_contiguous() and y.is_contiguous()
    one, _ = utils.lm_batch(cfg, 1, device="cpu")
    assert one.stride() == (16, 1)  # row-major even for a batch of 1  # targets are the inputs shifted by one
    x2, _ = utils.lm_batch(cfg, 3, device="cpu", seed=1)
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="seq_len"):
        utils.lm_batch(cfg, 2, seq_len=17, device="cpu")


def test_train_step_lowers_loss_for_both_models():
    torch.manual_seed(0)
    cfg = utils.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    for model, (x, y) in ((utils.TinyGPT(cfg), utils.lm_batch(cfg, 4, device="cpu")),
                          (utils.SmallCNN(width=4), utils.image_batch(8, device="cpu"))):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [utils.train_step(model, opt, x, y).item() for _ in range(15)]
        assert losses[-1] < losses[0] * 0.9, losses


def test_train_step_autocast_and_scaler_on_cpu():
    torch.manual_seed(0)
    model = utils.MLP(in_features=12, hidden=16, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 12), torch.randint(10, (8,))
    loss = utils.train_step(model, opt, x, y, amp_dtype=torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = [p.detach().clone() for p in model.parameters()]
    utils.train_step(model, opt, x, y, scaler=scaler)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="amp_dtype"):
        utils.train_step(model, opt, x, y, amp_dtype=torch.float64)


def test_first_call_s_measures_the_call():
    assert 0.04 <= utils.first_call_s(time.sleep, 0.05, device="cpu") < 0.5
    with pytest.raises(TypeError):
        utils.first_call_s(3)


def test_attached_ops_names_what_takes_a_tensor_still_on_its_graph():
    """utils.AttachedOps (00/04's Exercise 1 check): a sum of losses that keep their graphs is
    named; detach, .data, no_grad and the paused training step are not."""
    w = torch.randn(3, requires_grad=True)

    def step():
        loss = (w * 2).sum()
        loss.backward()
        return loss

    def run(accumulate):
        watch = utils.AttachedOps()
        watched_step = watch.unwatched(step)
        with watch:
            total = torch.zeros(())
            for _ in range(2):
                total = accumulate(total, watched_step())
        return watch.names

    assert run(lambda t, loss: t.add_(loss.detach())) == []
    assert run(lambda t, loss: t.add_(loss.data)) == []
    with torch.no_grad():
        watch = utils.AttachedOps()
        with watch:
            torch.zeros(()) + w.sum()
    assert watch.names == [], "without grad mode nothing is recorded"
    assert run(lambda t, loss: t.add_(loss)) == ["add_", "add_"]
    assert "stack" in run(lambda t, loss: torch.stack([t, loss]).sum())  # a list argument
    watch = utils.AttachedOps()
    with watch:
        with watch.paused():
            w * 2
    assert watch.names == []
