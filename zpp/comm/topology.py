"""Where the ranks are: the node layout and the flat / intra-node / inter-node transports.

A job of ``world_size`` ranks runs on ``nodes`` nodes of ``ranks_per_node`` ranks each, and
ranks are numbered node-major (``rank = node * ranks_per_node + local_rank``), as torchrun
and ``mpiexec -ppn`` number them. :class:`Layout` is that grid; :class:`Topology` turns a
world transport into the three transports the hierarchical collectives use::

    world   0 1 2 3        (2 nodes x 2 ranks)
    intra   [0 1] [2 3]    ranks of one node: fast links
    inter   [0 2] [1 3]    one rank per node, same local rank: the slow network

The layout is read from the environment once, at the transport's entry point
(:meth:`Layout.from_env`); below that, code asks the transport (``world.nodes``).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from zpp.comm.single import SingleRankTransport
from zpp.comm.transport import Transport

RANKS_PER_NODE_ENV = "ZPP_RANKS_PER_NODE"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A node-major grid of ranks.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks in the job.
        ranks_per_node: ranks on each node; must divide ``world_size`` (all nodes are equal).
    """

    rank: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"Layout: world_size={self.world_size} must be >= 1")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"Layout: ranks_per_node={self.ranks_per_node} must be positive and divide "
                f"world_size={self.world_size} (every node must hold the same number of ranks)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Layout: rank={self.rank} outside world_size={self.world_size}")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node index of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"node_of: rank={rank} outside world_size={self.world_size}")
        return rank // self.ranks_per_node

    def node_list(self) -> list[int]:
        """Node index of every rank, in rank order (what ``Transport.nodes`` holds)."""
        return [r // self.ranks_per_node for r in range(self.world_size)]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(
        cls,
        rank: int,
        world_size: int,
        env: Mapping[str, str] = os.environ,
        mpi_comm: Any = None,
    ) -> Layout:
        """The layout of a job, from the first source that says:

        1. ``ZPP_RANKS_PER_NODE`` (overrides everything; emulated clusters set it),
        2. torchrun's ``LOCAL_WORLD_SIZE``,
        3. with an mpi4py communicator, MPI's shared-memory split
           (``Split_type(COMM_TYPE_SHARED)``): collective over ``mpi_comm``, and every rank
           raises the same ``ValueError`` if the nodes are unequal or not node-major,
        4. otherwise one node holding every rank.
        """
        for var in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE"):
            value = env.get(var)
            if value:
                try:
                    per_node = int(value)
                except ValueError:
                    raise ValueError(f"Layout: {var}={value!r} is not an integer") from None
                return cls(rank=rank, world_size=world_size, ranks_per_node=per_node)
        if mpi_comm is not None:
            return cls._from_mpi(rank, world_size, mpi_comm)
        return cls(rank=rank, world_size=world_size, ranks_per_node=world_size)

    @classmethod
    def from_node_keys(cls, rank: int, keys: Sequence[Any]) -> Layout:
        """The layout from a per-rank node identifier (``keys[r]`` names rank ``r``'s node,
        e.g. a host name or the lowest rank on the node). Raises ``ValueError`` with the
        node sizes if nodes are unequal or their ranks are not contiguous. Every rank that
        passes the same ``keys`` gets the same answer, so the decision is collective."""
        runs = _runs(keys)
        seen: set = set()
        for key, _start, _length in runs:
            if key in seen:
                members = [r for r, k in enumerate(keys) if k == key]
                raise ValueError(
                    f"Layout: ranks are not numbered node-major: node {key!r} holds ranks "
                    f"{members} (every node's ranks must be contiguous, e.g. "
                    f"mpiexec -ppn / --map-by core); node of each rank: {list(keys)}"
                )
            seen.add(key)
        sizes = [length for _key, _start, length in runs]
        if len(set(sizes)) > 1:
            raise ValueError(f"Layout: nodes hold unequal numbers of ranks: {sizes} (node of each rank: {list(keys)})")
        return cls(rank=rank, world_size=len(keys), ranks_per_node=sizes[0])

    @classmethod
    def _from_mpi(cls, rank: int, world_size: int, comm: Any) -> Layout:
        from mpi4py import MPI

        if comm.Get_size() != world_size:
            raise ValueError(f"Layout: the MPI communicator has {comm.Get_size()} ranks, {world_size=}")
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            # The lowest rank of a node names it; every rank learns every rank's node.
            leader = min(local.allgather(rank))
        finally:
            local.Free()
        keys = comm.allgather(leader)
        return cls.from_node_keys(rank, keys)


def agree_on_layout(world: Transport, env: Mapping[str, str] = os.environ, mpi_comm: Any = None) -> Layout:
    """:meth:`Layout.from_env` on every rank of ``world``, then a check that every rank read
    the same layout; collective over ``world``. A bad environment on any rank makes every
    rank raise the same ``ValueError`` (naming what each rank saw) instead of some ranks
    going on and hanging. Backends call it from their entry points."""
    import torch  # the check travels as a tiny int64 tensor over the transport itself

    rank, world_size = world.rank, world.world_size
    error = None
    try:
        layout = Layout.from_env(rank, world_size, env, mpi_comm)
        local = layout.local_rank
        if not env.get(RANKS_PER_NODE_ENV) and env.get("LOCAL_WORLD_SIZE"):
            local = int(env.get("LOCAL_RANK", local))  # torchrun's numbering: check it is node-major
        mine = [layout.ranks_per_node, local]
    except ValueError as e:
        error, mine = e, [0, -1]
    if world_size > 1:
        everyone = torch.empty(2 * world_size, dtype=torch.int64)
        world._meta_all_gather(everyone, torch.tensor(mine, dtype=torch.int64))
        per_node, locals_ = everyone.view(world_size, 2).T.tolist()
    else:
        per_node, locals_ = [mine[0]], [mine[1]]
    if error is not None:
        raise error
    if 0 in per_node or len(set(per_node)) > 1:
        raise ValueError(f"Layout: ranks disagree on the node layout: ranks per node as each rank read it: {per_node}")
    expected = [r % per_node[0] for r in range(world_size)]
    if locals_ != expected:
        raise ValueError(
            f"Layout: ranks are not numbered node-major: LOCAL_RANK of each rank {locals_}, "
            f"expected {expected} for {per_node[0]} ranks per node"
        )
    return layout


def _runs(keys: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """Maximal runs of equal consecutive keys, as (key, start, length)."""
    runs: list[tuple[Any, int, int]] = []
    for r, key in enumerate(keys):
        if runs and runs[-1][0] == key:
            k, start, length = runs[-1]
            runs[-1] = (k, start, length + 1)
        else:
            runs.append((key, r, 1))
    return runs


class Topology:
    """The world transport and its intra-node and inter-node sub-transports.

    Build it with :meth:`Topology.build` (or :func:`topology_of`, which caches it); every rank
    of ``world`` must make the call, since it creates sub-groups collectively.

    Attributes:
        layout: the node grid of ``world``.
        world: the flat transport over every rank.
        intra: this rank's node (``ranks_per_node`` members, local-rank order).
        inter: the ranks with this rank's local rank on every node (``nodes`` members,
            node order).
    """

    __slots__ = ("layout", "world", "intra", "inter")

    def __init__(self, layout: Layout, world: Transport, intra: Transport, inter: Transport) -> None:
        self.layout = layout
        self.world = world
        self.intra = intra
        self.inter = inter

    @classmethod
    def build(cls, world: Transport) -> Topology:
        """Collective over ``world``: derive the layout from ``world.nodes`` (which must be
        equal, contiguous nodes) and create every intra-node and every inter-node group on
        every rank, in the same order, keeping the two that contain this rank. A group of
        one rank is a :class:`~zpp.comm.single.SingleRankTransport` (no backend group), so
        the topology of a sub-transport (the ranks of one node, or one rank per node) can be
        built too."""
        layout = Layout.from_node_keys(world.rank, world.nodes)
        per, n = layout.ranks_per_node, layout.nodes

        def group(members: range) -> Transport | None:
            if len(members) > 1 or world.world_size == 1:
                return world.subgroup(members)
            # one member: no backend group (see zpp.comm.single); every rank skips alike
            m = members[0]
            if m != world.rank:
                return None
            return world.derived(SingleRankTransport(world.ranks[m], world.nodes[m], counters=world.counters,
                                                     check_metadata=world.check_metadata))

        intra = inter = None
        for node in range(n):
            sub = group(range(node * per, (node + 1) * per))
            if node == layout.node:
                intra = sub
        for local in range(per):
            sub = group(range(local, world.world_size, per))
            if local == layout.local_rank:
                inter = sub
        if intra is None or inter is None:  # a backend broke the _subgroup contract
            raise RuntimeError(f"Topology.build: {world!r} returned no sub-transport for rank {world.rank}")
        return cls(layout, world, intra, inter)

    rank = property(lambda self: self.layout.rank)
    world_size = property(lambda self: self.layout.world_size)
    ranks_per_node = property(lambda self: self.layout.ranks_per_node)
    nodes = property(lambda self: self.layout.nodes)
    node = property(lambda self: self.layout.node)
    local_rank = property(lambda self: self.layout.local_rank)

    def __repr__(self) -> str:
        return (
            f"Topology(rank={self.rank}, nodes={self.nodes}, ranks_per_node={self.ranks_per_node}, "
            f"intra={self.intra.ranks}, inter={self.inter.ranks})"
        )


_CACHE_ATTR = "_zpp_topology"


def cached_topology(world: Transport) -> Topology | None:
    """The topology :func:`topology_of` cached on ``world``, or None (nothing is built)."""
    return getattr(world, _CACHE_ATTR, None)


def topology_of(world: Transport) -> Topology:
    """The :class:`Topology` of ``world``, built on first use (collectively: the first call
    must be made by every rank) and cached on the transport object."""
    topo = getattr(world, _CACHE_ATTR, None)
    if topo is None:
        topo = Topology.build(world)
        setattr(world, _CACHE_ATTR, topo)
    return topo
