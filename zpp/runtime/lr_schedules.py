"""DeepSpeed's learning-rate schedules (``deepspeed.runtime.lr_schedules``) that zpp has:
``WarmupLR`` and ``WarmupDecayLR`` (see :mod:`zpp.zero.schedulers`). ``OneCycle``,
``LRRangeTest`` and ``WarmupCosineLR`` are not in zpp: constructing one raises
``NotImplementedError``; pass any torch scheduler to ``zpp.initialize(lr_scheduler=...)``.
"""
from zpp.zero.schedulers import WarmupDecayLR, WarmupLR

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
VALID_LR_SCHEDULES = [WARMUP_LR, WARMUP_DECAY_LR]

__all__ = ["VALID_LR_SCHEDULES", "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupDecayLR", "WarmupLR"]


def _not_in_zpp(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"zpp.runtime.lr_schedules.{name} (deepspeed.runtime.lr_schedules.{name}) is not "
                                  f"in zpp; it has {VALID_LR_SCHEDULES}, or pass any torch scheduler to "
                                  "zpp.initialize(lr_scheduler=...)")
    refuse.__name__ = refuse.__qualname__ = name
    return refuse


OneCycle = _not_in_zpp("OneCycle")
LRRangeTest = _not_in_zpp("LRRangeTest")
WarmupCosineLR = _not_in_zpp("WarmupCosineLR")
