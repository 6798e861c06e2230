"""Counting the collectives a piece of distributed code runs.

:class:`CollectiveCounter` is a small ``TorchDispatchMode`` that sees every collective that goes
through PyTorch's dispatcher: the ``c10d`` operators behind ``torch.distributed.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor`` (what DDP, FSDP2 and DCP call) and the
functional collectives (``_c10d_functional``) that DTensor and tensor parallelism use. It counts
them by kind and by phase (forward or backward, read from the autograd engine), and nothing
else: no module tracking, which is the part of ``torch.distributed.tensor.debug.CommDebugMode``
that crashes under FSDP2's hooks on torch 2.11 (``IndexError`` in its module tracker). It works
the same on torch 2.11 and the newest.

Example::

    with utils.collectives.CollectiveCounter() as comm:
        loss = model(x).sum()
        loss.backward()
    print(comm)                      # all_gather x2 (forward 1, backward 1), reduce_scatter x1 ...
    comm.counts["reduce_scatter"]    # 1
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVE_KINDS", "collective_kind", "CollectiveCounter"]

#: The kinds a collective is counted as, and the operator names (c10d's, the functional
#: collectives', their coalesced forms) that belong to each.
COLLECTIVE_KINDS = {
    "all_reduce": ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_",
                   "all_reduce_coalesced", "all_reduce_coalesced_"),
    "all_gather": ("allgather_", "_allgather_base_", "allgather_coalesced_",
                   "allgather_into_tensor_coalesced_", "all_gather_into_tensor",
                   "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
    "reduce_scatter": ("reduce_scatter_", "_reduce_scatter_base_",
                       "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
                       "reduce_scatter_tensor_coalesced"),
    "broadcast": ("broadcast_", "broadcast"),
    "all_to_all": ("alltoall_", "alltoall_base_", "all_to_all_single"),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "reduce": ("reduce_",),
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_KIND_OF = {name: kind for kind, names in COLLECTIVE_KINDS.items() for name in names}


def collective_kind(op: Any) -> str | None:
    """The kind (a key of :data:`COLLECTIVE_KINDS`) of a dispatcher operator, or ``None`` when
    it is not a collective (``wait_tensor``, ``barrier``, any ``aten`` operator).

    Accepts an ``OpOverload``, an ``OpOverloadPacket`` or a qualified name such as
    ``"c10d::allreduce_"`` or ``"_c10d_functional::all_reduce.default"``.
    """
    name = op if isinstance(op, str) else getattr(op, "name", lambda: str(op))()
    if not isinstance(name, str):
        name = str(op)
    namespace, _, rest = name.partition("::")
    if namespace not in _NAMESPACES or not rest:
        return None
    return _KIND_OF.get(rest.split(".")[0])


def _in_backward() -> bool:
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and graph_task() != -1


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives run inside a ``with`` block, by kind and by phase.

    Attributes:
        counts: ``Counter`` of kind (``"all_reduce"``, ``"all_gather"``, ...) to calls.
        by_phase: ``{"forward": Counter, "backward": Counter}``; "backward" is what ran inside
            the autograd engine (gradient hooks, FSDP2's reduce-scatters), "forward" the rest.
        by_op: ``Counter`` of the operators' qualified names, for a closer look.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.by_phase: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = collective_kind(func)
        if kind is not None:
            self.counts[kind] += 1
            self.by_phase["backward" if _in_backward() else "forward"][kind] += 1
            self.by_op[func.name()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """All collectives counted."""
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """``{kind: calls}``, JSON-ready, kinds in alphabetical order."""
        return {k: self.counts[k] for k in sorted(self.counts)}

    def __str__(self) -> str:
        if not self.counts:
            return "no collectives"
        parts = []
        for kind in sorted(self.counts):
            f, b = self.by_phase["forward"][kind], self.by_phase["backward"][kind]
            parts.append(f"{kind} x{self.counts[kind]} (forward {f}, backward {b})")
        return ", ".join(parts)
