"""The optimizer and learning-rate schedule sections of the engine's typed configuration
(:class:`OptimizerConfig`, :class:`SchedulerConfig`), with the names and parameters each
accepts; part of :class:`zpp.zero.config.TrainConfig`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from zpp.zero.checks import check_bool, check_choice, check_int, check_number, check_pair, check_str, fail

__all__ = ["ONEBIT_OPTIMIZERS", "OPTIMIZERS", "OPTIMIZER_PARAMS", "OPTIMIZER_PARAM_CHECKS", "SCHEDULERS",
           "SCHEDULER_PARAMS", "SCHEDULER_PARAM_CHECKS", "SCHEDULER_REQUIRED", "OptimizerConfig",
           "SchedulerConfig"]

#: The 1-bit optimizers of :mod:`zpp.optim` (lower-case ``type`` -> their class name there).
ONEBIT_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
OPTIMIZERS = ("adam", "adamw", "sgd", *ONEBIT_OPTIMIZERS)
# Each optimizer's own keyword arguments (for the 1-bit ones: their constructors' names, less
# ``params`` and ``transport``; the engine passes its own transport).
_ONEBIT_COMMON = {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "cuda_aware",
                  "comm_backend_name"}
OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    "adam": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "adamw": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"}),
    "sgd": frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "onebitadam": frozenset(_ONEBIT_COMMON | {"freeze_step"}),
    "zerooneadam": frozenset(_ONEBIT_COMMON | {"var_freeze_step", "var_update_scaler", "local_step_scaler",
                                               "local_step_clipper"}),
    "onebitlamb": frozenset(_ONEBIT_COMMON | {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
                                              "factor_min", "factor_threshold"}),
}


def _num(lo=None, hi=None, lo_open=False, hi_open=False):
    return lambda w, n, v: check_number(w, n, v, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)


def _integer(lo=None):
    return lambda w, n, v: check_int(w, n, v, lo=lo)


#: The type of every optimizer parameter in ``OPTIMIZER_PARAMS`` (a check per name).
OPTIMIZER_PARAM_CHECKS: dict[str, Callable[[str, str, Any], Any]] = {
    "lr": _num(lo=0), "betas": check_pair, "eps": _num(lo=0), "weight_decay": _num(lo=0),
    "amsgrad": check_bool, "momentum": _num(lo=0), "dampening": _num(), "nesterov": check_bool,
    "bias_correction": check_bool, "cuda_aware": check_bool, "comm_backend_name": check_str,
    "freeze_step": _integer(lo=0), "var_freeze_step": _integer(lo=0), "var_update_scaler": _integer(lo=1),
    "local_step_scaler": _integer(lo=1), "local_step_clipper": _integer(lo=1),
    "max_coeff": _num(lo=0, lo_open=True), "min_coeff": _num(lo=0), "coeff_beta": _num(lo=0, hi=1, hi_open=True),
    "factor_max": _num(lo=0, lo_open=True), "factor_min": _num(lo=0), "factor_threshold": _num(lo=0),
}
def _lrs(lo=0):
    """A number, or a list of them, one per optimizer parameter group."""
    def check(w, n, v):
        values = v if isinstance(v, (list, tuple)) else [v]
        try:
            for x in values:
                check_number(w, n, x, lo=lo)
        except ValueError:
            raise fail(w, n, v, f"a finite number >= {lo} or a non-empty list of them (one per parameter "
                       "group)") from None
        if not values:
            raise fail(w, n, v, "a number or a non-empty list of them (one per parameter group)")
        return list(v) if isinstance(v, (list, tuple)) else v
    return check


def _optional(check):
    return lambda w, n, v: None if v is None else check(w, n, v)


#: DeepSpeed's schedules (deepspeed.runtime.lr_schedules) -> their parameters; see
#: :mod:`zpp.zero.schedulers`.
SCHEDULER_PARAMS: dict[str, frozenset[str]] = {
    "WarmupLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                           "last_batch_iteration"}),
    "WarmupDecayLR": frozenset({"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                "warmup_type", "last_batch_iteration"}),
    "WarmupCosineLR": frozenset({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                 "warmup_type", "last_batch_iteration"}),
    "OneCycle": frozenset({"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                           "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                           "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
                           "last_batch_iteration"}),
    "LRRangeTest": frozenset({"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                              "lr_range_test_staircase", "last_batch_iteration"}),
}
SCHEDULERS = tuple(SCHEDULER_PARAMS)
#: The parameters a schedule has no default for.
SCHEDULER_REQUIRED: dict[str, tuple[str, ...]] = {
    "WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr")}
#: The type of every scheduler parameter. ``warmup_max_lr`` null: each group's own lr.
SCHEDULER_PARAM_CHECKS: dict[str, Callable[[str, str, Any], Any]] = {
    "warmup_min_lr": _lrs(), "warmup_max_lr": _optional(_lrs()), "warmup_num_steps": _integer(lo=1),
    "warmup_type": lambda w, n, v: check_choice(w, n, v, ("log", "linear")),
    "last_batch_iteration": _integer(lo=-1), "total_num_steps": _integer(lo=1),
    "warmup_min_ratio": _num(lo=0), "cos_min_ratio": _num(lo=0),
    "cycle_min_lr": _lrs(), "cycle_max_lr": _lrs(), "decay_lr_rate": _num(),
    "cycle_first_step_size": _num(lo=0, lo_open=True), "cycle_second_step_size": _optional(_num(lo=0)),
    "cycle_first_stair_count": _integer(), "cycle_second_stair_count": _optional(_integer()),
    "decay_step_size": _num(lo=0), "cycle_momentum": check_bool, "cycle_min_mom": _lrs(),
    "cycle_max_mom": _lrs(), "decay_mom_rate": _num(),
    "lr_range_test_min_lr": _lrs(), "lr_range_test_step_size": _integer(lo=1), "lr_range_test_step_rate": _num(),
    "lr_range_test_staircase": check_bool,
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """The optimizer the engine builds over its fp32 master shards."""

    type: Literal["adam", "adamw", "sgd", "onebitadam", "zerooneadam", "onebitlamb"]
    """Lower-case optimizer name; DeepSpeed's "Adam" with ``adam_w_mode`` (its default)
    becomes "adamw". The 1-bit ones are built from :mod:`zpp.optim` on the engine's
    transport and do their own communication (ZeRO stage 0 only; see [Note: 1-bit
    optimizers] in :mod:`zpp.zero.engine`)."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, eps, weight_decay, momentum,
    freeze_step...); see ``OPTIMIZER_PARAMS``, each type-checked by
    ``OPTIMIZER_PARAM_CHECKS``. ``betas`` is stored as a tuple."""

    @property
    def onebit(self) -> bool:
        """Whether this is one of the 1-bit optimizers of :mod:`zpp.optim`."""
        return self.type in ONEBIT_OPTIMIZERS

    def __post_init__(self) -> None:
        if self.type not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig: type={self.type!r} must be one of {OPTIMIZERS}")
        if not isinstance(self.params, Mapping):
            raise fail("OptimizerConfig", "params", self.params, "a dict")
        allowed = OPTIMIZER_PARAMS[self.type]
        bad = sorted(set(self.params) - allowed)
        if bad:
            raise ValueError(f"OptimizerConfig: type={self.type!r} has unknown params {bad}; allowed {sorted(allowed)}")
        params = {k: OPTIMIZER_PARAM_CHECKS[k]("OptimizerConfig", f"params.{k}", v) for k, v in self.params.items()}
        object.__setattr__(self, "params", params)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerConfig:
    """A learning-rate schedule with DeepSpeed's names and parameters."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    """Schedule name."""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The schedule's keyword arguments, DeepSpeed's names (``SCHEDULER_PARAMS``), each
    type-checked by ``SCHEDULER_PARAM_CHECKS``; ``SCHEDULER_REQUIRED`` lists those without a
    default."""

    def __post_init__(self) -> None:
        if self.type not in SCHEDULERS:
            raise ValueError(f"SchedulerConfig: type={self.type!r} must be one of {SCHEDULERS}")
        if not isinstance(self.params, Mapping):
            raise fail("SchedulerConfig", "params", self.params, "a dict")
        allowed = SCHEDULER_PARAMS[self.type]
        bad = sorted(set(self.params) - allowed)
        if bad:
            raise ValueError(f"SchedulerConfig: type={self.type!r} has unknown params {bad}; allowed {sorted(allowed)}")
        missing = [k for k in SCHEDULER_REQUIRED.get(self.type, ()) if k not in self.params]
        if missing:
            raise ValueError(f"SchedulerConfig: {self.type} needs params {missing}")
        params = {k: SCHEDULER_PARAM_CHECKS[k]("SchedulerConfig", f"params.{k}", v) for k, v in self.params.items()}
        object.__setattr__(self, "params", params)
