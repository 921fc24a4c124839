"""fp16 loss scaling with DeepSpeed's rule (static or dynamic, with hysteresis).

The engine's loss-scale mode (:mod:`zpp.zero.modes.loss_scale`) multiplies the loss by
:attr:`LossScaler.cur_scale` before backward, the engine divides the gradients by it before
clipping, and after every optimizer step's overflow check
(see [Note: agreeing on a non-finite step] in :mod:`zpp.comm.nonfinite`) the mode calls
:meth:`LossScaler.update` with the same flag on every rank, so the scale stays the same
everywhere without any communication of its own.

[Note: dynamic loss scale]
DeepSpeed's ``DynamicLossScaler`` (the one its ZeRO stage 1-3 optimizers use), from the
config's ``fp16`` section: the scale starts at ``2**initial_scale_power``; ``hysteresis``
is the number of overflows tolerated before the scale moves (DeepSpeed's
``delayed_shift``), counted down by each overflow while it is above 1:

* an overflow with the hysteresis at 1 (or ``hysteresis: 1``) halves the scale, but not
  below ``min_loss_scale``; if the scale already *is* ``min_loss_scale``, the run fails
  (DeepSpeed raises "Current loss scale already at minimum"; zpp raises
  :class:`~zpp.comm.nonfinite.NonFiniteGradientError` on every rank, naming the step);
* an overflow with the hysteresis above 1 only decrements it (the step is still skipped);
* a step without overflow refills the hysteresis when ``consecutive_hysteresis`` is on;
  the scale doubles once the steps since the last overflow, less one, are a positive
  multiple of ``loss_scale_window`` (so ``window + 1`` steps after the start or after an
  overflow, then every ``window`` steps), which also refills the hysteresis.

Every overflow is a skipped step, whatever the scale does. With a static ``loss_scale``
the scale never changes; with fp16 off the scale is 1 and :meth:`update` does nothing.
DeepSpeed 0.19's stage 0 fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``)
follow a simpler rule (no hysteresis, no error at the minimum); zpp uses the rule above at
every stage.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from zpp.comm.nonfinite import NonFiniteGradientError
from zpp.zero.config import Fp16Config

__all__ = ["LossScaler", "ScaleChange"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleChange:
    """What one :meth:`LossScaler.update` did (for the log line)."""

    before: float
    after: float
    hysteresis_before: int
    hysteresis_after: int

    def describe(self) -> str:
        if self.after != self.before:
            return f"loss scale {self.before:g} -> {self.after:g}"
        if self.hysteresis_after != self.hysteresis_before:
            return f"loss scale {self.before:g} kept, hysteresis {self.hysteresis_before} -> {self.hysteresis_after}"
        return f"loss scale {self.before:g}"


@dataclasses.dataclass(slots=True)
class LossScaler:
    """The loss scale of an engine; see [Note: dynamic loss scale].

    Build it with :meth:`from_config`. ``enabled`` is False without fp16 (scale 1)."""

    enabled: bool = False
    """fp16 is on: the loss is scaled and the gradients unscaled."""
    dynamic: bool = False
    """The scale follows overflows (``fp16.loss_scale`` 0)."""
    cur_scale: float = 1.0
    """The scale of the next backward."""
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 1
    """``fp16.hysteresis``."""
    consecutive_hysteresis: bool = False
    cur_hysteresis: int = 1
    """Overflows still tolerated before the scale halves."""
    cur_iter: int = 0
    """Updates so far (optimizer steps at the accumulation boundary, skipped ones included)."""
    last_overflow_iter: int = -1
    scale_factor: float = 2.0

    @classmethod
    def from_config(cls, fp16: Fp16Config) -> LossScaler:
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale:
            return cls(enabled=True, dynamic=False, cur_scale=float(fp16.loss_scale))
        # an int until the scale first moves, as DeepSpeed's (its monitors write "65536", then "131072.0")
        return cls(enabled=True, dynamic=True, cur_scale=2 ** fp16.initial_scale_power,
                   scale_window=fp16.loss_scale_window, min_scale=float(fp16.min_loss_scale),
                   delayed_shift=fp16.hysteresis, cur_hysteresis=fp16.hysteresis,
                   consecutive_hysteresis=fp16.consecutive_hysteresis)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool, *, step: int) -> ScaleChange:
        """Record one optimizer step's overflow flag (the same on every rank). Raises
        :class:`NonFiniteGradientError` when an overflow would take a dynamic scale below
        ``min_loss_scale`` (``step`` names the step in the message)."""
        before, hyst = self.cur_scale, self.cur_hysteresis
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                    if self.cur_scale == self.min_scale:
                        raise NonFiniteGradientError(
                            f"zpp: optimizer step {step}: gradients overflowed (NaN or Inf) with the fp16 loss "
                            f"scale already at min_loss_scale={self.min_scale:g}; it cannot go lower, so the run "
                            "stops here (as DeepSpeed's). Look for a diverging loss or lower the learning rate; "
                            "a smaller fp16.min_loss_scale lets the scale go further down")
                    self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                stable = self.cur_iter - self.last_overflow_iter - 1
                if stable > 0 and stable % self.scale_window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.delayed_shift
                    self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return ScaleChange(before, self.cur_scale, hyst, self.cur_hysteresis)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The whole state (plain numbers), for the engine's checkpoint."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. A state saved without fp16, or with another kind of
        scale (static/dynamic), is ignored: this scaler keeps its configured start."""
        if not (self.enabled and state.get("enabled") and state.get("dynamic") == self.dynamic):
            return
        for name in ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter"):
            setattr(self, name, type(getattr(self, name))(state[name]))
