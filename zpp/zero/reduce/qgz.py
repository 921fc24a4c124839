"""qgZ: ZeRO++'s gradient reduce-scatter, block-quantized in two hops.

:func:`zpp.comm.collectives.quantized_reduce_scatter`: an intra-node all-to-all of int4 (or
int8) codes in a swizzled layout, a fused dequantize-sum-requantize, an inter-node
all-to-all among the ranks of equal local rank, then dequantize and sum: the mean over every
rank of the owned range, within the two-stage quantization bound. ``zpp.gradient_bits`` and
``zpp.gradient_group_size`` (capped at the shard) set the code; per reduction size the tune
plan's choice replaces the width (``by_nbytes``, set by :func:`zpp.zero.plan_bits.apply_plan`;
a size the plan sends plain is reduce-scattered plain, in fp32). ``start`` runs hop 1 and
leaves hop 2 to the reduction's ``wait()``, so the overlapped reductions pipeline the hops
(see [Note: qgZ's hops pipelined] in :mod:`zpp.comm.collectives`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import quantized_reduce_scatter_hops, two_hop
from zpp.zero.comm_api import Comms, GradReduce, Reduction
from zpp.zero.config import DEFAULT_GRADIENT_BITS

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout


class QuantizedReduceScatter(GradReduce):
    """The two-hop quantized reduce-scatter over ``comms.topology``."""

    name = "qgz"
    needs = frozenset({"topology"})

    def __init__(self, comms: Comms) -> None:
        if comms.topology is None:
            raise ValueError("QuantizedReduceScatter: qgZ needs the topology of the world")
        self.topology = comms.topology
        bits = comms.config.zpp.gradient_bits
        self.bits = DEFAULT_GRADIENT_BITS if bits is None else bits
        self.group_size = comms.config.zpp.gradient_group_size
        #: reduction bytes (the fp32 input's) -> code width, None: plain; from the tune plan
        self.by_nbytes: dict[int, int | None] = {}
        #: hop 2 (at wait) runs over topology.inter only, apart from hop 1's communicators
        self.pipelined = two_hop(self.topology)

    def start(self, flat: torch.Tensor, layout: FlatLayout) -> Reduction:
        out = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        bits = self.by_nbytes.get(flat.numel() * flat.element_size(), self.bits)
        if bits is None:
            self.topology.world.reduce_scatter(out, flat, "mean")
            return Reduction(out)
        gs = min(self.group_size, layout.shard_numel)
        hops = quantized_reduce_scatter_hops(out, flat, topology=self.topology, bits=bits, group_size=gs)
        return Reduction(out, hops.work, held_numel=-(-hops.held_bytes // 4))

    def __repr__(self) -> str:
        plan = f", by_nbytes={self.by_nbytes}" if self.by_nbytes else ""
        return f"QuantizedReduceScatter(bits={self.bits}, group_size={self.group_size}{plan})"
