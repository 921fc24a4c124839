"""fp16 loss scaling as a mode: the loss times the scale before backward, the scale divided
out before clipping, the scale updated after every step (see [Note: dynamic loss scale] in
:mod:`zpp.zero.loss_scale`, whose :class:`~zpp.zero.loss_scale.LossScaler` it drives).

Built for every engine, as a precision plugin is: without fp16 the scale is 1 and every hook
leaves the step as it is, and the optimizer still carries DeepSpeed's fp16 attributes
(``overflow``, ``cur_scale``, ``loss_scale``; see [Note: skipped steps] in
:mod:`zpp.zero.engine`). Its state is replicated: rank 0 saves it in ``meta.pt``'s
``step_state["loss_scaler"]`` (where DeepSpeed keeps it in its optimizer's state) and it is
loaded with the optimizer state.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zpp.zero.loss_scale import LossScaler
from zpp.zero.modes.base import Mode
from zpp.zero.unit import Unit


class LossScaleMode(Mode):
    """The engine's :class:`LossScaler` (``engine.loss_scaler``) in the step."""

    name = "loss_scaler"

    def __init__(self, engine, scaler: LossScaler) -> None:
        self.engine = engine
        self.scaler = scaler
        self._mirror(False)

    @classmethod
    def build(cls, engine) -> LossScaleMode:
        return cls(engine, LossScaler.from_config(engine.train_config.fp16))

    @property
    def grad_scale(self) -> float:
        return self.scaler.cur_scale

    @property
    def expects_overflows(self) -> bool:
        return self.scaler.dynamic

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` in fp32 times the scale, as DeepSpeed's (itself without fp16)."""
        return loss.float() * self.scaler.cur_scale if self.scaler.enabled else loss

    def after_optimizer_step(self, trained: Sequence[Unit]) -> None:
        self.scaler.update(False, step=self.engine.global_steps + 1)
        self._mirror(False)

    def on_skipped_step(self, trained: Sequence[Unit]) -> str | None:
        change = self.scaler.update(True, step=self.engine.global_steps)  # may raise at min_loss_scale
        return change.describe() if self.scaler.enabled else None

    def after_skipped_step(self) -> None:
        self._mirror(True)

    def _mirror(self, overflow: bool) -> None:
        """DeepSpeed's fp16 optimizer attributes on the engine's optimizer."""
        opt = self.engine.optimizer
        if opt is None:
            return
        opt.overflow = overflow
        opt.cur_scale = opt.loss_scale = self.scaler.cur_scale

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: Any, *, own: bool) -> None:
        if not state:
            return
        self.scaler.load_state_dict(state)
        self._mirror(False)
