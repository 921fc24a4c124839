"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: where ZeRO-3's partitioned
construction lives, for code that imports it from there (the Hugging Face ``from_pretrained``
under ZeRO-3 does).

``Init`` and ``GatheredParameters`` are zpp's (:mod:`zpp.zero.init`,
:mod:`zpp.zero.gathered`); ``ZeroParamStatus`` / ``ZeroParamType`` are the values of a
partitioned parameter's ``ds_status`` / ``ds_param_type`` (see [Note: ZeRO-3 parameter
attributes] in :mod:`zpp.zero.param_attrs`).

[Note: tensor constructors under Init]
DeepSpeed's ``Init`` replaces ``torch.empty``, ``torch.zeros``, ``torch.arange``... while it
is open, so that tensors are created on the accelerator in the config's 16-bit dtype, and
exposes the replacement as ``zero_wrapper_for_fp_tensor_constructor`` (transformers swaps it
to keep ``torch.arange``'s dtype for RoPE buffers). zpp's ``Init`` leaves the constructors
alone: modules are built where and in the dtype their code asks, and ``zpp.initialize``
casts to the engine's dtype; so the swap changes nothing under zpp.
``zero_wrapper_for_fp_tensor_constructor`` is still the function DeepSpeed's contract
names (it returns a constructor that creates floating tensors in ``target_fp_dtype`` on
``target_device``), for code that calls it.

``register_external_parameter`` and ``unregister_external_parameter`` are
:mod:`zpp.zero.init`'s (they have nothing to do in zpp).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zpp.compat.accelerator import get_accelerator
from zpp.zero.gathered import GatheredParameters
from zpp.zero.init import Init, register_external_parameter, unregister_external_parameter
from zpp.zero.param_attrs import ZeroParamStatus, ZeroParamType

__all__ = ["GatheredParameters", "Init", "MultipleAllGatherHandles", "ZeroParamStatus", "ZeroParamType",
           "get_accelerator", "partitioned_param_data_shape", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]

#: The shape of a partitioned parameter's own data: an empty placeholder (the values live in
#: ``ds_tensor``), as in DeepSpeed.
partitioned_param_data_shape = [0]

_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., torch.Tensor]:
    """``fn`` creating tensors on ``target_device`` (Default: the accelerator's current device)
    and, where floating, in ``target_fp_dtype``; see [Note: tensor constructors under Init]."""

    @functools.wraps(fn)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else \
                get_accelerator().current_device_name()
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return make


class MultipleAllGatherHandles:
    """Several started gathers waited on as one (DeepSpeed's name): ``wait(**kwargs)`` waits on
    each handle in order, passing the keyword arguments on (``handle_dependency=``)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def wait(self, **kwargs: Any) -> None:
        for handle in self.handles:
            handle.wait(**kwargs)
