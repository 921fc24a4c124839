"""0/1 Adam (Lu et al., arXiv 2202.06009) over a zpp Transport.

    opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=400)
    loss.backward(); opt.step()                                      # step() communicates

[Note: 0/1 Adam]
Stage 1, steps ``t <= var_freeze_step`` (variance updates on an exponentially thinning set):
``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance updates.
On a step with ``t % var_interval == 0`` the gradients are averaged in full precision and
both moments are updated (with ``var_interval`` still 1 -- the first ``var_update_scaler``
steps -- this is exactly AdamW); on the other steps the *gradient* goes through the 1-bit
error-feedback all-reduce and only the momentum is updated. The variance bias correction
counts variance updates, not steps.

Stage 2, steps ``t > var_freeze_step`` (variance frozen, 1-bit sync with local steps): the
error buffers restart from zero; each rank takes local AdamW steps with its own gradient,
``x -= gamma m / d`` with ``gamma = lr / (1 - beta1^t)`` and the frozen ``d = sqrt(v_hat) + eps``.
On a step with ``t % local_step_interval == 0`` the ranks synchronise: the accumulated
momentum ``u = (x_sync - x) * d`` (``x_sync``: the parameters at the last sync, kept in the
buffer ``anchor``) is 1-bit averaged to ``u_bar``, then ``x = x_sync - u_bar / d`` and
``m = u_bar / sum(gamma)`` on every rank. ``local_step_interval`` starts at 1 and doubles,
up to ``local_step_clipper``, every ``local_step_scaler`` stage-2 steps. Keeping ``x_sync``
(rather than subtracting the local updates again, as DeepSpeed does) makes the replicas
bit-identical after every sync.
"""
from __future__ import annotations

import torch

from zpp.comm.transport import Transport
from zpp.optim._common import FusedOneBitOptimizer, adamw_apply, bias_corrections, check_step

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(FusedOneBitOptimizer):
    """0/1 Adam; see [Note: 0/1 Adam]. Every rank must call :meth:`step` together.

    Args:
        params: parameters or parameter groups (fp32, bf16 or fp16; one device).
        lr: learning rate (Default: 1e-3).
        bias_correction: Adam's bias corrections (Default: True).
        betas: momentum and variance decay (Default: (0.9, 0.999)).
        eps: added to the denominator (Default: 1e-8).
        weight_decay: decoupled weight decay, as in AdamW (Default: 0).
        var_freeze_step: the last step that may update the variance (Default: 100000).
        var_update_scaler: variance updates between doublings of their interval, the
            paper's kappa (Default: 16).
        local_step_scaler: stage-2 steps between doublings of the local-step interval
            (Default: 32678).
        local_step_clipper: largest local-step interval, the paper's H (Default: 16).
        amsgrad: not supported; True raises NotImplementedError.
        cuda_aware: accepted for DeepSpeed compatibility; ignored (Default: False).
        comm_backend_name: "nccl", "gloo", "torch" or "mpi", used when ``transport`` is None
            (Default: "nccl").
        transport: the ranks to average over (Default: by ``comm_backend_name``).

    ``state_dict()`` is per rank (error buffers, and local steps make parameters and
    momentum differ between syncs): see [Note: per-rank state] in :mod:`zpp.optim._common`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        *,
        transport: Transport | None = None,
    ) -> None:
        who = type(self).__name__
        self.var_freeze_step = check_step(who, "var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = check_step(who, "var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = check_step(who, "local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = check_step(who, "local_step_clipper", local_step_clipper, 1)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(
            params, defaults, transport=transport, comm_backend_name=comm_backend_name,
            cuda_aware=cuda_aware, amsgrad=amsgrad,
        )
        n, dev = self.flat.numel, self.flat.device
        self.buffers = {
            "exp_avg": torch.zeros(n, dtype=torch.float32, device=dev),
            "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=dev),
            "anchor": None,  # parameters at the last stage-2 sync
        }
        self.scalars = {
            "var_interval": 1,
            "var_counter": 0,
            "var_updates": 0,
            "local_step_interval": 1,
            "local_step_counter": 0,
            "lrs": [0.0] * len(self.param_groups),  # sum of gamma since the last sync, per group
        }

    def _update(self, grad: torch.Tensor, step: int) -> None:
        if step <= self.var_freeze_step:
            self._stage1(grad, step)
        else:
            self._stage2(grad, step)

    def _stage1(self, grad: torch.Tensor, step: int) -> None:
        s = self.scalars
        m, v, x = self.buffers["exp_avg"], self.buffers["exp_avg_sq"], self.flat.master
        full = step % s["var_interval"] == 0
        if full:
            self.average(grad)
            s["var_updates"] += 1
        else:
            self.compress_average(grad)
        for _, g, sl in self.groups():
            beta1, beta2 = g["betas"]
            m[sl].lerp_(grad[sl], 1.0 - beta1)
            if full:
                v[sl].mul_(beta2).addcmul_(grad[sl], grad[sl], value=1.0 - beta2)
            bc1, bc2 = bias_corrections(g, step, s["var_updates"])
            adamw_apply(x[sl], m[sl], v[sl], g, bc1, bc2)
        if full:
            s["var_counter"] += 1
            if s["var_counter"] == self.var_update_scaler:
                s["var_counter"] = 0
                s["var_interval"] *= 2

    def _stage2(self, grad: torch.Tensor, step: int) -> None:
        s, b = self.scalars, self.buffers
        m, v, x = b["exp_avg"], b["exp_avg_sq"], self.flat.master
        if b["anchor"] is None:  # first stage-2 step: errors now measure momentum, not gradients
            self.reset_compression_error()
            b["anchor"] = x.clone()
        groups = self.groups()
        denoms = []
        for i, g, sl in groups:
            bc1, bc2 = bias_corrections(g, step, s["var_updates"])
            d = (v[sl].sqrt() / bc2).add_(g["eps"])
            denoms.append(d)
            m[sl].lerp_(grad[sl], 1.0 - g["betas"][0])
            if g["weight_decay"]:
                x[sl].mul_(1.0 - g["lr"] * g["weight_decay"])
            x[sl].addcdiv_(m[sl], d, value=-g["lr"] / bc1)
            s["lrs"][i] += g["lr"] / bc1
        if step % s["local_step_interval"] == 0:
            anchor, u = b["anchor"], grad  # the gradient buffer is free now: reuse it for u
            torch.sub(anchor, x, out=u)
            for (_, _, sl), d in zip(groups, denoms):
                u[sl].mul_(d)
            self.compress_average(u)
            for (i, _, sl), d in zip(groups, denoms):
                if s["lrs"][i] > 0:
                    torch.div(u[sl], s["lrs"][i], out=m[sl])
                torch.sub(anchor[sl], u[sl] / d, out=x[sl])
                s["lrs"][i] = 0.0
            anchor.copy_(x)
        s["local_step_counter"] += 1
        if s["local_step_counter"] == self.local_step_scaler:
            s["local_step_counter"] = 0
            s["local_step_interval"] = min(self.local_step_clipper, 2 * s["local_step_interval"])
