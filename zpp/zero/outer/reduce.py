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
``topk``    :class:`SparseMean`: in every chunk of 4096 elements the    ``(N-1) * 196 C``
            64 largest of (pseudo-gradient + error), int16 index and
            int8 value each plus one fp32 scale per chunk, all-gathered;
            error feedback on the sender ([Note: sparse outer
            all-reduce]); ``C = ceil(S / 4096)`` chunks (below 4096
            elements one chunk: ``(N-1) * (3 ceil(S/64) + 4)``)
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
``topk`` (SparseLoCo's shape, arXiv 2508.15706: top-k per chunk with error feedback and a
quantized payload). Each rank adds its error buffer ``e`` to the fragment, ``a = x + e``; cuts
``a`` into chunks of 4096 elements (one chunk of ``S`` when the fragment is shorter; the last
chunk padded with zeros, so it keeps 64 however short it is: at most 63 entries more than
1/64 per frame); keeps in every chunk the 64 entries of largest ``|a|`` (``torch.topk``);
codes each chunk's kept values as int8 with one fp32
scale ``max |kept| / 127``; and keeps as its new error everything it did not send,
``e = a - decoded`` (the unsent entries whole, the sent ones' rounding). Its frame, ``196``
bytes per chunk: every chunk's 64 indices inside the chunk as int16 (little-endian, as torch
stores them), then their int8 codes, then the chunks' scales. Picking per chunk is what lets an
index fit 16 bits: 3 bytes per kept entry instead of 5 with int32 indices over the whole
fragment (the first version, 2026-12-02: ``5 S / 64 + 4`` bytes), so 0.61x the bytes, and the
scale per chunk follows the pseudo-gradient's magnitude along the model. The frames are
all-gathered over the nodes and every rank forms the same mean
``sum_j scatter(idx_j, code_j * scale_j) / N``; the result has at most ``N k`` nonzeros (``k``
= 64 per chunk).
The error buffer (4S bytes per rank) is checkpointed like the 1-bit one (its layout did not
change with the chunks). The all-gather sends ``(N-1)`` frames per rank, about
``(N-1) * 3.06 S / 64`` bytes, where int4's reduce-scatter pair sends ``(N-1)/N * S`` bytes:
``topk`` sends about ``3N/64`` of int4's (1/10.4 at 2 nodes), less than int4 up to 20 nodes.
"""
from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from zpp.comm.collectives import quantized_all_reduce
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.topology import topology_of
from zpp.comm.transport import Transport
from zpp.zero.checks import check_int

__all__ = ["OUTER_REDUCES", "OneBitMean", "OuterReduce", "PlainMean", "QuantizedMean", "SparseMean",
           "build_outer_reduce", "sparse_frame_bytes", "sparse_layout"]


class OuterReduce(abc.ABC):
    """The mean over ``inter`` of a fixed-size fp32 vector, in place.

    Args:
        inter: the ranks of this local rank on every node.
        numel: the size of every vector this object reduces (one fragment of one rank).
        group_size: int8 / int4 quantization group.
        device: where the vectors (and any error-feedback buffer) live: the fragment's.
    """

    name: str = ""
    counter: str = ""
    """The :class:`~zpp.comm.counters.WireCounters` key its traffic is booked under."""

    def __init__(self, inter: Transport, numel: int, group_size: int, *,
                 device: torch.device | str = "cpu") -> None:
        self.inter = inter
        self.numel = numel
        self.group_size = group_size
        self.device = torch.device(device)

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

    def __init__(self, inter: Transport, numel: int, group_size: int, *, bits: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(inter, numel, group_size, device=device)
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

    def __init__(self, inter: Transport, numel: int, group_size: int, *, device: torch.device | str = "cpu") -> None:
        super().__init__(inter, numel, group_size, device=device)
        self.onebit = OneBitAllReduce(numel, inter, self.device) if inter.world_size > 1 else None

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


#: elements per kept entry of ``topk``: each chunk keeps ``TOPK_CHUNK / TOPK_EVERY`` entries
TOPK_EVERY = 64
#: ``topk`` picks its entries chunk by chunk, so an index fits 16 bits (see [Note: sparse outer all-reduce])
TOPK_CHUNK = 4096


def sparse_layout(numel: int, chunk: int = TOPK_CHUNK) -> tuple[int, int, int]:
    """(chunk length, chunks, entries kept per chunk) of ``topk`` for ``numel`` elements: one
    chunk of ``numel`` when it is shorter than ``chunk``, else ``ceil(numel / chunk)`` chunks
    (the last one padded with zeros)."""
    check_int("topk", "chunk", chunk, lo=TOPK_EVERY, hi=2**15)  # an index inside it is int16
    c = min(chunk, max(1, numel))
    return c, -(-numel // c), -(-c // TOPK_EVERY)


def sparse_frame_bytes(numel: int, chunk: int = TOPK_CHUNK) -> int:
    """Bytes of one ``topk`` frame for ``numel`` elements: per chunk, its kept entries' int16
    indices and int8 codes and one fp32 scale."""
    _, chunks, kept = sparse_layout(numel, chunk)
    return chunks * (3 * kept + 4)


class SparseMean(OuterReduce):
    """Top-k per chunk with error feedback and int8 values, all-gathered (see [Note: sparse
    outer all-reduce])."""

    name = "topk"
    counter = "sparse_all_reduce"

    def __init__(self, inter: Transport, numel: int, group_size: int, *, chunk: int = TOPK_CHUNK,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(inter, numel, group_size, device=device)
        self.chunk, self.chunks, self.kept = sparse_layout(numel, chunk)
        self.k = self.chunks * self.kept  # entries sent per call (the last chunk's padding included)
        # the error buffer padded to whole chunks; the padding stays zero (a padded entry that
        # is kept sends 0 and leaves 0 behind)
        self._padded = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=self.device)
        self.error = self._padded[:numel]
        self.frame = sparse_frame_bytes(numel, chunk)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's frame for ``x``; updates the error buffer."""
        self.error.add_(x)  # the error buffer becomes a = x + e in place
        a = self._padded.view(self.chunks, self.chunk)
        idx = a.abs().topk(self.kept, dim=1, sorted=False).indices
        vals = a.gather(1, idx)
        amax = vals.abs().amax(1).double()  # each chunk's scale: max |kept| / 127, rounded once to fp32
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).float()
        codes = torch.round(vals / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        a.scatter_add_(1, idx, -(codes.float() * scale[:, None]))  # e = a - decoded
        return torch.cat([idx.to(torch.int16).view(torch.uint8).reshape(-1), codes.view(torch.uint8).reshape(-1),
                          scale.view(torch.uint8)])

    def decode_sum(self, frames: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the sum of the decoded ``frames`` (``W`` frames laid end to end)."""
        n, kept = self.chunks * self.kept, self.kept
        padded = self.chunks * self.chunk != self.numel  # a scratch buffer only for a padded last chunk
        total = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=out.device) if padded else out.zero_()
        for f in frames.view(-1, self.frame):
            idx = f[:2 * n].clone().view(torch.int16).long().view(self.chunks, kept)
            codes = f[2 * n:3 * n].clone().view(torch.int8).float().view(self.chunks, kept)
            scale = f[3 * n:].clone().view(torch.float32)
            total.view(self.chunks, self.chunk).scatter_add_(1, idx, codes * scale[:, None])
        if padded:
            out.copy_(total[:self.numel])

    def _reduce(self, x: torch.Tensor) -> None:
        t = self.inter
        with t.counters.collective(self.counter, 4 * self.numel):
            mine = self.encode(x)
            frames = torch.empty(t.world_size * self.frame, dtype=torch.uint8, device=mine.device)
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
        self._padded.zero_()

    def buffers(self) -> list[torch.Tensor]:
        return [self._padded]


#: ``zpp.outer.compression`` -> factory(inter, numel, group_size, *, device)
OUTER_REDUCES: dict[str, Callable[..., OuterReduce]] = {
    "none": PlainMean,
    "int8": lambda inter, numel, gs, **kw: QuantizedMean(inter, numel, gs, bits=8, **kw),
    "int4": lambda inter, numel, gs, **kw: QuantizedMean(inter, numel, gs, bits=4, **kw),
    "1bit": OneBitMean,
    "topk": SparseMean,
}


def build_outer_reduce(name: str, inter: Transport, numel: int, group_size: int, *,
                       device: torch.device | str = "cpu") -> OuterReduce:
    """The outer all-reduce ``name`` for vectors of ``numel`` elements on ``device``;
    ValueError if unknown."""
    try:
        factory = OUTER_REDUCES[name]
    except KeyError:
        raise ValueError(f"zpp.outer.compression={name!r} is not an outer all-reduce; choices: "
                         f"{sorted(OUTER_REDUCES)}") from None
    return factory(inter, numel, group_size, device=device)
