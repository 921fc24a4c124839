"""``deepspeed.checkpoint.utils``: what accelerate and the Trainer call when they save."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor in it (also inside lists, tuples and dicts, at any depth)
    replaced by a detached copy on ``device``, so that ``torch.save`` writes only the
    values and not the whole storage a view points into. Other values are returned as
    they are; containers keep their type (a dict subclass such as ``OrderedDict`` too)."""
    if isinstance(item, torch.Tensor):
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
