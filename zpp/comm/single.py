"""A transport over one rank: the group of a rank alone (the intra-node group of a node
with one rank, the inter-node group of a job on one node).

Every collective over one rank is a local copy or nothing, which :class:`Transport` already
does before it would call a backend, so this class never talks to a backend. It exists so
that :meth:`~zpp.comm.topology.Topology.build` can give a one-member group without asking
the backend for one: ``torch.distributed.new_group`` must be entered by every rank of the
default group, so a torch transport can only make sub-groups of the world; with one-member
groups made here, the topology of a sub-transport (an engine running on the ranks of one
node, the outer sync running across nodes) can be built on any backend.
"""
from __future__ import annotations

import torch

from zpp.comm.counters import WireCounters
from zpp.comm.transport import Transport

__all__ = ["SingleRankTransport"]


class SingleRankTransport(Transport):
    """The group of one rank: global rank ``rank`` on node ``node``, booking its (zero)
    traffic in ``counters`` (the parent transport's)."""

    name = "single"

    def __init__(self, rank: int, node: int, counters: WireCounters | None = None,
                 check_metadata: bool = True) -> None:
        super().__init__(0, 1, (rank,), (node,), counters=counters, check_metadata=check_metadata)

    # Transport answers every call on one rank before reaching these.
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise AssertionError("SingleRankTransport: unreachable (one rank)")

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        raise AssertionError("SingleRankTransport: unreachable (one rank)")

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        raise AssertionError("SingleRankTransport: unreachable (one rank)")

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise AssertionError("SingleRankTransport: unreachable (one rank)")

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        raise AssertionError("SingleRankTransport: unreachable (one rank)")

    def barrier(self) -> None:
        return None

    def _subgroup(self, members: tuple[int, ...]) -> Transport:
        return self

    def duplicate(self) -> Transport:
        return self  # one rank: no collective ever runs
