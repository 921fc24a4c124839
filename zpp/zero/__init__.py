"""ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ), DeepSpeed-compatible.

:func:`initialize` (:mod:`~zpp.zero.api`) builds a :class:`ZeroEngine`
(:mod:`~zpp.zero.engine`, whose docstring maps every concern to its module) from a
DeepSpeed-style config (:mod:`~zpp.zero.config`).
"""
from zpp.zero.api import initialize
from zpp.zero.config import (
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    ZeroConfig,
    ZppConfig,
    from_deepspeed,
)
from zpp.zero.engine import ZeroEngine
from zpp.zero.policy import ShardingPolicy
from zpp.zero.schedulers import WarmupDecayLR, WarmupLR

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "ShardingPolicy",
    "TrainConfig",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroEngine",
    "ZppConfig",
    "from_deepspeed",
    "initialize",
]
