"""No reduction: the optimizer averages the gradients itself (the 1-bit optimizers).

The unit's locally accumulated gradient (the micro-steps' ``loss / gas`` gradients summed in
``.grad``) becomes its fp32 flat gradient as it is; see [Note: 1-bit optimizers] in
:mod:`zpp.zero.optimizer`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.zero.comm_api import Comms, GradReduce, Reduction

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout


class LocalGrad(GradReduce):
    """Returns this rank's own gradient: nothing is communicated."""

    name = "local"
    averages = False

    def __init__(self, comms: Comms) -> None:
        del comms

    def start(self, flat: torch.Tensor, layout: FlatLayout) -> Reduction:
        return Reduction(flat)
