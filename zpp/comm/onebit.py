"""The 1-bit error-feedback all-reduce (1-bit Adam / 0/1 Adam / 1-bit LAMB), once, over a
:class:`~zpp.comm.transport.Transport`.

[Note: 1-bit all-reduce]
For a tensor of ``n`` elements on ``W`` ranks, padded to ``W * c`` with ``c`` a multiple of 8:

1. Worker: ``b = x + e_w`` (fp32); scale ``a = sqrt(mean(b**2)) = ||b||_2 / sqrt(n)``; signs ``sign(b)``
   (``b >= 0`` -> +1); new worker error ``e_w = b - a * sign(b)``.
2. Phase 1, one all-to-all of frames: frame ``j`` of a rank holds chunk ``j`` of its packed signs
   (``c / 8`` bytes) followed by its scale (4 bytes, fp32) and goes to rank ``j``.
3. Server (each rank, for its chunk): ``m = sum_i a_i * sign_i / W`` in rank order;
   ``b_s = m + e_s``; scale ``a_s = ||b_s||_2 / sqrt(valid)`` over the chunk's real elements;
   new server error ``e_s = b_s - a_s * sign(b_s)``.
4. Phase 2, an all-gather of each rank's frame: its packed server signs and server scale. The
   result is chunk ``j`` = ``a_s[j] * sign_j``, the same on every rank, decoded straight into ``x``.
   On several nodes of several ranks each it is hierarchical (pure data movement, so the
   result is the same): an all-gather among the ranks of this local rank on every node
   (``topology.inter``), then an all-gather of those ``N`` frames inside the node
   (``topology.intra``). Each frame then crosses a node link once per other node instead of
   once per rank there: on 2 nodes x 2 ranks phase 2 sends half the inter-node bytes, the call
   a quarter less.

Steps 1 and 3 are the fused :func:`zpp.quant.onebit_compress`, step 3's average is
:func:`zpp.quant.signs_weighted_sum` and step 4's decode :func:`zpp.quant.unpack_scaled`
(see [Note: 1-bit kernels] in zpp/quant/reference.py), called with ``out=`` buffers that are
allocated once, in ``__init__``: a call allocates nothing of the tensor's size. Both
compressions run lazily (``pending=``): between calls ``worker_error`` and ``server_error`` hold
the last ``b`` and ``b_s``, and the error update ``- a * sign(b)`` is applied by the next call in
its single pass over memory (the eager kernel needs two). The results are the same bits;
:meth:`state_dict` settles the buffers it returns.

Padded positions never enter a norm and their errors stay zero. On the wire: about
``2 * (W - 1) / W * n / 8`` bytes plus ``2 (W - 1)`` scales per rank, against ``2 * (W - 1) / W * 4n``
for an fp32 all-reduce: about 32x less. Putting each scale in the frame with the signs costs
no extra bytes (every other rank needs it either way) and halves the collectives per call, so
the fixed latency of each, which dominates small tensors, is paid twice instead of four times.
"""
from __future__ import annotations

import torch

import zpp.quant as zq
from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport
from zpp.quant.reference import settle
from zpp.quant.types import check_dtype

__all__ = ["OneBitAllReduce"]


class OneBitAllReduce:
    """Stateful 1-bit compressed all-reduce (MEAN) of a fixed-size tensor.

    Args:
        numel: elements of the tensors this object will reduce.
        transport: the ranks to reduce over.
        device: where the error buffers live (Default: cpu).
        hierarchical: phase 2 in two hops, inter-node then intra-node (Default: when the
            transport spans several nodes of several ranks; see the Note). Every rank must
            pass the same value.

    The worker and server error buffers persist across calls; :meth:`state_dict` /
    :meth:`load_state_dict` checkpoint them (they are this rank's own, not replicated).
    Between calls the buffers hold the last ``b`` with the error update still pending (see
    the Note); :meth:`state_dict` returns the settled errors.
    Besides them the object holds its wire and scratch buffers (about ``3 n / 4`` bytes of
    signs and frames plus ``4 c`` for the server average), reused by every call.
    """

    def __init__(self, numel: int, transport: Transport, device: torch.device | str = "cpu",
                 hierarchical: bool | None = None) -> None:
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
        self._w_pending = self._s_pending = 0.0  # scales of the lazy updates (0: settled)
        # Wire frames: a chunk's packed signs, then an fp32 scale (see the Note).
        cb = self.chunk // 8
        self._frame = cb + 4

        def u8(count: int) -> torch.Tensor:
            return torch.empty(count, dtype=torch.uint8, device=device)

        def f32(count: int) -> torch.Tensor:
            return torch.empty(count, dtype=torch.float32, device=device)

        self._signs, self._scale = u8(world * cb), f32(1)          # worker compression
        self._send, self._recv = u8(world * self._frame), u8(world * self._frame)  # phase 1
        self._recv_signs, self._recv_scales = u8(world * cb), f32(world)
        self._avg = f32(self.chunk)                                 # server average m
        self._mine = u8(self._frame)                                # phase 2 frame, signs
        self._s_scale = f32(1)                                      # written in place
        self._gathered = u8(world * self._frame)
        self._all_signs, self._all_scales = u8(world * cb), f32(world)
        # Phase 2 in two hops (see the Note) on several nodes of several ranks; None: automatic.
        nodes = len(set(transport.nodes))
        self.hierarchical = (hierarchical is None or bool(hierarchical)) and 1 < nodes < world
        self._topo = None
        if self.hierarchical:
            self._topo = topology_of(transport)  # collective on first use: every rank is here
            self._column = u8(self._topo.nodes * self._frame)  # my local rank's frame on each node

    def _unframe(self, frames: torch.Tensor, signs: torch.Tensor, scales: torch.Tensor) -> None:
        """Split ``W`` received frames into packed signs and fp32 scales (n / 8 bytes copied)."""
        W, cb = self.transport.world_size, self.chunk // 8
        rows = frames.view(W, self._frame)
        signs.view(W, cb).copy_(rows[:, :cb])
        scales.view(torch.uint8).view(W, 4).copy_(rows[:, cb:])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` (``numel`` elements, fp32/fp16/bf16) by the compressed mean."""
        if x.numel() != self.numel:
            raise ValueError(f"OneBitAllReduce: got {x.numel()} elements, built for numel={self.numel}")
        if not x.is_contiguous():
            raise ValueError(f"OneBitAllReduce: x must be contiguous ({x.shape=} {x.stride()=})")
        check_dtype(x.dtype)
        t, W, n, c = self.transport, self.transport.world_size, self.numel, self.chunk
        cb = c // 8
        t.check_agree("onebit_all_reduce", (n,), ("numel",))
        dev = self.worker_error.device
        flat = x.view(-1)
        local = flat if flat.device == dev else flat.to(dev)
        with t.counters.collective("onebit_all_reduce", n * x.element_size()):
            # 1. worker compression with error feedback (fused; updates worker_error)
            zq.onebit_compress(local, self.worker_error, numel=n, out=(self._signs, self._scale),
                               pending=self._w_pending)
            self._w_pending = float(self._scale)
            # 2. phase 1: frame j = my chunk j of signs + my scale, to rank j
            frames = self._send.view(W, self._frame)
            frames[:, :cb].copy_(self._signs.view(W, cb))
            frames[:, cb:].copy_(self._scale.view(torch.uint8).expand(W, 4))
            t.all_to_all(self._recv, self._send)
            self._unframe(self._recv, self._recv_signs, self._recv_scales)
            # 3. server: average my chunk, add the server error, recompress (padding ignored);
            #    the signs land in my phase-2 frame directly
            zq.signs_weighted_sum(self._recv_signs, self._recv_scales, chunk=c, divisor=float(W), out=self._avg)
            zq.onebit_compress(self._avg, self.server_error, numel=self.valid,
                               out=(self._mine[:cb], self._s_scale), pending=self._s_pending)
            self._s_pending = float(self._s_scale)
            self._mine[cb:].copy_(self._s_scale.view(torch.uint8))
            # 4. phase 2: everyone's frame; decode into x
            if self._topo is None:
                t.all_gather(self._gathered, self._mine)
                self._unframe(self._gathered, self._all_signs, self._all_scales)
            else:
                topo = self._topo
                topo.inter.all_gather(self._column, self._mine)
                topo.intra.all_gather(self._gathered, self._column)
                # gathered is (local rank, node, frame); rank = node * ranks_per_node + local rank
                R, N = topo.ranks_per_node, topo.nodes
                rows = self._gathered.view(R, N, self._frame).transpose(0, 1)
                self._all_signs.view(N, R, cb).copy_(rows[:, :, :cb])
                self._all_scales.view(torch.uint8).view(N, R, 4).copy_(rows[:, :, cb:])
            if local is flat:
                zq.unpack_scaled(self._all_signs, self._all_scales, chunk=c, numel=n, dtype=x.dtype, out=flat)
        if local is not flat:
            flat.copy_(zq.unpack_scaled(self._all_signs, self._all_scales, chunk=c, numel=n, dtype=x.dtype))
        return x

    def state_dict(self) -> dict:
        return {
            "numel": self.numel,
            "world_size": self.transport.world_size,
            "rank": self.transport.rank,
            "worker_error": _settled(self.worker_error, self.numel, self._w_pending),
            "server_error": _settled(self.server_error, self.valid, self._s_pending),
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
        self._w_pending = self._s_pending = 0.0


def _settled(buf: torch.Tensor, valid: int, pending: float) -> torch.Tensor:
    """A copy of a lazy error buffer with its pending update applied to the ``valid`` real
    elements (the padding stays zero)."""
    out = buf.clone()
    out[:valid] = settle(buf, valid, pending)
    return out
