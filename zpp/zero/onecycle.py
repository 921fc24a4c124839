"""DeepSpeed's (0.19.8) ``OneCycle`` schedule: one triangular cycle of the lr (and, inversely,
of Adam's first beta), then an optional decay. Which lr each optimizer step runs at is
[Note: which lr a step uses] in :mod:`zpp.zero.schedule_base`.

The cycle is ``S = cycle_first_step_size + cycle_second_step_size`` steps long (the second
half defaults to the first). With ``b = last_batch_iteration + 1`` and ``x = b / S -
floor(b / S)``, the scale rises as ``x / r`` over the first half (``r`` = first / S) and falls
as ``(x - 1) / (r - 1)`` over the second; ``lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) *
scale`` and ``beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale``. A stair count
``n > 0`` for a half holds the scale at ``floor(n * position within the half) / n`` instead,
the position taken from the integer step (never from the rounded scale). After the cycle (from
``last_batch_iteration = S``), with ``d = last_batch_iteration - S + 1`` and ``k = d /
decay_step_size``: ``lr = cycle_min_lr / (1 + decay_lr_rate * k)`` and ``beta1 =
cycle_max_mom * (1 + decay_mom_rate * k)``; a zero ``decay_step_size`` or rate holds
``cycle_min_lr`` / ``cycle_max_mom``.

Momentum is cycled only for optimizers with ``betas`` (DeepSpeed warns and cycles nothing for
SGD); every write sets the group's ``betas`` to ``(beta1, 0.99)``: the second beta becomes
0.99 whatever the optimizer had, as in DeepSpeed.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from zpp.zero.schedule_base import LRSchedule, per_group, set_lrs

__all__ = ["OneCycle"]

log = logging.getLogger("zpp.zero")
BETA2 = 0.99  # the second beta OneCycle writes with every first beta


class OneCycle(LRSchedule):
    """The 1cycle policy over ``optimizer``'s groups (see the module docstring)."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.,
                 cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: float = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0., last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"OneCycle: cycle_first_step_size={cycle_first_step_size!r} must be positive")
        if second < 0:
            raise ValueError(f"OneCycle: cycle_second_step_size={cycle_second_step_size!r} must be non-negative")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)

        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)

        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            log.warning("OneCycle: cycle_momentum is off: optimizer %s has no betas", type(self.optimizer).__name__)
            self.cycle_momentum = False
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.min_moms = self.max_moms = []
        if self.cycle_momentum:
            self.min_moms = [(m, BETA2) for m in per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, BETA2) for m in per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, self.min_lrs)
        self._set_betas(self.min_moms)

    def _set_betas(self, betas: list | None) -> None:
        if self.cycle_momentum:
            for g, b in zip(self.optimizer.param_groups, betas):
                g["betas"] = b

    def _scale(self) -> float:
        """Where in the cycle ``last_batch_iteration`` is: 0 at the ends, 1 at the peak."""
        b = self.last_batch_iteration + 1
        x = 1. + b / self.total_size - math.floor(1 + b / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            i = b % self.total_size
            pos = i * stairs / self.first_step_size if i <= self.first_step_size else \
                (self.total_size - i) * stairs / self.second_step_size
            scale = math.floor(pos) / stairs
        return scale

    def _decay_steps(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_steps()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list | None:
        """The ``betas`` at ``last_batch_iteration``; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_steps()
        return [(hi[0] * factor, hi[1]) for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        self._set_betas(self.get_mom())

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to ``batch_iteration`` (default: the next one) and write its lr and betas."""
        super().step(batch_iteration)
