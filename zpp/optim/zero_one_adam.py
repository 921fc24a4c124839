"""0/1 Adam (Lu et al., arXiv 2202.06009) over a zpp Transport.

    opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=400)
    loss.backward(); opt.step()                                      # step() communicates

[Note: 0/1 Adam]
The paper's Algorithm 1, per step ``t`` on every rank, with ``gamma_t = lr / (1 - beta1^t)``
and ``d = sqrt(v_hat) + eps`` (the variance as of the last update; its bias correction counts
variance updates, not steps):

1. ``m = beta1 m + (1 - beta1) g``; a local step ``x = x (1 - lr wd) - gamma_t m / d``;
   ``sum_gamma += gamma_t``. The accumulated update ``u = sum of gamma m`` since the last
   sync ``x_sync`` (the buffer ``anchor``) is ``u = (x_sync - x) d``: decoupled weight decay
   is applied to ``x_sync`` too, so that ``u`` holds momentum only.
2. Variance steps ``T_v``: ``t <= var_freeze_step`` and ``t % var_interval == 0``;
   ``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` (the paper's
   kappa) variance updates. On them the gradient of step 1 is the full-precision mean and
   ``v = beta2 v + (1 - beta2) g^2`` is updated before the step (with ``var_interval`` still
   1 -- the first ``var_update_scaler`` steps -- this is exactly AdamW). All ranks then hold
   the same ``m`` and ``x``: the step is a sync (``x_sync = x``, nothing else is sent).
3. Sync steps ``T_u``, the other steps with ``t % local_step_interval == 0``: the
   accumulated update goes through the 1-bit error-feedback all-reduce,
   ``u_bar = 1bit-mean(u)``; then ``x = x_sync - u_bar / d`` and ``m = u_bar / sum_gamma`` on
   every rank, and ``x_sync = x``. ``local_step_interval`` is 1 up to ``var_freeze_step``
   (stage 1: every step between variance updates is a 1-bit sync of one step's ``gamma m``)
   and then doubles, up to ``local_step_clipper`` (the paper's H), every ``local_step_scaler``
   steps; between syncs the ranks take local steps and send nothing.

So only ``u`` is ever compressed (never a raw gradient), and the error-feedback buffers keep
measuring the same quantity through both stages. Keeping ``x_sync`` (rather than subtracting
the local updates again, as DeepSpeed does) makes the replicas bit-identical after every sync.

[Note: per-tensor scale of u]
The 1-bit all-reduce sends one scale (the rms) for the whole fused buffer, so a tensor whose
``u`` is much smaller than the buffer's rms (a LayerNorm gain, a rarely used embedding row)
would be sent as +-rms: after ``/ d`` a step far larger than Adam's. DeepSpeed compresses
tensor by tensor; here ``u`` is multiplied per tensor by ``k_i = 1 / rms(d_i)`` before the
all-reduce and divided after it, so that every tensor enters at about Adam's update size
(``m / d`` is of order 1). ``d`` is the same on every rank, so the mean is unchanged.
On the GPT of tests/test_zero_onebit.py this took the final loss against AdamW from +22% to
+5% (var_update_scaler=16) and from +1.5% to -1.8% (variance updated every stage-1 step).
"""
from __future__ import annotations

import torch

from zpp.comm.transport import Transport
from zpp.optim._common import FusedOneBitOptimizer, adam_moments, bias_corrections, check_step

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
        nonfinite: a step with NaN or Inf in some rank's gradient is skipped on every rank
            ("skip"), or skipped and then raises ``NonFiniteGradientError`` on every rank
            ("raise"); None: the caller checks (see [Note: non-finite gradients] in
            :mod:`zpp.optim._common`) (Default: "skip").

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
        nonfinite: str | None = "skip",
    ) -> None:
        who = type(self).__name__
        self.var_freeze_step = check_step(who, "var_freeze_step", var_freeze_step, 1)
        self.var_update_scaler = check_step(who, "var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = check_step(who, "local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = check_step(who, "local_step_clipper", local_step_clipper, 1)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            transport=transport, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, amsgrad=amsgrad,
            nonfinite=nonfinite,
        )
        self.buffers["anchor"] = self.flat.master.clone()  # x_sync: the parameters at the last sync
        self.scalars = {
            "var_interval": 1,
            "var_counter": 0,
            "var_updates": 0,
            "local_step_interval": 1,
            "local_step_counter": 0,
            "lrs": [0.0] * len(self.param_groups),  # sum of gamma since the last sync, per group
        }

    def _update(self, grad: torch.Tensor, step: int) -> None:
        s, b, flat = self.scalars, self.buffers, self.flat
        if b.get("anchor") is None:  # a state saved before x_sync was kept from step 1
            b["anchor"] = flat.master.clone()
        m, v, x, anchor = b["exp_avg"], b["exp_avg_sq"], flat.master, b["anchor"]
        full = step <= self.var_freeze_step and step % s["var_interval"] == 0
        if full:
            self.average(grad)
            s["var_updates"] += 1
        groups = self.groups()
        denoms = []
        for i, g, sl in groups:  # 1. (and 2.): moments, then the local step
            adam_moments(m[sl], v[sl] if full else None, grad[sl], g)
            bc1, bc2 = bias_corrections(g, step, s["var_updates"])
            d = (v[sl].sqrt() / bc2).add_(g["eps"])
            denoms.append(d)
            if g["weight_decay"]:
                decay = 1.0 - g["lr"] * g["weight_decay"]
                x[sl].mul_(decay)
                anchor[sl].mul_(decay)
            x[sl].addcdiv_(m[sl], d, value=-g["lr"] / bc1)
            s["lrs"][i] += g["lr"] / bc1
        if full or step % s["local_step_interval"] == 0:
            if not full:  # 3.: 1-bit average of u, per-tensor scaled (see [Note: per-tensor scale of u])
                u, ks = grad, []  # the gradient buffer is free now: reuse it for u
                torch.sub(anchor, x, out=u)
                for (gi, _, sl), d in zip(groups, denoms):
                    r = flat.rms(d, gi)
                    k = flat.per_element(torch.where(r > 0, 1.0 / r.clamp_min(1e-30), 1.0), gi)
                    u[sl].mul_(d).mul_(k)
                    ks.append(k)
                self.compress_average(u)
                for (i, _, sl), d, k in zip(groups, denoms, ks):
                    u[sl].div_(k)
                    if s["lrs"][i] > 0:
                        torch.div(u[sl], s["lrs"][i], out=m[sl])
                    torch.sub(anchor[sl], u[sl] / d, out=x[sl])
                self.mask_momentum(m)
            anchor.copy_(x)
            s["lrs"] = [0.0] * len(s["lrs"])
        if full:
            s["var_counter"] += 1
            if s["var_counter"] == self.var_update_scaler:
                s["var_counter"] = 0
                s["var_interval"] *= 2
        if step > self.var_freeze_step:
            s["local_step_counter"] += 1
            if s["local_step_counter"] == self.local_step_scaler:
                s["local_step_counter"] = 0
                s["local_step_interval"] = min(self.local_step_clipper, 2 * s["local_step_interval"])
