"""Non-finite values (NaN, +-Inf): found in a tensor, and agreed on by every rank.

    bad = any_rank_nonfinite(world, has_nonfinite(grad))   # the same answer on every rank

[Note: agreeing on a non-finite step]
A step with NaN or Inf in one rank's gradient must be skipped (or refused) by *every* rank,
or the replicas part ways (one steps, another does not) or a compressed exchange meets a
NaN on one rank only. The answer must therefore come from data every rank holds
identically, which costs a collective unless one already runs:

* a full-precision sum over ranks (an all-reduce of the gradient, or of a partial squared
  norm) carries the answer for free: NaN and Inf absorb every finite addend in any order
  (``Inf + -Inf`` is NaN), so the result is non-finite on every rank exactly when some
  input was (an fp32 sum of finite inputs overflows only beyond 3.4e38);
* otherwise :func:`any_rank_nonfinite` all-reduces one fp32 flag (4 bytes of payload),
  booked under its own name, ``"nonfinite_check"``, in the transport's counters.

:func:`has_nonfinite` reads a tensor once (``aminmax``: the max propagates NaN and exposes
+Inf, the min exposes -Inf) and allocates nothing proportional to it.
"""
from __future__ import annotations

import torch

from zpp.comm.transport import Transport

__all__ = ["CHECK_OP", "NonFiniteGradientError", "any_rank_nonfinite", "has_nonfinite"]

#: The counters' name of :func:`any_rank_nonfinite`'s all-reduce.
CHECK_OP = "nonfinite_check"


class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN or Inf on some rank and the configuration asks to fail
    (``zpp.nonfinite: "raise"``, an fp16 loss scale that cannot go lower, or a 1-bit
    optimizer built with ``nonfinite="raise"``). Raised on every rank together."""


def has_nonfinite(t: torch.Tensor | None) -> bool:
    """Whether ``t`` holds a NaN or an infinity (False for None or an empty tensor)."""
    if t is None or t.numel() == 0:
        return False
    if not t.is_floating_point():
        return False
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def any_rank_nonfinite(world: Transport, mine: bool, device: torch.device | str = "cpu") -> bool:
    """Collective: True on every rank when ``mine`` is True on some rank (one 4-byte
    all-reduce of a flag on ``device``, counted as ``"nonfinite_check"``; nothing on a
    single rank)."""
    if world.world_size == 1:
        return bool(mine)
    flag = torch.tensor([1.0 if mine else 0.0], dtype=torch.float32, device=device)
    with world.counters.collective(CHECK_OP, flag.element_size() * flag.numel()):
        world.all_reduce(flag, "max")
    return bool(flag[0] > 0)
