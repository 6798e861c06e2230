"""utils.memtools.memory_budget: a block run against a memory budget, and what it leaves."""

import pytest
import torch

from utils.memtools import OutOfMemoryError, memory_budget

MIB = 2**20


def test_a_block_within_the_budget_runs_and_reports_what_it_left_allocated():
    with memory_budget(4 * MIB, device="cpu") as budget:
        temporary = torch.ones(MIB // 4)  # 1 MiB, freed inside the block
        del temporary
        kept = torch.ones(MIB // 8)       # 512 KiB, still alive after the block
    assert budget.allocated_left_bytes == kept.numel() * kept.element_size()
    assert budget.reserved_left_bytes is None  # a CPU has no caching allocator
    del kept
    assert budget.allocated_left_bytes == MIB // 2  # read at exit, not live


def test_a_block_past_the_budget_raises_out_of_memory_and_nothing_else():
    with pytest.raises(OutOfMemoryError):
        with memory_budget(MIB, device="cpu"):
            torch.ones(MIB)  # 4 MiB
    with pytest.raises(ZeroDivisionError):  # other errors pass through unchanged
        with memory_budget(MIB, device="cpu"):
            1 / 0


def test_the_budget_counts_only_what_the_block_creates():
    outside = torch.ones(MIB)  # 4 MiB, more than the budget, allocated before the block
    with memory_budget(MIB, device="cpu") as budget:
        inside = outside[:10].clone()
    assert budget.allocated_left_bytes == inside.numel() * inside.element_size()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="budget_bytes"):
        memory_budget(bad, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_budget_on_cuda_limits_the_allocator_and_puts_the_limit_back():
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    with pytest.raises(OutOfMemoryError):
        with memory_budget(64 * MIB, device="cuda:0"):
            torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    assert torch.cuda.get_per_process_memory_fraction(0) == fraction
    with memory_budget(64 * MIB, device="cuda:0") as budget:
        kept = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda:0")
    assert budget.allocated_left_bytes == 8 * MIB
    assert budget.reserved_left_bytes >= 8 * MIB
    del kept


def test_memory_budget_sets_the_fraction_from_what_is_reserved_and_puts_it_back(monkeypatch):
    """With torch.cuda faked (tests/test_devices.py's FakeCuda): an 80 GiB device, 1 GiB
    reserved on entry, a budget of 7 GiB -> a fraction of 8/80 inside the block, the previous
    fraction after it, and what the block left read from the allocator's counters."""
    from test_devices import FakeCuda

    fake = FakeCuda().install(monkeypatch)
    fake.fraction = 0.9
    counters = {"memory_reserved": 2**30, "memory_allocated": 2**29}
    for name in counters:
        monkeypatch.setattr(torch.cuda, name, lambda device=None, n=name: counters[n])
    with memory_budget(7 * 2**30, device="cuda") as budget:
        assert fake.fraction == pytest.approx(8 / 80)
        counters["memory_allocated"] += 3 * MIB
        counters["memory_reserved"] += 4 * MIB
    assert fake.fraction == 0.9
    assert budget.allocated_left_bytes == 3 * MIB and budget.reserved_left_bytes == 4 * MIB
