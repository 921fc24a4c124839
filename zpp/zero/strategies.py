"""The engine's collectives: the strategies a config names, and what they need built for them.

Each strategy class declares the resources it communicates over (``needs``: a set of names
of ``RESOURCES``, e.g. hpZ and qgZ need ``"topology"``, the node structure of the world). The
engine resolves the configured strategies by name first (:func:`needs`), builds exactly the
resources they need (:func:`build_comms`; building the topology is collective, and every
rank resolves the same names), then constructs the strategies over them. So what the engine
builds follows from the chosen strategies, not from the DeepSpeed switches that may have
chosen them: ``"zpp": {"gradient_reduce": "qgz"}`` gets the topology as
``zero_quantized_gradients`` does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport
from zpp.zero.comm_api import Comms
from zpp.zero.config import TrainConfig
from zpp.zero.gather import gather_needs
from zpp.zero.policy import ShardingPolicy
from zpp.zero.reduce import REDUCES, reduce_name

__all__ = ["RESOURCES", "build_comms", "build_reduce_comms", "needs"]

#: resource name -> builder(world): what a strategy may declare in ``needs``
RESOURCES: dict[str, Callable[[Transport], Any]] = {
    "topology": topology_of,
}


def needs(comms: Comms, policy: ShardingPolicy) -> frozenset[str]:
    """The resources of the strategies ``comms.config`` chooses (names checked: ValueError)."""
    wanted = gather_needs(comms, policy) | REDUCES[reduce_name(comms, policy)].needs
    unknown = sorted(wanted - RESOURCES.keys())
    if unknown:
        raise ValueError(f"zpp: a strategy needs {unknown}, which the engine cannot build; it builds "
                         f"{sorted(RESOURCES)}")
    return wanted


def _with_resources(world: Transport, config: TrainConfig, wanted: frozenset[str]) -> Comms:
    return Comms(world=world, config=config,
                 topology=RESOURCES["topology"](world) if "topology" in wanted else None)


def build_comms(world: Transport, config: TrainConfig, policy: ShardingPolicy) -> Comms:
    """What the strategies of ``config`` communicate over, with the resources they need
    (collective over ``world`` when one of them is built the first time)."""
    return _with_resources(world, config, needs(Comms(world=world, topology=None, config=config), policy))


def build_reduce_comms(world: Transport, config: TrainConfig, policy: ShardingPolicy) -> Comms:
    """What the gradient reduction alone communicates over, built on ``world`` (the
    duplicate the reduction thread runs on, see [Note: overlapped reductions] in
    :mod:`zpp.zero.reduce.overlap`): the resources only it needs."""
    bare = Comms(world=world, topology=None, config=config)
    return _with_resources(world, config, REDUCES[reduce_name(bare, policy)].needs)
