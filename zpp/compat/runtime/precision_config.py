"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``bf16`` (alias ``bfloat16``) and
``fp16`` sections as objects, with DeepSpeed 0.19.8's fields and defaults, checked by zpp's
checks of the same keys (see :mod:`zpp.runtime.zero.config` for how these objects read a
section)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zpp.compat.runtime.zero.config import _Section

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config", "get_float16_config"]


class DeepSpeedBF16Config(_Section):
    PATH = "bf16"
    FIELDS = {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
              "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}


class DeepSpeedFP16Config(_Section):
    PATH = "fp16"
    FIELDS = {"enabled": False, "auto_cast": False, "loss_scale": 0.0, "initial_scale_power": 16,
              "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
              "fp16_master_weights_and_grads": False}


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` section of a config dict (else ``bfloat16``, DeepSpeed's older name)."""
    section = param_dict.get("bf16")
    return DeepSpeedBF16Config(**(section if section is not None else param_dict.get("bfloat16", {})))


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` section of a config dict."""
    return DeepSpeedFP16Config(**param_dict.get("fp16", {}))
