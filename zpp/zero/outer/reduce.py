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
==========  ==========================================================  =================

plus one fp32 scale per quantization group (int8/int4: ``group_size`` elements) or per chunk
(1bit). For int8/int4 the reduce-scatter + all-gather pair is chosen over the simpler
quantized all-gather of every node's whole fragment (then a local mean), which sends
``(N-1) * S * bits/8``: the same at 2 nodes, ``N/2`` times more beyond, and the pair's
second quantization (of the mean) costs one more rounding of at most half a step per group.
The pair is not error-compensated: DiLoCo's 8-bit (INTELLECT-1) and Streaming DiLoCo's 4-bit
outer gradients train as well as full precision without it, while 1 bit does not, so only
``1bit`` carries error-feedback buffers (per fragment, per rank: checkpointed by
:meth:`OuterReduce.state_dict`). On one node every variant returns its input unchanged.
"""
from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from zpp.comm.collectives import quantized_all_reduce
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport

__all__ = ["OUTER_REDUCES", "OneBitMean", "OuterReduce", "PlainMean", "QuantizedMean", "build_outer_reduce"]


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


#: ``zpp.outer.compression`` -> factory(inter, numel, group_size)
OUTER_REDUCES: dict[str, Callable[[Transport, int, int], OuterReduce]] = {
    "none": PlainMean,
    "int8": lambda inter, numel, gs: QuantizedMean(inter, numel, gs, bits=8),
    "int4": lambda inter, numel, gs: QuantizedMean(inter, numel, gs, bits=4),
    "1bit": OneBitMean,
}


def build_outer_reduce(name: str, inter: Transport, numel: int, group_size: int) -> OuterReduce:
    """The outer all-reduce ``name`` for vectors of ``numel`` elements; ValueError if unknown."""
    try:
        factory = OUTER_REDUCES[name]
    except KeyError:
        raise ValueError(f"zpp.outer.compression={name!r} is not an outer all-reduce; choices: "
                         f"{sorted(OUTER_REDUCES)}") from None
    return factory(inter, numel, group_size)
