"""qwZ: the forward weight gather of ZeRO++, block-quantized on the wire.

Each rank quantizes its shard (symmetric int8 or int4, one fp32 scale per group) and every
rank receives ``dequantize(quantize(shard))`` of every rank, so all ranks compute with the
same weights; the stored shards keep full precision. The group size is capped at the shard
(:func:`zpp.comm.collectives.effective_group_size` caps it further for tiny shards).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import quantized_all_gather_async
from zpp.comm.transport import Work
from zpp.zero.comm_api import Comms, WeightGather

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


class QuantizedGather(WeightGather):
    """``quantized_all_gather_async`` with ``zpp.weight_bits`` and ``zpp.weight_group_size``."""

    name = "qwz"

    def __init__(self, comms: Comms) -> None:
        self.world = comms.world
        self.bits = comms.config.zpp.weight_bits
        self.group_size = comms.config.zpp.weight_group_size

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        gs = min(self.group_size, flat.layout.shard_numel)
        return quantized_all_gather_async(full, flat.compute_shard(), transport=self.world, bits=self.bits, group_size=gs)

    def __repr__(self) -> str:
        return f"QuantizedGather(bits={self.bits}, group_size={self.group_size})"
