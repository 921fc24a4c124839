"""ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ), DeepSpeed-compatible.

Modules: :mod:`~zpp.zero.config` (typed config, DeepSpeed translation),
:mod:`~zpp.zero.shard` (flat shard state), :mod:`~zpp.zero.group` (the unit and its
collectives), :mod:`~zpp.zero.engine` (hooks, step, :func:`initialize`),
:mod:`~zpp.zero.checkpoint` (sharded, reshardable checkpoints),
:mod:`~zpp.zero.schedulers` (WarmupLR, WarmupDecayLR).
"""
from zpp.zero.config import (
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    ZeroConfig,
    ZppConfig,
    from_deepspeed,
)
from zpp.zero.engine import ZeroEngine, initialize
from zpp.zero.schedulers import WarmupDecayLR, WarmupLR

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroEngine",
    "ZppConfig",
    "from_deepspeed",
    "initialize",
]
