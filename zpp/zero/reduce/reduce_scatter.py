"""Sharded gradients (stages 1-3): a reduce-scatter into the owned range, mean over ranks."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.zero.comm_api import Comms, GradReduce, Reduction

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout


class ReduceScatterMean(GradReduce):
    """``world.reduce_scatter(out, flat, "mean")``, full precision (the transport's own ring
    or MPI's, see :mod:`zpp.comm`)."""

    name = "reduce_scatter"

    def __init__(self, comms: Comms) -> None:
        self.world = comms.world

    def start(self, flat: torch.Tensor, layout: FlatLayout) -> Reduction:
        out = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        self.world.reduce_scatter(out, flat, "mean")
        return Reduction(out)
