"""DeepSpeed's ``deepspeed.checkpoint`` names that front-ends and scripts import:
:mod:`zpp.checkpoint.utils` (``clone_tensors_for_torch_save``). zpp's own checkpoints are
:mod:`zpp.zero.checkpoint`; activation checkpointing is :mod:`zpp.checkpointing`."""
from zpp.checkpoint import utils
from zpp.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save", "utils"]
