"""The MPI transport, over an mpi4py communicator.

Launch (one process per rank)::

    mpiexec -n 4 python train.py                    # in train.py:
    world = zpp.comm.get_transport("mpi", timeout_s=300)

mpi4py is imported on first use, so this module imports without it.

[Note: MPI buffers]
CPU tensors go to MPI without copies: the buffer is the tensor's memory, named by address
(``MPI.buffer.fromaddress(t.data_ptr(), nbytes)``) with an MPI datatype. MPI has no fp16 or
bf16 type, so data-movement ops (all-gather, all-to-all, broadcast) carry them as 2-byte
words (``MPI.UINT16_T``, bit copies), and reductions of fp16/bf16 are done in fp32: the
tensor is widened to an fp32 copy, reduced (4 bytes per element on the wire, one rounding at
the end), and written back. bool reductions are logical: "sum" and "max" are ``MPI.LOR``,
"min" is ``MPI.LAND`` (gloo agrees). "mean" is sum, then a division (floats only; integer
mean raises ``TypeError``).

CUDA tensors are staged through host memory (copied to the CPU, carried, copied back) unless
the transport is made with ``cuda_aware=True`` (or ``ZPP_MPI_CUDA_AWARE=1``), in which case
MPI is handed device pointers after the current stream is synchronized.

[Note: MPI timeouts]
MPI's blocking collectives wait forever for a peer that died without taking the job down
(a launcher that does not kill the job, a rank stuck elsewhere). Every collective here is
therefore the non-blocking one (``Iallgather``, ``Ialltoall``, ``Iallreduce``,
``Ireduce_scatter_block``, ``Ibcast``, ``Ibarrier``) polled with ``Test()`` until
``timeout_s`` passes (see :mod:`zpp.comm.timeout`), then the fault channel names the call
and the ranks that did not report ([Note: fault reports] in :mod:`zpp.comm.faults`) in a
``TimeoutError``. ``all_gather_async``
starts the ``Iallgather`` and polls it the same way in ``Work.wait()``, the ``timeout_s``
counted from the call of ``wait()``; other collectives polled meanwhile also progress it. Polling yields the
CPU between tests (``sleep(0)`` at first, then ``poll_interval_s``): on an oversubscribed
machine this was faster than MPICH's busy-waiting ``Wait``. A collective cannot be
cancelled, so after a timeout the request and its buffers are kept alive (MPI may still
write into them), every transport of the world refuses further calls, and at interpreter
exit the job is aborted (``MPI_Abort``; see [Note: clean exit] in :mod:`zpp.comm.teardown`),
since ``MPI_Finalize`` would wait for the silent peer forever. Note that hydra's
``mpiexec`` kills the whole job when a rank *exits* without ``MPI_Finalize``; the timeout
covers ranks that hang, stop, or finalize early.

[Note: MPI ring reduce-scatter]
MPICH's ``Ireduce_scatter_block`` reached only 0.68 of a 100 Mbit node link on an emulated
2 nodes x 2 ranks (perf/BENCHMARKS.md). So "sum" and "mean" reduce_scatter run here on
point-to-point messages instead (``$ZPP_MPI_RING=0`` returns to MPICH's):

* fp32, fp64 and integers: the pipelined ring in node order of [Note: ring reduce-scatter]
  (zpp/comm/ring.py, shared with TorchTransport), on ``Isend`` / ``Irecv``, pieces of about
  ``RING_PIECE_BYTES``; sums in the input dtype (integer sums wrap). A rank sends
  ``(W - 1) / W`` of the buffer; a node's link carries one slice per step each way. The
  additions run in ring order, so float sums can differ from MPICH's in the last bits.
* fp16 / bf16: an all-to-all of the 16-bit slices, then this rank sums the ``W`` slices in
  fp32 and rounds once (after the division, for "mean"): half the bytes of the widened fp32
  reduction, and the same single rounding.
* bool, "max" and "min": MPICH's collective, as before.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zpp.comm import mpi_init, teardown
from zpp.comm.counters import WireCounters
from zpp.comm.faults import FaultChannel
from zpp.comm.ring import ring_order, ring_reduce_scatter
from zpp.comm.timeout import resolve_timeout
from zpp.comm.topology import agree_on_layout
from zpp.comm.transport import Transport, Work

CUDA_AWARE_ENV = "ZPP_MPI_CUDA_AWARE"
_HALF = (torch.float16, torch.bfloat16)
_SPIN_POLLS = 200  # polls with sleep(0) before sleeping poll_interval_s
#: "0" (or false/no/off) makes reduce_scatter use MPICH's own; see [Note: MPI ring reduce-scatter].
RING_ENV = "ZPP_MPI_RING"
#: The ring sends each step's slice in pieces of about this many bytes (at most RING_MAX_PIECES).
RING_PIECE_BYTES = 64 << 10
RING_MAX_PIECES = 64


def ring_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``$ZPP_MPI_RING`` leaves the point-to-point reduce_scatter on (Default: on)."""
    return env.get(RING_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _mpi():
    return mpi_init.mpi()


class MpiTransport(Transport):
    """A :class:`~zpp.comm.transport.Transport` over an mpi4py communicator.

    Args:
        comm: the communicator (Default: ``MPI.COMM_WORLD``).
        ranks: ``COMM_WORLD`` rank of each member (Default: translated from ``comm``).
        nodes: node index of each member (Default: all on node 0).
        counters: shared wire-byte counters (Default: new ones).
        check_metadata: see [Note: metadata check] (Default: True).
        timeout_s: seconds a collective waits for its peers before ``TimeoutError``
            (Default: ``$ZPP_TIMEOUT_S``, else 300); see [Note: MPI timeouts].
        cuda_aware: hand CUDA pointers to MPI instead of staging through host memory
            (Default: False).
        poll_interval_s: sleep between ``Test()`` polls once the first quick polls are
            spent (Default: 1e-4).
        faults: the world's fault channel (Default: none); see [Note: MPI timeouts].
    """

    name = "mpi"

    @property
    def thread_safe(self) -> bool:
        MPI = _mpi()
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def __init__(
        self,
        comm: Any = None,
        *,
        ranks: Sequence[int] | None = None,
        nodes: Sequence[int] | None = None,
        counters: WireCounters | None = None,
        check_metadata: bool = True,
        timeout_s: float | None = None,
        cuda_aware: bool = False,
        poll_interval_s: float = 1e-4,
        ring: bool | None = None,
        faults: FaultChannel | None = None,
    ) -> None:
        MPI = _mpi()
        timeout_s = resolve_timeout(timeout_s)
        if poll_interval_s < 0:
            raise ValueError(f"MpiTransport: {poll_interval_s=} must be >= 0")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        size = self.comm.Get_size()
        if ranks is None:
            group, world_group = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(size)), world_group)
            group.Free()
            world_group.Free()
        super().__init__(
            rank=self.comm.Get_rank(),
            world_size=size,
            ranks=ranks,
            nodes=list(nodes) if nodes is not None else [0] * size,
            counters=counters,
            check_metadata=check_metadata,
        )
        self.timeout_s = timeout_s
        self.cuda_aware = cuda_aware
        self.poll_interval_s = poll_interval_s
        self.ring = ring_from_env() if ring is None else ring
        self._types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.float16: MPI.UINT16_T, torch.bfloat16: MPI.UINT16_T,
            torch.uint8: MPI.UINT8_T, torch.int8: MPI.INT8_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.bool: MPI.C_BOOL,
        }
        self._orphans: list[tuple[Any, tuple]] = []  # (request, buffers) abandoned at a timeout
        self.faults = faults
        teardown.track_mpi(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def init(
        cls,
        comm: Any = None,
        timeout_s: float | None = None,
        *,
        cuda_aware: bool | None = None,
        env: Mapping[str, str] = os.environ,
        check_metadata: bool = True,
        poll_interval_s: float = 1e-4,
    ) -> MpiTransport:
        """The world transport of an ``mpiexec`` job (or of ``comm``).

        Args:
            comm: the communicator (Default: ``MPI.COMM_WORLD``, checked against the
                environment's WORLD_SIZE / RANK so a torchrun-started job fails clearly).
            timeout_s: see [Note: MPI timeouts] (Default: ``$ZPP_TIMEOUT_S`` of ``env``, else 300).
            cuda_aware: see [Note: MPI buffers] (Default: ``ZPP_MPI_CUDA_AWARE=1`` in ``env``).
            env: the environment to read (Default: ``os.environ``); the node layout comes
                from :meth:`~zpp.comm.topology.Layout.from_env`, MPI's shared-memory split
                when the environment does not say.
        """
        timeout_s = resolve_timeout(timeout_s, env)
        MPI = mpi_init.mpi(timeout_s)  # MPI_Init, bounded too: see zpp.comm.mpi_init
        if comm is None:
            comm = MPI.COMM_WORLD
            _check_launcher(comm.Get_size(), comm.Get_rank(), env)
        if cuda_aware is None:
            cuda_aware = env.get(CUDA_AWARE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
        world = cls(
            comm, check_metadata=check_metadata, timeout_s=timeout_s,
            cuda_aware=cuda_aware, poll_interval_s=poll_interval_s,
        )
        world.nodes = tuple(agree_on_layout(world, env, mpi_comm=comm).node_list())
        world.faults = FaultChannel.open(world)
        return world

    # ------------------------------------------------------------------ collectives
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() == 0:
            return
        with self._staged((out,), (inp,)) as (o, i):
            self._run("all_gather", lambda: self.comm.Iallgather(self._buf(i), self._buf(o)), (o, i))

    def _all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``Iallgather``, polled to completion against ``timeout_s`` in ``wait()``; CUDA
        tensors without CUDA-aware MPI go through host copies, the output copied back at
        ``wait()``. See [Note: MPI timeouts]."""
        if inp.numel() == 0:
            return Work("all_gather", None, asynchronous=False)
        staged = not (self.cuda_aware or (out.device.type == "cpu" and inp.device.type == "cpu"))
        o, i = (out.cpu(), inp.cpu()) if staged else (out, inp)
        req = self._start("all_gather", lambda: self.comm.Iallgather(self._buf(i), self._buf(o)), (o, i))
        call = self._calls

        def finish() -> None:
            self._poll("all_gather", req, (o, i), call=call)
            if staged:
                out.copy_(o)

        return Work("all_gather", finish)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        mpi_op = self._op(op, inp.dtype)
        if out.numel() == 0:
            return
        if self.ring and op in ("sum", "mean") and inp.dtype != torch.bool:
            with self._staged((out,), (inp,)) as (o, i):
                if i.dtype in _HALF:
                    self._half_reduce_scatter(o, i, op)
                    return
                self._ring_reduce_scatter(o, i)
                if op == "mean":
                    o.div_(self.world_size)
            return
        with self._staged((out,), (inp,)) as (o, i):
            wide_i, wide_o = _widen(i), _widen(o, copy=False)
            self._run(
                "reduce_scatter",
                lambda: self.comm.Ireduce_scatter_block(self._buf(wide_i), self._buf(wide_o), mpi_op),
                (wide_i, wide_o),
            )
            if op == "mean":
                wide_o.div_(self.world_size)
            if wide_o is not o:
                o.copy_(wide_o)

    def _ring_reduce_scatter(self, o: torch.Tensor, i: torch.Tensor) -> None:
        """``o`` = the sum over ranks of slice ``rank`` of ``i``: [Note: ring reduce-scatter] in
        zpp/comm/ring.py, on ``Isend`` / ``Irecv`` polled against ``timeout_s``."""
        held: list[torch.Tensor] = [o, i]  # every buffer MPI may touch, kept past a timeout

        def isend(t: torch.Tensor, peer: int, tag: int):
            held.append(t)
            return self._start("reduce_scatter", lambda: self.comm.Isend(self._buf(t), peer, tag), (t,))

        def irecv(t: torch.Tensor, peer: int, tag: int):
            held.append(t)
            return self._start("reduce_scatter", lambda: self.comm.Irecv(self._buf(t), peer, tag), (t,))

        ring_reduce_scatter(o, i, rank=self.rank, order=ring_order(self.nodes), isend=isend, irecv=irecv,
                            wait=lambda req: self._poll("reduce_scatter", req, tuple(held)),
                            piece_bytes=RING_PIECE_BYTES, max_pieces=RING_MAX_PIECES)

    def _half_reduce_scatter(self, o: torch.Tensor, i: torch.Tensor, op: str) -> None:
        """fp16 / bf16: all-to-all of the 16-bit slices, fp32 sum here, one rounding."""
        n = self.world_size
        got = torch.empty(n * o.numel(), dtype=i.dtype)
        self._run("reduce_scatter", lambda: self.comm.Ialltoall(self._buf(i), self._buf(got)), (got, i))
        total = got.view(n, -1).sum(0, dtype=torch.float32)
        if op == "mean":
            total.div_(n)
        o.copy_(total)

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        MPI = _mpi()
        mpi_op = self._op(op, t.dtype)
        if t.numel() == 0:
            return
        with self._staged((t,), ()) as (h,):
            wide = _widen(h)
            self._run("all_reduce", lambda: self.comm.Iallreduce(MPI.IN_PLACE, self._buf(wide), mpi_op), (wide,))
            if op == "mean":
                wide.div_(self.world_size)
            if wide is not h:
                h.copy_(wide)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.numel() == 0:
            return
        with self._staged((out,), (inp,)) as (o, i):
            self._run("all_to_all", lambda: self.comm.Ialltoall(self._buf(i), self._buf(o)), (o, i))

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if t.numel() == 0:
            return
        with self._staged((t,), ()) as (h,):
            self._run("broadcast", lambda: self.comm.Ibcast(self._buf(h), root=src), (h,))

    def barrier(self) -> None:
        self._begin("barrier")
        self._run("barrier", self.comm.Ibarrier, ())

    # ------------------------------------------------------------------ sub-groups
    def _subgroup(self, members: tuple[int, ...]) -> MpiTransport | None:
        MPI = _mpi()
        # Split blocks with no timeout; a polled barrier first makes a dead peer raise here.
        self.barrier()
        sub = self.comm.Split(0 if self.rank in members else MPI.UNDEFINED, self.rank)
        if sub == MPI.COMM_NULL:
            return None
        return self._over(sub, members)

    def duplicate(self) -> MpiTransport:
        self.barrier()  # as in _subgroup: a dead peer raises here, not in Dup
        return self.derived(self._over(self.comm.Dup(), tuple(range(self.world_size))))

    def free(self) -> None:
        MPI = _mpi()
        comms = {}
        for t in self._with_topology():
            if isinstance(t, MpiTransport) and t.comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
                comms[id(t.comm)] = t
        for t in comms.values():
            t.comm.Free()  # each member frees its own handle (MPI_Comm_free)
            t.comm = MPI.COMM_NULL

    def _over(self, comm, members: tuple[int, ...]) -> MpiTransport:
        """A transport of these settings over ``comm``, whose ranks are ``members`` of this one."""
        return MpiTransport(
            comm,
            ranks=[self.ranks[m] for m in members],
            nodes=[self.nodes[m] for m in members],
            counters=self.counters,
            check_metadata=self.check_metadata,
            timeout_s=self.timeout_s,
            cuda_aware=self.cuda_aware,
            poll_interval_s=self.poll_interval_s,
            ring=self.ring,
            faults=self.faults,
        )

    # ------------------------------------------------------------------ helpers
    def _buf(self, t: torch.Tensor) -> list:
        """``t``'s memory as an MPI buffer spec, no copy; see [Note: MPI buffers]."""
        MPI = _mpi()
        return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), self._types[t.dtype]]

    def _op(self, op: str, dtype: torch.dtype):
        MPI = _mpi()
        if op == "mean" and not dtype.is_floating_point:
            raise TypeError(f"mean of dtype {dtype} is not defined (integer division); use op='sum'")
        if dtype == torch.bool:
            return MPI.LAND if op == "min" else MPI.LOR
        return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]

    @contextlib.contextmanager
    def _staged(self, outs: tuple[torch.Tensor, ...], ins: tuple[torch.Tensor, ...]):
        """The tensors as MPI may touch them (``outs`` then ``ins``): CPU tensors, and CUDA
        tensors for CUDA-aware MPI, as they are; else host copies, with ``outs`` copied back to
        the device afterwards."""
        tensors = outs + ins
        if self.cuda_aware or all(t.device.type == "cpu" for t in tensors):
            yield tensors
            return
        staged = tuple(t.cpu() for t in tensors)
        yield staged
        for t, h in zip(outs, staged):
            t.copy_(h)

    def _run(self, op: str, start, keep: tuple) -> None:
        """Start a non-blocking collective and poll it to completion or ``timeout_s``."""
        self._poll(op, self._start(op, start, keep), keep)

    def _start(self, op: str, start, keep: tuple):
        """Start a non-blocking collective over the buffers ``keep``; its request."""
        if self.broken is not None:
            raise RuntimeError(f"{op}: MpiTransport rank {self.rank} is unusable since {self.broken}; the job must stop")
        for t in keep:  # MPI does not know torch's streams: finish the kernels that fill t
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()
        return start()

    def _poll(self, op: str, req, keep: tuple, call: int | None = None) -> None:
        """Poll ``req`` to completion, or raise TimeoutError ``timeout_s`` from now (after
        the fault channel's exchange; see [Note: MPI timeouts])."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        polls = 0
        while not req.Test():
            if time.monotonic() > deadline:
                self._orphans.append((req, keep))
                detail = f"MPI {op} still incomplete" if op != self._call_op else ""
                raise self._fault("timeout", time.monotonic() - start, detail, call=call)
            polls += 1
            time.sleep(0 if polls < _SPIN_POLLS else self.poll_interval_s)


def _widen(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """fp16/bf16 -> an fp32 tensor (a copy of ``t`` or, with ``copy=False``, uninitialized)
    for MPI reductions; other dtypes as they are."""
    if t.dtype not in _HALF:
        return t
    return t.float() if copy else torch.empty(t.shape, dtype=torch.float32, device=t.device)


def _check_launcher(size: int, rank: int, env: Mapping[str, str]) -> None:
    """A job whose launcher (torchrun, srun) set WORLD_SIZE / RANK but whose MPI world does not
    match was not started by mpiexec: every process would be its own one-rank MPI world."""
    want_size, want_rank = env.get("WORLD_SIZE"), env.get("RANK")
    if want_size and int(want_size) != size:
        raise RuntimeError(
            f"MpiTransport: the MPI world has {size} rank(s) but the environment says WORLD_SIZE={want_size}; "
            f"this process was not started by mpiexec with {want_size} ranks (torchrun starts each rank "
            f"as its own one-rank MPI world). Launch with `mpiexec -n {want_size} python ...`, or use "
            f"the torch transport."
        )
    if want_size and want_rank and int(want_rank) != rank:
        raise RuntimeError(
            f"MpiTransport: MPI rank {rank} but the environment says RANK={want_rank}; the launcher's "
            f"numbering does not match MPI's"
        )
