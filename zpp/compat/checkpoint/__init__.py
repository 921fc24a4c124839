"""DeepSpeed's ``deepspeed.checkpoint`` names that front-ends and scripts import:
:mod:`zpp.checkpoint.utils` (``clone_tensors_for_torch_save``, DeepSpeed's file names) and
:mod:`zpp.checkpoint.constants` (DeepSpeed's key names). zpp's own checkpoints are
:mod:`zpp.zero.checkpoint`; activation checkpointing is :mod:`zpp.checkpointing`."""
from zpp.compat.checkpoint import constants, utils
from zpp.compat.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save", "constants", "utils"]
