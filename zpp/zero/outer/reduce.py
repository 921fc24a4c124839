"""The outer all-reduce: the mean over nodes of one fragment of the pseudo-gradient, plain or
compressed, chosen once by name (``zpp.outer.compression``).

Each local rank holds its own ZeRO shard of the node's replica, so the reduction runs among
the ranks of this local rank on every node (``topology.inter``), one shard per rank: a sync
moves the model across the nodes once, spread over the local ranks.

[Note: outer all-reduce bytes]
Per rank, for a fragment of ``S`` elements over ``N`` nodes, the bytes this rank sends to
other nodes (the transport counters' direct-exchange model, see zpp/comm/counters.py):

==========  ==========================================================  =================
name        what                                                        bytes sent
==========  ==========================================================  =================
``none``    ``Transport.all_reduce`` (mean) of the fp32 fragment        ``2 (N-1)/N * 4S``
``int8``    :func:`~zpp.comm.collectives.quantized_all_reduce`:          ``2 (N-1)/N * S``
            quantized reduce-scatter, then quantized all-gather of the
            mean
``int4``    the same in 4 bits                                          ``2 (N-1)/N * S/2``
``1bit``    :class:`~zpp.comm.onebit.OneBitAllReduce`: signs and one    ``2 (N-1)/N * S/8``
            scale per chunk, error feedback on both sides
``topk``    :class:`SparseMean`: the ``k = ceil(S / 64)`` largest          ``(N-1) * (5k + 4)``
            entries of (pseudo-gradient + error), int32 index and int8
            value each plus one fp32 scale, all-gathered; error
            feedback on the sender ([Note: sparse outer all-reduce])
==========  ==========================================================  =================

plus one fp32 scale per quantization group (int8/int4: ``group_size`` elements) or per chunk
(1bit). For int8/int4 the reduce-scatter + all-gather pair is chosen over the simpler
quantized all-gather of every node's whole fragment (then a local mean), which sends
``(N-1) * S * bits/8``: the same at 2 nodes, ``N/2`` times more beyond, and the pair's
second quantization (of the mean) costs one more rounding of at most half a step per group.
The pair is not error-compensated: DiLoCo's 8-bit (INTELLECT-1) and Streaming DiLoCo's 4-bit
outer gradients train as well as full precision without it, while 1 bit does not, so only
``1bit`` (and ``topk``, which drops most entries) carries error-feedback buffers (per
fragment, per rank: checkpointed by :meth:`OuterReduce.state_dict`). On one node every
variant returns its input unchanged.

[Note: sparse outer all-reduce]
``topk`` (SparseLoCo's shape, arXiv 2508.15706: top-k with error feedback and a quantized
payload). Each rank adds its error buffer ``e`` to the fragment, ``a = x + e``; keeps the
``k`` entries of largest ``|a|`` (``torch.topk``); codes their values as int8 with one fp32
scale ``max |a_idx| / 127``; and keeps as its new error everything it did not send,
``e = a - decoded`` (the unsent entries whole, the sent ones' rounding). Its frame, ``5k + 4``
bytes: ``k`` int32 indices (little-endian, as torch stores them), ``k`` int8 codes, the scale.
The frames are all-gathered over the nodes and every rank forms the same mean
``sum_j scatter(idx_j, code_j * scale_j) / N``; the result has at most ``N k`` nonzeros. The
error buffer (4S bytes per rank) is checkpointed like the 1-bit one. The all-gather sends
``(N-1)`` frames per rank, where int4's reduce-scatter pair sends ``(N-1)/N * S``
bytes: ``topk`` sends ``5N/64`` of int4's (1/6.4 at 2 nodes), less than int4 up to 12 nodes.
"""
from __future__ import annotations

import abc
import math
from collections.abc import Callable

import torch

from zpp.comm.collectives import quantized_all_reduce
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport

__all__ = ["OUTER_REDUCES", "OneBitMean", "OuterReduce", "PlainMean", "QuantizedMean", "SparseMean",
           "build_outer_reduce", "sparse_frame_bytes"]


class OuterReduce(abc.ABC):
    """The mean over ``inter`` of a fixed-size fp32 vector, in place.

    Args:
        inter: the ranks of this local rank on every node.
        numel: the size of every vector this object reduces (one fragment of one rank).
        group_size: int8 / int4 quantization group.
    """

    name: str = ""
    counter: str = ""
    """The :class:`~zpp.comm.counters.WireCounters` key its traffic is booked under."""

    def __init__(self, inter: Transport, numel: int, group_size: int) -> None:
        self.inter = inter
        self.numel = numel
        self.group_size = group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` (``numel`` fp32 elements) by the (approximate) mean over the nodes."""
        if x.numel() != self.numel or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{type(self).__name__}: expected {self.numel} contiguous fp32 elements, got "
                             f"{x.numel()} {x.dtype} (contiguous={x.is_contiguous()})")
        if self.inter.world_size > 1:
            self._reduce(x)
        return x

    @abc.abstractmethod
    def _reduce(self, x: torch.Tensor) -> None: ...

    def state_dict(self) -> dict:
        """This rank's state across calls (error feedback), empty when there is none."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - stateless by default
        """Restore :meth:`state_dict`."""

    def reset(self) -> None:  # noqa: B027 - stateless by default
        """Forget the state across calls (error feedback restarts from zero)."""

    def buffers(self) -> list[torch.Tensor]:
        """The tensors it keeps between calls (for memory accounting)."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(numel={self.numel}, nodes={self.inter.world_size})"


class PlainMean(OuterReduce):
    name = counter = "all_reduce"

    def _reduce(self, x: torch.Tensor) -> None:
        self.inter.all_reduce(x, "mean")


class QuantizedMean(OuterReduce):
    """int8 / int4: quantized reduce-scatter over the nodes, quantized all-gather of the mean
    (see [Note: outer all-reduce bytes])."""

    counter = "quantized_all_reduce"

    def __init__(self, inter: Transport, numel: int, group_size: int, *, bits: int) -> None:
        super().__init__(inter, numel, group_size)
        self.bits = bits
        self.name = f"int{bits}"
        # one rank per node: the reduce-scatter's first (intra-node) hop is skipped
        self.topology = topology_of(inter) if inter.world_size > 1 else None

    def _reduce(self, x: torch.Tensor) -> None:
        quantized_all_reduce(x, topology=self.topology, bits=self.bits, group_size=self.group_size)


class OneBitMean(OuterReduce):
    """1-bit all-reduce with worker and server error feedback (:mod:`zpp.comm.onebit`)."""

    name = "1bit"
    counter = "onebit_all_reduce"

    def __init__(self, inter: Transport, numel: int, group_size: int) -> None:
        super().__init__(inter, numel, group_size)
        self.onebit = OneBitAllReduce(numel, inter) if inter.world_size > 1 else None

    def _reduce(self, x: torch.Tensor) -> None:
        self.onebit(x)

    def state_dict(self) -> dict:
        return {} if self.onebit is None else self.onebit.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.onebit is not None:
            self.onebit.load_state_dict(state)

    def reset(self) -> None:
        if self.onebit is not None:
            o = self.onebit
            self.onebit.load_state_dict({"numel": o.numel, "world_size": o.transport.world_size,
                                         "worker_error": torch.zeros_like(o.worker_error),
                                         "server_error": torch.zeros_like(o.server_error)})

    def buffers(self) -> list[torch.Tensor]:
        """The error-feedback buffers (its wire scratch, about ``3 numel / 4`` bytes, is not
        model state; :mod:`zpp.zero.memory` leaves it out for the 1-bit optimizers too)."""
        return [] if self.onebit is None else [self.onebit.worker_error, self.onebit.server_error]


#: elements per kept entry of ``topk`` (k = ceil(numel / TOPK_EVERY))
TOPK_EVERY = 64


def sparse_frame_bytes(k: int) -> int:
    """Bytes of one ``topk`` frame: ``k`` int32 indices, ``k`` int8 codes, one fp32 scale."""
    return 5 * k + 4


class SparseMean(OuterReduce):
    """Top-k with error feedback and int8 values, all-gathered (see [Note: sparse outer
    all-reduce])."""

    name = "topk"
    counter = "sparse_all_reduce"

    def __init__(self, inter: Transport, numel: int, group_size: int) -> None:
        super().__init__(inter, numel, group_size)
        self.k = max(1, math.ceil(numel / TOPK_EVERY))
        self.error = torch.zeros(numel, dtype=torch.float32)
        self.frame = sparse_frame_bytes(self.k)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's frame for ``x``; updates the error buffer."""
        k = self.k
        acc = self.error.add_(x)  # the error buffer becomes x + e in place
        idx = acc.abs().topk(k, sorted=False).indices.to(torch.int32)
        vals = acc[idx.long()]
        amax = float(vals.abs().max()) if k else 0.0
        scale = torch.tensor([amax / 127.0 if amax > 0 else 1.0], dtype=torch.float32)
        codes = torch.round(vals / scale).clamp_(-127, 127).to(torch.int8)
        acc[idx.long()] -= codes.float() * scale  # e = a - decoded
        return torch.cat([idx.view(torch.uint8), codes.view(torch.uint8), scale.view(torch.uint8)])

    def decode_sum(self, frames: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the sum of the decoded ``frames`` (``W`` frames laid end to end)."""
        k = self.k
        out.zero_()
        for f in frames.view(-1, self.frame):
            idx = f[:4 * k].clone().view(torch.int32).long()
            codes = f[4 * k:5 * k].clone().view(torch.int8).float()
            scale = f[5 * k:].clone().view(torch.float32)
            out.index_add_(0, idx, codes * scale)

    def _reduce(self, x: torch.Tensor) -> None:
        t = self.inter
        with t.counters.collective(self.counter, 4 * self.numel):
            mine = self.encode(x)
            frames = torch.empty(t.world_size * self.frame, dtype=torch.uint8)
            t.all_gather(frames, mine)
            self.decode_sum(frames, x)
            x.div_(t.world_size)

    def state_dict(self) -> dict:
        return {"numel": self.numel, "error": self.error.clone()}

    def load_state_dict(self, state: dict) -> None:
        if int(state["numel"]) != self.numel:
            raise ValueError(f"SparseMean: state for numel={state['numel']}, this one has {self.numel}")
        self.error.copy_(state["error"])

    def reset(self) -> None:
        self.error.zero_()

    def buffers(self) -> list[torch.Tensor]:
        return [self.error]


#: ``zpp.outer.compression`` -> factory(inter, numel, group_size)
OUTER_REDUCES: dict[str, Callable[[Transport, int, int], OuterReduce]] = {
    "none": PlainMean,
    "int8": lambda inter, numel, gs: QuantizedMean(inter, numel, gs, bits=8),
    "int4": lambda inter, numel, gs: QuantizedMean(inter, numel, gs, bits=4),
    "1bit": OneBitMean,
    "topk": SparseMean,
}


def build_outer_reduce(name: str, inter: Transport, numel: int, group_size: int) -> OuterReduce:
    """The outer all-reduce ``name`` for vectors of ``numel`` elements; ValueError if unknown."""
    try:
        factory = OUTER_REDUCES[name]
    except KeyError:
        raise ValueError(f"zpp.outer.compression={name!r} is not an outer all-reduce; choices: "
                         f"{sorted(OUTER_REDUCES)}") from None
    return factory(inter, numel, group_size)
