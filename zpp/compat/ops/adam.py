"""DeepSpeed's Adam optimizers (``deepspeed.ops.adam``) with their constructor signatures,
running torch's Adam underneath.

    from zpp.compat.ops.adam import FusedAdam, DeepSpeedCPUAdam
    opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)   # AdamW (adam_w_mode=True)

Both are ``torch.optim.Adam`` subclasses: ``adam_w_mode`` / ``adamw_mode`` choose decoupled
weight decay (AdamW) or L2 (Adam), exactly DeepSpeed's update (the same formulas: bias
corrections, ``eps`` added to ``sqrt(v_hat)``). torch's fused kernel runs when every
parameter is a floating-point tensor on a device torch has one for (CPU and CUDA), else its
multi-tensor (``foreach``) path; ``fused=`` / ``foreach=`` choose explicitly.

What differs from DeepSpeed: ``amsgrad=True`` runs torch's AMSGrad (DeepSpeed's FusedAdam
raises, its CPU Adam ignores it); ``bias_correction=False`` raises ``NotImplementedError``
(torch's Adam always corrects); ``DeepSpeedCPUAdam`` runs wherever its parameters are (torch
has the kernels), and keeps its states in the parameters' dtype, so
``fp32_optimizer_states=True`` (DeepSpeed's default) with 16-bit parameters raises
``NotImplementedError`` (zpp's engine gives optimizers fp32 master parameters).
torch's own keyword arguments (``maximize``, ``capturable``, ``differentiable``,
``decoupled_weight_decay``) are accepted too, so ``type(opt)(params, **opt.defaults)``
rebuilds an equal optimizer; ``decoupled_weight_decay`` is torch's name for ``adam_w_mode``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _param_list(params: Any) -> list:
    """The parameters (or parameter groups) as a list, so they can be inspected and then
    handed to torch."""
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def _tensors(groups: list) -> list[torch.Tensor]:
    out = []
    for g in groups:
        if isinstance(g, dict):
            ps = g["params"]
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        elif isinstance(g, tuple) and len(g) == 2:  # (name, tensor), as torch accepts
            out.append(g[1])
        else:
            out.append(g)
    return out


def _can_fuse(tensors: list[torch.Tensor]) -> bool:
    devices = _get_fused_kernels_supported_devices()
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type in devices for t in tensors)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam``: Adam with decoupled weight decay (``adam_w_mode=True``,
    AdamW) or L2 regularization (``adam_w_mode=False``), on torch's fused kernels.

    Args:
        params: parameters or parameter groups (per-group ``lr``, ``weight_decay``... as in
            torch).
        lr, betas, eps, weight_decay, amsgrad: as DeepSpeed's (weight decay 0 by default).
        bias_correction: only True (torch's Adam always corrects the bias).
        adam_w_mode: decoupled weight decay (Default: True).
        set_grad_none: ``zero_grad()`` sets gradients to None (Default: True).
        fused, foreach: torch's implementation switches (Default: fused where possible).
        **torch_kwargs: torch Adam's other keyword arguments.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True, *,
                 fused: bool | None = None, foreach: bool | None = None, **torch_kwargs: Any) -> None:
        name = type(self).__name__
        if not isinstance(bias_correction, bool):
            raise ValueError(f"{name}: bias_correction={bias_correction!r} must be true or false")
        if not bias_correction:
            raise NotImplementedError(f"{name}: bias_correction={bias_correction!r}: zpp's Adam is torch's, which "
                                      "always corrects the bias")
        if not isinstance(adam_w_mode, bool):
            raise ValueError(f"{name}: adam_w_mode={adam_w_mode!r} must be true or false")
        adam_w_mode = torch_kwargs.pop("decoupled_weight_decay", adam_w_mode)
        groups = _param_list(params)
        if fused is None and foreach is None and not torch_kwargs.get("differentiable", False):
            fused = _can_fuse(_tensors(groups)) or None
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=fused, foreach=foreach, decoupled_weight_decay=adam_w_mode, **torch_kwargs)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
        self.defaults["bias_correction"] = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: to None if ``set_to_none`` (Default: ``set_grad_none``)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (its ZeRO-Offload optimizer): Adam or AdamW
    (``adamw_mode``) on torch's fused CPU kernel. See the module docstring for what differs.

    Args:
        model_params: parameters or parameter groups.
        lr, bias_correction, betas, eps, weight_decay, amsgrad: as :class:`FusedAdam`.
        adamw_mode: decoupled weight decay (Default: True).
        fp32_optimizer_states: DeepSpeed keeps fp32 states for 16-bit parameters; torch keeps
            them in the parameters' dtype, so True needs fp32 parameters (Default: True).
    """

    optimizer_id = 0

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True,
                 **torch_kwargs: Any) -> None:
        groups = _param_list(model_params)
        if fp32_optimizer_states:
            low = sorted({str(t.dtype) for t in _tensors(groups) if t.dtype != torch.float32})
            if low:
                raise NotImplementedError(
                    f"DeepSpeedCPUAdam: fp32_optimizer_states=True with {low} parameters: zpp's Adam is torch's, "
                    "which keeps the states in the parameters' dtype; give it fp32 parameters (zpp's engine does) "
                    "or pass fp32_optimizer_states=False")
        torch_kwargs.pop("set_grad_none", None)
        torch_kwargs.pop("adam_w_mode", None)
        super().__init__(groups, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad, **torch_kwargs)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
