"""hpZ: a secondary copy of the gathered weights inside the node.

Wraps the gather over the world (plain or qwZ). After a world gather, each rank keeps the
``1/k`` slice of the full buffer that its local rank owns among the ``k`` ranks of its node
(the *secondary shard*, ``FlatShard.secondary``); until the optimizer step invalidates it
(:meth:`zpp.zero.unit.Unit.publish`), gathers are all-gathers of the secondary shards over
the node (``topology.intra``) and cross no node link. The secondary holds exactly the
weights the world gather produced (quantized ones under qwZ), so forward and backward of
a micro-step see the same weights. Extra memory: ``numel / k`` elements per unit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.transport import Work
from zpp.zero.comm_api import Comms, WeightGather
from zpp.zero.shard import SecondaryState

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


class SecondaryGather(WeightGather):
    """The intra-node gather of the secondary shards when they are valid, else ``inner``
    (which then leaves this rank's secondary slice behind)."""

    name = "hpz"

    def __init__(self, comms: Comms, inner: WeightGather) -> None:
        if comms.topology is None:
            raise ValueError("SecondaryGather: hpZ needs the topology of the world")
        self.topology = comms.topology
        self.inner = inner

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        if flat.secondary_state is SecondaryState.VALID:
            return self.topology.intra.all_gather_async(full, flat.secondary)
        return self.inner.start(flat, full)

    def finish(self, flat: FlatShard, full: torch.Tensor) -> None:
        if flat.secondary_state is SecondaryState.VALID:
            return  # gathered from it
        self.inner.finish(flat, full)
        k, lr = self.topology.ranks_per_node, self.topology.local_rank
        n = flat.layout.padded_numel // k
        flat.secondary = full[lr * n:(lr + 1) * n].clone()
        flat.secondary_state = SecondaryState.VALID

    def __repr__(self) -> str:
        return f"SecondaryGather({self.inner!r}, k={self.topology.ranks_per_node})"
