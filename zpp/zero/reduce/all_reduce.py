"""Unsharded gradients (stage 0): an all-reduce of the whole flat gradient, mean over ranks."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.zero.comm_api import Comms, GradReduce, Reduction

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout


class AllReduceMean(GradReduce):
    """``world.all_reduce(flat, "mean")`` in place; every rank keeps everything."""

    name = "all_reduce"

    def __init__(self, comms: Comms) -> None:
        self.world = comms.world

    def start(self, flat: torch.Tensor, layout: FlatLayout) -> Reduction:
        self.world.all_reduce(flat, "mean")
        return Reduction(flat)
