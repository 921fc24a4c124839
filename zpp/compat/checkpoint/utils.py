"""``deepspeed.checkpoint.utils``: what accelerate and the Trainer call when they save, and
DeepSpeed's file names (for scripts that read DeepSpeed's own checkpoints; zpp's are laid
out by :mod:`zpp.zero.checkpoint`)."""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file of a model-parallel rank (``mp_rank_00``...)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO optimizer-states file of a data-parallel rank."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """DeepSpeed's pipeline-layer file."""
    return os.path.join(base_folder, f"layer_{layer_id}-model_{tp_rank:02d}-model_states.pt")


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
