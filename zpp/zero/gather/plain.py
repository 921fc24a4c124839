"""The plain weight gather: an all-gather of the shards over every rank, in their dtype (in
two hops over the node topology where :func:`~zpp.zero.gather.two_hop_topology` says so)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import hierarchical_all_gather_async, two_hop
from zpp.comm.transport import Transport, Work
from zpp.zero.comm_api import Comms, WeightGather

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


def two_hop_topology(comms: Comms):
    """The topology the world gathers run in two hops over (``zpp.hierarchical_gather``:
    None uses the topology when the engine built it for another strategy), or None: one
    hop."""
    on = comms.config.zpp.hierarchical_gather
    return comms.topology if on is not False and two_hop(comms.topology) else None


class PlainGather(WeightGather):
    """``world.all_gather_async(full, shard)`` (or its two hops): ZeRO-3's gather, exact."""

    name = "plain"

    def __init__(self, comms: Comms) -> None:
        self.world: Transport = comms.world
        self.topology = two_hop_topology(comms)

    def _all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> Work:
        if self.topology is not None:
            return hierarchical_all_gather_async(full, shard, topology=self.topology)
        return self.world.all_gather_async(full, shard)

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        return self._all_gather(full, flat.compute_shard())

    def publish(self, flat: FlatShard) -> Work:
        """``world.all_gather_async(flat.full, copy of flat.shard)``: the shard is a view of
        the buffer it is gathered into (the transport's work holds the copy until done)."""
        return self._all_gather(flat.full, flat.shard.clone())
