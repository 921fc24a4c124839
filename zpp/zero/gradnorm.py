"""The global gradient norm of an optimizer step, and clipping by it.

With averaged gradients in the units' ``flat.grad`` (each rank holds its owned range, or
everything without sharding), the squared norm is the sum of the ranks' partial sums: one
scalar all-reduce where the gradient is sharded, none otherwise.

With a 1-bit optimizer (see [Note: 1-bit optimizers] in :mod:`zpp.zero.optimizer`) the
averaged gradient never exists outside the optimizer: its norm would need a full-precision
all-reduce of the gradients, the very traffic the compression stage removes. The engine
all-reduces one scalar instead and clips every rank's local gradient by the same
``min(1, clip / rms)``, ``rms = sqrt(mean over ranks of ||local gradient||^2)``. As
``||mean g|| <= rms``, the mean of the clipped gradients has norm ``<= clip``, as with DDP's
rule; but it clips more often (rms exceeds the averaged norm by the spread of the ranks'
gradients), equals DDP's rule on one rank, and costs a scalar all-reduce every step (0/1
Adam's local steps included). Without clipping nothing is computed then, and the norm
reported is None.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zpp.comm.transport import Transport
from zpp.zero.unit import Unit


def clip_grads(units: Sequence[Unit], *, world: Transport, clip: float, sharded: bool,
               local: bool) -> float | None:
    """Compute the gradient norm of ``units`` and scale their ``flat.grad`` so that it is at
    most ``clip`` (0: no clipping). ``sharded``: each rank holds a range of the averaged
    gradient; ``local``: each rank holds its own unaveraged gradient (1-bit optimizers).
    Returns the norm (None for ``local`` without clipping)."""
    if local and not clip:
        return None
    sq = torch.zeros((), dtype=torch.float64)
    for u in units:
        sq += u.grad_norm_sq()
    if local:  # rms of the local norms
        t = sq.reshape(1).clone()
        if world.world_size > 1:
            world.all_reduce(t, "sum")
        sq = t[0] / world.world_size
    elif sharded:
        t = sq.reshape(1).clone()
        world.all_reduce(t, "sum")
        sq = t[0]
    norm = float(sq.sqrt())
    if clip > 0:
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            for u in units:
                if u.flat.grad is not None:
                    u.flat.grad.mul_(coef)
    return norm
