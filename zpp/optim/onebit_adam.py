"""1-bit Adam (Tang et al., arXiv 2102.02888) over a zpp Transport.

    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=400)   # plain, replicated model
    loss.backward(); opt.step()                                      # step() communicates

[Note: 1-bit Adam]
Warm-up, steps ``1 .. freeze_step``: the gradients are averaged in full precision (one fp32
all-reduce of the flat buffer) and the update is Adam's with decoupled weight decay, i.e.
``torch.optim.AdamW`` (``torch.optim.Adam`` when ``weight_decay=0``).

Compression, steps ``t > freeze_step``: the variance ``v`` is frozen (with its bias
correction at ``freeze_step``); each rank updates the momentum with its *local* gradient,
``m = beta1 m + (1 - beta1) g``, and the fused momentum goes through the 1-bit
error-feedback all-reduce (:class:`zpp.comm.onebit.OneBitAllReduce`), which leaves the same
``m`` on every rank; then ``x = x (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^freeze_step) + eps)``.
With ``bias_correction=False`` both corrections are 1 (DeepSpeed's update).
"""
from __future__ import annotations

import torch

from zpp.comm.transport import Transport
from zpp.optim._common import FusedOneBitOptimizer, adam_moments, adamw_apply, bias_corrections, check_step

__all__ = ["OneBitAdam"]


class OneBitAdam(FusedOneBitOptimizer):
    """1-bit Adam; see [Note: 1-bit Adam]. Every rank must call :meth:`step` together.

    Args:
        params: parameters or parameter groups (fp32, bf16 or fp16; one device).
        lr: learning rate (Default: 1e-3).
        freeze_step: number of full-precision warm-up steps before compression (Default: 100000).
        bias_correction: Adam's bias corrections (Default: True).
        betas: momentum and variance decay (Default: (0.9, 0.999)).
        eps: added to the denominator (Default: 1e-8).
        weight_decay: decoupled weight decay, as in AdamW (Default: 0).
        amsgrad: not supported; True raises NotImplementedError.
        cuda_aware: accepted for DeepSpeed compatibility; ignored (Default: False).
        comm_backend_name: "nccl", "gloo", "torch" (the torch.distributed transport) or "mpi",
            used when ``transport`` is None (Default: "nccl").
        transport: the ranks to average over (Default: by ``comm_backend_name``).
        nonfinite: a step with NaN or Inf in some rank's gradient is skipped on every rank
            ("skip"), or skipped and then raises ``NonFiniteGradientError`` on every rank
            ("raise"); None: the caller checks (see [Note: non-finite gradients] in
            :mod:`zpp.optim._common`) (Default: "skip").

    ``state_dict()`` holds this rank's error-feedback buffers: see [Note: per-rank state]
    in :mod:`zpp.optim._common`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        transport: Transport | None = None,
        nonfinite: str | None = "skip",
    ) -> None:
        self.freeze_step = check_step(type(self).__name__, "freeze_step", freeze_step, 1)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            transport=transport, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, amsgrad=amsgrad,
            nonfinite=nonfinite,
        )

    def _update(self, grad: torch.Tensor, step: int) -> None:
        m, v, x = self.buffers["exp_avg"], self.buffers["exp_avg_sq"], self.flat.master
        groups = [(g, sl) for _, g, sl in self.groups()]
        if step <= self.freeze_step:  # warm-up: AdamW on the averaged gradient
            self.average(grad)
            for g, sl in groups:
                adam_moments(m[sl], v[sl], grad[sl], g)
                bc1, bc2 = bias_corrections(g, step)
                adamw_apply(x[sl], m[sl], v[sl], g, bc1, bc2)
            return
        for g, sl in groups:  # compression: local momentum, 1-bit averaged, frozen variance
            adam_moments(m[sl], None, grad[sl], g)
        self.compress_average(m)
        self.mask_momentum(m)
        for g, sl in groups:
            bc1, _ = bias_corrections(g, step)
            _, bc2 = bias_corrections(g, self.freeze_step)
            adamw_apply(x[sl], m[sl], v[sl], g, bc1, bc2)
