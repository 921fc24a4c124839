"""ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ), DeepSpeed-compatible.

Modules: :mod:`~zpp.zero.config` (typed config), :mod:`~zpp.zero.deepspeed_config` (the
DeepSpeed edge: key tables, translation), :mod:`~zpp.zero.checks` (typed value checks),
:mod:`~zpp.zero.agreement` (every rank runs the same config),
:mod:`~zpp.zero.shard` (flat shard state), :mod:`~zpp.zero.group` (the unit and its
collectives), :mod:`~zpp.zero.engine` (hooks, step, :func:`initialize`),
:mod:`~zpp.zero.checkpoint` (sharded, reshardable checkpoints),
:mod:`~zpp.zero.schedulers` (WarmupLR, WarmupDecayLR).
"""
from zpp.zero.agreement import check_same_config
from zpp.zero.config import (
    ActivationCheckpointingConfig,
    Fp16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    ZeroConfig,
    ZppConfig,
)
from zpp.zero.deepspeed_config import from_deepspeed
from zpp.zero.engine import ZeroEngine, initialize
from zpp.zero.schedulers import WarmupDecayLR, WarmupLR

__all__ = [
    "ActivationCheckpointingConfig",
    "Fp16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroEngine",
    "ZppConfig",
    "check_same_config",
    "from_deepspeed",
    "initialize",
]
