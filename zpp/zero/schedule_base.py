"""What zpp's learning-rate schedules (:mod:`zpp.zero.schedulers`, :mod:`zpp.zero.onecycle`)
share: the optimizer they drive, the per-group values, the step counter and its state.

[Note: which lr a step uses]
DeepSpeed (0.19.8) builds the config's schedule after the optimizer and never steps it at
construction; its engine calls ``step()`` after each applied optimizer step (not after a
skipped one). A schedule built with ``last_batch_iteration=-1`` writes a start value into the
optimizer's groups itself. So optimizer step ``i`` (counting from 0) runs at:

    step 0:   the start value the constructor wrote
    step i:   get_lr() at last_batch_iteration = i - 1

For WarmupLR / WarmupDecayLR the start value is ``warmup_min_lr`` and iteration 0 gives
``warmup_min_lr`` again (log(0 + 1) = 0, 0 / warmup_num_steps = 0): the minimum is used for
two steps, the warm-up's second value on step 2. WarmupCosineLR starts at 0.0 (not
``warmup_min_ratio`` times the lr), LRRangeTest and OneCycle at their minimum lr (OneCycle's
momentum at ``cycle_min_mom``). A schedule built with another ``last_batch_iteration`` writes
nothing: the first step runs at the optimizer's own lr, as in DeepSpeed.

zpp's engine (:mod:`zpp.zero.engine`) drives its schedule the same way. One difference:
:meth:`LRSchedule.load_state_dict` writes the restored iteration's values into the optimizer
(DeepSpeed only sets the counter and relies on the optimizer's own restored groups), so a
schedule restored into a fresh engine continues the saved sequence even without the
optimizer's state; with it, the values are the same ones.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["LRSchedule", "per_group", "set_lrs", "torch_optimizer"]


def torch_optimizer(optimizer: Any) -> Any:
    """The optimizer whose ``param_groups`` a schedule drives: ``optimizer`` itself, or the
    ``optimizer`` it wraps (as DeepSpeed unwraps its ZeRO optimizers)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):  # zpp's 1-bit optimizers and other look-alikes
        return optimizer
    raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer (no param_groups)")


def per_group(optimizer: Any, value: Any, name: str) -> list:
    """``value`` for each of the optimizer's groups: a list or tuple as given (one per group),
    anything else repeated."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}={list(value)!r} has {len(value)} values; the optimizer has {n} parameter "
                             "groups")
        return list(value)
    return [value] * n


def set_lrs(groups: list[dict], lrs: list) -> list:
    """Write ``lrs`` into ``groups`` (into a tensor lr in place) and return the groups' lrs."""
    for g, lr in zip(groups, lrs):
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            g["lr"] = lr
    return [g["lr"] for g in groups]


class LRSchedule:
    """A schedule over ``optimizer``'s groups, counted in ``last_batch_iteration`` (the last
    optimizer step taken, -1 before the first; see [Note: which lr a step uses]).

    Subclasses give :meth:`get_lr` (the lrs at ``last_batch_iteration``) and :meth:`_start`
    (what the constructor writes at ``last_batch_iteration=-1``), and may extend
    :meth:`_apply` (OneCycle's momentum)."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list | None = None

    def get_lr(self) -> list:
        raise NotImplementedError

    def _start(self) -> None:
        """Write the start values (``last_batch_iteration=-1``) into the optimizer."""
        raise NotImplementedError

    def _apply(self) -> None:
        """Write :meth:`get_lr` at ``last_batch_iteration`` into the optimizer."""
        self._last_lr = set_lrs(self.optimizer.param_groups, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next one) and write its lr."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list:
        """The lrs last written (by the constructor, :meth:`step` or :meth:`load_state_dict`)."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no lr written yet (built with "
                               f"last_batch_iteration={self.last_batch_iteration}); call step() first")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter and write its values into the optimizer (see the Note)."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        if self.last_batch_iteration < 0:
            self._start()
        else:
            self._apply()
