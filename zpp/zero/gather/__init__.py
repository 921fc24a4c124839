"""Weight gathers (stage 3), one file each, chosen once per engine by :func:`build_gathers`.

==========  =======================================  =============================
name        what crosses the wire                    file
==========  =======================================  =============================
``plain``   the shards, in the parameters' dtype     :mod:`~zpp.zero.gather.plain`
``qwz``     int8/int4 codes + fp32 group scales      :mod:`~zpp.zero.gather.qwz`
(hpZ)       wraps either: later gathers stay in      :mod:`~zpp.zero.gather.hpz`
            the node until the optimizer step
(hpZ delta) after a step, quantized differences      :mod:`~zpp.zero.gather.delta`
            refresh the node's copy over the
            inter-node hop only (int4: half of
            qwZ's int8 bytes)
==========  =======================================  =============================

Without sharded parameters the only gather is :attr:`Phase.EXACT`'s ``plain``, which
publishes the updated shards into the persistent parameters after each step (stages 1-2;
none at stage 0, where nothing is sharded). The forward gather is ``zpp.weight_gather`` when set, else ``qwz`` with
``zero_quantized_weights`` and ``plain`` without; the backward gather is ``plain`` (ZeRO++
keeps the backward in full precision); both are wrapped by hpZ when
``zero_hpz_partition_size > 1``, by hpZ refreshed with weight deltas when
``zpp.weight_delta_bits`` is set too. :attr:`Phase.EXACT` is always ``plain`` from the primary
shards. Adding a variant: a file here and a line in ``GATHERS``.
"""
from __future__ import annotations

from collections.abc import Callable

from zpp.zero.comm_api import Comms, Phase, WeightGather
from zpp.zero.gather.delta import DeltaSecondaryGather
from zpp.zero.gather.hpz import Secondaries, SecondaryGather
from zpp.zero.gather.plain import PlainGather, two_hop_topology
from zpp.zero.gather.qwz import QuantizedGather
from zpp.zero.policy import ShardingPolicy

__all__ = ["GATHERS", "DeltaSecondaryGather", "PlainGather", "QuantizedGather", "SecondaryGather", "build_gathers", "gather_needs",
           "two_hop_topology"]

#: name -> factory(comms)
GATHERS: dict[str, Callable[[Comms], WeightGather]] = {
    "plain": PlainGather,
    "qwz": QuantizedGather,
}


def forward_gather_name(comms: Comms) -> str:
    """The configured forward gather (see the module docstring); ValueError if unknown."""
    zero, name = comms.config.zero, comms.config.zpp.weight_gather
    if name is None:
        return "qwz" if zero.quantized_weights else "plain"
    if name not in GATHERS:
        raise ValueError(f"zpp.weight_gather={name!r} is not a weight gather; choices: {sorted(GATHERS)}")
    if zero.quantized_weights and name != "qwz":
        raise ValueError(f"zpp.weight_gather={name!r} contradicts zero_quantized_weights=true (which is 'qwz'); "
                         "set one of them")
    return name


def gather_needs(comms: Comms, policy: ShardingPolicy) -> frozenset[str]:
    """The resources the gathers :func:`build_gathers` would build need (nothing built)."""
    if not policy.shard_parameters:
        return frozenset({"topology"}) if comms.config.zpp.hierarchical_gather and policy.gather_after_step \
            else frozenset()
    needs = PlainGather.needs | GATHERS[forward_gather_name(comms)].needs
    if comms.config.zpp.hierarchical_gather:
        needs |= {"topology"}
    return needs | SecondaryGather.needs if policy.secondary_degree > 1 else needs


def build_gathers(comms: Comms, policy: ShardingPolicy) -> dict[Phase, WeightGather]:
    """The gather of each phase for an engine (stage 3); without sharded parameters only
    the one that publishes updated shards (stages 1-2), or none (stage 0)."""
    if not policy.shard_parameters:
        return {Phase.EXACT: PlainGather(comms)} if policy.gather_after_step else {}
    plain = PlainGather(comms)
    name = forward_gather_name(comms)
    forward = plain if name == "plain" else GATHERS[name](comms)
    backward = plain
    # zpp.weight_delta_bits without hpZ is refused by TrainConfig before an engine exists
    if policy.secondary_degree > 1:  # one store: see [Note: the secondary shard belongs to hpZ]
        delta = comms.config.zpp.weight_delta_bits is not None
        store = Secondaries(comms.topology, counterparts=delta)
        wrap = DeltaSecondaryGather if delta else SecondaryGather
        forward, backward = wrap(comms, forward, store), wrap(comms, backward, store)
    return {Phase.FORWARD: forward, Phase.BACKWARD: backward, Phase.EXACT: plain}
