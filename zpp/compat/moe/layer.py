"""DeepSpeed's ``deepspeed.moe.layer``: ``MoE`` imports, and building one raises
``NotImplementedError`` (zpp has no MoE layers or expert parallelism; see
:func:`zpp.unsupported.refused_class`)."""
import torch

from zpp.compat.unsupported import MOE, refused_class

MoE = refused_class("MoE", __name__, MOE, torch.nn.Module)

__all__ = ["MoE"]
