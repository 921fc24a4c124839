"""The torch.distributed transport: gloo on CPU, NCCL on CUDA.

Launch (one process per rank; the environment carries RANK, WORLD_SIZE, MASTER_ADDR, ...)::

    torchrun --nnodes 2 --nproc-per-node 2 ... train.py        # in train.py:
    world = zpp.comm.get_transport("torch", timeout_s=300)

[Note: single-tensor collectives and fallbacks]
The collectives run on flat tensors with the single-tensor ops (``all_gather_single`` /
``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``,
``all_to_all_single``). Where a backend answers "not supported" for an (op, dtype, device),
the answer is remembered for that transport and the op falls back to the list form
(``all_gather``, ``all_to_all``) or, for reduce-scatter, to an all-reduce of a copy and a
slice (more traffic, same numbers). Only "not supported" errors trigger a fallback; a dead
peer or any other error propagates. If the fallback is refused too, the op raises
``TypeError`` naming the dtype rather than guessing.

Measured with torch 2.13 gloo (CPU, 2 and 4 ranks): every single-tensor op and every list op
accepts fp32, fp64, fp16, bf16, uint8, int8, int32, int64 and bool, so no fallback is taken
there. Reductions of fp16/bf16 accumulate in the 16-bit type (as NCCL does), so a sum over
many ranks rounds at each step. Gloo's bool "sum" is a logical or. gloo's ``ReduceOp.AVG``
fails for integer dtypes, so "mean" is always sum-then-divide, and integer "mean" raises
``TypeError``. Data-movement ops on 2-byte floats go through a uint8 view (bit copies),
which every backend version carries. Gloo refuses dtypes it lacks (int16, for one) with
"Invalid scalar type"; that counts as "not supported".

[Note: dead peers]
``timeout_s`` is handed to ``init_process_group`` and to every ``new_group``; gloo then
raises when a peer stops answering for that long, and at once when a peer's process exits
(its sockets close). Those two gloo errors are re-raised as ``TimeoutError`` and
``ConnectionError`` naming the op and the rank, so callers see the same exception types as
with the MPI transport. The process group is unusable afterwards.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from zpp.comm.counters import WireCounters
from zpp.comm.topology import agree_on_layout
from zpp.comm.transport import Transport

_REDUCE = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_NOT_SUPPORTED = re.compile(r"not support|unsupported|no support|not implemented|invalid scalar type", re.I)
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
_PEER_GONE = re.compile(r"connection (closed|reset|refused)|closed by peer|broken pipe", re.I)

# torch >= 2.11 renames the single-tensor ops; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DEFAULT_TIMEOUT_S = 300.0


class TorchTransport(Transport):
    """A :class:`~zpp.comm.transport.Transport` over a ``torch.distributed`` process group.

    Args:
        group: the process group (Default: the default world group).
        nodes: node index of each member (Default: all on node 0).
        counters: shared wire-byte counters (Default: new ones).
        check_metadata: see [Note: metadata check] (Default: True).
        timeout_s: timeout given to sub-groups this transport creates (Default: torch's).
        prefer_single_tensor: use the single-tensor collectives where the backend has them
            (Default: True); False forces the list-based fallbacks (old backends, tests).
    """

    name = "torch"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        nodes: Sequence[int] | None = None,
        counters: WireCounters | None = None,
        check_metadata: bool = True,
        timeout_s: float | None = None,
        prefer_single_tensor: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchTransport: torch.distributed is not initialized; use TorchTransport.init()")
        self.group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(self.group)
        world_size = len(ranks)
        super().__init__(
            rank=dist.get_rank(self.group),
            world_size=world_size,
            ranks=ranks,
            nodes=list(nodes) if nodes is not None else [0] * world_size,
            counters=counters,
            check_metadata=check_metadata,
        )
        self.timeout_s = timeout_s
        self.prefer_single_tensor = prefer_single_tensor
        self.backend = str(dist.get_backend(self.group))
        # (op, dtype, device type) -> whether the single-tensor op works; see the Note.
        self._native: dict[tuple[str, torch.dtype, str], bool] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def init(
        cls,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backend: str | None = None,
        *,
        env: Mapping[str, str] = os.environ,
        check_metadata: bool = True,
    ) -> TorchTransport:
        """The world transport of this job, initializing ``torch.distributed`` if needed.

        Args:
            timeout_s: how long a collective waits for a silent peer before raising
                (Default: 300). Ignored when the default group already exists.
            backend: "gloo" (Default) or "nccl" (needs CUDA; binds the device
                ``LOCAL_RANK``). Ignored when the default group already exists.
            env: the environment to read (Default: ``os.environ``): RANK, WORLD_SIZE,
                MASTER_ADDR, MASTER_PORT as torchrun sets them (without WORLD_SIZE, a
                one-rank world), and the node layout (see :meth:`Layout.from_env`).
        """
        if not dist.is_initialized():
            backend = backend or "gloo"
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"TorchTransport.init: backend={backend!r} must be 'gloo' or 'nccl'")
            if backend == "nccl":
                if not torch.cuda.is_available():
                    raise ValueError("TorchTransport.init: backend='nccl' asked for but CUDA is not available")
                torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
            timeout = datetime.timedelta(seconds=timeout_s)
            if "WORLD_SIZE" in env:
                dist.init_process_group(backend, timeout=timeout)
            else:  # a lone process: no rendezvous needed
                dist.init_process_group(backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)
        else:
            timeout_s = None
        world = cls(check_metadata=check_metadata, timeout_s=timeout_s)
        layout = agree_on_layout(world, env)
        world.nodes = tuple(layout.node_list())
        return world

    # ------------------------------------------------------------------ collectives
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() == 0:
            return
        o, i = _bits(out).reshape(-1), _bits(inp).reshape(-1)
        with self._guard("all_gather"):
            if self._try_native("all_gather", i, lambda: _all_gather_single(o, i, group=self.group)):
                return
            self._fallback("all_gather", i, lambda: dist.all_gather(list(o.chunk(self.world_size)), i, group=self.group))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        _check_mean(op, inp.dtype)
        if out.numel() == 0:
            return
        o, i = out.reshape(-1), inp.reshape(-1)
        with self._guard("reduce_scatter"):
            if not self._try_native("reduce_scatter", i, lambda: _reduce_scatter_single(o, i, op=_REDUCE[op], group=self.group)):
                def via_all_reduce() -> None:
                    full = i.clone()
                    dist.all_reduce(full, op=_REDUCE[op], group=self.group)
                    o.copy_(full.view(self.world_size, -1)[self.rank])
                self._fallback("reduce_scatter", i, via_all_reduce)
        if op == "mean":
            out.div_(self.world_size)

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        _check_mean(op, t.dtype)
        if t.numel() == 0:
            return
        with self._guard("all_reduce"):
            self._fallback("all_reduce", t, lambda: dist.all_reduce(t, op=_REDUCE[op], group=self.group))
        if op == "mean":
            t.div_(self.world_size)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() == 0:
            return
        o, i = _bits(out).reshape(-1), _bits(inp).reshape(-1)
        with self._guard("all_to_all"):
            if self._try_native("all_to_all", i, lambda: dist.all_to_all_single(o, i, group=self.group)):
                return
            n = self.world_size
            self._fallback("all_to_all", i, lambda: dist.all_to_all(list(o.chunk(n)), list(i.chunk(n)), group=self.group))

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if t.numel() == 0:
            return
        b = _bits(t)
        with self._guard("broadcast"):
            self._fallback("broadcast", b, lambda: dist.broadcast(b, src=self.ranks[src], group=self.group))

    def barrier(self) -> None:
        with self._guard("barrier"):
            dist.barrier(group=self.group)

    def _meta_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if "gloo" in self.backend or "mpi" in self.backend:
            self._all_gather(out, inp)
            return
        # NCCL carries device tensors only.
        dev = torch.device("cuda", torch.cuda.current_device())
        dev_out = torch.empty_like(out, device=dev)
        self._all_gather(dev_out, inp.to(dev))
        out.copy_(dev_out)

    # ------------------------------------------------------------------ sub-groups
    def _subgroup(self, members: tuple[int, ...]) -> TorchTransport | None:
        if len(members) == self.world_size:  # the whole group: share its process group
            return self._child(self.group, members)
        if self.world_size != dist.get_world_size():
            # torch's new_group must be entered by every rank of the default group, in the
            # same order; only the world transport can promise that.
            raise NotImplementedError(
                f"TorchTransport: sub-groups can only be made from the world transport, not from {self!r}"
            )
        timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s else None
        group = dist.new_group([self.ranks[m] for m in members], timeout=timeout)
        if self.rank not in members:
            return None
        return self._child(group, members)

    def _child(self, group: dist.ProcessGroup, members: tuple[int, ...]) -> TorchTransport:
        return TorchTransport(
            group,
            nodes=[self.nodes[m] for m in members],
            counters=self.counters,
            check_metadata=self.check_metadata,
            timeout_s=self.timeout_s,
            prefer_single_tensor=self.prefer_single_tensor,
        )

    # ------------------------------------------------------------------ helpers
    def _try_native(self, op: str, t: torch.Tensor, call) -> bool:
        """Run the single-tensor form of ``op`` if the backend has it; False if it does not."""
        key = (op, t.dtype, t.device.type)
        if not self.prefer_single_tensor or self._native.get(key) is False:
            return False
        try:
            call()
        except (RuntimeError, NotImplementedError) as e:
            if not _NOT_SUPPORTED.search(str(e)):
                raise
            self._native[key] = False
            return False
        self._native[key] = True
        return True

    def _fallback(self, op: str, t: torch.Tensor, call) -> None:
        try:
            call()
        except (RuntimeError, NotImplementedError) as e:
            if not _NOT_SUPPORTED.search(str(e)):
                raise
            raise TypeError(
                f"{op}: the {self.backend} backend cannot carry dtype {t.dtype} on {t.device.type} ({e})"
            ) from e

    @contextlib.contextmanager
    def _guard(self, op: str):
        """Re-raise a dead or silent peer as ConnectionError / TimeoutError; see [Note: dead peers]."""
        try:
            yield
        except RuntimeError as e:
            msg = str(e)
            where = f"{op}: rank {self.rank} of {self.world_size} (global ranks {list(self.ranks)})"
            if _TIMED_OUT.search(msg):
                raise TimeoutError(f"{where} timed out waiting for a peer ({msg.splitlines()[0]})") from e
            if _PEER_GONE.search(msg):
                raise ConnectionError(f"{where} lost a peer ({msg.splitlines()[0]})") from e
            raise


def _bits(t: torch.Tensor) -> torch.Tensor:
    """2-byte floats as bytes for data-movement ops: bit copies that any backend carries
    (gloo has no int16: it answers "Invalid scalar type")."""
    return t.view(torch.uint8) if t.dtype in (torch.float16, torch.bfloat16) else t


def _check_mean(op: str, dtype: torch.dtype) -> None:
    if op == "mean" and not dtype.is_floating_point:
        raise TypeError(f"mean of dtype {dtype} is not defined (integer division); use op='sum'")
