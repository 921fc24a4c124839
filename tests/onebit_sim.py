"""The 1-bit error-feedback all-reduce of zpp.comm.onebit, written again in plain torch with
all W ranks in one process: the reference the collective and the 1-bit optimizers are tested
against; and :class:`Lamb`, plain per-tensor LAMB, the uncompressed reference of 1-bit LAMB.

    sim = OneBitSim(n, W)
    out = sim(torch.stack([x_rank0, x_rank1]))   # the mean every rank receives

Worker compression (per rank ``r``): ``b = x_r + e_r``, scale ``a_r = ||b|| / sqrt(n)``,
signs of ``b`` (+1 for zero), new error ``e_r = b - a_r sign(b)``. The padded buffer is cut
into W chunks of ``c`` elements (a multiple of 8); for chunk ``j`` the server averages the
ranks' ``a_r sign`` (padding signs are +1), adds its error, and compresses again with one
scale over its real elements; padding stays 0 in the server error.
"""
from __future__ import annotations

import math

import torch


class OneBitSim:
    """All W ranks of the 1-bit all-reduce (mean) of ``n`` elements, in one process."""

    def __init__(self, n: int, W: int) -> None:
        self.n, self.W = n, W
        self.c = -(-n // (8 * W)) * 8
        self.we = torch.zeros(W, n)  # worker errors, one row per rank
        self.se = torch.zeros(W, self.c)  # server error of chunk j (held by rank j)

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:
        """``xs``: (W, n), one row per rank; returns the (n,) mean every rank receives."""
        n, W, c = self.n, self.W, self.c
        b = xs + self.we
        a = b.norm(dim=1) / math.sqrt(n)
        sg = torch.where(b >= 0, 1.0, -1.0)
        self.we = b - a[:, None] * sg
        full = torch.ones(W, W * c)
        full[:, :n] = sg
        out = torch.zeros(W * c)
        for j in range(W):
            m = full[0, j * c:(j + 1) * c] * a[0]
            for i in range(1, W):
                m = m + full[i, j * c:(j + 1) * c] * a[i]
            m = m / W
            valid = max(0, min(c, n - j * c))
            srv = m + self.se[j]
            srv[valid:] = 0
            sa = srv[:valid].norm() / math.sqrt(valid) if valid else torch.tensor(0.0)
            ss = torch.where(srv >= 0, 1.0, -1.0)
            self.se[j] = srv - sa * ss
            self.se[j, valid:] = 0
            out[j * c:(j + 1) * c] = sa * ss
        return out[:n]


class Lamb:
    """LAMB per tensor in plain torch: Adam moments with bias correction, ``u = m_hat /
    (sqrt(v_hat) + eps) + wd x``, trust ratio ``||x|| / ||u||`` clipped to [min, max] (1 if
    either is 0), and DeepSpeed's running average of the ratios (1-bit LAMB's frozen one)."""

    def __init__(self, xs, lr, betas, eps, weight_decay, max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, **_):
        self.xs, self.lr, self.betas, self.eps, self.wd = xs, lr, betas, eps, weight_decay
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.m = [torch.zeros_like(x) for x in xs]
        self.v = [torch.zeros_like(x) for x in xs]
        self.frozen = [0.0] * len(xs)
        self.t = 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        for i, (x, g) in enumerate(zip(self.xs, grads)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            u = (self.m[i] / (1 - b1 ** self.t)) / ((self.v[i] / (1 - b2 ** self.t)).sqrt() + self.eps) + self.wd * x
            wn, un = float(x.norm()), float(u.norm())
            c = min(max(wn / un, self.min_coeff), self.max_coeff) if wn > 0 and un > 0 else 1.0
            if c != 1.0:
                self.frozen[i] = self.coeff_beta * self.frozen[i] + (1 - self.coeff_beta) * c
            x -= self.lr * c * u
