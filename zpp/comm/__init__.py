"""Transports (torch.distributed, MPI), topology, compressed collectives, wire bytes."""
from zpp.comm.collectives import (
    hierarchical_reduce_scatter,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from zpp.comm.counters import OpStats, WireCounters
from zpp.comm.mpi_backend import MpiTransport
from zpp.comm.nonfinite import NonFiniteGradientError, any_rank_nonfinite, has_nonfinite
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.registry import get_transport, register_transport
from zpp.comm.topology import Layout, Topology, topology_of
from zpp.comm.torch_backend import TorchTransport
from zpp.comm.transport import Transport

__all__ = [
    "Layout",
    "MpiTransport",
    "NonFiniteGradientError",
    "OneBitAllReduce",
    "OpStats",
    "Topology",
    "TorchTransport",
    "Transport",
    "WireCounters",
    "any_rank_nonfinite",
    "get_transport",
    "has_nonfinite",
    "hierarchical_reduce_scatter",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "register_transport",
    "topology_of",
]
