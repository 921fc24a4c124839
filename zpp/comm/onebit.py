"""The 1-bit error-feedback all-reduce (1-bit Adam / 0/1 Adam / 1-bit LAMB), once, over a
:class:`~zpp.comm.transport.Transport`.

[Note: 1-bit all-reduce]
For a tensor of ``n`` elements on ``W`` ranks, padded to ``W * c`` with ``c`` a multiple of 8:

1. Worker: ``b = x + e_w`` (fp32); scale ``a = sqrt(mean(b**2)) = ||b||_2 / sqrt(n)``; signs ``sign(b)``
   (``b >= 0`` -> +1); new worker error ``e_w = b - a * sign(b)``.
2. Phase 1: all-to-all of the packed signs (chunk ``j`` of every rank goes to rank ``j``,
   ``c / 8`` bytes each) and all-gather of the ``W`` worker scales.
3. Server (each rank, for its chunk): ``m = sum_i a_i * sign_i / W`` in rank order;
   ``b_s = m + e_s``; scale ``a_s = ||b_s||_2 / sqrt(valid)`` over the chunk's real elements;
   new server error ``e_s = b_s - a_s * sign(b_s)``.

Steps 1 and 3 are the fused :func:`zpp.quant.onebit_compress`, step 3's average is
:func:`zpp.quant.signs_weighted_sum` and step 4's decode :func:`zpp.quant.unpack_scaled`
(see [Note: 1-bit kernels] in zpp/quant/reference.py).
4. Phase 2: all-gather of the packed server signs and server scales; the result is chunk
   ``j`` = ``a_s[j] * sign_j``, the same on every rank.

Padded positions never enter a norm and their errors stay zero. On the wire: about
``2 * (W - 1) / W * n / 8`` bytes plus ``2 W`` scales per rank, against ``2 * (W - 1) / W * 4n``
for an fp32 all-reduce: about 32x less.
"""
from __future__ import annotations


import torch

import zpp.quant as zq
from zpp.comm.transport import Transport

__all__ = ["OneBitAllReduce"]


class OneBitAllReduce:
    """Stateful 1-bit compressed all-reduce (MEAN) of a fixed-size tensor.

    Args:
        numel: elements of the tensors this object will reduce.
        transport: the ranks to reduce over.
        device: where the error buffers live (Default: cpu).

    The worker and server error buffers persist across calls; :meth:`state_dict` /
    :meth:`load_state_dict` checkpoint them (they are this rank's own, not replicated).
    """

    def __init__(self, numel: int, transport: Transport, device: torch.device | str = "cpu") -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"OneBitAllReduce: numel={numel!r} must be a positive integer")
        self.numel = numel
        self.transport = transport
        world = transport.world_size
        self.chunk = -(-numel // (8 * world)) * 8
        self.padded = self.chunk * world
        device = torch.device(device)
        self.worker_error = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        start = transport.rank * self.chunk
        self.valid = max(0, min(self.chunk, numel - start))  # real elements of my chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` (``numel`` elements, any float dtype) by the compressed mean."""
        if x.numel() != self.numel:
            raise ValueError(f"OneBitAllReduce: got {x.numel()} elements, built for numel={self.numel}")
        if not x.is_contiguous():
            raise ValueError(f"OneBitAllReduce: x must be contiguous ({x.shape=} {x.stride()=})")
        t, W, n, c = self.transport, self.transport.world_size, self.numel, self.chunk
        t.check_agree("onebit_all_reduce", (n,), ("numel",))
        dev = self.worker_error.device
        with t.counters.collective("onebit_all_reduce", n * x.element_size()):
            # 1. worker compression with error feedback (fused; updates worker_error)
            signs, scale = zq.onebit_compress(x.reshape(-1).to(dev), self.worker_error, numel=n)
            # 2. phase 1: my chunk of every worker's signs, and every worker's scale
            recv = torch.empty_like(signs)
            t.all_to_all(recv, signs)
            scales = torch.empty(W, dtype=torch.float32, device=dev)
            t.all_gather(scales, scale)
            # 3. server: average my chunk, add the server error, recompress (padding ignored)
            m = zq.signs_weighted_sum(recv, scales, chunk=c, divisor=float(W))
            s_signs, s_scale = zq.onebit_compress(m, self.server_error, numel=self.valid)
            # 4. phase 2: everyone's recompressed chunk
            all_signs = torch.empty(W * s_signs.numel(), dtype=torch.uint8, device=dev)
            t.all_gather(all_signs, s_signs)
            all_scales = torch.empty(W, dtype=torch.float32, device=dev)
            t.all_gather(all_scales, s_scale)
            result = zq.unpack_scaled(all_signs, all_scales, chunk=c, numel=n, dtype=x.dtype)
        x.view(-1).copy_(result)
        return x

    def state_dict(self) -> dict:
        return {
            "numel": self.numel,
            "world_size": self.transport.world_size,
            "rank": self.transport.rank,
            "worker_error": self.worker_error.clone(),
            "server_error": self.server_error.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's error buffers (same numel and world size)."""
        want = (self.numel, self.transport.world_size)
        got = (state.get("numel"), state.get("world_size"))
        if got != want:
            raise ValueError(
                f"OneBitAllReduce.load_state_dict: state is for (numel, world_size)={got}, "
                f"this object has {want}"
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
