"""The pipelined ring reduce-scatter both transports run on their point-to-point messages
(TorchTransport on gloo, MpiTransport on MPI): the schedule once, the messages theirs.

[Note: ring reduce-scatter]
Ranks in node order (``ring_order``: by node, then rank, so the ring crosses into and out of
each node once). ``W - 1`` steps; the buffer ``i`` is ``W`` slices, slice ``j`` reduced onto
rank ``j``. Step 0 sends this rank's part of the slice of the rank before it; step ``s`` receives
the partial sum of slice ``order[pos - s - 2]``, adds this rank's part and sends it on; the last
step's sum is this rank's own slice, written to ``o``. Each step's slice goes in pieces of about
``piece_bytes`` (at most ``max_pieces``) so that the next step of one piece overlaps the
transfer of the next. A rank sends ``(W - 1) / W`` of the buffer, a node's link carries one
slice per step each way. Sums run in the input dtype, in ring order.

Three receive buffers rotate: one is received into again only after the send that read it has
completed. Messages of one piece share a tag; both transports match a pair's messages in order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ring_order", "ring_reduce_scatter"]


def ring_order(nodes: Sequence[int]) -> list[int]:
    """Group ranks in ring order: by node, then rank."""
    return sorted(range(len(nodes)), key=lambda q: (nodes[q], q))


def ring_reduce_scatter(
    o: torch.Tensor,
    i: torch.Tensor,
    *,
    rank: int,
    order: Sequence[int],
    isend: Callable[[torch.Tensor, int, int], Any],
    irecv: Callable[[torch.Tensor, int, int], Any],
    wait: Callable[[Any], None],
    piece_bytes: int,
    max_pieces: int,
) -> None:
    """``o`` = the sum over ranks of slice ``rank`` of ``i`` (see the Note).

    ``isend(tensor, peer, tag)`` / ``irecv(tensor, peer, tag)`` start a message to / from
    group rank ``peer`` and return a handle; ``wait(handle)`` completes it (raising on a
    timeout or a lost peer)."""
    n = len(order)
    pos = order.index(rank)
    nxt, prv = order[(pos + 1) % n], order[(pos - 1) % n]
    rows = i.view(n, -1)
    m = rows.shape[1]
    pieces = max(1, min(max_pieces, -(-m * i.element_size() // piece_bytes), m))
    cuts = [m * c // pieces for c in range(pieces + 1)]
    spans = [slice(cuts[c], cuts[c + 1]) for c in range(pieces)]
    bufs = [torch.empty(m, dtype=i.dtype, device=i.device) for _ in range(min(3, n - 1))]
    sends: dict[tuple[int, int], Any] = {}
    recvs: dict[tuple[int, int], Any] = {}
    first = rows[order[(pos - 1) % n]]
    for c, sp in enumerate(spans):
        recvs[0, c] = irecv(bufs[0][sp], prv, c)
        sends[0, c] = isend(first[sp], nxt, c)
    for s in range(n - 1):
        got, mine = bufs[s % len(bufs)], rows[order[(pos - s - 2) % n]]
        for c, sp in enumerate(spans):
            wait(recvs.pop((s, c)))
            if s == n - 2:
                torch.add(got[sp], mine[sp], out=o[sp])
                continue
            got[sp].add_(mine[sp])
            if (s - 1, c) in sends:
                wait(sends.pop((s - 1, c)))
            recvs[s + 1, c] = irecv(bufs[(s + 1) % len(bufs)][sp], prv, c)
            sends[s + 1, c] = isend(got[sp], nxt, c)
    for handle in sends.values():
        wait(handle)
