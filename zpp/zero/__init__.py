"""ZeRO stage 0-3 engine with the ZeRO++ switches (qwZ, hpZ, qgZ), DeepSpeed-compatible.

:func:`initialize` (:mod:`~zpp.zero.api`) builds a :class:`ZeroEngine`
(:mod:`~zpp.zero.engine`, whose docstring maps every concern to its module) from a typed
config (:mod:`~zpp.zero.config`), translated from a DeepSpeed config at the edge
(:mod:`~zpp.zero.deepspeed_config`, value checks in :mod:`~zpp.zero.checks`); every rank
checks it runs the same one (:mod:`~zpp.zero.agreement`).
"""
from zpp.comm.nonfinite import NonFiniteGradientError
from zpp.zero.agreement import check_same_config
from zpp.zero.api import initialize
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
from zpp.zero.engine import ZeroEngine
from zpp.zero.gathered import GatheredParameters
from zpp.zero.init import Init, register_external_parameter, unregister_external_parameter
from zpp.zero.loss_scale import LossScaler
from zpp.zero.param_attrs import ZeroParamStatus, ZeroParamType
from zpp.zero.policy import ShardingPolicy
from zpp.zero.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "ActivationCheckpointingConfig",
    "Fp16Config",
    "LossScaler",
    "LRRangeTest",
    "NonFiniteGradientError",
    "OneCycle",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ShardingPolicy",
    "TrainConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZppConfig",
    "check_same_config",
    "GatheredParameters",
    "Init",
    "from_deepspeed",
    "initialize",
    "register_external_parameter",
    "unregister_external_parameter",
]
