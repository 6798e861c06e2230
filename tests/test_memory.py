import pytest
import torch
import torch.nn.functional as F

import utils

MIB = 2**20


def test_cpu_probe_sees_a_known_allocation():
    def work():
        a = torch.empty(8 * MIB, dtype=torch.uint8)  # 8 MiB
        b = torch.ones(1024, 1024)  # 4 MiB, alive together with a
        del a, b
        c = torch.zeros(MIB // 4)  # 1 MiB, returned
        return c

    r = utils.measure_peak_memory(work, device="cpu")
    assert r.peak_bytes == 12 * MIB
    assert r.retained_bytes == 0  # the result was not kept
    assert r.allocator_peak_allocated_bytes is None
    assert "TorchDispatchMode" in r.method

    kept = utils.measure_peak_memory(work, device="cpu", keep_result=True)
    assert kept.retained_bytes == MIB and kept.result.numel() == MIB // 4


def test_cpu_probe_counts_views_once_and_is_never_silent_zero():
    def work():
        x = torch.randn(512, 512)  # 1 MiB
        v = x.view(-1)[::2]  # a view: no new memory
        return (v * 2).sum()

    r = utils.measure_peak_memory(work, device="cpu")
    # x (1 MiB), the product v*2 (0.5 MiB) and the 4-byte sum are alive at once.
    assert r.peak_bytes == MIB + MIB // 2 + 4


def test_views_and_in_place_results_of_existing_tensors_are_not_new_memory():
    x = torch.randn(2048, 2048)  # 16 MiB, allocated before the measurement
    for name, fn in [("transpose", lambda: x.t()), ("slice", lambda: x[::2]),
                     ("in-place add", lambda: x.add_(1)), ("view", lambda: x.view(-1))]:
        r = utils.measure_peak_memory(fn, device="cpu", keep_result=True)
        assert r.peak_bytes == 0 and r.retained_bytes == 0, (name, r)
    # while a new result is new memory, and an in-place op on it adds nothing more
    r = utils.measure_peak_memory(lambda: (x * 2).add_(1), device="cpu")
    assert r.peak_bytes == 16 * MIB


def test_saved_activations_count_while_autograd_holds_them():
    """The tensor a user drops may live on inside autograd: exp saves its output."""
    a = torch.randn(MIB, requires_grad=True)  # 4 MiB
    r = utils.measure_peak_memory(lambda: a.exp().sum(), device="cpu", keep_result=True)
    assert r.retained_bytes == 4 * MIB + 4  # exp's saved output (and the scalar loss)
    r.result.backward()  # frees the saved output


def test_a_warm_optimizer_step_adds_temporaries_only():
    """Parameters, gradients and optimizer state exist before a warm step: its peak is the
    update's temporaries, which stay below the parameters' own size for AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024))
    param_bytes = 4 * utils.count_parameters(model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()  # creates the state: the next step is warm
    r = utils.measure_peak_memory(opt.step, device="cpu")
    assert 0 < r.peak_bytes < param_bytes, (r, param_bytes)
    assert r.retained_bytes == 0


def test_a_storage_kept_without_its_tensor_still_counts():
    """The storage, not the Python tensor, decides: a storage held on its own stays counted."""
    tracker = utils.TensorMemoryTracker()
    with tracker:
        a = torch.ones(256, 1024)  # 1 MiB
        st = a.untyped_storage()
        del a
        assert tracker.current_bytes == MIB
        del st
        assert tracker.current_bytes == 0
    assert tracker.peak_bytes == MIB and tracker.allocations == 1


def test_tracker_budget_raises_the_out_of_memory_error():
    from utils.memory import OutOfMemoryError

    assert OutOfMemoryError is torch.cuda.OutOfMemoryError
    tracker = utils.TensorMemoryTracker(limit_bytes=MIB + MIB // 2)
    with tracker:
        a = torch.ones(256, 1024)  # 1 MiB: within the budget
        with pytest.raises(torch.OutOfMemoryError, match="over the 1.50 MiB budget"):
            torch.ones(256, 1024)  # a second MiB crosses it
        del a
    assert tracker.current_bytes == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit_bytes"):
            utils.TensorMemoryTracker(limit_bytes=bad)


def test_tracker_events_name_the_allocating_line_and_stop_when_asked():
    from utils.memory import BACKWARD_SITE, MemoryEvent

    tracker = utils.TensorMemoryTracker(record_events=True)
    x = torch.randn(64, 64, requires_grad=True)
    with tracker:
        y = (x * 2).exp()
        y.sum().backward()
        del y
    assert all(isinstance(e, MemoryEvent) for e in tracker.events)
    sites = {e.site for e in tracker.events if e.action == "alloc"}
    assert any(s.startswith("test_memory.py:") for s in sites), sites
    assert BACKWARD_SITE in sites
    frees = sum(e.action == "free" for e in tracker.events)
    assert frees >= 2 and tracker.events[0].op.startswith("aten.")
    tracker.stop_recording()
    n = len(tracker.events)
    x.grad = None  # freed after recording stopped: counted, not recorded
    assert len(tracker.events) == n and tracker.current_bytes == 0
    assert utils.TensorMemoryTracker().events is None  # no list unless asked


def test_tracker_can_be_entered_again_and_its_peak_reset():
    tracker = utils.TensorMemoryTracker()
    with tracker:
        a = torch.ones(512, 1024)  # 2 MiB
    del a
    tracker.reset_peak()
    assert tracker.peak_bytes == 0
    with tracker:
        b = torch.ones(256, 1024)  # 1 MiB
    assert tracker.peak_bytes == MIB and tracker.current_bytes == MIB and tracker.allocations == 2
    del b


def test_memory_meter_agrees_with_measure_peak_memory():
    from utils.memory import MemoryMeter

    def work():
        a = torch.ones(512, 1024)  # 2 MiB
        b = torch.ones(256, 1024)  # 1 MiB
        del a
        return b

    with MemoryMeter("cpu") as m:
        kept = work()
        assert m.held_bytes == MIB and m.peak_bytes == 3 * MIB  # readable inside the block
    r = utils.measure_peak_memory(work, device="cpu", keep_result=True)
    assert (m.peak_bytes, m.held_bytes) == (r.peak_bytes, r.retained_bytes) == (3 * MIB, MIB)
    assert m.method == r.method
    del kept
    assert m.held_bytes == 0


def test_cpu_probe_sees_saved_activations():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    x = torch.randn(64, 256)

    def forward():
        return model(x).sum()

    r = utils.measure_peak_memory(forward, device="cpu", keep_result=True)
    assert r.peak_bytes >= 64 * 1024 * 4  # at least the hidden activation


def test_breakdown_of_adamw_step():
    model = utils.MLP(in_features=32, hidden=64, out_features=4, depth=2)
    n_params = utils.count_parameters(model)
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    b = utils.memory_breakdown(model, batch, F.cross_entropy, lr=1e-3)
    assert b.parameters_bytes == 4 * n_params
    assert b.gradients_bytes == 4 * n_params
    n_tensors = len(list(model.parameters()))
    # AdamW keeps exp_avg and exp_avg_sq (2 x params) plus a scalar step per tensor.
    assert 8 * n_params <= b.optimizer_state_bytes <= 8 * n_params + 8 * n_tensors
    assert b.activations_bytes > 0
    assert b.total_bytes == sum(b.as_dict().values())
    # the model passed in is untouched
    assert all(p.grad is None for p in model.parameters())


def test_bad_input():
    with pytest.raises(TypeError, match="callable"):
        utils.measure_peak_memory("not a function")
    with pytest.raises(ValueError, match="device"):
        utils.measure_peak_memory(lambda: None, device="floppy")
    with pytest.raises(ValueError, match="pair"):
        utils.memory_breakdown(utils.MLP(), torch.randn(2, 784), F.cross_entropy)


def test_format_bytes():
    assert utils.format_bytes(512) == "512 B"
    assert utils.format_bytes(3 * MIB) == "3.00 MiB"
    assert utils.format_bytes(None) == "n/a"


@pytest.mark.gpu
def test_cuda_probe_reads_the_allocator():
    def work():
        return torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")

    r = utils.measure_peak_memory(work, device="cuda")
    assert r.peak_bytes >= 64 * MIB
    assert r.allocator_peak_reserved_bytes >= r.allocator_peak_allocated_bytes


def test_meter_counts_the_release_of_tensors_that_existed_before_it_as_cuda_does():
    """On CUDA a meter reads memory_allocated() against its start, so clearing gradients
    made before the block shows as negative memory: 04/04's Exercise 2 check and 04/06's
    peak claims failed on the H100/H200 that way while passing on CPUs, whose meter saw only
    storage created inside the block. The CPU meter now sees such releases too."""
    from utils.memory import MemoryMeter

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 1024)  # 1 MiB of weight
    model(torch.randn(4, 256)).sum().backward()  # gradients exist before the meters start
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    before = torch.ones(256, 1024)  # 1 MiB, made before the meter
    with MemoryMeter("cpu") as m:
        model.zero_grad(set_to_none=True)  # frees the gradients made before the block
        del before
        kept = torch.ones(128, 1024)  # 0.5 MiB added
    assert m.held_bytes == MIB // 2 - grad_bytes - MIB, (m.held_bytes, grad_bytes)
    assert m.peak_bytes == 0, "the highest level was the start, as CUDA's reset peak reads"
    del kept
    assert m.held_bytes == -grad_bytes - MIB
    # the tracker without the option counts only what the block created (its documented
    # default, which MemoryMeter used before)
    model(torch.randn(4, 256)).sum().backward()
    plain = utils.TensorMemoryTracker()
    with plain:
        model.zero_grad(set_to_none=True)
    assert plain.current_bytes == 0


def test_memory_budget_reports_the_gradients_a_block_cleared_below_its_start():
    from utils.memtools import memory_budget

    model = torch.nn.Linear(256, 1024)
    model(torch.randn(4, 256)).sum().backward()
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    with memory_budget(8 * MIB, device="cpu") as budget:
        model.zero_grad(set_to_none=True)
    assert budget.allocated_left_bytes == -grad_bytes
    with memory_budget(8 * MIB, device="cpu") as budget:  # nothing there before: nothing freed
        model(torch.randn(4, 256)).sum().backward()
        model.zero_grad(set_to_none=True)
    assert budget.allocated_left_bytes == 0


def test_meter_pauses_automatic_garbage_collection_inside_its_block():
    """Garbage made before the block (a reference cycle holding a tensor) must not be freed by
    an automatic collection inside it, which would lower the count at a moment no one chose;
    an explicit gc.collect() still runs, and the collector is back on after the block."""
    import gc

    from utils.memory import MemoryMeter

    class Node:
        pass

    def make_garbage():
        node = Node()
        node.self, node.tensor = node, torch.ones(256, 1024)  # 1 MiB, only a cycle holds it

    assert gc.isenabled()
    gc.collect()
    make_garbage()
    with MemoryMeter("cpu") as m:
        junk = [[] for _ in range(50_000)]  # enough new containers to trigger collections
        del junk
        assert m.held_bytes == 0, "the cycle made before the block was collected inside it"
        assert not gc.isenabled()
        gc.collect()  # asked for: it runs, and the release of the old tensor counts
        assert m.held_bytes == -MIB
    assert gc.isenabled(), "the collector is back on after the block"
    gc.disable()
    try:
        with MemoryMeter("cpu"):
            pass
        assert not gc.isenabled(), "a collector the caller had turned off stays off"
    finally:
        gc.enable()


def test_meter_scan_survives_odd_tensors_and_leaves_no_watchers_behind():
    """The scan for existing tensors meets whatever a session holds: a lazy module's
    uninitialized parameter (no storage) must not stop the meter, and the watchers it sets on
    existing storages go when the meter does (a loop of meters must not pile them up)."""
    import gc
    import weakref

    from utils.memory import MemoryMeter

    lazy = torch.nn.LazyLinear(8)  # an UninitializedParameter until its first call
    kept = torch.ones(16)
    before = len([f for f in weakref.finalize._registry.values()])
    with MemoryMeter("cpu") as m:
        x = torch.ones(256, 1024)
    assert m.held_bytes == MIB and lazy is not None
    del m, x
    gc.collect()
    after = len([f for f in weakref.finalize._registry.values()])
    assert after <= before, (before, after)
    del kept
