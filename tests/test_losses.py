"""utils.losses.chunked_linear_cross_entropy: the plain loss's values and gradients, in chunks,
without the logits-sized tensors."""

import math

import pytest
import torch
import torch.nn.functional as F

import utils
from utils.losses import chunked_linear_cross_entropy as chunked
from utils.memory import TensorMemoryTracker


def _problem(n=96, c=32, v=512, *, dtype=torch.float32, seed=0, shape=None, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, dtype=dtype)
    weight = (0.3 * torch.randn(v, c, generator=g)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = ignore  # some padding
    if shape is not None:
        hidden, targets = hidden.reshape(*shape, c), targets.reshape(shape)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _loss_and_grads(fn, hidden, weight):
    hidden.grad = weight.grad = None
    loss = fn()
    loss.backward()
    return [loss.detach(), hidden.grad.clone(), weight.grad.clone()]


def _excess(tol_of, actual, expected):
    return [tol_of(e).excess(a, e) for a, e in zip(actual, expected)]


@pytest.mark.parametrize("chunk", [1, 7, 32, 96, 1000])
def test_matches_plain_cross_entropy_in_fp32(chunk):
    hidden, weight, targets = _problem(shape=(4, 24))  # (batch, time, width), as a GPT's
    ref = _loss_and_grads(lambda: F.cross_entropy((hidden @ weight.T).flatten(0, 1),
                                                  targets.flatten()), hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=chunk),
                          hidden, weight)
    assert out[0].dtype == torch.float32 and out[1].shape == hidden.shape
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu",
                                                           scale=e).kwargs())


def test_matches_plain_cross_entropy_under_bf16_autocast():
    hidden, weight, targets = _problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets), hidden, weight)
        out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=16),
                              hidden, weight)
    assert out[0].dtype == torch.float32  # the loss in fp32, as F.cross_entropy's under autocast
    assert out[1].dtype == hidden.dtype and out[2].dtype == weight.dtype
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.bfloat16, "cpu",
                                                           scale=e).kwargs())
    # and bf16 really ran: the fp32 loss is not bit for bit the same
    fp32 = F.cross_entropy(hidden @ weight.T, targets).detach()
    assert out[0] != fp32


@pytest.mark.parametrize("ignore", [-100, 3])  # 3: a real class id used as padding
def test_ignore_index_adds_nothing_and_is_not_counted(ignore):
    hidden, weight, targets = _problem(ignore=ignore)
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets,
                                                  ignore_index=ignore), hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=10,
                                          ignore_index=ignore), hidden, weight)
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu",
                                                           scale=e).kwargs())
    padded = targets == ignore
    assert padded.any() and (out[1][padded] == 0).all(), "a padded token got a gradient"
    # the mean is over the counted tokens: the same as the loss of those tokens alone
    kept = chunked(hidden[~padded], weight, targets[~padded], chunk_tokens=10,
                   ignore_index=ignore)
    torch.testing.assert_close(out[0], kept.detach(), **utils.tolerance(torch.float32, "cpu",
                                                                        scale=kept).kwargs())


def test_all_ignored_is_nan_as_in_cross_entropy_and_sum_reduction_matches():
    hidden, weight, targets = _problem(n=12)
    none = torch.full_like(targets, -100)
    assert math.isnan(F.cross_entropy(hidden @ weight.T, none).item())
    assert math.isnan(chunked(hidden, weight, none, chunk_tokens=5).item())
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets, reduction="sum"),
                          hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=5,
                                          reduction="sum"), hidden, weight)
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu",
                                                           scale=e).kwargs())


def test_gradients_pass_gradcheck_in_fp64_and_a_frozen_weight_gets_none():
    hidden, weight, targets = _problem(n=10, c=4, v=6, dtype=torch.float64, ignore=-100)
    assert torch.autograd.gradcheck(lambda h, w: chunked(h, w, targets, chunk_tokens=3),
                                    (hidden, weight))
    weight.requires_grad_(False)
    chunked(hidden, weight, targets, chunk_tokens=4).backward()
    assert hidden.grad is not None and weight.grad is None


def test_peak_memory_is_one_chunk_of_logits_not_three_whole_ones():
    n, c, v = 512, 64, 4096
    hidden, weight, targets = _problem(n=n, c=c, v=v, ignore=-100)
    logits = n * v * 4  # one fp32 logits-sized tensor

    def fwd_bwd(fn):
        # the last call's gradients go before the meter starts: it counts from what is
        # allocated then, and freeing them inside would lower the peak (on CUDA, and on a CPU)
        hidden.grad = weight.grad = None
        return lambda: fn().backward()

    plain = utils.measure_peak_memory(fwd_bwd(lambda: F.cross_entropy(hidden @ weight.T,
                                                                      targets)), device="cpu")
    # Plain: at log_softmax's backward the log-probabilities (saved), their gradient and the
    # logits' gradient are alive: three logits-sized tensors (the logits themselves were freed
    # after the forward pass: nothing holds them here).
    assert 3 * logits <= plain.peak_bytes <= 3 * logits + 1024, plain
    peaks = {}
    for chunk in (64, 128):
        peaks[chunk] = utils.measure_peak_memory(
            fwd_bwd(lambda: chunked(hidden, weight, targets, chunk_tokens=chunk)),
            device="cpu").peak_bytes
        # Chunked, in backward: the gradients of the hidden states (n x c) and of the weight
        # (v x c), one chunk's logits (chunk x v), and per token the log-sum-exp (4 bytes), the
        # mask (1), the targets made safe (8) and the gradient's row scale (4).
        predicted = 4 * (n * c + v * c + chunk * v) + 17 * n
        assert predicted <= peaks[chunk] <= predicted + 1024, (chunk, peaks[chunk], predicted)
    saving = plain.peak_bytes - peaks[64]
    predicted_saving = 3 * logits - (4 * (n * c + v * c + 64 * v) + 17 * n)
    assert abs(saving - predicted_saving) <= 2048, (saving, predicted_saving)
    # One chunk more per step is one chunk of logits more, exactly.
    assert peaks[128] - peaks[64] == 64 * v * 4


def test_no_tensor_as_large_as_the_logits_is_ever_made():
    n, c, v, chunk = 256, 32, 2048, 32
    hidden, weight, targets = _problem(n=n, c=c, v=v)
    with TensorMemoryTracker(record_events=True) as tracker:
        chunked(hidden, weight, targets, chunk_tokens=chunk).backward()
    largest = max(e.size_bytes for e in tracker.events if e.action == "alloc")
    assert largest == 4 * max(chunk * v, v * c), largest  # a chunk of logits, or weight.grad
    assert largest < n * v * 4


@pytest.mark.parametrize("call, error, match", [
    (lambda h, w, t: chunked(h, w, t, chunk_tokens=0), ValueError, "chunk_tokens must be >= 1"),
    (lambda h, w, t: chunked(h, w, t, chunk_tokens=2.0), TypeError, "chunk_tokens must be an int"),
    (lambda h, w, t: chunked(h, w, t, chunk_tokens=True), TypeError, "chunk_tokens must be an int"),
    (lambda h, w, t: chunked(h, w, t, chunk_tokens=4, reduction="avg"), ValueError,
     "reduction must be one of mean, sum"),
    (lambda h, w, t: chunked(h, w[:, :5], t, chunk_tokens=4), ValueError, "last dim"),
    (lambda h, w, t: chunked(h, w[0], t, chunk_tokens=4), ValueError, r"weight must be \(vocab"),
    (lambda h, w, t: chunked(h, w, t[:-1], chunk_tokens=4), ValueError, "targets must be shaped"),
    (lambda h, w, t: chunked(h, w, t.float(), chunk_tokens=4), TypeError, "integer tensor"),
    (lambda h, w, t: chunked(h.long(), w, t, chunk_tokens=4), TypeError, "hidden must be a float"),
    (lambda h, w, t: chunked(h, w.double(), t, chunk_tokens=4), ValueError, "same dtype"),
    (lambda h, w, t: chunked(h, w.to("meta"), t, chunk_tokens=4), ValueError, "one device"),
])
def test_bad_arguments_are_rejected_clearly(call, error, match):
    hidden, weight, targets = _problem(n=8, c=6, v=10)
    with pytest.raises(error, match=match):
        call(hidden.detach(), weight.detach(), targets)


def test_compiled_it_saves_for_backward_what_eager_saves_not_the_logits():
    """Traced by torch.compile as Python, the chunk loops were unrolled and the compiler saved
    every chunk's logits for backward (the whole logits' memory: what the H200 run's 'chunked
    loss' row showed as more memory, not less). Compiled, it is one opaque operator now: the
    same saved tensors as eager (the inputs and one number per token), the same loss and
    gradients, one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    n, c, v = 256, 32, 1024
    hidden, weight, targets = _problem(n=n, c=c, v=v, ignore=-100)
    logits_bytes = n * v * 4

    def loss_fn(h, w, t):
        return chunked(h, w, t, chunk_tokens=32)

    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")  # Inductor, graphs counted
        fn = torch.compile(loss_fn, backend=counter) if compiled else loss_fn
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = fn(hidden, weight, targets)
        loss.backward()
        if compiled:
            assert counter.frame_count == 1, "one graph, no break around the operator"
        results[compiled] = (sum(saved), loss.detach(), hidden.grad, weight.grad)
        hidden.grad = weight.grad = None
    eager_saved, compiled_saved = results[False][0], results[True][0]
    assert eager_saved < logits_bytes / 4, eager_saved
    assert compiled_saved <= eager_saved, (compiled_saved, eager_saved, logits_bytes)
    for a, b in zip(results[False][1:], results[True][1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
