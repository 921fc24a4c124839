"""Transports (torch.distributed, MPI), topology, compressed collectives, wire bytes; and
DeepSpeed's ``deepspeed.comm`` process-level functions (:mod:`zpp.comm.dist`).

Names load on first use, so ``zpp.comm.launch`` (launcher detection, used by the command
lines) imports without torch.
"""
import importlib

_NAMES = {
    "Layout": "zpp.comm.topology",
    "MpiTransport": "zpp.comm.mpi_backend",
    "NonFiniteGradientError": "zpp.comm.nonfinite",
    "OneBitAllReduce": "zpp.comm.onebit",
    "OpStats": "zpp.comm.counters",
    "Topology": "zpp.comm.topology",
    "TorchTransport": "zpp.comm.torch_backend",
    "Transport": "zpp.comm.transport",
    "WireCounters": "zpp.comm.counters",
    "any_rank_nonfinite": "zpp.comm.nonfinite",
    "get_transport": "zpp.comm.registry",
    "has_nonfinite": "zpp.comm.nonfinite",
    "hierarchical_reduce_scatter": "zpp.comm.collectives",
    "quantized_all_gather": "zpp.comm.collectives",
    "quantized_reduce_scatter": "zpp.comm.collectives",
    "register_transport": "zpp.comm.registry",
    "resolve_backend": "zpp.comm.registry",
    "topology_of": "zpp.comm.topology",
}
# DeepSpeed's deepspeed.comm names, from zpp.comm.dist (kept in step with its __all__ by a test).
_DIST_NAMES = (
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "allgather_fn", "barrier", "broadcast", "broadcast_object_list",
    "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "inference_all_reduce", "init_distributed", "irecv", "is_available", "is_initialized", "isend",
    "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_fn",
    "reduce_scatter_tensor", "scatter", "send",
)
_NAMES.update({name: "zpp.comm.dist" for name in _DIST_NAMES})

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'zpp.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
