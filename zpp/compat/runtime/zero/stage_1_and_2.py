"""``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer``, refused at construction:
ZeRO in zpp is the engine (see :func:`zpp.unsupported.refused_class`)."""
from zpp.compat.unsupported import ZERO_OPTIMIZERS, refused_class

DeepSpeedZeroOptimizer = refused_class("DeepSpeedZeroOptimizer", __name__, ZERO_OPTIMIZERS)

__all__ = ["DeepSpeedZeroOptimizer"]
