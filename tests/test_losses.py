"""utils.losses.chunked_linear_cross_entropy: the plain loss's values and gradients, in chunks,
without the logits-sized tensors."""

import math
import re

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


#: the two algorithms: the logits computed again in backward (False), or the gradients
#: computed in forward and saved (True)
both = pytest.mark.parametrize("in_forward", [False, True], ids=["recompute", "in_forward"])


@both
@pytest.mark.parametrize("chunk", [1, 7, 32, 96, 1000])
def test_matches_plain_cross_entropy_in_fp32(chunk, in_forward):
    hidden, weight, targets = _problem(shape=(4, 24))  # (batch, time, width), as a GPT's
    ref = _loss_and_grads(lambda: F.cross_entropy((hidden @ weight.T).flatten(0, 1),
                                                  targets.flatten()), hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=chunk,
                                          grads_in_forward=in_forward), hidden, weight)
    assert out[0].dtype == torch.float32 and out[1].shape == hidden.shape
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu",
                                                           scale=e).kwargs())


@both
def test_matches_plain_cross_entropy_under_bf16_autocast(in_forward):
    hidden, weight, targets = _problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets), hidden, weight)
        out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=16,
                                              grads_in_forward=in_forward), hidden, weight)
    assert out[0].dtype == torch.float32  # the loss in fp32, as F.cross_entropy's under autocast
    assert out[1].dtype == hidden.dtype and out[2].dtype == weight.dtype
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.bfloat16, "cpu",
                                                           scale=e).kwargs())
    # and bf16 really ran: the fp32 loss is not bit for bit the same
    fp32 = F.cross_entropy(hidden @ weight.T, targets).detach()
    assert out[0] != fp32


@both
@pytest.mark.parametrize("ignore", [-100, 3])  # 3: a real class id used as padding
def test_ignore_index_adds_nothing_and_is_not_counted(ignore, in_forward):
    hidden, weight, targets = _problem(ignore=ignore)
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets,
                                                  ignore_index=ignore), hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=10,
                                          ignore_index=ignore, grads_in_forward=in_forward),
                          hidden, weight)
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


@both
def test_all_ignored_is_nan_as_in_cross_entropy_and_sum_reduction_matches(in_forward):
    hidden, weight, targets = _problem(n=12)
    none = torch.full_like(targets, -100)
    assert math.isnan(F.cross_entropy(hidden @ weight.T, none).item())
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, none), hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, none, chunk_tokens=5,
                                          grads_in_forward=in_forward), hidden, weight)
    assert math.isnan(out[0].item())
    # no token counted, no gradient (F.cross_entropy's gradients are zero here too)
    assert all(torch.equal(a, e) and not a.any() for a, e in zip(out[1:], ref[1:]))
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets, reduction="sum"),
                          hidden, weight)
    out = _loss_and_grads(lambda: chunked(hidden, weight, targets, chunk_tokens=5,
                                          reduction="sum", grads_in_forward=in_forward),
                          hidden, weight)
    for a, e in zip(out, ref):
        torch.testing.assert_close(a, e, **utils.tolerance(torch.float32, "cpu",
                                                           scale=e).kwargs())


@both
def test_gradients_pass_gradcheck_in_fp64_and_a_frozen_weight_gets_none(in_forward):
    hidden, weight, targets = _problem(n=10, c=4, v=6, dtype=torch.float64, ignore=-100)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked(h, w, targets, chunk_tokens=3, grads_in_forward=in_forward),
        (hidden, weight))
    weight.requires_grad_(False)
    chunked(hidden, weight, targets, chunk_tokens=4, grads_in_forward=in_forward).backward()
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


def test_gradients_in_forward_peak_is_one_chunk_of_logits_and_saves_only_the_gradients():
    n, c, v = 512, 32, 4096
    hidden, weight, targets = _problem(n=n, c=c, v=v, ignore=-100)
    grads = 4 * (n * c + v * c)  # the gradients of the hidden states and of the weight
    peaks = {}
    for chunk in (64, 128):
        hidden.grad = weight.grad = None  # not alive when the meter starts, as above
        peaks[chunk] = utils.measure_peak_memory(
            lambda: chunked(hidden, weight, targets, chunk_tokens=chunk,
                            grads_in_forward=True).backward(), device="cpu").peak_bytes
        # In forward: the two gradients, one chunk's logits (turned in place into their
        # gradient), per token the mask (1 byte), the targets made safe (8) and the row scale
        # (4), and a few 4-byte numbers per row of the chunk (log-sum-exp, target logit...).
        # In backward the saved gradients and their scaled copies: less, at these shapes.
        base = grads + 4 * chunk * v + 13 * n
        assert 2 * grads < base
        assert base <= peaks[chunk] <= base + 32 * chunk + 1024, (chunk, peaks[chunk], base)
    assert 64 * v * 4 <= peaks[128] - peaks[64] <= 64 * (v * 4 + 32)
    # what forward saves for backward: the two gradients, nothing per chunk or per token
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        loss = chunked(hidden, weight, targets, chunk_tokens=64, grads_in_forward=True)
    assert sum(saved) == grads, (saved, grads)
    del loss


def test_gradients_in_forward_follow_the_incoming_gradient_and_a_second_backward():
    """Computed in forward for an incoming gradient of 1, they are scaled in backward: a loss
    multiplied by 3 (as a loss scale or an accumulation's 1/k would) gets 3 times them, and a
    second backward of a retained graph adds the same again (the saved ones stay unscaled)."""
    hidden, weight, targets = _problem()
    ref = _loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets), hidden, weight)
    hidden.grad = weight.grad = None
    loss = chunked(hidden, weight, targets, chunk_tokens=16, grads_in_forward=True)
    (3 * loss).backward(retain_graph=True)
    tol = utils.tolerance(torch.float32, "cpu")
    for a, e in zip((hidden.grad, weight.grad), ref[1:]):
        torch.testing.assert_close(a, 3 * e, **tol.kwargs())
    loss.backward()
    for a, e in zip((hidden.grad, weight.grad), ref[1:]):
        torch.testing.assert_close(a, 4 * e, **tol.kwargs())


@both
def test_a_second_derivative_is_refused_clearly(in_forward):
    """A gradient penalty needs the gradient's own graph; this backward makes none, and the
    penalty would silently add nothing: asking for it is an error that says so."""
    hidden, weight, targets = _problem(n=12, c=4, v=6)
    loss = chunked(hidden, weight, targets, chunk_tokens=5, grads_in_forward=in_forward)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_under_float16_the_gradients_are_not_made_in_forward():
    """Made in forward for an incoming gradient of 1, fp16 logit gradients (about
    1 / tokens each) would underflow before a GradScaler's scale reaches them in backward:
    under float16 the function computes the logits again in backward instead, the same
    kernels and the same numbers as grads_in_forward=False."""
    from torch.utils.flop_counter import FlopCounterMode

    n, c, v = 96, 32, 512
    hidden, weight, targets = _problem(n=n, c=c, v=v)
    out, flops = {}, {}
    for in_forward in (False, True):
        with torch.autocast("cpu", dtype=torch.float16), FlopCounterMode(display=False) as fc:
            out[in_forward] = _loss_and_grads(
                lambda: chunked(hidden, weight, targets, chunk_tokens=32,
                                grads_in_forward=in_forward), hidden, weight)
        flops[in_forward] = fc.get_total_flops()
    assert flops[True] == flops[False] == 4 * 2 * n * v * c  # the head's forward matmul twice
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


def test_gradients_in_forward_run_the_heads_matmul_once_recompute_twice():
    """FLOPs of the head and loss, counted by torch's FLOP counter: the plain loss's three
    matmuls (2NVC forward, 4NVC backward) with the gradients in forward, one forward matmul more
    when the logits are computed again, and one matmul only when no gradient is wanted."""
    from torch.utils.flop_counter import FlopCounterMode

    n, c, v = 96, 32, 512
    hidden, weight, targets = _problem(n=n, c=c, v=v)
    head = 2 * n * v * c

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    plain = flops(lambda: F.cross_entropy(hidden @ weight.T, targets).backward())
    assert plain == 3 * head
    for in_forward, expected in ((True, 3 * head), (False, 4 * head)):
        got = flops(lambda: chunked(hidden, weight, targets, chunk_tokens=32,
                                    grads_in_forward=in_forward).backward())
        assert got == expected, (in_forward, got / head)
    # the gradients in forward, counted apart: all three matmuls before backward
    with FlopCounterMode(display=False) as counter:
        loss = chunked(hidden, weight, targets, chunk_tokens=32, grads_in_forward=True)
    assert counter.get_total_flops() == 3 * head
    # nothing wanted, nothing computed: under no_grad, or with inputs that need no gradient
    with torch.no_grad():
        assert flops(lambda: chunked(hidden, weight, targets, chunk_tokens=32,
                                     grads_in_forward=True)) == head
    assert flops(lambda: chunked(hidden.detach(), weight.detach(), targets, chunk_tokens=32,
                                 grads_in_forward=True)) == head
    torch.testing.assert_close(loss.detach(), F.cross_entropy(hidden @ weight.T,
                                                              targets).detach())


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
    (lambda h, w, t: chunked(h, w, t, chunk_tokens=4, grads_in_forward=1), TypeError,
     "grads_in_forward must be a bool"),
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


def _kernels(code):
    """The kernels a piece of Inductor's generated code launches: (name, is_matmul)."""
    found = re.findall(r"^\s+(extern_kernels\.\w+|\w*(?:cpp|triton)\w*fused\w*)\(", code, re.M)
    return [(name, name.startswith("extern_kernels.")) for name in found]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_compiled_gradients_in_forward_fuse_each_chunk_and_save_no_logits(autocast):
    """Traced by torch.compile (no custom operator): backward needs no logits, so none are
    saved, and each chunk's element-wise work between the matmuls is one fused kernel."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    n, c, v, chunk = 256, 32, 1024, 64
    hidden, weight, targets = _problem(n=n, c=c, v=v, ignore=-100)
    chunks, logits_bytes = n // chunk, n * v * 4

    def loss_fn(h, w, t):
        return chunked(h, w, t, chunk_tokens=chunk, num_classes=1000, grads_in_forward=True)

    results, saved = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        fn = torch.compile(loss_fn, backend=counter) if compiled else loss_fn
        sizes = []

        def step():
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t):
                loss = fn(hidden, weight, targets)
            (loss / 3).backward()  # an incoming gradient other than 1, as accumulation's
            return loss.detach()

        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, codes = run_and_get_code(step) if compiled else (step(), [])
        results[compiled] = (loss, hidden.grad, weight.grad)
        saved[compiled] = sum(sizes)
        if compiled:
            assert counter.frame_count == 1, "one graph, no break"
            forward, backward = codes  # Inductor's forward and backward graphs
    hidden.grad = weight.grad = None
    grads = 4 * (n * c + v * c)
    assert saved[False] == grads
    if autocast:
        # Inductor keeps each chunk's (V, C) bf16 product and adds them up in backward, in
        # one kernel with the scaling: at most one such product per chunk, never a logit
        assert saved[True] <= 4 * n * c + chunks * 2 * v * c < logits_bytes / 2, saved
    else:
        assert saved[True] == grads, saved
    tol = utils.tolerance(torch.bfloat16 if autocast else torch.float32, "cpu")
    for a, e in zip(results[True], results[False]):
        torch.testing.assert_close(a, e, **tol.kwargs())
    fwd = _kernels(forward)
    assert sum(is_mm for _, is_mm in fwd) == 3 * chunks, fwd  # the three matmuls per chunk
    # Each chunk's logits pass through one fused kernel between the matmuls: the log-sum-exp,
    # the softmax, the one-hot, the scale and the cast (Inductor names a kernel after the ops
    # it fused). Two per chunk would mean a second pass over the logits; a scatter_add_ for
    # the one-hot would cut the fusion in two. The other kernels are small: the count of
    # valid targets, casts of the inputs, the loss's sum (which of them, depends on the
    # version of torch).
    softmax = [name for name, is_mm in fwd if not is_mm and "exp" in name]
    assert len(softmax) == chunks and all("logsumexp" in name for name in softmax), fwd
    assert not any("scatter" in name for name, _ in fwd), fwd
    assert [is_mm for _, is_mm in _kernels(backward)] == [False], backward  # the scaling
    if not autocast:  # which scales the saved gradients in their own memory (eagerly: copies)
        assert backward.count("# reuse") == 2, backward
