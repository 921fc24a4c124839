"""Learning-rate schedules with DeepSpeed's (0.19.8) names, parameters, defaults and lr
sequences: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``LRRangeTest`` here and
``OneCycle`` (:mod:`zpp.zero.onecycle`). Which lr each optimizer step runs at, and why
``warmup_min_lr`` lasts two steps, is [Note: which lr a step uses] in
:mod:`zpp.zero.schedule_base`. With ``t = last_batch_iteration`` and ``W = max(2,
warmup_num_steps)``:

``WarmupLR``: ``lr = min + (max - min) * gamma``, ``gamma = log(t + 1) / log(W)`` ("log",
the default) or ``t / W`` ("linear") while ``t < W``, then 1. ``warmup_max_lr`` defaults to
each group's own lr.

``WarmupDecayLR``: the same warm-up (``warmup_max_lr`` defaults to 0.001), then
``gamma = max(0, (total_num_steps - t) / max(1, total_num_steps - W))``, down to
``warmup_min_lr`` at ``total_num_steps``.

``WarmupCosineLR``: each group's lr at construction times a ratio: the warm-up gamma mapped
onto ``[warmup_min_ratio, 1]``, then ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi *
p)) / 2`` with ``p = min(1, (t - W + 1) / max(1, total_num_steps - W))``.

``LRRangeTest``: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * k)``, ``k = (t + 1)
/ lr_range_test_step_size`` (floored with ``lr_range_test_staircase``).

Per-group values (``warmup_min_lr``, ``warmup_max_lr``, ``lr_range_test_min_lr``) may be
lists, one per optimizer group. Bad values raise ``ValueError`` naming the value where
DeepSpeed raises; where DeepSpeed only warns (``total_num_steps`` below the warm-up) zpp warns.
zpp refuses an unknown ``warmup_type`` (DeepSpeed warns and uses "log").
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from zpp.zero.onecycle import OneCycle
from zpp.zero.schedule_base import LRSchedule, per_group, set_lrs

if TYPE_CHECKING:
    from zpp.zero.optim_config import SchedulerConfig

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULER_CLASSES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler"]

log = logging.getLogger("zpp.zero")
WARMUP_TYPES = ("log", "linear")


def _check_warmup(who: str, warmup_num_steps: Any, warmup_type: Any) -> int:
    """``max(2, warmup_num_steps)`` after DeepSpeed's check (a positive int)."""
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"{who}: warmup_num_steps={warmup_num_steps!r} must be a positive integer")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"{who}: warmup_type={warmup_type!r} must be one of {list(WARMUP_TYPES)}")
    return max(2, warmup_num_steps)


def _warn_short(who: str, total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:  # DeepSpeed warns and runs on
        log.warning("%s: total_num_steps=%s is less than warmup_num_steps=%s", who, total_num_steps,
                    warmup_num_steps)


class _Warmup(LRSchedule):
    """The warm-up fraction both warm-up families share (``self.warmup_num_steps`` is W)."""

    warmup_num_steps: int
    warmup_type: str
    inverse_log_warm_up: float

    def _warmup_gamma(self) -> float:
        t = self.last_batch_iteration
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(t + 1)
        return t / self.warmup_num_steps


class WarmupLR(_Warmup):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then
    constant (see the module docstring)."""

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        who = type(self).__name__
        self.warmup_num_steps = _check_warmup(who, warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, self.min_lrs)

    def _gamma(self) -> float:
        return self._warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay back to ``warmup_min_lr`` (gamma 0) at
    ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        _warn_short(type(self).__name__, total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - t) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Warmup):
    """Each group's lr times a ratio: warm-up from ``warmup_min_ratio`` to 1, then cosine
    decay to ``cos_min_ratio`` at ``total_num_steps`` (see the module docstring)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        who = type(self).__name__
        self.warmup_num_steps = _check_warmup(who, warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        _warn_short(who, total_num_steps, self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                        for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, [0.0] * len(self.org_lrs))

    def get_lr_ratio(self) -> float:
        """The factor on each group's original lr at ``last_batch_iteration``."""
        t, w = self.last_batch_iteration, self.warmup_num_steps
        if t < 0:
            return 0.0
        if t < w:
            return self.warmup_min_ratio + self._warmup_gamma() * (1. - self.warmup_min_ratio)
        progress = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(LRSchedule):
    """The lr range test: from ``lr_range_test_min_lr`` up by ``lr_range_test_step_rate`` per
    ``lr_range_test_step_size`` steps, continuously or in stairs (see the module docstring)."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Any = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        size = lr_range_test_step_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"LRRangeTest: lr_range_test_step_size={size!r} must be a positive integer")
        self.step_size = size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        k = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(k) if self.staircase else k

    def get_lr(self) -> list:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next one) and write its lr."""
        super().step(batch_iteration)


#: ``scheduler.type`` -> its class.
SCHEDULER_CLASSES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(cfg: SchedulerConfig, optimizer: Any) -> LRSchedule:
    """The schedule ``cfg`` names, over ``optimizer``."""
    try:
        cls = SCHEDULER_CLASSES[cfg.type]
    except KeyError:
        raise ValueError(f"scheduler type={cfg.type!r} is not one of {sorted(SCHEDULER_CLASSES)}") from None
    return cls(optimizer, **cfg.params)
