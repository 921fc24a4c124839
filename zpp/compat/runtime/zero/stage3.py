"""``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3``, refused at
construction: ZeRO in zpp is the engine (see :func:`zpp.unsupported.refused_class`)."""
from zpp.compat.unsupported import ZERO_OPTIMIZERS, refused_class

DeepSpeedZeroOptimizer_Stage3 = refused_class("DeepSpeedZeroOptimizer_Stage3", __name__, ZERO_OPTIMIZERS)

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
