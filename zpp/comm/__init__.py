"""Transports (torch.distributed, MPI), topology, compressed collectives, wire bytes."""
from zpp.comm.counters import OpStats, WireCounters
from zpp.comm.transport import Transport

__all__ = ["OpStats", "Transport", "WireCounters"]
