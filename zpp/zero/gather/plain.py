"""The plain weight gather: an all-gather of the shards over every rank, in their dtype."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.transport import Transport, Work
from zpp.zero.comm_api import Comms, WeightGather

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


class PlainGather(WeightGather):
    """``world.all_gather_async(full, shard)``: ZeRO-3's gather, exact."""

    name = "plain"

    def __init__(self, comms: Comms) -> None:
        self.world: Transport = comms.world

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        return self.world.all_gather_async(full, flat.compute_shard())

    def publish(self, flat: FlatShard) -> Work:
        """``world.all_gather_async(flat.full, copy of flat.shard)``: the shard is a view of
        the buffer it is gathered into (the transport's work holds the copy until done)."""
        return self.world.all_gather_async(flat.full, flat.shard.clone())
