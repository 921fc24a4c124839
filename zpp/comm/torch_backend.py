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
there. Reductions of fp16/bf16 by the backend's own ops accumulate in the 16-bit type (as
NCCL does), so a sum over many ranks rounds at each step; the gloo duplex reduce-scatter
(below) accumulates them in fp32 instead. Gloo's bool "sum" is a logical or. gloo's ``ReduceOp.AVG``
fails for integer dtypes, so "mean" is always sum-then-divide, and integer "mean" raises
``TypeError``. Data-movement ops on 2-byte floats go through a uint8 view (bit copies),
which every backend version carries. Gloo refuses dtypes it lacks (int16, for one) with
"Invalid scalar type"; that counts as "not supported".

[Note: gloo duplex pairs]
On gloo with CPU tensors, ``all_to_all`` and ``reduce_scatter`` do not use gloo's own ops by
default. Measured on an emulated 2-node cluster (one shaped link per node): a gloo pair (one
TCP connection per two ranks of a process group) often moves a two-way exchange at about
half the link rate each way, while the same exchange split over two process groups, one
per direction, runs at the full rate both ways; and gloo's ``reduce_scatter_tensor`` moves
1.5x the buffer across nodes, like an all-reduce. So each transport holds a second process
group over the same ranks (the "reverse" group) and sends every message from group rank
``i`` to ``j`` on its own group when ``i < j`` and on the reverse group when ``i > j``:
every connection carries one direction.

* all_to_all: ``world_size - 1`` rounds of point-to-point ``isend`` / ``irecv``; in round
  ``k`` rank ``r`` sends slice ``(r + k) % W`` to that rank and receives slice
  ``(r - k) % W`` from that rank. Every round is posted at once and then waited for.
* reduce_scatter of fp32, fp64, integers and bool: the pipelined ring in node order of
  [Note: ring reduce-scatter] (zpp/comm/ring.py, shared with MpiTransport), ``world_size - 1``
  steps; each step sends one partial slice to the next rank, receives one from the previous
  and adds this rank's own slice. It moves
  ``(W - 1) / W`` of the buffer per rank (on a node-major ring, a node's link carries one
  slice per step each way) and adds in the input dtype (fp32 sums in fp32; integer sums
  wrap as they do in gloo; bool "sum" is a logical or). The order of the additions differs
  from gloo's, so float sums may differ from gloo's in the last bits.
* reduce_scatter of fp16 / bf16: an all_to_all of the 16-bit slices (as above), then this
  rank sums the ``world_size`` slices it received in fp32 and rounds to the 16-bit type
  once (for "mean", after the division). A ring would either round at every step or double
  the bytes on the wire with fp32 partials; the all_to_all moves ``(W - 1) / W`` of the
  buffer per rank with no extra rounding, at the price of more node crossings than the
  ring when several ranks share a node.
* "mean" is the sum divided by ``world_size``.

The reverse groups: ``torch.distributed.new_group`` must be entered by every rank of the
default group in the same order. A transport over the whole world makes its reverse group
at its first duplex collective (which every rank calls); ``_subgroup`` (intra / inter
transports) makes the reverse group of each sub-group right after the sub-group itself, on
every rank. A transport over any other group its caller made has no reverse group and
uses gloo's own ops. Switch the duplex path off with ``gloo_duplex=False`` (constructor,
:meth:`TorchTransport.init`) or ``ZPP_GLOO_DUPLEX=0`` in the environment; the attribute
``gloo_duplex`` may be flipped between calls (the same way on every rank) to compare both
paths in one job, but a sub-transport made while it was off has no reverse group and keeps
using gloo's own ops. NCCL, and CUDA tensors on any backend, always take the backend's own
ops.

[Note: metadata checks on gloo]
A gloo process group runs its collectives in the order they were started, on its own worker
threads, over one connection per pair of ranks. The metadata check's tiny all-gather on the
transport's own group (see [Note: metadata check] in :mod:`zpp.comm.transport`) therefore
waited for every collective started before it: starting a prefetched gather blocked the
training thread until the gathers started before it had crossed the link (ZeRO-3 on the 25M
GPT at 100 Mbit: 9.7 s of its 20 s step in checks; 1.0 s on a group of their own,
perf/BENCHMARKS.md "The metadata check on the user's road"). On gloo, while the check is on,
every transport made by :meth:`TorchTransport.init`, ``duplicate`` or a sub-group holds one
more process group over the same ranks (its "meta" companion, beside the reverse group) and
runs the checks there; a transport over a group made elsewhere keeps them on its own group.
NCCL and MPI are as before. What remains is the round trip itself: on a busy link its
packets still queue behind the other connections' bytes, and each check holds the ranks in
step (ZeRO++: 0.9 s of a 2.9 s step at 100 Mbit, 20-25% below the check on its own group).

[Note: dead peers]
``timeout_s`` (see :mod:`zpp.comm.timeout`) bounds the rendezvous (see [Note: rendezvous] in
:mod:`zpp.comm.rendezvous`) and is handed to ``init_process_group`` and to every
``new_group``; gloo then raises when a peer stops answering for that long, and at once when
a peer's process exits (its sockets close). Either error goes through the fault channel
([Note: fault reports] in :mod:`zpp.comm.faults`) and is raised as ``TimeoutError`` or
``ConnectionError`` naming the call and the ranks that did not report; the process groups
are unusable afterwards, and every transport of the world refuses further calls. At exit
the groups are torn down before the interpreter (see [Note: clean exit] in
:mod:`zpp.comm.teardown`).
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import re
import time
from collections import ChainMap
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from zpp.comm import teardown
from zpp.comm.counters import WireCounters
from zpp.comm.faults import FaultChannel
from zpp.comm.launch import detect
from zpp.comm.rendezvous import export_env, init_torch_world
from zpp.comm.ring import ring_order, ring_reduce_scatter
from zpp.comm.timeout import resolve_timeout
from zpp.comm.topology import agree_on_layout
from zpp.comm.transport import Transport, Work

_REDUCE = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_NOT_SUPPORTED = re.compile(r"not support|unsupported|no support|not implemented|invalid scalar type", re.I)
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
_PEER_GONE = re.compile(r"connection (closed|reset|refused)|closed by peer|broken pipe", re.I)

# torch >= 2.11 renames the single-tensor ops; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: "0" (or false/no/off) makes gloo use its own all_to_all / reduce_scatter; see [Note: gloo duplex pairs].
DUPLEX_ENV = "ZPP_GLOO_DUPLEX"

# torch >= 2.6 takes group-local peers (group_dst / group_src); older releases want global ranks.
_P2P_GROUP_PEER = "group_dst" in inspect.signature(dist.isend).parameters
_HALF_FLOATS = (torch.float16, torch.bfloat16)
#: The ring reduce-scatter sends each step's slice in pieces of about this many bytes (at most
#: RING_MAX_PIECES), so one piece's next step overlaps the transfer of the next piece.
RING_PIECE_BYTES = 64 << 10
RING_MAX_PIECES = 64


def duplex_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``$ZPP_GLOO_DUPLEX`` leaves the gloo duplex path on (Default: on)."""
    value = env.get(DUPLEX_ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{DUPLEX_ENV}={env.get(DUPLEX_ENV)!r}: expected 1 or 0")


class _Companions:
    """The process groups beside a transport's own, shared by every transport over the same
    process group: ``reverse`` (see [Note: gloo duplex pairs]; None until made) and ``meta``
    (see [Note: metadata checks on gloo]; None: the checks take the transport's group)."""

    __slots__ = ("reverse", "meta")

    def __init__(self, reverse: dist.ProcessGroup | None = None, meta: dist.ProcessGroup | None = None) -> None:
        self.reverse = reverse
        self.meta = meta


class TorchTransport(Transport):
    """A :class:`~zpp.comm.transport.Transport` over a ``torch.distributed`` process group.

    Args:
        group: the process group (Default: the default world group).
        nodes: node index of each member (Default: all on node 0).
        counters: shared wire-byte counters (Default: new ones).
        check_metadata: see [Note: metadata check] (Default: True).
        timeout_s: timeout given to sub-groups this transport creates (Default: torch's).
        faults: the world's fault channel (Default: none); see [Note: dead peers].
        prefer_single_tensor: use the single-tensor collectives where the backend has them
            (Default: True); False forces the list-based fallbacks (old backends, tests).
        gloo_duplex: on gloo with CPU tensors, run all_to_all and reduce_scatter as
            point-to-point exchanges split over two process groups, one per direction
            (Default: ``$ZPP_GLOO_DUPLEX``, else True); see [Note: gloo duplex pairs].
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
        gloo_duplex: bool | None = None,
        faults: FaultChannel | None = None,
        _companions: _Companions | None = None,
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
        self.gloo_duplex = duplex_from_env() if gloo_duplex is None else bool(gloo_duplex)
        self._companions = _companions if _companions is not None else _Companions()
        self.faults = faults
        teardown.track_torch(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def init(
        cls,
        timeout_s: float | None = None,
        backend: str | None = None,
        *,
        env: Mapping[str, str] = os.environ,
        check_metadata: bool = True,
        gloo_duplex: bool | None = None,
    ) -> TorchTransport:
        """The world transport of this job, initializing ``torch.distributed`` if needed.

        Args:
            timeout_s: how long the rendezvous and every collective wait for a silent peer
                before raising (Default: ``$ZPP_TIMEOUT_S``, else 300; see
                :mod:`zpp.comm.timeout`). Also bounds the sub-groups zpp creates; a default
                group made by the caller keeps its own timeout.
            backend: "gloo" (Default) or "nccl" (needs CUDA; binds the device of the local
                rank). Ignored when the default group already exists.
            env: the environment to read (Default: ``os.environ``): the launcher's
                variables (:func:`zpp.comm.launch.detect`: torchrun, an MPI launcher, srun;
                none: a one-rank world) and the node layout (:meth:`Layout.from_env`).
                Under an MPI launcher or srun the world comes from the launcher's numbering
                (see [Note: rendezvous] in :mod:`zpp.comm.rendezvous`), and when ``env`` is
                ``os.environ`` the torch variables (RANK, WORLD_SIZE, LOCAL_RANK,
                LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are set there where unset.
            gloo_duplex: see the class (Default: ``$ZPP_GLOO_DUPLEX`` of ``env``, else True).
        """
        timeout_s = resolve_timeout(timeout_s, env)
        layout_env: Mapping[str, str] = env
        if not dist.is_initialized():
            backend = backend or "gloo"
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"TorchTransport.init: backend={backend!r} must be 'gloo' or 'nccl'")
            launch = detect(env)
            if backend == "nccl":
                if not torch.cuda.is_available():
                    raise ValueError("TorchTransport.init: backend='nccl' asked for but CUDA is not available")
                torch.cuda.set_device(launch.local_rank or 0)
            point = init_torch_world(backend, timeout_s, env, launch=launch)
            if point is not None and launch.kind in ("mpi", "slurm"):
                layout_env = ChainMap(point.env(), env)
                if env is os.environ:
                    export_env(point)
        if gloo_duplex is None:
            gloo_duplex = duplex_from_env(env)
        world = cls(check_metadata=check_metadata, timeout_s=timeout_s, gloo_duplex=gloo_duplex)
        layout = agree_on_layout(world, layout_env)
        world.nodes = tuple(layout.node_list())
        world.faults = FaultChannel.open(world)
        # Ranks on different paths would make different process groups and hang.
        world.check_agree(
            "TorchTransport.init (gloo_duplex, $ZPP_GLOO_DUPLEX)", (int(world.gloo_duplex),), ("gloo_duplex",)
        )
        if world.world_size == dist.get_world_size():  # every rank is here: new_group may run
            world._companions.meta = world._new_companions(list(world.ranks), reverse=False).meta
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

    def _all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``async_op=True`` of the same op ``_all_gather`` picks (single-tensor, else list);
        waited under the same guard, so a dead peer raises TimeoutError / ConnectionError."""
        if inp.numel() == 0:
            return Work("all_gather", None, asynchronous=False)
        o, i = _bits(out).reshape(-1), _bits(inp).reshape(-1)
        handle: list[dist.Work] = []
        call = self._calls
        with self._guard("all_gather"):
            if not self._try_native("all_gather", i, lambda: handle.append(
                    _all_gather_single(o, i, group=self.group, async_op=True))):
                self._fallback("all_gather", i, lambda: handle.append(
                    dist.all_gather(list(o.chunk(self.world_size)), i, group=self.group, async_op=True)))

        def finish() -> None:  # torch's work holds o and i until it completes
            with self._guard("all_gather", call=call):
                handle[0].wait()

        return Work("all_gather", finish)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        _check_mean(op, inp.dtype)
        if out.numel() == 0:
            return
        o, i = out.reshape(-1), inp.reshape(-1)
        pair = self._duplex_pair(i)
        if pair is not None:
            with self._guard("reduce_scatter"):
                if i.dtype in _HALF_FLOATS:
                    self._duplex_reduce_scatter_half(o, i, op, pair)
                    return
                self._ring_reduce_scatter(o, i, pair)
            if op == "mean":
                out.div_(self.world_size)
            return
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
        pair = self._duplex_pair(i)
        with self._guard("all_to_all"):
            if pair is not None:
                n = self.world_size
                self._pairwise_all_to_all(o.view(n, -1), i.view(n, -1), pair)
                return
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
        self._begin("barrier")
        with self._guard("barrier"):
            dist.barrier(group=self.group)

    def _meta_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        meta = self._companions.meta
        if meta is not None:  # see [Note: metadata checks on gloo]
            with self._guard("all_gather"):
                dist.all_gather(list(out.chunk(self.world_size)), inp, group=meta)
            return
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
        group = self._new_group([self.ranks[m] for m in members])
        # Its companions right away, while every rank is here; see [Note: gloo duplex pairs].
        companions = self._new_companions([self.ranks[m] for m in members])
        if self.rank not in members:
            return None
        return self._child(group, members, companions)

    def duplicate(self) -> TorchTransport:
        if self.world_size != dist.get_world_size():  # as for _subgroup: new_group needs every rank
            raise NotImplementedError(f"TorchTransport.duplicate: only the world transport can, not {self!r}")
        group = self._new_group(list(self.ranks))
        return self.derived(self._child(group, tuple(range(self.world_size)), self._new_companions(list(self.ranks))))

    def _new_companions(self, global_ranks: list[int], *, reverse: bool = True) -> _Companions:
        """The companion groups of a new group of ``global_ranks`` (collective over the
        default group, as ``new_group``): its reverse group on the gloo duplex path (unless
        ``reverse`` is False), its metadata group on gloo while the check is on (see [Note:
        metadata checks on gloo])."""
        gloo = len(global_ranks) > 1 and "gloo" in self.backend
        reverse = self._new_group(global_ranks) if gloo and self.gloo_duplex and reverse else None
        meta = self._new_group(global_ranks) if gloo and self.check_metadata else None
        return _Companions(reverse, meta)

    def _child(
        self, group: dist.ProcessGroup, members: tuple[int, ...], companions: _Companions | None = None
    ) -> TorchTransport:
        return TorchTransport(
            group,
            nodes=[self.nodes[m] for m in members],
            counters=self.counters,
            check_metadata=self.check_metadata,
            timeout_s=self.timeout_s,
            prefer_single_tensor=self.prefer_single_tensor,
            gloo_duplex=self.gloo_duplex,
            faults=self.faults,
            _companions=companions if companions is not None else self._companions,
        )

    def _new_group(self, global_ranks: list[int]) -> dist.ProcessGroup:
        """``dist.new_group``: collective over the whole default group, in program order."""
        timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s else None
        return dist.new_group(global_ranks, timeout=timeout)

    # ------------------------------------------------------------------ gloo duplex pairs
    def _duplex_pair(self, t: torch.Tensor) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """(group for messages to higher group ranks, group for messages to lower ones) when
        ``t`` takes the duplex path, else None; see [Note: gloo duplex pairs]. Makes the
        reverse group of a world transport on first use: call it only from a collective
        that every rank enters, with the same decision on every rank."""
        if not self.gloo_duplex or t.device.type != "cpu" or "gloo" not in self.backend:
            return None
        if self._companions.reverse is None:
            if self.world_size != dist.get_world_size():
                return None  # a group made elsewhere: new_group here could hang; gloo's own ops
            self._companions.reverse = self._new_group(list(self.ranks))
        return self.group, self._companions.reverse

    def _isend(self, t: torch.Tensor, peer: int, pair, tag: int = 0) -> dist.Work:
        group = pair[0] if self.rank < peer else pair[1]
        if _P2P_GROUP_PEER:
            return dist.isend(t, group=group, group_dst=peer, tag=tag)
        return dist.isend(t, dst=self.ranks[peer], group=group, tag=tag)

    def _irecv(self, t: torch.Tensor, peer: int, pair, tag: int = 0) -> dist.Work:
        group = pair[0] if peer < self.rank else pair[1]
        if _P2P_GROUP_PEER:
            return dist.irecv(t, group=group, group_src=peer, tag=tag)
        return dist.irecv(t, src=self.ranks[peer], group=group, tag=tag)

    def _pairwise_all_to_all(self, out_rows: torch.Tensor, in_rows: torch.Tensor, pair) -> None:
        """Row ``j`` of ``in_rows`` to group rank ``j``; row ``i`` of ``out_rows`` from ``i``."""
        n, r = self.world_size, self.rank
        works = []
        for k in range(1, n):
            to, frm = (r + k) % n, (r - k) % n
            works.append(self._irecv(out_rows[frm], frm, pair))
            works.append(self._isend(in_rows[to], to, pair))
        out_rows[r].copy_(in_rows[r])
        _wait_all(works)

    def _ring_reduce_scatter(self, o: torch.Tensor, i: torch.Tensor, pair) -> None:
        """``o`` = sum over ranks of slice ``rank`` of ``i``: [Note: ring reduce-scatter] in
        zpp/comm/ring.py, on the duplex pair's point-to-point messages."""
        ring_reduce_scatter(o, i, rank=self.rank, order=ring_order(self.nodes),
                            isend=lambda t, peer, tag: self._isend(t, peer, pair, tag=tag),
                            irecv=lambda t, peer, tag: self._irecv(t, peer, pair, tag=tag),
                            wait=lambda work: work.wait(),
                            piece_bytes=RING_PIECE_BYTES, max_pieces=RING_MAX_PIECES)

    def _duplex_reduce_scatter_half(self, o: torch.Tensor, i: torch.Tensor, op: str, pair) -> None:
        """fp16 / bf16: all_to_all of the slices, fp32 sum here, one rounding."""
        n = self.world_size
        got = torch.empty(n, o.numel(), dtype=i.dtype)
        self._pairwise_all_to_all(_bits(got), _bits(i).view(n, -1), pair)
        total = got.sum(0, dtype=torch.float32)
        if op == "mean":
            total.div_(n)
        o.copy_(total)

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
    def _guard(self, op: str, call: int | None = None):
        """Re-raise a silent peer (gloo's timeout) as TimeoutError and a dead one (a closed
        connection) as ConnectionError, after the fault channel's exchange; see [Note: dead
        peers]. ``call``: the public call it belongs to (Default: the current one)."""
        start = time.monotonic()
        try:
            yield
        except RuntimeError as e:
            msg = str(e)
            line = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
            line = line.split(" This is typically caused by")[0]  # gloo's guess, not an observation
            detail = f"{self.backend} {op}: {line}" if op != self._call_op else f"{self.backend}: {line}"
            kind = "timeout" if _TIMED_OUT.search(msg) else "closed" if _PEER_GONE.search(msg) else None
            if kind is None:
                raise
            raise self._fault(kind, time.monotonic() - start, detail, call=call) from e

    # ------------------------------------------------------------------ teardown
    def process_groups(self) -> list[dist.ProcessGroup]:
        """The process groups this transport holds (its group and its companions)."""
        return [g for g in (self.group, self._companions.reverse, self._companions.meta) if g is not None]

    def free(self) -> None:
        groups: dict[int, dist.ProcessGroup] = {}
        for t in self._with_topology():
            if isinstance(t, TorchTransport):
                groups.update((id(g), g) for g in t.process_groups() if g is not dist.GroupMember.WORLD)
                t.release()
        if dist.is_initialized():
            for g in groups.values():  # a sub-group that shares a group with its parent: once
                dist.destroy_process_group(g)

    def release(self) -> None:
        """Drop this transport's process groups and works in flight; it is unusable
        afterwards. See [Note: clean exit] in :mod:`zpp.comm.teardown`."""
        self.group = None
        self._companions.reverse = self._companions.meta = None
        self._inflight.clear()


def _wait_all(works: list) -> None:
    for w in works:
        if w is not None:
            w.wait()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """2-byte floats as bytes for data-movement ops: bit copies that any backend carries
    (gloo has no int16: it answers "Invalid scalar type")."""
    return t.view(torch.uint8) if t.dtype in (torch.float16, torch.bfloat16) else t


def _check_mean(op: str, dtype: torch.dtype) -> None:
    if op == "mean" and not dtype.is_floating_point:
        raise TypeError(f"mean of dtype {dtype} is not defined (integer division); use op='sum'")
