"""The hierarchical mode: ZeRO inside each node, streaming compressed DiLoCo across nodes.

=================================  ===========================================================
:mod:`~zpp.zero.outer.algorithm`   the outer optimizer on plain tensors ([Note: the outer step])
:mod:`~zpp.zero.outer.reduce`      the outer all-reduce, plain or compressed, by name
                                   ([Note: outer all-reduce bytes])
:mod:`~zpp.zero.outer.schedule`    fragments and their staggered schedule (Streaming DiLoCo)
:mod:`~zpp.zero.outer.sync`        :class:`OuterSync`, the engine's outer state and step
                                   ([Note: hierarchical mode], [Note: background outer sync],
                                   [Note: outer state in checkpoints])
=================================  ===========================================================

The engine reaches it through its mode (:mod:`zpp.zero.modes.outer`), which calls
:func:`node_world` once (the engine's data-parallel world becomes the node),
:func:`build_outer` once, and :meth:`OuterSync.after_inner_step` after each inner step.
"""
from __future__ import annotations

from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport
from zpp.zero.config import TrainConfig
from zpp.zero.outer.algorithm import merge, outer_step, pseudo_gradient
from zpp.zero.outer.reduce import OUTER_REDUCES, OuterReduce, build_outer_reduce
from zpp.zero.outer.schedule import Fragment, Piece, Schedule, cut
from zpp.zero.outer.sync import OuterStats, OuterSync

__all__ = [
    "OUTER_REDUCES", "Fragment", "OuterReduce", "OuterStats", "OuterSync", "Piece", "Schedule", "build_outer",
    "build_outer_reduce", "cut", "merge", "node_world", "outer_step", "pseudo_gradient",
]


def node_world(world: Transport, config: TrainConfig) -> Transport:
    """The engine's data-parallel world: ``world`` itself, or with ``zpp.outer`` the ranks of
    this rank's node (``topology_of(world).intra``; collective over ``world`` on first use)."""
    if config.zpp.outer is None:
        return world
    return topology_of(world).intra


def build_outer(engine) -> OuterSync | None:
    """The engine's :class:`OuterSync` (None without ``zpp.outer``), over its units and the
    inter-node ranks of its job world."""
    cfg = engine.train_config.zpp.outer
    if cfg is None:
        return None
    topo = topology_of(engine.job_world)
    inter = topo.inter
    if 1 < inter.world_size == engine.job_world.world_size:
        # one rank per node: the inter-node ranks are the whole world, whose communicator the
        # torch transport shares with them; the sync gets its own (see [Note: background outer sync])
        inter = engine.job_world.duplicate()
    return OuterSync(engine.units, cfg, inter, node=topo.node, world=engine.job_world,
                     owns_inter=inter is not topo.inter)
