"""The Transport interface: the few collectives zpp's algorithms need.

A backend (``torch.distributed``, MPI) subclasses :class:`Transport` and implements the
underscored methods on already-validated, contiguous tensors. Everything common lives here,
once: argument checks, the cross-rank metadata check, and wire-byte accounting
(see [Note: what is counted] in :mod:`zpp.comm.counters`).

[Note: metadata check]
With ``check_metadata=True`` (the default) every call first all-gathers a few int64 words
(op, element count, dtype) over the backend, and every rank raises the same ``ValueError``
if they differ; mismatched calls thus fail on every rank instead of hanging or reading
garbage. It costs one tiny collective per call; switch it off for speed once a job runs.
The call blocks its thread until every rank has made it, and on a slow link its few bytes
queue behind whatever that link carries; :func:`check_seconds` says how long each thread
has spent there, and the engine books its training thread's share as a link wait (phase
``metadata`` of :class:`~zpp.zero.reduce.overlap.LinkWaits`).

[Note: agreed calls]
A collective built of several calls (qwZ's gather: a size check, then an all-gather, over the
world or in hops) need not check each call: once one ``check_agree`` over every rank
involved has agreed on values that fix the calls' ops, element counts and dtypes (the
shard's size, the bits, the group size, the dtypes, one hop or two), the calls started right
after it, before this thread makes any other call, cannot disagree; inside ``agreed()`` they
skip their own checks. A call made later (a two-hop gather's second hop, run at ``wait()``,
after other calls may have been made) keeps its check: it is what catches ranks that wait
their works in different orders.

[Note: asynchronous collectives]
``all_gather_async(out, inp)`` starts the all-gather and returns a :class:`Work`; ``out``
holds the result once ``work.wait()`` returns. Validation, the metadata check (itself a
small blocking collective) and wire accounting happen at the call, exactly as for
``all_gather``, so a check fails on every rank before anything is in flight, and bytes are
booked once whether or not the work is ever waited. Every rank must start and wait its
works in the same order relative to its other calls on the transport, as with any
collective. Rules, checked where it is cheap:

* ``wait()`` exactly once: a second ``wait()`` raises ``RuntimeError`` naming the op.
* Until it is waited, a work's ``out`` belongs to the backend: a call on the same
  transport whose tensors overlap the ``out`` of one of its works in flight raises
  ``RuntimeError`` (a forgotten ``wait()``). ``inflight`` lists the works not yet waited.
* A backend without non-blocking collectives runs the blocking one and returns a finished
  work whose ``asynchronous`` is False, so callers can count that fallback.

Backends time out inside ``wait()`` like their blocking ops (``timeout_s`` from the call of
``wait()``), raising ``TimeoutError`` / ``ConnectionError`` naming the op and the rank.

[Note: failures]
Every public call is numbered per transport (``_begin``). A backend that sees a collective
time out or lose a peer raises ``self._fault(...)``: the exception of [Note: fault reports]
(:mod:`zpp.comm.faults`), which names the call and the ranks that did not report. From then
on every transport of that world refuses calls with ``RuntimeError``.
"""
from __future__ import annotations

import abc
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from zpp.comm.counters import WireCounters
from zpp.comm.faults import Fault, FaultChannel, describe

_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4, "broadcast": 5}
_DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.uint8: 5, torch.int8: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9,
}
REDUCE_OPS = ("sum", "mean", "max", "min")


def dtype_code(dtype: torch.dtype) -> int:
    """The metadata check's number for ``dtype`` (0: one it does not name)."""
    return _DTYPE_CODES.get(dtype, 0)


_check_s: dict[int, float] = {}  # thread ident -> seconds; each entry written by its own thread
_agreed = threading.local()  # .depth: calls on this thread inside agreed() blocks skip their check


@contextlib.contextmanager
def agreed():
    """The calls this thread makes inside the block skip their own metadata check: the caller
    has just made every rank they involve agree, with one :meth:`Transport.check_agree` over
    a transport spanning those ranks, on values that fix every such call's op and sizes, and
    starts them before any other call. One round trip instead of one per call; see [Note:
    agreed calls]."""
    depth = getattr(_agreed, "depth", 0)
    _agreed.depth = depth + 1
    try:
        yield
    finally:
        _agreed.depth = depth


def check_seconds(thread: int | None = None) -> float:
    """Seconds thread ``thread`` (an ident; None: the calling thread) has spent in metadata
    checks, every transport's, so far (only grows); see [Note: metadata check]."""
    return _check_s.get(threading.get_ident() if thread is None else thread, 0.0)


class Work:
    """A collective in flight; see [Note: asynchronous collectives].

    Args:
        op: the collective's name (for messages).
        finish: completes the collective (blocks until ``out`` is written); None for work
            that is already done.
        asynchronous: whether the collective really runs in the background (False: the
            backend ran it to completion at the call).
        buffers: (start, end) address ranges of the outputs, for the overlap check.
    """

    __slots__ = ("op", "asynchronous", "_finish", "_waited", "_owner", "buffers")

    def __init__(self, op: str, finish: Callable[[], None] | None = None, *, asynchronous: bool = True,
                 buffers: tuple[tuple[int, int], ...] = ()) -> None:
        self.op = op
        self.asynchronous = asynchronous and finish is not None
        self._finish = finish
        self._waited = False
        self._owner: Transport | None = None
        self.buffers = buffers

    @property
    def waited(self) -> bool:
        return self._waited

    def wait(self) -> None:
        """Block until the collective's output is written. Call it exactly once."""
        if self._waited:
            raise RuntimeError(f"{self.op}: this work was already waited; wait() each work exactly once")
        self._waited = True
        if self._owner is not None:
            self._owner._inflight.remove(self)
            self._owner = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def __repr__(self) -> str:
        state = "waited" if self._waited else "in flight"
        return f"Work({self.op}, {state}, asynchronous={self.asynchronous})"


class Transport(abc.ABC):
    """A group of ranks that can run collectives together.

    Attributes:
        rank: this process's index in the group.
        world_size: number of ranks in the group.
        ranks: global rank of each member, in group order.
        nodes: node index of each member, in group order (drives intra/inter accounting).
        counters: wire-byte counters, shared with sub-transports.
        check_metadata: run the cross-rank size check before each call (Default: True).
            Setting it sets it on the transports made from this one as well (its
            sub-groups, the groups of its topology, its duplicates), so one switch governs
            every call a layer above makes.
        faults: the world's fault channel (see [Note: failures]), shared with
            sub-transports; None for a transport made without one.
    """

    name: str = "abstract"
    #: dtypes this backend can carry; others raise TypeError.
    supported_dtypes: tuple[torch.dtype, ...] = tuple(_DTYPE_CODES)

    @property
    def thread_safe(self) -> bool:
        """Whether this transport's collectives may run on another thread while the caller's
        thread runs collectives of other groups of the same job (each group still used by one
        thread at a time). True for torch.distributed's process groups; an MPI library must
        provide ``MPI_THREAD_MULTIPLE`` (Default: True)."""
        return True

    def __init__(
        self,
        rank: int,
        world_size: int,
        ranks: Sequence[int],
        nodes: Sequence[int],
        counters: WireCounters | None = None,
        check_metadata: bool = True,
    ) -> None:
        if len(ranks) != world_size or len(nodes) != world_size:
            raise ValueError(f"{world_size=} but {len(ranks)=} and {len(nodes)=}")
        self.rank = rank
        self.world_size = world_size
        self.ranks = tuple(ranks)
        self.nodes = tuple(nodes)
        self.counters = counters if counters is not None else WireCounters()
        self._derived: weakref.WeakSet[Transport] = weakref.WeakSet()
        self.check_metadata = check_metadata
        self._inflight: list[Work] = []
        self.faults: FaultChannel | None = None
        self._broken: str | None = None  # the first failure, when there is no fault channel
        self._calls = 0  # public calls so far; see [Note: failures]
        self._call_op = "(no call yet)"  # the current (or last) public call

    @property
    def check_metadata(self) -> bool:
        """See [Note: metadata check]."""
        return self._check_metadata

    @check_metadata.setter
    def check_metadata(self, on: bool) -> None:
        self._check_metadata = bool(on)
        for t in list(self._derived):
            t.check_metadata = on

    def derived(self, t: Transport | None) -> Transport | None:
        """Record ``t``, made from this transport over some of its ranks (a sub-group, a
        duplicate, a topology's one-rank group), so that :attr:`check_metadata` set here
        reaches it; returns ``t``."""
        if t is not None and t is not self:
            t.check_metadata = self.check_metadata
            self._derived.add(t)
        return t

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None: ...

    @abc.abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str) -> None: ...

    @abc.abstractmethod
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> None: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def _all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start the all-gather; backends with non-blocking collectives override this.
        Default: the blocking one, reported as ``asynchronous=False``."""
        self._all_gather(out, inp)
        return Work("all_gather", None, asynchronous=False)

    @abc.abstractmethod
    def _subgroup(self, members: tuple[int, ...]) -> Transport | None:
        """A transport over group-local ``members`` (sorted), or None on non-members.
        Called by every rank of this group with the same ``members``."""

    # ------------------------------------------------------------------ public API
    def subgroup(self, members: Sequence[int]) -> Transport | None:
        """Sub-transport over the group-local ranks ``members``; ``None`` on ranks outside it.
        Collective: every rank of this transport must call it with the same list."""
        m = tuple(sorted(int(r) for r in members))
        if not m or len(set(m)) != len(m) or m[0] < 0 or m[-1] >= self.world_size:
            raise ValueError(f"subgroup members {list(members)} invalid for world_size={self.world_size}")
        return self.derived(self._subgroup(m))

    def duplicate(self) -> Transport:
        """A transport over the same ranks with a communicator of its own (collective: every
        rank calls it): its collectives never interleave with this one's, so another thread
        may run them meanwhile (the hierarchical mode's background sync with one rank per
        node, whose inter-node ranks are the whole world)."""
        raise NotImplementedError(f"{type(self).__name__}.duplicate")

    def free(self) -> None:
        """Release the communicator of a transport :meth:`duplicate` made, and those of the
        sub-groups of its cached topology (:func:`zpp.comm.topology.topology_of`), once no
        collective is in flight on them; the transport is unusable afterwards. Local (each
        rank frees its own), for the owner of the duplicate to call at its close: without it
        every engine built and closed keeps a process group (sockets, threads) until exit.
        A no-op where there is nothing to release."""

    def _with_topology(self) -> tuple[Transport, ...]:
        """This transport and the sub-transports of its cached topology (what :meth:`free`
        releases)."""
        from zpp.comm.topology import cached_topology

        topo = cached_topology(self)
        return (self,) if topo is None else (self, topo.intra, topo.inter)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``world_size * inp.numel()`` elements) receives every rank's ``inp`` in rank order."""
        self._begin("all_gather")
        if self._start_all_gather("all_gather", out, inp):
            self._all_gather(out, inp)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start ``all_gather(out, inp)``; ``out`` is valid once the returned work's
        ``wait()`` returns. See [Note: asynchronous collectives]."""
        self._begin("all_gather")
        if not self._start_all_gather("all_gather_async", out, inp):
            return Work("all_gather", None, asynchronous=False)
        return self.adopt(self._all_gather_async(out, inp), out)

    def adopt(self, work: Work, *outs: torch.Tensor) -> Work:
        """Hold ``work`` (one of this transport's, or a collective composed over it and its
        sub-transports, such as a two-hop all-gather) in :attr:`inflight` until it is waited,
        with ``outs`` as its output: a call on this transport whose tensors overlap them
        raises meanwhile (see [Note: asynchronous collectives]). Returns ``work``."""
        if not work.waited and work._finish is not None and work._owner is None:
            work.buffers = tuple(_span(o) for o in outs)
            work._owner = self
            self._inflight.append(work)
        return work

    @property
    def inflight(self) -> tuple[Work, ...]:
        """Works started on this transport and not yet waited."""
        return tuple(self._inflight)

    def _start_all_gather(self, what: str, out: torch.Tensor, inp: torch.Tensor) -> bool:
        """Checks, metadata and accounting of an all-gather; False when it is done already
        (one rank: ``out`` is a copy of ``inp``)."""
        self._check(what, inp, out)
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"{what}: out has {out.numel()} elements, expected world_size*inp = "
                f"{self.world_size}*{inp.numel()}"
            )
        self._meta("all_gather", inp)
        nb = _nbytes(inp)
        self._account("all_gather", _nbytes(out), [nb] * self.world_size)
        if self.world_size == 1:
            out.reshape(-1).copy_(inp.reshape(-1))
            return False
        return True

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "mean") -> None:
        """``out`` receives slice ``rank`` of the element-wise ``op`` ("sum"/"mean") of every ``inp``."""
        self._begin("reduce_scatter")
        self._check("reduce_scatter", inp, out)
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce_scatter: op={op!r} must be 'sum' or 'mean'")
        _check_mean("reduce_scatter", op, inp)
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: inp has {inp.numel()} elements, expected world_size*out = "
                f"{self.world_size}*{out.numel()}"
            )
        self._meta("reduce_scatter", inp)
        self._account("reduce_scatter", _nbytes(inp), [_nbytes(out)] * self.world_size)
        if self.world_size == 1:
            out.reshape(-1).copy_(inp.reshape(-1))
            return
        self._reduce_scatter(out, inp, op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place: ``t`` becomes the element-wise ``op`` (sum, mean, max, min) over ranks."""
        self._begin("all_reduce")
        self._check("all_reduce", t)
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce: op={op!r} must be one of {REDUCE_OPS}")
        _check_mean("all_reduce", op, t)
        self._meta("all_reduce", t)
        per_peer = 2 * _nbytes(t) // self.world_size
        self._account("all_reduce", _nbytes(t), [per_peer] * self.world_size)
        if self.world_size == 1:
            return
        self._all_reduce(t, op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Equal splits: slice ``j`` of ``inp`` goes to rank ``j``; slice ``i`` of ``out`` comes from rank ``i``."""
        self._begin("all_to_all")
        self._check("all_to_all", inp, out)
        if inp.numel() != out.numel() or inp.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: inp ({inp.numel()}) and out ({out.numel()}) must have the same "
                f"number of elements, divisible by world_size={self.world_size}"
            )
        self._meta("all_to_all", inp)
        self._account("all_to_all", _nbytes(inp), [_nbytes(inp) // self.world_size] * self.world_size)
        if self.world_size == 1:
            out.reshape(-1).copy_(inp.reshape(-1))
            return
        self._all_to_all(out, inp)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """In place: every rank's ``t`` becomes rank ``src``'s."""
        self._begin("broadcast")
        self._check("broadcast", t)
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src={src} outside world_size={self.world_size}")
        self._meta("broadcast", t, extra=src)
        sizes = [_nbytes(t) if self.rank == src else 0] * self.world_size
        self._account("broadcast", _nbytes(t), sizes)
        if self.world_size == 1:
            return
        self._broadcast(t, src)

    # ------------------------------------------------------------------ failures
    @property
    def broken(self) -> str | None:
        """The failure that made this transport's world unusable, or None; see [Note: failures]."""
        return self.faults.broken if self.faults is not None else self._broken

    def _begin(self, op: str) -> int:
        """Number a public call (see [Note: failures]); refuse it on a broken world."""
        if self.broken is not None:
            raise RuntimeError(
                f"{op}: the {self.name} transport of rank {self.rank} is unusable since {self.broken}; "
                f"the job must stop")
        self._calls += 1
        self._call_op = op
        return self._calls

    def _fault(self, kind: str, waited_s: float, detail: str = "", *, op: str | None = None,
               call: int | None = None) -> Exception:
        """The exception for a failed collective (Default: the current public call), after
        the fault channel's exchange; see [Note: fault reports]."""
        fault = Fault(op or self._call_op, self._calls if call is None else call, self.ranks, kind, waited_s, detail)
        reports = self.faults.report(fault) if self.faults is not None else None
        if self.faults is None and self._broken is None:
            self._broken = fault.where() + (" timed out" if kind == "timeout" else " lost a peer")
        cls, msg = describe(fault, self.ranks[self.rank], len(self.faults.peers) if self.faults else self.world_size,
                            reports, self.faults.window_s if self.faults else 0.0)
        return cls(msg)

    # ------------------------------------------------------------------ shared checks
    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        dtype = tensors[0].dtype
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: expected torch.Tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise TypeError(f"{op}: dtypes differ ({dtype} and {t.dtype})")
            if t.device != tensors[0].device:
                raise ValueError(f"{op}: devices differ ({tensors[0].device} and {t.device})")
            if not t.is_contiguous():
                raise ValueError(f"{op}: tensors must be contiguous ({t.shape=} {t.stride()=})")
        if dtype not in self.supported_dtypes:
            raise TypeError(f"{op}: the {self.name} transport cannot carry dtype {dtype}")
        for work in self._inflight:  # see [Note: asynchronous collectives]
            for t in tensors:
                a, b = _span(t)
                if a < b and any(a < e and s < b for s, e in work.buffers):
                    raise RuntimeError(
                        f"{op}: a tensor ({t.shape=}, {t.dtype}) overlaps the output of {work!r} on rank "
                        f"{self.rank}; wait() that work before using its output")

    def _meta(self, op: str, t: torch.Tensor, extra: int = 0) -> None:
        if not self.check_metadata or self.world_size == 1 or getattr(_agreed, "depth", 0):
            return
        self._agree(op, (_OPS[op], t.numel(), dtype_code(t.dtype), extra), ("op", "numel", "dtype#", "arg"))

    def check_agree(self, what: str, values: Sequence[int], names: Sequence[str] | None = None) -> None:
        """Raise the same ``ValueError`` on every rank unless all ranks pass equal ``values``.

        Collective (every rank must call it); a no-op when ``check_metadata`` is off. Layers
        above use it for sizes the wire cannot show (e.g. a shard's numel hidden by padding).
        See [Note: metadata check].
        """
        if not self.check_metadata or self.world_size == 1:
            return
        self._begin("check_agree")  # a call of its own when a layer above makes it
        self._agree(what, values, names)

    def _agree(self, what: str, values: Sequence[int], names: Sequence[str] | None) -> None:
        k = len(values)
        mine = torch.tensor(list(values), dtype=torch.int64)
        everyone = torch.empty(self.world_size * k, dtype=torch.int64)
        t0 = time.perf_counter()
        try:
            self._meta_all_gather(everyone, mine)
        finally:
            me = threading.get_ident()
            _check_s[me] = _check_s.get(me, 0.0) + (time.perf_counter() - t0)
        rows = everyone.view(self.world_size, k)
        if not bool((rows == rows[0]).all()):
            names = list(names) if names else [f"v{i}" for i in range(k)]
            inv = {v: n for n, v in _OPS.items()}
            desc = "; ".join(
                f"rank {r}: " + ", ".join(
                    f"{n}={inv.get(v, v) if n == 'op' else v}" for n, v in zip(names, row)
                )
                for r, row in enumerate(rows.tolist())
            )
            raise ValueError(f"{what}: ranks disagree on the call ({desc})")

    def _meta_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """All-gather of small CPU int64 tensors, used by the metadata check (not counted).
        Backends whose collectives need device tensors override it."""
        self._all_gather(out, inp)

    def _account(self, op: str, logical: int, per_peer: list[int]) -> None:
        me = self.nodes[self.rank]
        intra = inter = 0
        for peer, nb in enumerate(per_peer):
            if peer == self.rank:
                continue
            if self.nodes[peer] == me:
                intra += nb
            else:
                inter += nb
        self.counters.record(op, logical, intra, inter)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, ranks={self.ranks})"


def _check_mean(op: str, reduce_op: str, t: torch.Tensor) -> None:
    if reduce_op == "mean" and not t.dtype.is_floating_point:
        raise TypeError(f"{op}: op='mean' needs a floating dtype, got {t.dtype}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The address range ``[start, end)`` of a contiguous tensor's elements."""
    return t.data_ptr(), t.data_ptr() + _nbytes(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
