"""Gradient reductions overlapped with the backward: a communication thread per engine.

[Note: overlapped reductions]
With ``zero_optimization.overlap_comm`` (DeepSpeed's key; on by default at stage 3, off below,
as DeepSpeed) a unit's reduction is handed to one worker thread as soon as the backward has
delivered the unit's gradients, and the backward goes on with the units before it while the
reduction is on the link. The engine waits for every reduction at the end of the backward
(``Unit.finish_reductions``, before the gradients are read) in the order they started.

Exact by construction: the worker runs the same :class:`~zpp.zero.comm_api.GradReduce` (same
class, same settings, same tune plan) over a duplicate of the world with a communicator of
its own (:meth:`~zpp.comm.transport.Transport.duplicate`; qgZ's topology is built again over
it), so its collectives never interleave with the gathers the backward runs meanwhile, and
the ring or all-to-all order, hence every bit of the result, is the synchronous path's. One
worker runs the reductions in the order they started, the same order on every rank (the
backward's order), as any collective must be.

Bounded by memory: the reductions started and not yet done hold at most ``min(
reduce_bucket_size, 2 x the largest unit's gradient)`` elements (DeepSpeed's meaning of
``reduce_bucket_size`` under ``overlap_comm``; the second term keeps the cost at two units'
gradients, the stage-3 memory formula's transient); a start past it first waits for the
oldest. Each holds the unit's flat fp32 gradient until it is done, or, pipelined, until its
first part is: qgZ's second part holds only the codes and scales of the intra-node sum and
the shard it writes (``Reduction.held_numel``, about ``1/(8 R)`` of the gradient's bytes at
int4), so the backward stalls on the first parts' pace, not on the link's. A bound in count
instead (first tried: 2 in flight) stalled the backward on the 25M GPT's 33 small units at
100 Mbit (0.8 s of its 1.4 s backward, perf/results/step_trace-zeropp-100mbit.json.txt).

Pipelined (qgZ, [Note: qgZ's hops pipelined] in :mod:`zpp.comm.collectives`): a
:attr:`~zpp.zero.comm_api.GradReduce.pipelined` strategy's ``start`` runs on the worker and
its ``wait()`` on a second worker, in the same order, so the inter-node hop of unit k is on the
link while the worker runs unit k+1's quantization and intra-node hop. The bits are the same:
each reduction runs the same calls over the same communicators in the same order; only the
two communicators' calls interleave differently in time.

Not overlapped (run at the start, as before, with the reason logged once and kept in
``engine.overlap_reason``): one rank; a transport that cannot run collectives on a second
thread (MPI without ``MPI_THREAD_MULTIPLE``: ``Transport.thread_safe``); a world that
cannot be duplicated (the hierarchical mode's intra-node world on torch.distributed, whose
``new_group`` needs every rank of the job).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import TYPE_CHECKING

import torch

from zpp.comm.transport import Transport, check_seconds
from zpp.zero.comm_api import GradReduce, Reduction

if TYPE_CHECKING:
    from zpp.zero.shard import FlatLayout

#: reductions started and not done, at most (see [Note: overlapped reductions]): the memory
#: bound decides; this only caps the queue of tiny units
DEFAULT_MAX_INFLIGHT = 64


class ThreadReduction(Reduction):
    """A reduction running on the :class:`ReductionThread`; ``wait()`` blocks until it is done
    and returns its result (or raises what the worker raised: a transport fault, a timeout)."""

    __slots__ = ("future", "numel", "clock", "what", "released")

    def __init__(self, future: concurrent.futures.Future, numel: int, clock: LinkWaits, what: str) -> None:
        super().__init__(torch.empty(0))
        self.future = future
        #: gradient elements' worth of memory it holds: the unit's whole gradient until the
        #: first part is done, then what the second part still holds (pipelined strategies)
        self.numel = numel
        self.clock = clock
        self.what = what
        #: set once ``numel`` will not fall further (the first part done, or the whole)
        self.released = threading.Event()

    def wait(self) -> torch.Tensor:
        if not self.future.done():
            with self.clock.waiting("reduce", self.what):
                self.future.result()
        return self.future.result()


@dataclasses.dataclass
class LinkWaits:
    """Seconds the training thread spent blocked on communication, per phase, since the last
    :meth:`take`: ``forward_gather`` / ``backward_gather`` (waiting for a unit's weights),
    ``reduce`` (waiting for gradient reductions: the whole reduction when it runs at once,
    the rest of it when overlapped), ``norm`` (the gradient norm's all-reduce, which waits for
    the slowest rank), ``publish`` (stages 1-2: the updated weights' gather), ``metadata``
    (the training thread's metadata checks outside those waits, e.g. while it starts a
    prefetched gather: blocking round trips, see [Note: metadata check] in
    :mod:`zpp.comm.transport`; the training thread is the one of the first wait). The bench
    prints them per step (``perf/train_cluster.py``).

    Each wait is also a span named ``zpp.wait.<phase> <what>``, as are the engine's
    ``zpp.forward``, ``zpp.backward`` and ``zpp.step`` and each overlapped reduction on its
    thread (``zpp.reduce <what>``): a ``torch.profiler.record_function`` (so a profiler trace
    shows them beside the compute ops), and, while :attr:`spans` is a list, an entry
    ``(name, start, end, thread name)`` there in ``time.perf_counter`` seconds (the profiler
    does not see the reduction thread, which predates it): ``perf/train_bench.py --trace``."""

    PHASES = ("forward_gather", "backward_gather", "exact_gather", "reduce", "norm", "publish", "metadata")
    """Every phase a wait is booked under (a gather's is its :class:`~zpp.zero.comm_api.Phase`'s)."""

    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    spans: list[tuple[str, float, float, str]] | None = None
    #: the training thread (of the first wait), its metadata-check seconds at the last take,
    #: those inside its waits since (booked there already), and its depth of nested waits
    _thread: int | None = None
    _checks_mark: float = 0.0
    _checks_inside: float = 0.0
    _depth: int = 0

    def add(self, phase: str, s: float) -> None:
        if phase not in self.PHASES:
            raise ValueError(f"LinkWaits.add: phase={phase!r} is not one of {self.PHASES}")
        self.seconds[phase] += s

    @contextlib.contextmanager
    def span(self, name: str):
        """A named span (see above), not booked as a wait."""
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            if self.spans is not None:
                self.spans.append((name, t0, time.perf_counter(), threading.current_thread().name))

    @contextlib.contextmanager
    def waiting(self, phase: str, what: str):
        """Book the time inside the block as a wait of ``phase`` (``what``: e.g. "unit 3")."""
        me = threading.get_ident()
        if self._thread is None:
            self._thread, self._checks_mark = me, check_seconds(me)
        outer = me == self._thread and self._depth == 0
        self._depth += outer
        c0, t0 = check_seconds(me), time.perf_counter()
        try:
            with self.span(f"zpp.wait.{phase} {what}"):
                yield
        finally:
            self.add(phase, time.perf_counter() - t0)
            if outer:
                self._depth -= 1
                self._checks_inside += check_seconds(me) - c0

    def take(self) -> dict[str, float]:
        """The seconds per phase so far, and start again from zero."""
        if self._thread is not None:  # the training thread's checks that no wait above held
            now = check_seconds(self._thread)
            self.seconds["metadata"] += max(0.0, now - self._checks_mark - self._checks_inside)
            self._checks_mark, self._checks_inside = now, 0.0
        out, self.seconds = dict(self.seconds), collections.defaultdict(float)
        return out


class ReductionThread:
    """Runs ``reduce`` (built over a duplicate of the world) on one worker thread; see
    [Note: overlapped reductions].

    Args:
        reduce: the gradient reduction, built over ``comms`` (the duplicate).
        world: that duplicate of the world; the thread owns it and frees it at :meth:`close`.
        max_inflight: reductions started and not done, at most (>= 1).
        max_numel: gradient elements held by reductions started and not done, at most
            (:attr:`ThreadReduction.numel`; one reduction larger than this still runs,
            alone); the engine sets it once its units are planned.
        clock: where the time the training thread waits is booked.
        pipeline: run a :attr:`~zpp.zero.comm_api.GradReduce.pipelined` strategy's second
            part on a second worker (``zpp.pipeline_reductions``); False: every reduction
            whole on the one worker.
    """

    def __init__(self, reduce: GradReduce, *, world: Transport, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 max_numel: int, clock: LinkWaits, pipeline: bool = True) -> None:
        if max_inflight < 1:
            raise ValueError(f"ReductionThread: max_inflight={max_inflight} must be >= 1")
        self.reduce = reduce
        self.world: Transport | None = world
        self.max_inflight = max_inflight
        self.max_numel = max_numel
        self.clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zpp-reduce")
        #: the second worker of a pipelined strategy (its reductions' ``wait()``), else None
        self._hop2 = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zpp-reduce-hop2")
                      if pipeline and reduce.pipelined else None)
        self._inflight: collections.deque[ThreadReduction] = collections.deque()
        #: reductions run on the worker so far (the bench and tests read it)
        self.started = 0
        #: the most gradient elements held at once by reductions handed to the worker and not
        #: yet done, the new one included (each a unit's full gradient until its reduction,
        #: or a pipelined one's first part, is done; perf/memory_bench.py reports it beside
        #: the resident peak)
        self.peak_numel = 0
        #: reductions whose second part ran on the second worker (pipelined strategies)
        self.hop2_started = 0

    def start(self, flat: torch.Tensor, layout: FlatLayout, what: str = "") -> ThreadReduction:
        """Hand ``flat`` (which the worker then owns) to the worker, after waiting for the
        oldest reductions while a bound would be passed. ``what`` names it in traces."""
        numel = flat.numel()
        self._make_room(numel)
        pending = sum(r.numel for r in self._inflight if not r.future.done())
        self.peak_numel = max(self.peak_numel, pending + numel)
        ready = None
        if flat.is_cuda:  # the worker's device and stream: after the kernels that wrote flat
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(flat.device))

        def first() -> Reduction:
            if ready is not None:
                torch.cuda.set_device(flat.device)
                torch.cuda.current_stream(flat.device).wait_event(ready)
            with self.clock.span(f"zpp.reduce {what}"):
                return self.reduce.start(flat, layout)

        if self._hop2 is None:
            r = ThreadReduction(self._pool.submit(lambda: first().wait()), numel, self.clock, what)
            r.future.add_done_callback(lambda _: r.released.set())
        else:
            r = ThreadReduction(concurrent.futures.Future(), numel, self.clock, what)
            self._pipelined(first, r, flat.device if flat.is_cuda else None)
        self._inflight.append(r)
        self.started += 1
        return r

    def _make_room(self, numel: int) -> None:
        """Wait until ``numel`` more elements fit the bounds: for the oldest reduction still
        holding its whole gradient to finish its first part, or, past the count or with every
        one released, for the oldest to finish (see [Note: overlapped reductions])."""
        while self._inflight:
            over_count = len(self._inflight) >= self.max_inflight
            if not over_count and sum(r.numel for r in self._inflight) + numel <= self.max_numel:
                return
            holding = next((r for r in self._inflight if not r.released.is_set()), None)
            if over_count or holding is None:
                oldest = self._inflight.popleft()
                if not oldest.future.done():
                    with self.clock.waiting("reduce", f"{oldest.what} (bound)"):
                        concurrent.futures.wait([oldest.future])
            else:
                with self.clock.waiting("reduce", f"{holding.what} (bound)"):
                    holding.released.wait()

    def _pipelined(self, first, r: ThreadReduction, device: torch.device | None) -> None:
        """Run ``first`` on the worker, then its reduction's ``wait()`` on the second worker;
        ``r.future`` is done when that is (or holds the error of either). Between the two,
        ``r`` holds what the started reduction says it holds (``Reduction.held_numel``)."""
        done = r.future

        def second(started: Reduction) -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                with self.clock.span(f"zpp.reduce {r.what} (hop 2)"):
                    done.set_result(started.wait())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                done.set_exception(exc)

        def run() -> None:
            try:
                started = first()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                done.set_exception(exc)
                r.released.set()
                return
            if started.held_numel is not None:
                r.numel = started.held_numel
            r.released.set()
            self.hop2_started += 1
            self._hop2.submit(second, started)

        self._pool.submit(run)

    def forget_done(self) -> None:
        """Forget the reductions that are done (their owners wait for their results)."""
        while self._inflight and self._inflight[0].future.done():
            self._inflight.popleft()

    def close(self) -> None:
        """Let the running reductions finish, stop the worker and free the world it ran over
        (:meth:`~zpp.comm.transport.Transport.free`: without it every engine built and closed
        would keep that communicator until exit)."""
        self._inflight.clear()
        self._pool.shutdown(wait=True)  # first: its last reductions hand their wait() on
        if self._hop2 is not None:
            self._hop2.shutdown(wait=True)
        world, self.world = self.world, None
        if world is not None:
            world.free()

    def __repr__(self) -> str:
        return (f"ReductionThread({self.reduce!r}, max_inflight={self.max_inflight}, "
                f"max_numel={self.max_numel})")


def overlap_world(world: Transport, wanted: bool) -> tuple[Transport | None, str]:
    """A duplicate of ``world`` for the reduction thread and "" when the reductions can be
    overlapped; else None and why not (see [Note: overlapped reductions]). Collective over
    ``world`` when it duplicates (every rank decides alike: the reasons depend on the
    configuration and the transport, the same on every rank)."""
    if not wanted:
        return None, "overlap_comm is off"
    if world.world_size == 1:
        return None, "one rank: nothing to overlap"
    if not world.thread_safe:
        return None, (f"{world.name} cannot run collectives on a second thread (MPI without "
                      "MPI_THREAD_MULTIPLE)")
    try:
        return world.duplicate(), ""
    except NotImplementedError as exc:
        return None, f"the world cannot be duplicated ({exc})"
