"""The outer optimizer of DiLoCo, on plain tensors: nothing here knows about nodes, shards,
fragments or configs.

[Note: the outer step]
Each replica starts a round from the synced weights ``anchor`` and trains alone; at the sync
the replicas average their pseudo-gradients ``anchor - weights`` into ``delta``, and the
outer optimizer treats ``delta`` as the gradient of ``anchor``: SGD with momentum ``mu`` and
learning rate ``lr``, Nesterov or heavy-ball, written exactly as ``torch.optim.SGD`` writes it
(no dampening)::

    buf    = mu * buf + delta                 (buf starts at 0, so the first buf is delta)
    step   = delta + mu * buf  (Nesterov)  |  buf  (heavy-ball)  |  delta  (mu = 0: no buf)
    anchor = anchor - lr * step

and every replica continues from the new ``anchor``. ``lr = 1, mu = 0`` makes the new anchor
the mean of the replicas' weights (federated averaging); DiLoCo uses ``lr = 0.7, mu = 0.9``,
Nesterov. With a delay (Streaming DiLoCo) the replica has taken more local steps by the time
the update lands; its weights become ``mix * local + (1 - mix) * anchor``
(:func:`merge`).
"""
from __future__ import annotations

import torch

__all__ = ["merge", "outer_step", "pseudo_gradient"]


def pseudo_gradient(anchor: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``anchor - weights`` (fp32), into ``out`` when given."""
    if out is None:
        return anchor.float() - weights.float()
    return torch.sub(anchor, weights, out=out)


def outer_step(anchor: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None, *, lr: float,
               momentum: float, nesterov: bool) -> None:
    """One outer step in place on ``anchor`` (and the momentum ``buf``; None when
    ``momentum`` is 0); see [Note: the outer step]. ``delta`` is not modified."""
    if momentum:
        if buf is None:
            raise ValueError(f"outer_step: momentum={momentum} needs a momentum buffer")
        buf.mul_(momentum).add_(delta)
        step = delta.add(buf, alpha=momentum) if nesterov else buf
    else:
        step = delta
    anchor.add_(step, alpha=-lr)


def merge(weights: torch.Tensor, anchor: torch.Tensor, mix: float) -> None:
    """``weights = mix * weights + (1 - mix) * anchor`` in place (``mix`` 0: a copy)."""
    if mix == 0:
        weights.copy_(anchor)
    else:
        weights.mul_(mix).add_(anchor, alpha=1.0 - mix)
