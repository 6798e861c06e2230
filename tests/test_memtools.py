"""utils.memtools: memory timelines, batch-size search, saved-tensor compression, host memory."""

import gc
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import utils
from utils.memtools import (
    BACKWARD_SITE,
    BatchSearch,
    MemoryTimeline,
    OutOfMemoryError,
    SavedTensorCompression,
    batch_finder_faults,
    find_max_batch,
    saved_tensor_hook_faults,
    host_memory,
    plot_memory_timeline,
    record_memory,
    reset_peak_host_memory,
    timeline_from_snapshot,
)

MIB = 2**20


def test_out_of_memory_error_is_the_current_name():
    assert OutOfMemoryError is torch.cuda.OutOfMemoryError
    assert issubclass(OutOfMemoryError, RuntimeError)


# -- record_memory on a CPU ----------------------------------------------------------------

def test_views_and_inplace_results_are_not_new_memory():
    old = torch.zeros(256, 1024)  # 1 MiB that exists before recording
    with record_memory("cpu") as rec:
        v = old.view(-1)
        w = old.t()
        old.add_(1)
        new = torch.ones(512, 1024)  # 2 MiB
        nv = new[:10]
        new.mul_(2)
        assert rec.live_bytes_now == 2 * MIB
        del new, nv
        assert rec.live_bytes_now == 0
    tl = rec.timeline
    assert isinstance(tl, MemoryTimeline)
    assert tl.peak_bytes == 2 * MIB and tl.allocations == 1
    assert [e.action for e in tl.events] == ["alloc", "free"]
    assert tl.events[0].site.startswith("test_memtools.py:")
    assert tl.reserved_bytes() is None
    del v, w


def test_one_tracker_serves_memory_and_memtools():
    """memtools builds on utils.memory's tracker: one storage key, one MemoryMeter."""
    import utils.memory as memory
    import utils.memtools as memtools

    assert memtools._storage_key is memory._storage_key
    assert memtools.MemoryMeter is memory.MemoryMeter
    assert memtools.OutOfMemoryError is memory.OutOfMemoryError
    assert not hasattr(memtools, "_StorageRecorder")


def test_a_storage_kept_without_its_tensor_stays_in_the_recording():
    with record_memory("cpu") as rec:
        a = torch.ones(256, 1024)  # 1 MiB
        st = a.untyped_storage()  # the storage outlives the tensor
        del a
        assert rec.live_bytes_now == MIB
    assert rec.live_bytes_now == MIB
    del st
    assert rec.live_bytes_now == 0
    assert rec.timeline.live_bytes() == [MIB]


def test_memory_alive_after_the_block_is_reported():
    with record_memory("cpu") as rec:
        keep = torch.ones(256, 1024)
    assert rec.live_bytes_now == MIB
    del keep
    assert rec.live_bytes_now == 0
    assert rec.timeline.live_bytes() == [MIB]  # the free after the block is not in the timeline


def test_backward_allocations_get_the_backward_site():
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with record_memory("cpu") as rec:
        lin(x).relu().sum().backward()
    sites = {e.site for e in rec.timeline.events}
    assert BACKWARD_SITE in sites
    assert any(s.startswith("test_memtools.py:") for s in sites)


def test_training_step_peak_counts_activations_and_gradients():
    cfg = utils.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    x, y = utils.lm_batch(cfg, 4, device="cpu")
    utils.train_step(model, opt, x, y)  # optimizer state exists before recording
    model.zero_grad(set_to_none=True)
    with record_memory("cpu") as rec:
        utils.train_step(model, opt, x, y)
    grads = utils.tensor_bytes(p.grad for p in model.parameters())
    assert rec.live_bytes_now == grads  # only the new gradients outlive the step
    acts = utils.memory_breakdown(model, (x, y),
                                  lambda out, t: F.cross_entropy(out.flatten(0, 1),
                                                                 t.flatten())).activations_bytes
    assert rec.timeline.peak_bytes >= acts
    by_site = rec.timeline.by_site()
    assert sum(by_site.values()) == rec.timeline.peak_bytes
    assert rec.timeline.by_site(at_peak=False)


def test_budget_raises_out_of_memory_also_in_backward():
    x = torch.randn(64, 1024, requires_grad=True)
    with pytest.raises(OutOfMemoryError, match="over the 1.00 MiB budget"):
        with record_memory("cpu", limit_bytes=MIB):
            torch.ones(512, 1024)
    y = (x * 2).sum()  # forward outside: 256 KiB saved; backward makes a 256 KiB gradient
    with pytest.raises(torch.OutOfMemoryError):
        with record_memory("cpu", limit_bytes=1000):
            y.backward()


def test_record_memory_arguments():
    with pytest.raises(ValueError, match="max_entries"):
        record_memory("cpu", max_entries=0)
    with pytest.raises(ValueError, match="limit_bytes"):
        record_memory("cpu", limit_bytes=-5)
    rec = record_memory("cpu")
    with pytest.raises(ValueError, match="not finished"):
        _ = rec.timeline
    with record_memory("cpu") as rec:
        pass
    assert rec.dump_snapshot("/nonexistent/x.pickle") is None  # a CPU has no snapshot
    with pytest.raises(ValueError, match="no events"):
        plot_memory_timeline(rec.timeline)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_record_memory_on_cuda(tmp_path):
    with record_memory("cuda") as rec:
        a = torch.ones(1024, 1024, device="cuda")
        del a
    assert rec.timeline.peak_bytes >= 4 * MIB
    path = rec.dump_snapshot(tmp_path / "s.pickle")
    assert timeline_from_snapshot(path).peak_bytes == rec.timeline.peak_bytes
    with pytest.raises(ValueError, match="CPU stand-in"):
        record_memory("cuda", limit_bytes=MIB)


# -- CUDA snapshots, read offline ------------------------------------------------------------

def _fake_snapshot():
    f = [{"filename": "/x/torch/nn/functional.py", "line": 10, "name": "linear"},
         {"filename": "/home/me/train.py", "line": 42, "name": "forward"}]
    trace = [
        {"action": "segment_alloc", "addr": 1000, "size": 20 * MIB, "frames": f},
        {"action": "alloc", "addr": 1000, "size": 4 * MIB, "frames": f},
        {"action": "alloc", "addr": 5000, "size": 2 * MIB, "frames": []},
        {"action": "free_requested", "addr": 1000, "size": 4 * MIB, "frames": f},
        {"action": "free_completed", "addr": 1000, "size": 4 * MIB, "frames": f},
        {"action": "free_requested", "addr": 77, "size": MIB, "frames": []},  # from before
        {"action": "free_completed", "addr": 77, "size": MIB, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "frames": []},
        {"action": "segment_free", "addr": 1000, "size": 20 * MIB, "frames": []},
    ]
    return {"segments": [], "device_traces": [trace]}


def test_timeline_from_snapshot(tmp_path):
    tl = timeline_from_snapshot(_fake_snapshot(), 0, start_bytes=123)
    assert [e.action for e in tl.events] == ["segment_alloc", "alloc", "alloc", "free",
                                             "segment_free"]
    assert tl.live_bytes() == [0, 4 * MIB, 6 * MIB, 2 * MIB, 2 * MIB]
    assert tl.reserved_bytes() == [20 * MIB, 20 * MIB, 20 * MIB, 20 * MIB, 0]
    assert tl.peak_bytes == 6 * MIB and tl.start_bytes == 123 and tl.dropped_frees == 1
    assert tl.events[1].site == "train.py:42 forward"
    assert tl.events[2].site == BACKWARD_SITE  # no Python frame: the autograd engine's thread
    assert tl.by_site() == {"train.py:42 forward": 4 * MIB, BACKWARD_SITE: 2 * MIB}
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_fake_snapshot()))
    assert timeline_from_snapshot(path).peak_bytes == 6 * MIB
    with pytest.raises(ValueError, match="not a CUDA memory snapshot"):
        timeline_from_snapshot({"segments": []})
    with pytest.raises(ValueError, match="traces for 1 device"):
        timeline_from_snapshot(_fake_snapshot(), 3)


def test_plot_memory_timeline():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_memory_timeline(timeline_from_snapshot(_fake_snapshot()), top=1,
                              marks={"backward": 2}, title="fake")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "train.py:42 forward" and "other" in labels
    assert any("reserved" in s for s in labels)
    with pytest.raises(ValueError, match="top must be"):
        plot_memory_timeline(timeline_from_snapshot(_fake_snapshot()), top=0)
    plt.close("all")


# -- the batch-size search ---------------------------------------------------------------------

def _rows(batch):
    """A trial whose memory grows with the batch: 4 KiB per row, twice (input and output)."""
    x = torch.ones(batch, 1024)
    return x * 2


def test_find_max_batch_is_exact_and_leaves_memory_clean():
    calls = []
    res = find_max_batch(_rows, budget_bytes=2 * 100 * 4096, device="cpu",
                         cleanup=lambda: calls.append(1))
    assert isinstance(res, BatchSearch)
    assert res.max_batch == 100 and res.first_failing == 101 and res.gap == 1.0
    assert res.allocated_after_bytes == 0 and res.reserved_after_bytes is None
    assert len(calls) == len(res.trials)
    assert [t.batch for t in res.trials[:8]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(t.fits == (t.batch <= 100) for t in res.trials)
    assert all(t.peak_bytes == 2 * 4096 * t.batch for t in res.trials if t.fits)
    assert "out of memory" in [t for t in res.trials if not t.fits][0].error
    assert "largest batch that fits: 100" in str(res)


def test_find_max_batch_collects_earlier_garbage_before_it_starts():
    """A tensor in a reference cycle, left by earlier work: freed before the search, not inside
    it, where the CPU count (which counts frees of older tensors) would go below zero."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        junk = [torch.ones(MIB)]  # 4 MiB
        junk.append(junk)
        del junk
        res = find_max_batch(_rows, budget_bytes=2 * 100 * 4096, device="cpu")
    finally:
        if was_enabled:
            gc.enable()
    assert res.max_batch == 100 and res.allocated_after_bytes == 0, res

def test_find_max_batch_with_tolerance_and_cap():
    res = find_max_batch(_rows, budget_bytes=2 * 1000 * 4096, device="cpu", rel_tol=0.1)
    assert res.max_batch <= 1000 < res.first_failing and res.gap <= 1.1
    capped = find_max_batch(_rows, budget_bytes=2 * 1000 * 4096, device="cpu", max_batch=300)
    assert capped.max_batch == 300 and capped.first_failing is None


def test_find_max_batch_sees_a_leak():
    kept = []

    def leaky(batch):
        kept.append(torch.ones(batch, 1024))  # the trial keeps its tensors alive

    res = find_max_batch(leaky, budget_bytes=64 * 4096 * 8, device="cpu", start=4)
    assert res.allocated_after_bytes > 0
    kept.clear()


def test_find_max_batch_on_a_training_step_frees_gradients():
    cfg = utils.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = utils.TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    utils.train_step(model, opt, *utils.lm_batch(cfg, 1, device="cpu"))
    model.zero_grad(set_to_none=True)

    def step(b):
        utils.train_step(model, opt, *utils.lm_batch(cfg, b, device="cpu"))

    res = find_max_batch(step, budget_bytes=4 * MIB, device="cpu",
                         cleanup=lambda: model.zero_grad(set_to_none=True))
    assert 1 < res.max_batch and res.first_failing == res.max_batch + 1
    assert res.allocated_after_bytes == 0
    assert all(p.grad is None for p in model.parameters())


def test_find_max_batch_arguments_and_errors():
    with pytest.raises(ValueError, match="on a CPU give budget_bytes"):
        find_max_batch(_rows, device="cpu")
    with pytest.raises(ValueError, match="even the first batch"):
        find_max_batch(_rows, budget_bytes=100, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        find_max_batch(5, budget_bytes=100, device="cpu")
    with pytest.raises(ValueError, match="start"):
        find_max_batch(_rows, budget_bytes=100, device="cpu", start=0)
    with pytest.raises(ValueError, match="rel_tol"):
        find_max_batch(_rows, budget_bytes=100, device="cpu", rel_tol=1.5)

    def broken(batch):
        raise RuntimeError("shape mismatch")  # not an out-of-memory: it must not be swallowed

    with pytest.raises(RuntimeError, match="shape mismatch"):
        find_max_batch(broken, budget_bytes=MIB, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_find_max_batch_on_cuda_starts_every_trial_from_the_same_allocator_state():
    reserved_at_start = []

    def trial(batch):
        reserved_at_start.append(torch.cuda.memory_reserved())
        x = torch.ones(batch, MIB // 4, device="cuda")  # 1 MiB per row
        return x * 2

    res = find_max_batch(trial, budget_bytes=64 * MIB, device="cuda")
    assert res.first_failing == res.max_batch + 1 and 16 <= res.max_batch <= 32
    assert len(set(reserved_at_start)) == 1, reserved_at_start  # cache emptied before each
    assert res.allocated_after_bytes == res.allocated_before_bytes
    assert res.reserved_after_bytes <= res.reserved_before_bytes


# -- saved-tensor compression --------------------------------------------------------------

def _mlp_step(model, x, hooks=None):
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = model(x).pow(2).mean()
    else:
        with hooks:
            loss = model(x).pow(2).mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode,tol", [("none", 0.0), ("bf16", 2e-2), ("int8", 5e-2)])
def test_compression_keeps_gradients_close(mode, tol):
    torch.manual_seed(0)
    model = utils.MLP(in_features=64, hidden=256, out_features=8, depth=3)
    x = torch.randn(32, 64)
    ref = _mlp_step(model, x)
    comp = SavedTensorCompression(mode, keep=model.parameters())
    got = _mlp_step(model, x, comp)
    for g, r in zip(got, ref):
        assert ((g - r).norm() / r.norm()).item() <= tol + 1e-7
    assert comp.kept_bytes > 0 and comp.saved_tensors > 0
    if mode == "none":
        assert comp.ratio == 1.0 and comp.compressed_tensors == 0
    else:
        assert comp.ratio > (1.9 if mode == "bf16" else 3.5)


def test_compression_frees_the_activations():
    torch.manual_seed(0)
    model = utils.MLP(in_features=256, hidden=1024, out_features=8, depth=3)
    x = torch.randn(64, 256)
    held = {}
    for mode in ("none", "bf16", "int8"):
        with record_memory("cpu") as rec:
            with SavedTensorCompression(mode, keep=model.parameters()):
                loss = model(x).pow(2).mean()
        held[mode] = rec.live_bytes_now
        del loss
    assert held["none"] / held["bf16"] > 1.9
    assert held["none"] / held["int8"] > 3.5


def test_compressing_the_weights_too_adds_memory():
    """The negative control for keep=: a weight's compressed copy lives beside the weight."""
    torch.manual_seed(0)
    model = utils.MLP(in_features=512, hidden=512, out_features=512, depth=2)
    x = torch.randn(2, 512)  # tiny batch: the weights dominate what is saved
    held = {}
    for name, keep in (("kept", model.parameters()), ("compressed", ())):
        with record_memory("cpu") as rec:
            with SavedTensorCompression("bf16", keep=keep):
                loss = model(x).sum()
        held[name] = rec.live_bytes_now
        del loss
    assert held["compressed"] > 2 * held["kept"]


def test_a_storage_saved_twice_is_compressed_once():
    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorCompression("bf16") as comp:
        y = x.exp()   # exp saves its output
        z = y * y     # mul saves y twice (the same full view)
    z.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.exp(2 * x), rtol=2e-2, atol=1e-3)
    assert comp.shared_tensors >= 1 and comp.ratio > 2.5


def test_compression_arguments():
    with pytest.raises(ValueError, match="mode must be"):
        SavedTensorCompression("fp4")
    with pytest.raises(ValueError, match="min_numel"):
        SavedTensorCompression("bf16", min_numel=-1)



def test_compression_is_freed_without_the_garbage_collector():
    """No reference cycle through the hooks: the object (and what it holds) goes when the last
    name and the graph let go of it, not at the next collection, and it can be entered again."""
    import weakref

    torch.manual_seed(0)
    model = utils.MLP(in_features=64, hidden=256, out_features=8, depth=2)
    x = torch.randn(32, 64)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        comp = SavedTensorCompression("int8", keep=model.parameters())
        with comp:
            loss = model(x).pow(2).mean()
        ref = weakref.ref(comp)
        del comp
        assert ref() is not None, "the graph's saved tensors hold the unpack hook until backward"
        loss.backward()
        del loss
        assert ref() is None, "a reference cycle keeps the hooks alive until gc.collect()"
    finally:
        if was_enabled:
            gc.enable()
    comp = SavedTensorCompression("bf16", keep=model.parameters())
    counts = []
    for _ in range(2):
        with comp:
            model(x).pow(2).mean().backward()
        counts.append(comp.compressed_tensors)
    assert counts[0] > 0 and counts[1] == 2 * counts[0], counts  # the second pass packed too



# -- saved_tensor_hook_faults ------------------------------------------------------------------

def _fp8_hooks(keep, min_numel, *, scale=True, dtype=torch.float8_e4m3fn, fmax=448.0):
    """04/03's Exercise 1 in the shape of its solution, with switches for its wrong answers."""
    kept = {p.untyped_storage().data_ptr() for p in keep}

    def pack(t):
        if not t.is_floating_point() or t.numel() < min_numel or \
                t.untyped_storage().data_ptr() in kept:
            return ("raw", t)
        s = t.detach().abs().amax().float().clamp_min(1e-30) / fmax if scale else 1.0
        return ("fp8", (t.detach() / s).to(dtype), s, t.dtype)

    def unpack(packed):
        return packed[1] if packed[0] == "raw" else (packed[1].float() * packed[2]).to(packed[3])

    return pack, unpack


def test_saved_tensor_hook_faults_passes_right_hooks():
    model = utils.MLP(in_features=64, hidden=256, out_features=8, depth=2)
    params = list(model.parameters())
    assert saved_tensor_hook_faults(lambda t: t, lambda t: t, keep=params, max_rel_error=1e-9,
                                    device="cpu") == []
    comp = SavedTensorCompression("bf16", keep=params, min_numel=2048)
    assert saved_tensor_hook_faults(comp._pack, comp._unpack, keep=params, min_numel=2048,
                                    max_rel_error=2**-8, device="cpu") == []
    pack, unpack = _fp8_hooks(params, 4096)
    assert saved_tensor_hook_faults(pack, unpack, keep=params, min_numel=4096,
                                    max_rel_error=2**-4, device="cpu") == []


@pytest.mark.parametrize("wrong, words", [
    ({"scale": False}, "relative error of 1,"),                      # e4m3 alone underflows
    ({"dtype": torch.float8_e5m2, "fmax": 57344.0}, "relative error"),  # 2 significant bits
    ({"min_numel": 1024}, "a float tensor of 4095 elements"),        # statistics not exact
    ({"keep": ()}, "tensors to keep"),                               # parameters packed too
])
def test_saved_tensor_hook_faults_names_each_wrong_fp8_answer(wrong, words):
    params = list(utils.MLP(in_features=64, hidden=256, out_features=8, depth=2).parameters())
    kw = {"keep": params, "min_numel": 4096} | wrong
    pack, unpack = _fp8_hooks(kw.pop("keep"), kw.pop("min_numel"), **kw)
    faults = saved_tensor_hook_faults(pack, unpack, keep=params, min_numel=4096,
                                      max_rel_error=2**-4, device="cpu")
    assert len(faults) == 1 and words in faults[0], faults


def test_saved_tensor_hook_faults_sees_copies_and_a_wrong_dtype():
    w = torch.randn(300, 200, requires_grad=True)
    faults = saved_tensor_hook_faults(lambda t: t.clone(), lambda t: t, keep=[w], min_numel=64,
                                      max_rel_error=0.1, device="cpu")
    assert [f.split(" came back")[0] for f in faults] == [
        "2 of 2 tensors to keep (and the transposes a Linear saves of its weight)",
        "a tensor of integers", "a float tensor of 63 elements (fewer than min_numel)"]
    faults = saved_tensor_hook_faults(lambda t: t.to(torch.bfloat16), lambda t: t,
                                      max_rel_error=0.1, device="cpu")
    assert len(faults) == 3 and "came back as torch.bfloat16" in faults[-1], faults
    pack, unpack = _fp8_hooks((), 1, scale=False)
    assert "relative error of 1," in saved_tensor_hook_faults(
        pack, unpack, min_numel=0, max_rel_error=0.1, device="cpu")[0]


def test_saved_tensor_hook_faults_arguments():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_numel"):
            saved_tensor_hook_faults(id, id, min_numel=bad, max_rel_error=0.1)
    for bad in (0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="max_rel_error"):
            saved_tensor_hook_faults(id, id, max_rel_error=bad)
    with pytest.raises(ValueError, match="amax"):
        saved_tensor_hook_faults(id, id, max_rel_error=0.1, amax=0)

# -- batch_finder_faults -----------------------------------------------------------------------

def _bisecting_finder(step, cleanup, *, catch=(OutOfMemoryError,), needs_text=False,
                      cleanup_in_handler=False, bisect=True):
    """A finder in the shape of 04/04's Exercise 2, with one switch per fault."""
    def ok(batch):
        failed = False
        try:
            step(batch)
        except catch as exc:
            if needs_text and "out of memory" not in str(exc):
                raise
            if cleanup_in_handler:
                cleanup()
                return False
            failed = True
        cleanup()
        return not failed

    lo, hi = 1, None
    assert ok(lo)
    while hi is None:
        if ok(2 * lo):
            lo *= 2
        else:
            hi = 2 * lo
    while bisect and hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def test_batch_finder_faults_passes_a_careful_finder():
    assert batch_finder_faults(_bisecting_finder) == []
    assert batch_finder_faults(lambda s, c: _bisecting_finder(s, c), fits_up_to=12) == []


def _folklore(step, cleanup):
    batch = 1
    while True:
        try:
            step(batch)
        except RuntimeError as e:
            if "out of memory" in str(e):
                return batch // 2
            raise
        batch *= 2


@pytest.mark.parametrize("finder, expected", [
    (lambda s, c: _bisecting_finder(s, c, catch=(RuntimeError,)), ["swallowed a RuntimeError"]),
    (lambda s, c: _bisecting_finder(s, c, catch=(RuntimeError,), needs_text=True),
     ["escaped the finder", "swallowed a RuntimeError"]),
    (lambda s, c: _bisecting_finder(s, c, bisect=False), ["it returned 4"]),
    (lambda s, c: _bisecting_finder(s, c, cleanup_in_handler=True), ["still alive"]),
    (lambda s, c: _bisecting_finder(s, lambda: None), ["did not run after every try"]),
    (_folklore, ["escaped the finder", "did not run after every try",
                 "swallowed a RuntimeError"]),
])
def test_batch_finder_faults_names_each_fault(finder, expected):
    faults = batch_finder_faults(finder)
    assert len(faults) == len(expected), faults
    for fault, words in zip(faults, expected):
        assert words in fault, (words, fault)


def test_batch_finder_faults_sees_an_exception_kept_for_the_log():
    kept = []

    def keeping(step, cleanup):
        def logged(batch):
            try:
                step(batch)
            except OutOfMemoryError as exc:
                kept.append(exc)
                raise
        return _bisecting_finder(logged, cleanup)

    assert any("still alive" in f for f in batch_finder_faults(keeping))


def test_batch_finder_faults_arguments():
    with pytest.raises(TypeError, match="callable"):
        batch_finder_faults(5)
    for bad in (1, 0, 2.5, True, "5"):
        with pytest.raises(ValueError, match="fits_up_to"):
            batch_finder_faults(_bisecting_finder, fits_up_to=bad)

# -- host memory -----------------------------------------------------------------------------

def test_host_memory_sees_a_large_allocation():
    reset = reset_peak_host_memory()
    before = host_memory()
    assert before.peak_rss_bytes > 0
    buf = torch.ones(64 * MIB // 4)  # 64 MiB, touched
    after = host_memory()
    del buf
    gc.collect()
    if reset:
        assert after.peak_rss_bytes - before.peak_rss_bytes >= 60 * MIB
    assert after.peak_rss_bytes >= before.peak_rss_bytes


# -- MemoryMeter -------------------------------------------------------------------------------

def test_memory_meter_on_cpu():
    from utils.memtools import MemoryMeter

    old = torch.zeros(256, 1024)
    with MemoryMeter("cpu") as m:
        _ = old.view(-1)
        a = torch.ones(256, 1024)
        b = torch.ones(512, 1024)
        del b
        assert m.held_bytes == MIB and m.peak_bytes == 3 * MIB
    assert m.peak_bytes == 3 * MIB and m.held_bytes == MIB
    del a
    assert m.held_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_meter_on_cuda():
    from utils.memtools import MemoryMeter

    with MemoryMeter("cuda") as m:
        a = torch.ones(256, 1024, device="cuda")
        b = torch.ones(512, 1024, device="cuda")
        del b
    assert m.peak_bytes >= 3 * MIB and m.held_bytes >= MIB
    del a
