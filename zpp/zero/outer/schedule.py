"""Streaming: which piece of a rank's weights is synced when (Streaming DiLoCo's fragments).

[Note: fragments]
A rank's trainable weights are its units' fp32 master shards, in unit order. Laid end to end
they are cut into ``F`` contiguous fragments of equal size (the first ``T mod F`` one element
longer, ``T`` the total), so every sync moves the same bytes whatever the units are (blocks at
stage 3, size-capped buckets below). A fragment is a list of :class:`Piece`: ranges of the
masters of one or more units. Every rank of a node holds shards of equal size, and its
counterparts on the other nodes hold the same layout, so fragment ``f`` of local rank ``l``
lines up with fragment ``f`` of local rank ``l`` on every node: they are reduced together.

[Note: staggered schedule]
Positions count the inner optimizer steps taken (1 after the first). Fragment ``f`` of ``F``
starts a sync after the steps ``p`` with ``p mod H == floor((f + 1) H / F) mod H``, so over
any ``H`` consecutive steps every fragment starts exactly once, the last fragment at the
multiples of ``H`` (with ``F = 1``: plain DiLoCo, all at once every ``H`` steps), and the
starts spread evenly over the period. A sync started after step ``p`` lands (its outer
update is applied) after step ``p + tau``; ``tau < H``, so it lands before the fragment's next
start.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Fragment", "Piece", "Schedule", "cut"]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """``[lo, hi)`` of the master shard of the ``unit``-th trainable unit."""

    unit: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment of a rank's weights (see [Note: fragments])."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def cut(shard_numels: Sequence[int], fragments: int) -> tuple[Fragment, ...]:
    """The ``fragments`` fragments of shards of ``shard_numels`` elements laid end to end
    (see [Note: fragments]); ValueError when there are fewer elements than fragments."""
    total = sum(shard_numels)
    if fragments < 1 or fragments > total:
        raise ValueError(f"zpp.outer.fragments={fragments} must be between 1 and the {total} trainable elements "
                         "of a rank's shards")
    bounds = [(k * total) // fragments for k in range(fragments + 1)]
    starts = [0]
    for n in shard_numels:
        starts.append(starts[-1] + n)
    out = []
    for f in range(fragments):
        lo, hi = bounds[f], bounds[f + 1]
        pieces = []
        for u, n in enumerate(shard_numels):
            a, b = max(lo, starts[u]), min(hi, starts[u] + n)
            if a < b:
                pieces.append(Piece(u, a - starts[u], b - starts[u]))
        out.append(Fragment(f, tuple(pieces)))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """When each fragment starts and lands (see [Note: staggered schedule])."""

    sync_every: int
    """H."""
    fragments: int
    """F."""
    delay: int = 0
    """tau, in ``[0, H)``."""

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.fragments < 1 or not 0 <= self.delay < self.sync_every:
            raise ValueError(f"Schedule: sync_every={self.sync_every}, fragments={self.fragments}, "
                             f"delay={self.delay}: need H >= 1, F >= 1 and 0 <= delay < H")

    def phase(self, f: int) -> int:
        """The residue mod H of the steps after which fragment ``f`` starts."""
        return ((f + 1) * self.sync_every // self.fragments) % self.sync_every

    def starting(self, position: int) -> list[int]:
        """Fragments whose sync starts after inner step ``position`` (>= 1)."""
        if position < 1:
            return []
        r = position % self.sync_every
        return [f for f in range(self.fragments) if self.phase(f) == r]

    def landing(self, position: int) -> list[int]:
        """Fragments whose sync, started ``delay`` steps before, lands after step ``position``."""
        return self.starting(position - self.delay)
