"""Learning-rate schedules with DeepSpeed's names and parameters.

``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` optimizer
steps, then constant. ``warmup_type`` "log" (DeepSpeed's default) uses
``gamma = log(step + 1) / log(warmup_num_steps)``, "linear" uses ``step / warmup_num_steps``;
``lr = min + (max - min) * gamma``. ``WarmupDecayLR`` then decays linearly to 0 at
``total_num_steps``: ``gamma = max(0, (total - step) / max(1, total - warmup))``.

The engine calls :meth:`step` after each optimizer step; the lr for step ``i`` (counting from
0) is set before step ``i`` runs.
"""
from __future__ import annotations

import math

import torch

from zpp.zero.config import SchedulerConfig


class WarmupLR:
    """DeepSpeed-compatible warm-up schedule (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"WarmupLR: warmup_type={warmup_type!r} must be 'log' or 'linear'")
        if warmup_num_steps < 1:
            raise ValueError(f"WarmupLR: warmup_num_steps={warmup_num_steps} must be >= 1")
        self.optimizer = optimizer
        self.min_lr = float(warmup_min_lr)
        self.max_lr = float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self.step()

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        return 1.0

    def lr_at(self, it: int) -> float:
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(max(it, 0))

    def step(self) -> None:
        self.last_batch_iteration += 1
        lr = self.lr_at(self.last_batch_iteration)
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"]) - 1
        self.step()


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_num_steps: int, **kw) -> None:
        warm = max(2, int(kw.get("warmup_num_steps", 1000)))
        if total_num_steps < warm:
            raise ValueError(f"WarmupDecayLR: total_num_steps={total_num_steps} is below "
                             f"warmup_num_steps={warm}")
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, **kw)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return WarmupLR._gamma(self, it)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


_SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> WarmupLR:
    """The schedule ``cfg`` names, over ``optimizer``."""
    try:
        cls = _SCHEDULERS[cfg.type]
    except KeyError:
        raise ValueError(f"scheduler type={cfg.type!r} is not one of {sorted(_SCHEDULERS)}") from None
    return cls(optimizer, **cfg.params)
