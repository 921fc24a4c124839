"""``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer``, refused at
construction (see :mod:`zpp.runtime.fp16`)."""
from zpp.compat.unsupported import FP16_WRAPPERS, refused_class

FP16_UnfusedOptimizer = refused_class("FP16_UnfusedOptimizer", __name__, FP16_WRAPPERS)

__all__ = ["FP16_UnfusedOptimizer"]
