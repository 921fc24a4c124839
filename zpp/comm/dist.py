"""DeepSpeed's ``deepspeed.comm`` process-level functions, over ``torch.distributed``.

    import zpp as deepspeed
    from zpp import comm as dist
    deepspeed.init_distributed()             # gloo on CPU, nccl on CUDA; torchrun, mpirun, srun
    dist.get_rank(), dist.get_world_size(), dist.get_local_rank()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False)

[Note: deepspeed.comm on zpp]
These functions keep DeepSpeed's names, signatures and return values (``async_op=True``
returns a work with ``wait()``; ``group=None`` is the world) and run on torch tensors over
``torch.distributed``'s process groups; they are beside, not instead of, zpp's own comm API
(transports and compressed collectives). Where DeepSpeed differs from torch they follow
DeepSpeed (``get_local_rank()`` reads the launcher, ``ReduceOp`` is DeepSpeed's enum, and
torch's ``ReduceOp`` is accepted too). Where DeepSpeed passes a known gloo gap through,
zpp does the right thing: ``ReduceOp.AVG`` on gloo (which has no AVG) is a sum divided by
the group size, also for ``async_op=True`` (the division happens in ``wait()``).

They need ``torch.distributed`` to be initialized, by :func:`init_distributed` or by a torch
transport (``zpp.initialize`` on the torch transport initializes it); otherwise they raise
``RuntimeError`` saying so. When a job's zpp transport is MPI (the default of a CPU job
under mpiexec), the MPI world is not a torch process group: a script that also uses these
functions calls ``zpp.init_distributed()`` first, which builds torch.distributed (gloo, or
nccl on CUDA) from the MPI launcher's numbering, the same ranks, as DeepSpeed's MPI
discovery does. ``zpp.initialize`` then runs on that torch world (see [Note: which
transport] in :mod:`zpp.comm.registry`): one world, not two.
"""
from __future__ import annotations

import datetime
import enum
import logging
import os
from typing import Any

import torch
import torch.distributed as _td

from zpp.comm import teardown
from zpp.comm.launch import DEFAULT_PORT, detect
from zpp.comm.rendezvous import export_env, init_torch_world
from zpp.comm.timeout import resolve_timeout

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

logger = logging.getLogger("zpp.comm")


class ReduceOp(enum.Enum):
    """DeepSpeed's reduction names (``deepspeed.comm.ReduceOp``); torch's are accepted too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


_TORCH_OPS = {
    ReduceOp.SUM: _td.ReduceOp.SUM, ReduceOp.PRODUCT: _td.ReduceOp.PRODUCT, ReduceOp.MIN: _td.ReduceOp.MIN,
    ReduceOp.MAX: _td.ReduceOp.MAX, ReduceOp.BAND: _td.ReduceOp.BAND, ReduceOp.BOR: _td.ReduceOp.BOR,
    ReduceOp.BXOR: _td.ReduceOp.BXOR, ReduceOp.AVG: _td.ReduceOp.AVG,
}


# ---------------------------------------------------------------------- set-up
def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | float | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialize ``torch.distributed`` for this job, as ``deepspeed.init_distributed``.

    Idempotent: when it is already initialized (by an earlier call, the script, or a zpp
    torch transport) this does nothing.

    Args:
        dist_backend: "gloo", "nccl" (or "mpi" where torch is built with it) (Default: nccl
            when CUDA is available, else gloo). With nccl the device of the local rank is
            made current.
        auto_mpi_discovery: under an MPI launcher or srun, build the world from the
            launcher's variables when torch's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
            LOCAL_RANK) are not all set (Default: True); see :mod:`zpp.comm.launch`. The
            variables are then set in ``os.environ`` where unset, as DeepSpeed does.
        distributed_port: ``MASTER_PORT`` when the environment sets none (Default: 29500).
        verbose: log the world on rank 0 (Default: True).
        timeout: a ``timedelta`` or seconds bounding the rendezvous and every collective
            (Default: zpp's one timeout, ``$ZPP_TIMEOUT_S`` else 300 s, where DeepSpeed
            waits 30 minutes).
        init_method: a torch ``init_method`` URL ("tcp://host:port", "file://...") instead of
            the launcher's environment (Default: None).
        dist_init_required: False: only check that torch.distributed is initialized (raise
            ``RuntimeError`` if not); None/True: initialize it if needed (Default: None).
        config: a DeepSpeed config (dict); zpp has no communication logger, so one that
            enables ``comms_logger`` raises ``NotImplementedError`` (Default: None).
        rank: this rank, with ``world_size``, overriding the launcher's (Default: -1).
        world_size: the world size, with ``rank`` (Default: -1).
    """
    _check_comms_config(config)
    if dist_init_required is False:
        if not is_initialized():
            raise RuntimeError("zpp.init_distributed(dist_init_required=False): torch.distributed is not "
                               "initialized; call it with dist_init_required=None or True")
        return
    if is_initialized():
        if verbose and _td.get_rank() == 0:
            logger.info("zpp.init_distributed: torch.distributed is already initialized (%s, %d ranks)",
                        _td.get_backend(), _td.get_world_size())
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "mpi" and not _td.is_mpi_available():
        raise NotImplementedError("zpp.init_distributed(dist_backend='mpi'): this torch is built without MPI; "
                                  "use gloo/nccl (built from the MPI launch) or zpp's MPI transport, "
                                  "zpp.comm.get_transport('mpi')")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    timeout_s = resolve_timeout(timeout)
    launch = detect()
    required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    if not auto_mpi_discovery and launch.kind in ("mpi", "slurm") and init_method is None \
            and not all(v in os.environ for v in required):
        missing = [v for v in required if v not in os.environ]
        raise ValueError(f"zpp.init_distributed(auto_mpi_discovery=False): launched by {launch.launcher} but "
                         f"{missing} are not set; set them or allow auto_mpi_discovery")
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank or 0)
    point = init_torch_world(backend, timeout_s, os.environ, launch=launch, init_method=init_method,
                             rank=rank, world_size=world_size, port=distributed_port)
    teardown.track_default_group()
    if point is not None:
        export_env(point)
    if verbose and _td.get_rank() == 0:
        where = f" at {point.addr}:{point.port} ({point.source})" if point is not None else ""
        logger.info("zpp.init_distributed: %s world of %d ranks from %s%s, timeout %g s", backend,
                    _td.get_world_size(), launch.launcher, where, timeout_s)


def _check_comms_config(config: Any) -> None:
    if config is None:
        return
    section = config.get("comms_logger") if isinstance(config, dict) else getattr(config, "comms_config", None)
    enabled = section.get("enabled", False) if isinstance(section, dict) else getattr(section, "enabled", False)
    if enabled:
        raise NotImplementedError("zpp.init_distributed: config comms_logger.enabled=True: zpp has no "
                                  "communication logger; zpp's wire counters are transport.counters")


def is_available() -> bool:
    """Whether the communication package is usable (torch.distributed is built)."""
    return _td.is_available()


def is_initialized() -> bool:
    """Whether torch.distributed's default group exists."""
    return _td.is_available() and _td.is_initialized()


def _need(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"zpp.comm.{what}: torch.distributed is not initialized; call zpp.init_distributed() "
                           f"first (zpp.initialize on the torch transport also initializes it)")


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group`` (the world's, and every group, when None)."""
    _need("destroy_process_group")
    _td.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    """A process group over the global ``ranks``; collective over the world."""
    _need("new_group")
    return _td.new_group(ranks)


# ---------------------------------------------------------------------- who am I
def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (Default: the world); -1 outside it."""
    _need("get_rank")
    return _td.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (Default: the world)."""
    _need("get_world_size")
    return _td.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher (``LOCAL_RANK``, MPI's local
    rank, ``SLURM_LOCALID``; 0 alone), as DeepSpeed."""
    _need("get_local_rank")
    launch = detect()
    if launch.local_rank is not None:
        return launch.local_rank
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    _need("get_global_rank")
    if group is None or group is _td.GroupMember.WORLD:
        return group_rank
    return _td.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group order."""
    _need("get_all_ranks_from_group")
    return list(range(_td.get_world_size())) if group is None else _td.get_process_group_ranks(group)


def get_world_group() -> Any:
    """The world's process group."""
    _need("get_world_group")
    return _td.group.WORLD


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


# ---------------------------------------------------------------------- collectives
class _DividingWork:
    """A work whose ``wait()`` divides its tensor by ``n`` once the sum is in (AVG on gloo)."""

    def __init__(self, work: Any, tensor: torch.Tensor, n: int) -> None:
        self._work, self._tensor, self._n, self._done = work, tensor, n, False

    def wait(self, timeout: Any = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._done = True
            self._tensor.div_(self._n)
        return ok if ok is not None else True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._work.is_success() if hasattr(self._work, "is_success") else True


def _op(op: Any) -> _td.ReduceOp:
    if isinstance(op, ReduceOp):
        if op not in _TORCH_OPS:
            raise ValueError(f"zpp.comm: op={op} is not a reduction")
        return _TORCH_OPS[op]
    if isinstance(op, (_td.ReduceOp, _td.ReduceOp.RedOpType)):
        return op
    raise TypeError(f"zpp.comm: op={op!r} must be a zpp.comm.ReduceOp or a torch.distributed.ReduceOp")


def _is_avg(op: _td.ReduceOp) -> bool:
    return op == _td.ReduceOp.AVG


def _needs_emulated_avg(op: _td.ReduceOp, group: Any) -> bool:
    return _is_avg(op) and "gloo" in str(_td.get_backend(group))


def _reduced(what: str, op: Any, group: Any, async_op: bool, tensor: torch.Tensor, run) -> Any:
    """Run ``run(torch_op, async_op)``; AVG on gloo as SUM then a division by the group size."""
    _need(what)
    top = _op(op)
    if not _needs_emulated_avg(top, group):
        return run(top, async_op)
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"zpp.comm.{what}: ReduceOp.AVG of dtype {tensor.dtype} is not defined (integer division)")
    n = _td.get_world_size(group)
    work = run(_td.ReduceOp.SUM, async_op)
    if async_op:
        return _DividingWork(work, tensor, n)
    tensor.div_(n)
    return None


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """In place: ``tensor`` becomes the ``op`` over ``group``'s ranks."""
    return _reduced("all_reduce", op, group, async_op, tensor,
                    lambda o, a: _td.all_reduce(tensor, op=o, group=group, async_op=a))


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                         prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """DeepSpeed's inference all-reduce: the plain one here."""
    return all_reduce(tensor, op, group, async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:
    """``tensor`` on global rank ``dst`` becomes the ``op`` over ``group``'s ranks."""
    return _reduced("reduce", op, group, async_op, tensor,
                    lambda o, a: _td.reduce(tensor, dst=dst, op=o, group=group, async_op=a))


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    """``output_tensor`` receives this rank's slice of the ``op`` of every rank's ``tensor``."""
    return _reduced("reduce_scatter_tensor", op, group, async_op, output_tensor,
                    lambda o, a: _td.reduce_scatter_tensor(output_tensor, tensor, op=o, group=group, async_op=a))


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's helper: :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False, prof: bool = False,
                   log_name: str = "reduce_scatter", debug: Any = None) -> Any:
    """``output`` receives the ``op`` over ranks of their ``input_list[rank]``."""
    return _reduced("reduce_scatter", op, group, async_op, output,
                    lambda o, a: _td.reduce_scatter(output, input_list, op=o, group=group, async_op=a))


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Any = None) -> Any:
    """In place: every rank's ``tensor`` becomes global rank ``src``'s."""
    _need("broadcast")
    return _td.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    """``tensor_list[i]`` receives rank ``i``'s ``tensor``."""
    _need("all_gather")
    return _td.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    """``output_tensor`` receives every rank's ``tensor``, concatenated in rank order."""
    _need("all_gather_into_tensor")
    return _td.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's helper: :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> None:
    """``object_list[i]`` receives rank ``i``'s picklable ``obj``."""
    _need("all_gather_object")
    _td.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None) -> None:
    """Every rank's ``object_list`` becomes global rank ``src``'s."""
    _need("broadcast_object_list")
    _td.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    """Slices of ``tensor`` to every rank, slices of ``output`` from every rank."""
    _need("all_to_all_single")
    return _td.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                 input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False) -> Any:
    """``input_tensor_list[j]`` to rank ``j``; ``output_tensor_list[i]`` from rank ``i``."""
    _need("all_to_all")
    return _td.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:
    _need("send")
    _td.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> int:
    _need("recv")
    return _td.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    """Non-blocking send (DeepSpeed's own ``isend`` blocks, a known bug; this one does not)."""
    _need("isend")
    return _td.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Any = None) -> Any:
    """Non-blocking receive (DeepSpeed's own ``irecv`` blocks, a known bug; this one does not)."""
    _need("irecv")
    return _td.irecv(tensor, src=src, group=group, tag=tag)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:
    _need("gather")
    return _td.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: Any = None) -> Any:
    _need("scatter")
    return _td.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None, prof: bool = False,
            log_name: str = "barrier", debug: Any = None) -> Any:
    """Wait until every rank of ``group`` (Default: the world) arrives."""
    _need("barrier")
    return _td.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: Any = None) -> Any:
    """torch's monitored barrier (gloo): names the ranks that do not arrive within ``timeout``."""
    _need("monitored_barrier")
    return _td.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
