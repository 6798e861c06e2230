"""utils.collectives.CollectiveCounter: counts collectives on torch 2.11 and the newest.

It replaces torch.distributed.tensor.debug.CommDebugMode in module 05, whose module tracker
crashed under FSDP2's hooks on torch 2.11 (IndexError at ``parent_list[-1]``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import utils.distributed as ud
from utils.collectives import CollectiveCounter, collective_kind


@pytest.mark.parametrize("name, kind", [
    ("c10d::allreduce_", "all_reduce"),
    ("c10d::_allgather_base_", "all_gather"),
    ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
    ("c10d::broadcast_", "broadcast"),
    ("_c10d_functional::all_reduce", "all_reduce"),
    ("_c10d_functional::all_gather_into_tensor.default", "all_gather"),
    ("_c10d_functional::reduce_scatter_tensor", "reduce_scatter"),
    ("_c10d_functional::all_to_all_single", "all_to_all"),
    ("_c10d_functional::wait_tensor", None),
    ("c10d::barrier", None),
    ("aten::mm", None),
    ("aten::all_reduce", None),
])
def test_collective_kind(name, kind):
    assert collective_kind(name) == kind


def test_counts_by_kind_and_phase_in_one_rank():
    import torch.distributed._functional_collectives as funcol

    with ud.single_process_group():
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        with CollectiveCounter() as comm:
            t = torch.ones(3)
            dist.all_reduce(t)                                   # forward: c10d
            model(torch.randn(2, 4)).sum().backward()            # backward: DDP's bucket
            funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
            out = torch.empty(2)
            dist.all_gather_into_tensor(out, torch.ones(2))
    assert comm.as_dict() == {"all_gather": 1, "all_reduce": 3}
    assert comm.by_phase["backward"]["all_reduce"] == 1
    assert comm.by_phase["forward"]["all_reduce"] == 2
    assert comm.total == 4
    assert "all_reduce x3 (forward 2, backward 1)" in str(comm)


def test_nothing_counted_outside_the_block_or_without_collectives():
    with CollectiveCounter() as comm:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert comm.total == 0 and str(comm) == "no collectives"
