"""``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer``, refused at construction
(see :mod:`zpp.runtime.fp16`)."""
from zpp.compat.unsupported import FP16_WRAPPERS, refused_class

FP16_Optimizer = refused_class("FP16_Optimizer", __name__, FP16_WRAPPERS)

__all__ = ["FP16_Optimizer"]
