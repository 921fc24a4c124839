"""An optimizer step's gradient check: the global norm, whether every rank's gradient is
finite, then unscaling (fp16) and clipping.

With averaged gradients in the units' ``flat.grad`` (each rank holds its owned range, or
everything without sharding), the squared norm is the sum of the ranks' partial sums: one
scalar all-reduce where the gradient is sharded, none otherwise.

[Note: the non-finite check rides on the norm]
The squared norm is summed in float64 from fp32 elements, so it is non-finite exactly when
some gradient element is (a finite fp32 square is below 1.2e77). So the check costs no
collective of its own (see [Note: agreeing on a non-finite step] in
:mod:`zpp.comm.nonfinite`):

* sharded gradients (stages 1-3): the partial sums go through the scalar all-reduce that
  the norm needs anyway; a NaN or Inf in one rank's gradient reached the owning rank's
  range through the reduce-scatter (full precision, or qgZ, whose block quantizer turns a
  group holding NaN or Inf into NaN: see ``zpp.quant``), so the summed norm is non-finite
  on every rank;
* unsharded (stage 0, or one rank): every rank holds the result of the same all-reduce
  of the gradient, which already carried any rank's NaN or Inf; the local norm agrees.
* 1-bit optimizers (local gradients, see below): with clipping, the rms all-reduce
  carries it; without, :func:`~zpp.comm.nonfinite.any_rank_nonfinite` all-reduces one
  4-byte flag, before the optimizer's compressed exchange runs. The local flag then costs
  one read of the gradient, except under fp16, where it comes out of the unscaling pass
  (torch's fused check-and-unscale, GradScaler's kernel), which runs anyway.

With a 1-bit optimizer (see [Note: 1-bit optimizers] in :mod:`zpp.zero.optimizer`) the
averaged gradient never exists outside the optimizer: its norm would need a full-precision
all-reduce of the gradients, the very traffic the compression stage removes. The engine
all-reduces one scalar instead and clips every rank's local gradient by the same
``min(1, clip / rms)``, ``rms = sqrt(mean over ranks of ||local gradient||^2)``. As
``||mean g|| <= rms``, the mean of the clipped gradients has norm ``<= clip``, as with DDP's
rule; but it clips more often (rms exceeds the averaged norm by the spread of the ranks'
gradients), equals DDP's rule on one rank, and costs a scalar all-reduce every step (0/1
Adam's local steps included). Without clipping no norm is computed, and the norm reported
is None.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from zpp.comm.nonfinite import any_rank_nonfinite, has_nonfinite
from zpp.comm.transport import Transport
from zpp.zero.unit import Unit

#: torch's fused unscale-and-check of GradScaler: multiplies every tensor by ``inv_scale``
#: and sets ``found_inf`` if any element is not finite, in one pass (None if absent).
_FUSED_UNSCALE = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


class GradCheck(NamedTuple):
    """The outcome of :func:`check_grads`, the same on every rank."""

    finite: bool
    """No rank's gradient holds NaN or Inf."""
    norm: float | None
    """The global norm of the gradients as they were checked (still scaled under fp16);
    None for a 1-bit optimizer without clipping."""
    unscaled: bool = False
    """The check divided the gradients by the loss scale already (fused with the scan)."""


def check_grads(units: Sequence[Unit], *, world: Transport, clip: float, sharded: bool,
                local: bool, scale: float = 1.0,
                waiting: Callable[[], contextlib.AbstractContextManager] | None = None) -> GradCheck:
    """The global gradient norm of ``units`` and whether it is finite on every rank; see
    [Note: the non-finite check rides on the norm]. ``sharded``: each rank holds a range
    of the averaged gradient; ``local``: each rank holds its own unaveraged gradient
    (1-bit optimizers); ``scale``: the fp16 loss scale in the gradients. Collective where
    the gradient is sharded or local; ``waiting()`` wraps that collective (the engine books
    it as a wait on the link: it waits for the slowest rank's reductions too)."""
    waiting = waiting or contextlib.nullcontext
    # on the gradients' device (NCCL all-reduces device tensors only)
    device = next((u.flat.grad.device for u in units if u.flat.grad is not None), torch.device("cpu"))
    if local and not clip:
        grads = [u.flat.grad for u in units if u.flat.grad is not None]
        fused = scale != 1.0 and bool(grads) and _FUSED_UNSCALE is not None
        if fused:
            found = torch.zeros(1, dtype=torch.float32, device=device)
            _FUSED_UNSCALE(grads, found, torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device))
            mine = bool(found[0] > 0)
        else:
            mine = any(has_nonfinite(g) for g in grads)
        with waiting():
            finite = not any_rank_nonfinite(world, mine, device)
        return GradCheck(finite=finite, norm=None, unscaled=fused)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for u in units:
        sq += u.grad_norm_sq().to(device)
    if local:  # rms of the local norms
        t = sq.reshape(1).clone()
        if world.world_size > 1:
            with waiting():
                world.all_reduce(t, "sum")
        sq = t[0] / world.world_size
    elif sharded:
        t = sq.reshape(1).clone()
        with waiting():
            world.all_reduce(t, "sum")
        sq = t[0]
    norm = float(sq.sqrt())
    return GradCheck(finite=math.isfinite(norm), norm=norm)


def unscale_and_clip(units: Sequence[Unit], *, norm: float | None, clip: float, scale: float = 1.0,
                     unscaled: bool = False) -> float | None:
    """Divide the units' ``flat.grad`` by the loss ``scale`` (unless ``unscaled``: the check
    did) and, with ``clip`` > 0, scale them so that their norm is at most ``clip`` (one
    multiplication). ``norm``: the norm from :func:`check_grads`. Returns the unscaled norm."""
    factor = 1.0 if unscaled else 1.0 / scale
    unscaled = None if norm is None else norm / scale
    if clip > 0 and unscaled is not None:
        coef = clip / (unscaled + 1e-6)
        if coef < 1.0:
            factor *= coef
    if factor != 1.0:
        for u in units:
            u.scale_grad(factor)
    return unscaled

