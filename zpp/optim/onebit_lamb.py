"""1-bit LAMB (Li et al., arXiv 2104.06069) over a zpp Transport.

    opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=400)
    loss.backward(); opt.step()                                      # step() communicates

[Note: 1-bit LAMB]
Per parameter tensor ``i`` (a LAMB "layer"), with ``m_hat = m / (1 - beta1^t)`` and
``v_hat = v / (1 - beta2^t)`` (both corrections 1 with ``bias_correction=False``):

Warm-up, steps ``1 .. freeze_step``: full-precision averaged gradient, then LAMB:
``u = m_hat / (sqrt(v_hat) + eps) + wd x``; trust ratio ``c = ||x_i|| / ||u_i||`` clipped
to ``[min_coeff, max_coeff]`` (1 when either norm is 0); ``x -= lr c u``. The ratios feed
an exponential average ``c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c`` (steps with
``c == 1`` are skipped); at ``freeze_step`` ``v`` is frozen and copied to ``v_fresh``.

Compression, steps ``t > freeze_step``:

1. Once, at the first compression step: per-tensor momentum scale ``s_i = ||m_i|| / sqrt(n_i)``
   and scaling coefficient ``k_i = mean(s) / s_i``, so that every tensor enters the fused
   1-bit buffer at a similar magnitude.
2. ``m = beta1 m + (1 - beta1) g_local``; ``m *= k``; 1-bit error-feedback all-reduce of
   the one fused buffer; ``m /= k``.
3. The averaged gradient is reconstructed, ``g~ = (m - beta1 m_prev) / (1 - beta1)``, and
   keeps ``v_fresh`` up to date (``v_fresh = beta2 v_fresh + (1 - beta2) g~^2``).
4. ``u = m_hat / d + wd x`` with the frozen ``d = sqrt(v_hat_frozen) + eps``. The frozen trust
   ratio is corrected by ``f_i = max_i(d / (sqrt(v_fresh_hat) + eps))``; with weight decay
   ``f = f r + (1 - r)`` where ``r = min(1, ||m_hat / d|| / ||u||)``; ``f`` is clipped to
   ``[factor_min, factor_max]`` and to ``(1 +- factor_threshold)`` times the previous step's
   ``f``; then ``x -= lr c_frozen f u``.
"""
from __future__ import annotations

import torch

from zpp.comm.transport import Transport
from zpp.optim._common import (
    FusedOneBitOptimizer,
    adam_moments,
    bias_corrections,
    check_step,
    segment_max,
    segment_norms,
)

__all__ = ["OneBitLamb"]


class OneBitLamb(FusedOneBitOptimizer):
    """1-bit LAMB; see [Note: 1-bit LAMB]. Every rank must call :meth:`step` together.

    Args:
        params: parameters or parameter groups (fp32, bf16 or fp16; one device).
        lr: learning rate (Default: 1e-3).
        freeze_step: number of full-precision warm-up steps before compression (Default: 100000).
        bias_correction: Adam's bias corrections of both moments (Default: True).
        betas: momentum and variance decay (Default: (0.9, 0.999)).
        eps: added to the denominator (Default: 1e-8).
        weight_decay: weight decay added to the update, inside the trust ratio (Default: 0).
        max_coeff: largest trust ratio (Default: 10.0).
        min_coeff: smallest trust ratio (Default: 0.01).
        amsgrad: not supported; True raises NotImplementedError.
        cuda_aware: accepted for DeepSpeed compatibility; ignored (Default: False).
        comm_backend_name: "nccl", "gloo", "torch" or "mpi", used when ``transport`` is None
            (Default: "nccl").
        coeff_beta: decay of the trust-ratio average frozen at ``freeze_step``; keep
            ``1 / (1 - coeff_beta) <= freeze_step`` (Default: 0.9).
        factor_max: largest correction factor of the frozen trust ratio (Default: 4.0).
        factor_min: smallest correction factor (Default: 0.5).
        factor_threshold: largest relative change of the factor per step (Default: 0.1).
        transport: the ranks to average over (Default: by ``comm_backend_name``).
        nonfinite: a step with NaN or Inf in some rank's gradient is skipped on every rank
            ("skip"), or skipped and then raises ``NonFiniteGradientError`` on every rank
            ("raise"); None: the caller checks (see [Note: non-finite gradients] in
            :mod:`zpp.optim._common`) (Default: "skip").

    After each step ``last_lamb_coeffs`` holds the trust ratio used for every tensor.
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        transport: Transport | None = None,
        nonfinite: str | None = "skip",
    ) -> None:
        who = type(self).__name__
        self.freeze_step = check_step(who, "freeze_step", freeze_step, 1)
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"{who}: need 0 < min_coeff <= max_coeff, got {min_coeff=} {max_coeff=}")
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"{who}: coeff_beta={coeff_beta!r} must be in [0, 1)")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(f"{who}: need 0 < factor_min <= factor_max, got {factor_min=} {factor_max=}")
        if not 0.0 <= factor_threshold:
            raise ValueError(f"{who}: factor_threshold={factor_threshold!r} must be >= 0")
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            transport=transport, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware, amsgrad=amsgrad,
            nonfinite=nonfinite,
            max_coeff=max_coeff, min_coeff=min_coeff,
        )
        k, dev = len(self.flat.params), self.flat.device
        self.buffers.update({
            "exp_avg_sq_fresh": None,  # v kept up to date from reconstructed gradients
            "lamb_coeff_freeze": torch.zeros(k, dtype=torch.float32, device=dev),
            "last_factor": torch.ones(k, dtype=torch.float32, device=dev),
            "scaling_coeff": None,  # per-tensor momentum scaling, fixed at the first 1-bit step
        })
        self.last_lamb_coeffs = torch.ones(k, dtype=torch.float32, device=dev)

    def _update(self, grad: torch.Tensor, step: int) -> None:
        if step <= self.freeze_step:
            self._warmup(grad, step)
        else:
            self._compressed(grad, step)

    def _warmup(self, grad: torch.Tensor, step: int) -> None:
        b = self.buffers
        m, v, x, frozen = b["exp_avg"], b["exp_avg_sq"], self.flat.master, b["lamb_coeff_freeze"]
        self.average(grad)
        for gi, g, sl in self.groups():
            adam_moments(m[sl], v[sl], grad[sl], g)
            bc1, bc2 = bias_corrections(g, step)
            update = (m[sl] / bc1).div_((v[sl].sqrt() / bc2).add_(g["eps"]))
            if g["weight_decay"]:
                update.add_(x[sl], alpha=g["weight_decay"])
            w_norm = segment_norms(self.flat.segments(x[sl], gi))
            u_norm = segment_norms(self.flat.segments(update, gi))
            ok = (w_norm > 0) & (u_norm > 0)
            coeff = torch.where(ok, (w_norm / u_norm.clamp_min(1e-38)).clamp(g["min_coeff"], g["max_coeff"]), 1.0)
            r = self.flat.group_params[gi]
            cb = self.coeff_beta
            frozen[r.start:r.stop] = torch.where(coeff != 1.0, cb * frozen[r.start:r.stop] + (1 - cb) * coeff,
                                                 frozen[r.start:r.stop])
            self.last_lamb_coeffs[r.start:r.stop] = coeff
            x[sl].sub_(update.mul_(self.flat.per_element(coeff, gi)), alpha=g["lr"])
        if step == self.freeze_step:
            b["exp_avg_sq_fresh"] = v.clone()

    def _compressed(self, grad: torch.Tensor, step: int) -> None:
        b, flat = self.buffers, self.flat
        m, v, x = b["exp_avg"], b["exp_avg_sq"], flat.master
        if b["exp_avg_sq_fresh"] is None:  # freeze_step raised after a checkpoint: freeze now
            b["exp_avg_sq_fresh"] = v.clone()
        v_fresh = b["exp_avg_sq_fresh"]
        if b["scaling_coeff"] is None:
            scale = flat.rms(m)
            b["scaling_coeff"] = torch.where(scale > 0, scale.mean() / scale.clamp_min(1e-38), 1.0)
        k = torch.repeat_interleave(b["scaling_coeff"], flat.sizes_t)
        # the new local momentum goes into the gradient buffer; m keeps the previous one
        new_m = grad
        for _, g, sl in self.groups():
            new_m[sl].mul_(1.0 - g["betas"][0]).add_(m[sl], alpha=g["betas"][0])
        self.compress_average(new_m.mul_(k)).div_(k)
        self.mask_momentum(new_m)
        for gi, g, sl in self.groups():
            beta1, beta2 = g["betas"]
            g_rec = (new_m[sl] - beta1 * m[sl]).div_(1.0 - beta1)
            v_fresh[sl].mul_(beta2).addcmul_(g_rec, g_rec, value=1.0 - beta2)
            m[sl].copy_(new_m[sl])
            bc1, bc2_now = bias_corrections(g, step)
            _, bc2_frozen = bias_corrections(g, self.freeze_step)
            denom = (v[sl].sqrt() / bc2_frozen).add_(g["eps"])
            update_prelim = (m[sl] / bc1).div_(denom)
            denom_real = (v_fresh[sl].sqrt() / bc2_now).add_(g["eps"])
            factor = segment_max(flat.segments(denom.div_(denom_real), gi), empty=1.0)
            if g["weight_decay"]:
                update = update_prelim + g["weight_decay"] * x[sl]
                u_norm = segment_norms(flat.segments(update, gi))
                p_norm = segment_norms(flat.segments(update_prelim, gi))
                ratio = torch.where(u_norm > 0, (p_norm / u_norm.clamp_min(1e-38)).clamp_max(1.0), 1.0)
                factor = factor * ratio + (1.0 - ratio)
            else:
                update = update_prelim
            r = flat.group_params[gi]
            last = b["last_factor"][r.start:r.stop]
            factor = factor.clamp(self.factor_min, self.factor_max)
            factor = torch.minimum(torch.maximum(factor, last * (1.0 - self.factor_threshold)),
                                   last * (1.0 + self.factor_threshold))
            last.copy_(factor)
            coeff = b["lamb_coeff_freeze"][r.start:r.stop] * factor
            self.last_lamb_coeffs[r.start:r.stop] = coeff
            x[sl].sub_(update.mul_(flat.per_element(coeff, gi)), alpha=g["lr"])

