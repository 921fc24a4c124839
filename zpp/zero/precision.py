"""The model's parameter dtype under mixed precision: casting a module (also one still
partitioned by :class:`zpp.zero.Init`) and, for ``fp16.auto_cast``, a forward's inputs."""
from __future__ import annotations

from typing import Any

import torch

from zpp.zero import init as zinit

__all__ = ["MODEL_DTYPES", "cast_module", "to_half"]

#: ``TrainConfig.precision`` -> the parameters' dtype while training (fp32 masters apart).
MODEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_half(obj: Any) -> Any:
    """``obj`` with every floating-point tensor in it cast to fp16 (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return type(obj)((k, to_half(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(to_half(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_half(v) for v in obj)
    return obj

def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for floating parameters and buffers, also for parameters still
    partitioned by :class:`zpp.zero.Init` (whose data must not be read)."""
    for p in module.parameters():
        if zinit.is_loose(p):
            zinit.cast_loose(p, dtype)
        elif p.is_floating_point():
            p.data = p.data.to(dtype)
    for b in module.buffers():
        if b.is_floating_point():
            b.data = b.data.to(dtype)
