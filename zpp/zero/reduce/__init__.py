"""Gradient reductions, one file each, chosen once per engine by :func:`build_reduce`.

==================  ===============================================  ======================================
name                what it does                                     file
==================  ===============================================  ======================================
``all_reduce``      mean of the whole gradient on every rank         :mod:`~zpp.zero.reduce.all_reduce`
``reduce_scatter``  mean of the owned range, full precision          :mod:`~zpp.zero.reduce.reduce_scatter`
``qgz``             mean of the owned range, quantized in two hops   :mod:`~zpp.zero.reduce.qgz`
``local``           nothing: the optimizer averages (1-bit)          :mod:`~zpp.zero.reduce.local`
==================  ===============================================  ======================================

The reduction is ``zpp.gradient_reduce`` when set, else: ``local`` with a 1-bit optimizer,
``all_reduce`` without sharded optimizer state (stage 0), ``qgz`` with
``zero_quantized_gradients`` on more than one rank, ``reduce_scatter`` otherwise. Adding a
variant: a file here and a line in ``REDUCES``.
"""
from __future__ import annotations

from collections.abc import Callable

from zpp.zero.comm_api import Comms, GradReduce
from zpp.zero.policy import ShardingPolicy
from zpp.zero.reduce.all_reduce import AllReduceMean
from zpp.zero.reduce.local import LocalGrad
from zpp.zero.reduce.qgz import QuantizedReduceScatter
from zpp.zero.reduce.reduce_scatter import ReduceScatterMean

__all__ = ["REDUCES", "AllReduceMean", "LocalGrad", "QuantizedReduceScatter", "ReduceScatterMean", "build_reduce"]

#: name -> factory(comms)
REDUCES: dict[str, Callable[[Comms], GradReduce]] = {
    "all_reduce": AllReduceMean,
    "reduce_scatter": ReduceScatterMean,
    "qgz": QuantizedReduceScatter,
    "local": LocalGrad,
}
_SHARDED = ("reduce_scatter", "qgz")  # return the owned range only


def reduce_name(comms: Comms, policy: ShardingPolicy) -> str:
    """The configured reduction (see the module docstring); ValueError if it cannot serve
    the policy."""
    cfg = comms.config
    optimizer_averages = cfg.optimizer is not None and cfg.optimizer.onebit
    name = cfg.zpp.gradient_reduce
    if name is None:
        if optimizer_averages:
            return "local"
        if not policy.shard_optimizer_state:
            return "all_reduce"
        return "qgz" if cfg.zero.quantized_gradients and comms.world.world_size > 1 else "reduce_scatter"
    if name not in REDUCES:
        raise ValueError(f"zpp.gradient_reduce={name!r} is not a gradient reduction; choices: {sorted(REDUCES)}")
    if (name in _SHARDED) != policy.shard_optimizer_state:
        raise ValueError(f"zpp.gradient_reduce={name!r} does not fit ZeRO stage {cfg.zero.stage} "
                         f"({'' if policy.shard_optimizer_state else 'un'}sharded gradients)")
    if optimizer_averages != (name == "local"):
        raise ValueError(f"zpp.gradient_reduce={name!r}: 'local' goes with the 1-bit optimizers, and only "
                         "they (they average the gradients themselves)")
    if cfg.zero.quantized_gradients and name != "qgz":
        raise ValueError(f"zpp.gradient_reduce={name!r} contradicts zero_quantized_gradients=true (which is "
                         "'qgz'); set one of them")
    return name


def build_reduce(comms: Comms, policy: ShardingPolicy) -> GradReduce:
    """The gradient reduction of an engine."""
    return REDUCES[reduce_name(comms, policy)](comms)
