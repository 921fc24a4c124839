"""qgZ: ZeRO++'s gradient reduce-scatter, block-quantized in two hops.

:func:`zpp.comm.collectives.quantized_reduce_scatter`: an intra-node all-to-all of int4 (or
int8) codes in a swizzled layout, a fused dequantize-sum-requantize, an inter-node
all-to-all among the ranks of equal local rank, then dequantize and sum: the mean over every
rank of the owned range, within the two-stage quantization bound. ``zpp.gradient_bits`` and
``zpp.gradient_group_size`` (capped at the shard) set the code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import quantized_reduce_scatter
from zpp.zero.comm_api import Comms, GradReduce

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout


class QuantizedReduceScatter(GradReduce):
    """The two-hop quantized reduce-scatter over ``comms.topology``."""

    name = "qgz"

    def __init__(self, comms: Comms) -> None:
        if comms.topology is None:
            raise ValueError("QuantizedReduceScatter: qgZ needs the topology of the world")
        self.topology = comms.topology
        self.bits = comms.config.zpp.gradient_bits
        self.group_size = comms.config.zpp.gradient_group_size

    def __call__(self, flat: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        out = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        gs = min(self.group_size, layout.shard_numel)
        quantized_reduce_scatter(out, flat, topology=self.topology, bits=self.bits, group_size=gs)
        return out

    def __repr__(self) -> str:
        return f"QuantizedReduceScatter(bits={self.bits}, group_size={self.group_size})"
