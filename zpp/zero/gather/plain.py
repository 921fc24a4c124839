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


def all_gather_async(world: Transport, topology, out: torch.Tensor, inp: torch.Tensor) -> Work:
    """``world``'s all-gather of ``inp`` into ``out``, in two hops over ``topology`` when it is
    given (:func:`two_hop_topology`'s answer)."""
    if topology is not None:
        return hierarchical_all_gather_async(out, inp, topology=topology)
    return world.all_gather_async(out, inp)


class PlainGather(WeightGather):
    """``world.all_gather_async(full, shard)`` (or its two hops): ZeRO-3's gather, exact."""

    name = "plain"

    def __init__(self, comms: Comms) -> None:
        self.world: Transport = comms.world
        self.topology = two_hop_topology(comms)

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        return all_gather_async(self.world, self.topology, full, flat.compute_shard())

    def publish(self, flat: FlatShard) -> Work:
        """``world.all_gather_async(flat.full, copy of flat.shard)``: the shard is a view of
        the buffer it is gathered into (the transport's work holds the copy until done)."""
        return all_gather_async(self.world, self.topology, flat.full, flat.shard.clone())
