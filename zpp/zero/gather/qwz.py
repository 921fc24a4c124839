"""qwZ: the forward weight gather of ZeRO++, block-quantized on the wire.

Each rank quantizes its shard (symmetric int8 or int4, one fp32 scale per group) and every
rank receives ``dequantize(quantize(shard))`` of every rank, so all ranks compute with the
same weights; the stored shards keep full precision. The group size is capped at the shard
(:func:`zpp.comm.collectives.effective_group_size` caps it further for tiny shards). The code
width is ``zpp.weight_bits``, or per gather size the tune plan's choice (``by_nbytes``, set
by :func:`zpp.zero.plan_bits.apply_plan`; a size the plan sends plain is gathered plain).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import quantized_all_gather_async
from zpp.comm.transport import Work
from zpp.zero.comm_api import Comms, WeightGather
from zpp.zero.config import DEFAULT_WEIGHT_BITS
from zpp.zero.gather.plain import all_gather_async, two_hop_topology

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


class QuantizedGather(WeightGather):
    """``quantized_all_gather_async`` with ``zpp.weight_bits`` and ``zpp.weight_group_size``."""

    name = "qwz"

    def __init__(self, comms: Comms) -> None:
        self.world = comms.world
        self.topology = two_hop_topology(comms)
        bits = comms.config.zpp.weight_bits
        self.bits = DEFAULT_WEIGHT_BITS if bits is None else bits
        self.group_size = comms.config.zpp.weight_group_size
        #: gather bytes (the full buffer's) -> code width, None: plain; from the tune plan
        self.by_nbytes: dict[int, int | None] = {}

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        bits = self.by_nbytes.get(full.numel() * full.element_size(), self.bits)
        if bits is None:
            return all_gather_async(self.world, self.topology, full, flat.compute_shard())
        # (the collective caps the group at the shard: effective_group_size)
        return quantized_all_gather_async(full, flat.compute_shard(), transport=self.world, bits=bits,
                                          group_size=self.group_size,
                                          topology=self.topology)

    def __repr__(self) -> str:
        plan = f", by_nbytes={self.by_nbytes}" if self.by_nbytes else ""
        return f"QuantizedGather(bits={self.bits}, group_size={self.group_size}{plan})"
