"""Training modes as plug-ins: one file each, built by the engine from the registry.

============  ==============================================  ========================================
name          what it adds                                    file
============  ==============================================  ========================================
``offload``   host copies of the reduced gradients folded     :mod:`~zpp.zero.modes.offload`
``nvme``      optimizer state on NVMe, stepped unit by unit   :mod:`~zpp.zero.modes.nvme`
``onebit``    1-bit optimizer views and per-rank state        :mod:`~zpp.zero.modes.onebit`
``outer``     the node as the ZeRO world, the outer sync      :mod:`~zpp.zero.modes.outer`
``loss_scaler``  fp16 loss scaling (scale 1 without fp16)     :mod:`~zpp.zero.modes.loss_scale`
============  ==============================================  ========================================

The protocol is :class:`~zpp.zero.modes.base.Mode` ([Note: modes], [Note: mode state in
checkpoints]). Adding a mode: a file here and a line in ``MODES`` (the order of the lines is
the order of the hooks).
"""
from __future__ import annotations

import logging

from zpp.comm.transport import Transport
from zpp.zero.config import TrainConfig
from zpp.zero.modes.base import Mode
from zpp.zero.modes.loss_scale import LossScaleMode
from zpp.zero.modes.nvme import NvmeMode
from zpp.zero.modes.offload import OffloadMode
from zpp.zero.modes.onebit import OneBitMode
from zpp.zero.modes.outer import OuterMode

__all__ = ["MODES", "LossScaleMode", "Mode", "ModeAttributes", "NvmeMode", "OffloadMode", "OneBitMode", "OuterMode",
           "build_modes", "data_parallel_world"]

log = logging.getLogger("zpp.zero")

#: name -> mode class, in hook order
MODES: dict[str, type[Mode]] = {
    "offload": OffloadMode,
    "nvme": NvmeMode,
    "onebit": OneBitMode,
    "outer": OuterMode,
    "loss_scaler": LossScaleMode,
}


def data_parallel_world(world: Transport, config: TrainConfig) -> Transport:
    """The world ZeRO shards over: ``world`` as each registered mode narrows it."""
    for cls in MODES.values():
        world = cls.data_parallel_world(world, config)
    return world


def build_modes(engine) -> tuple[Mode, ...]:
    """The modes ``engine``'s config asks for, in registry order; if one fails to build, the
    ones built before it are closed (a swap file, a sync thread) before the error goes on."""
    built: list[Mode] = []
    try:
        for cls in MODES.values():
            mode = cls.build(engine)
            if mode is not None:
                built.append(mode)
    except BaseException:
        for mode in reversed(built):
            try:
                mode.close()
            except Exception:  # noqa: BLE001 - the build's error is the one to see
                log.exception("zpp: closing mode %s after a failed build", mode.name)
        raise
    return tuple(built)


class ModeAttributes:
    """The engine attributes that name a mode's object (mixed into the engine):
    ``engine.outer`` (:class:`~zpp.zero.outer.OuterSync`, else None) and
    ``engine.loss_scaler`` (:class:`~zpp.zero.loss_scale.LossScaler`)."""

    def mode(self, name: str) -> Mode | None:
        """The engine's mode of that registry name, or None."""
        if name not in MODES:
            raise ValueError(f"engine.mode(name={name!r}): not a mode; choices: {sorted(MODES)}")
        return next((m for m in getattr(self, "modes", ()) if m.name == name), None)

    @property
    def outer(self):
        m = self.mode("outer")
        return None if m is None else m.sync

    @property
    def loss_scaler(self):
        return self.mode("loss_scaler").scaler
