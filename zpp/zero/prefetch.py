"""Stage 3 prefetch: the order of a pass's gathers, recorded once, and gathers started ahead.

[Note: stage 3 prefetch]
A *pass* runs from the root module's forward to the end of ``engine.backward`` (or, for a
forward without grad, to the end of that forward; a forward that starts while a pass is
open closes it). Every gather a hook asks for that has to communicate (the unit is not
gathered already) is one entry ``(unit index, phase)`` of the pass's sequence.

* The first pass of each kind (with / without grad) runs without prefetch and its sequence
  becomes the *trace*; every rank then checks that all ranks recorded the same trace (one
  small collective, with the transport's metadata check on).
* In a later pass, entry ``i`` asked for is compared with the trace's entry ``i``. While
  they agree, after serving entry ``i`` the engine starts the gathers of trace entries
  ``i + 1, i + 2, ...`` (:meth:`Unit.start_gather <zpp.zero.unit.Unit.start_gather>`, on
  the transport's asynchronous all-gather) while the started-but-not-yet-used units hold
  fewer elements than the *window* (``stage3_prefetch_bucket_size``, or with "auto" the
  window chosen from a timed pass: [Note: the prefetch window from the
  measured link] in :mod:`zpp.zero.prefetch_depth`) and the units gathered plus the one
  to start would hold at most ``stage3_max_live_parameters`` elements, stopping at the first
  entry whose unit is still gathered or in flight (it is started at a later entry). The
  hook asking for a started unit waits for it instead of gathering. The window is
  DeepSpeed's rule: the count is checked before a gather starts, so the last one may go
  past it and a window smaller than one unit still starts one unit ahead (DeepSpeed
  prefetches whole parameters the same way; the Hugging Face Trainer fills "auto" with
  0.9 x hidden^2, less than one transformer block, which would otherwise turn prefetch off).
* At the first entry that differs, the pass stops prefetching (counted in
  ``PrefetchStats.mismatches``); gathers already started are used if asked for with the
  same phase, else waited for and dropped (``dropped``). At the end of that pass its
  sequence replaces the trace.
* At the end of every pass, started gathers nobody asked for are waited for and dropped, so
  nothing is in flight at the optimizer step.

Collective order: what is started, and when, depends only on the trace and on the
sequence of entries asked for so far, which are the same on every rank when every rank
runs the same graph (the engine's requirement, as DDP's). So every rank issues the same
collectives in the same order, with or without a mismatch, and prefetch never reorders
one rank against another. A prefetched gather moves exactly the bytes the gather at the
point of use would move; only dropped gathers add bytes.

Memory: a started gather allocates its full buffer at once, so up to the window's elements
(plus one unit) of full buffers are held beyond what the module running needs;
``ZeroEngine.model_state_bytes`` counts them as parameters while they exist and
``PrefetchStats.peak_inflight_numel`` records the most held at once.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Sequence

import torch

from zpp.comm.transport import Transport
from zpp.log import logger as log
from zpp.zero.comm_api import Phase
from zpp.zero.prefetch_depth import Measured, choose_window, simulate
from zpp.zero.unit import Unit
from zpp.zero.shard import ShardState

Entry = tuple[int, Phase]  # (unit index, phase)
WINDOW_OP = "prefetch_window"
"""The name the window's agreement (one int64 all-reduce, once per engine) is counted under."""


def _now(unit: Unit) -> float:
    """The host clock once the unit's device has done its queued work (a GPU's gathers and
    kernels return before they run; a timed pass waits for them)."""
    if unit.flat.device.type == "cuda":
        torch.cuda.synchronize(unit.flat.device)
    return time.perf_counter()


@dataclasses.dataclass(slots=True)
class PrefetchStats:
    """What the prefetcher did since the engine was built."""

    passes: int = 0
    """Passes closed."""
    recorded: int = 0
    """Passes whose sequence became the trace (the first of each kind, and each mismatch)."""
    mismatches: int = 0
    """Passes whose order differed from the trace: prefetch stopped at the first difference."""
    prefetched: int = 0
    """Gathers started ahead of use."""
    hits: int = 0
    """Gathers served by a started gather of the same phase."""
    dropped: int = 0
    """Started gathers waited for and thrown away (asked for with another phase, or never
    asked for before the pass ended); each one moved bytes for nothing."""
    synchronous: int = 0
    """Started gathers that the transport ran to completion at the call (a backend without
    asynchronous all-gather): prefetched, but with no overlap."""
    peak_inflight_numel: int = 0
    """Most elements of full buffers started but not yet used, at any time."""
    window_numel: int | None = None
    """Elements of gathers allowed ahead of use: ``stage3_prefetch_bucket_size``, or with
    "auto" the window chosen at the end of the second pass with grad (None until then)."""
    measured: tuple[Measured, ...] = ()
    """With "auto": this rank's timed gathers of the pass that chose the window."""


class Prefetcher:
    """Records the gather order of stage 3 passes and starts gathers ahead; see
    [Note: stage 3 prefetch].

    Args:
        units: the engine's units (indexed by ``Unit.index``).
        bucket_numel: ``stage3_prefetch_bucket_size``: elements of started-but-unused full
            buffers allowed at once; 0 turns prefetching off; "auto": chosen from the
            second pass's measured gathers and compute (see [Note: the prefetch window from
            the measured link]).
        max_live_numel: ``stage3_max_live_parameters``: no gather is started ahead while
            the units gathered and started would hold more elements than this.
        enabled: ``zpp.prefetch``; False turns prefetching off (nothing is traced; the
            engine gathers at the point of use, as without a prefetcher).
        world: the engine's transport (for the trace agreement check).
    """

    def __init__(self, units: Sequence[Unit], *, bucket_numel: int | str, enabled: bool, world: Transport,
                 max_live_numel: int | None = None) -> None:
        self.units = list(units)
        self.auto = bucket_numel == "auto"
        self.bucket_numel = None if self.auto else bucket_numel
        # the bound can only bite below every unit gathered at once; above it, no count per entry
        total = sum(u.layout.padded_numel for u in self.units)
        self.max_live_numel = max_live_numel if max_live_numel is not None and max_live_numel < total else None
        self.enabled = enabled and (self.auto or bucket_numel > 0)
        self.world = world
        self.stats = PrefetchStats(window_numel=self.bucket_numel)
        # the timed pass: (unit, numel, asked, served, units gathered after it was served)
        self._timed: list[tuple[int, int, float, float, frozenset[int]]] | None = None
        self._traces: dict[bool, list[Entry]] = {}
        self._kind: bool | None = None  # the open pass's kind (grad enabled), None: no pass
        self._seq: list[Entry] = []
        self._matching = False
        self._next = 0  # trace position of the next entry not yet started
        self._started: set[int] = set()  # units started ahead and not yet asked for
        self._started_numel = 0

    @property
    def in_pass(self) -> bool:
        return self._kind is not None

    def begin_pass(self, grad: bool) -> None:
        """The root module's forward starts (closes a pass still open). A no-op when
        prefetching is off: no trace, no extra collective."""
        if self._kind is not None:
            self.end_pass()
        if not self.enabled:
            return
        self._kind = grad
        self._seq = []
        self._matching = self.enabled and grad in self._traces
        self._next = 0
        # "auto": the second pass with grad (the first that has a trace; still in line) is timed
        timing = self.auto and self.bucket_numel is None and grad and grad in self._traces
        self._timed = [] if timing else None

    def gather(self, unit: Unit, phase: Phase) -> None:
        """A hook needs ``unit`` gathered for ``phase``."""
        f = unit.flat
        if f.state is ShardState.GATHERED:
            return
        if self._kind is None:  # outside a pass: no trace, no prefetch
            unit.gather(phase)
            return
        pos = len(self._seq)
        self._seq.append((unit.index, phase))
        if self._matching:
            trace = self._traces[self._kind]
            if pos >= len(trace) or trace[pos] != (unit.index, phase):
                self._matching = False
                self.stats.mismatches += 1
        if unit.index in self._started:
            self._started.discard(unit.index)
            self._started_numel -= unit.layout.padded_numel
            if unit.inflight.phase is phase:
                self.stats.hits += 1
            else:
                self.stats.dropped += 1  # Unit.gather drops it and gathers again
        if self._timed is None:
            unit.gather(phase)
        else:
            asked = _now(unit)
            unit.gather(phase)
            served = _now(unit)
            held = frozenset(u.index for u in self.units if u.flat.state is not ShardState.SHARDED)
            self._timed.append((unit.index, unit.layout.padded_numel, asked, served, held))
        if self._matching:
            self._start_ahead(pos + 1)

    def _start_ahead(self, first: int) -> None:
        if self.bucket_numel is None:  # "auto" before the window is chosen: in line
            return
        trace = self._traces[self._kind]
        i = max(first, self._next)
        live = None
        if self.max_live_numel is not None:
            live = self._started_numel + sum(u.layout.padded_numel for u in self.units
                                             if u.flat.state is ShardState.GATHERED)
        while i < len(trace):
            index, phase = trace[i]
            u = self.units[index]
            n = u.layout.padded_numel
            if u.flat.state is not ShardState.SHARDED or self._started_numel >= self.bucket_numel:
                break
            if live is not None and live + n > self.max_live_numel:
                break
            work = u.start_gather(phase)
            self._started.add(index)
            self._started_numel += n
            self.stats.prefetched += 1
            self.stats.synchronous += not work.asynchronous
            self.stats.peak_inflight_numel = max(self.stats.peak_inflight_numel, self._started_numel)
            if live is not None:
                live += n
            i += 1
        self._next = i

    def end_pass(self) -> None:
        """Close the open pass: drop unused started gathers, re-record the trace if the
        pass did not follow it. Every rank calls it at the same point (collective when a
        trace is recorded)."""
        if self._kind is None:
            return
        kind, seq = self._kind, self._seq
        self._kind = None
        if self._timed is not None:
            self._choose_window(self._timed)
            self._timed = None
        for index in sorted(self._started):  # the same order on every rank
            self.units[index].drop_started()
            self.stats.dropped += 1
        self._started.clear()
        self._started_numel = 0
        self.stats.passes += 1
        trace = self._traces.get(kind)
        if trace is not None and seq != trace and self._matching:  # a strict prefix of the trace
            self.stats.mismatches += 1
        if trace is None or seq != trace:
            self._traces[kind] = seq
            self.stats.recorded += 1
            code = zlib.crc32(repr(seq).encode())
            self.world.check_agree("zpp stage 3 prefetch trace (every rank must run the same graph)",
                                   (len(seq), code), ("gathers", "crc32"))

    def _choose_window(self, timed: list[tuple[int, int, float, float, frozenset[int]]]) -> None:
        """The window from this pass's timed gathers, the largest over ranks (collective:
        every rank closes its timed pass at the same point). The pass's tail after its last
        gather (the wait for the reductions, whatever the job does before its next forward)
        is left out: no gather can be hidden behind it, and it would loosen the tolerance."""
        nexts = [asked for _, _, asked, _, _ in timed[1:]]
        steps = tuple(Measured(unit, numel, served - asked, max(0.0, nxt - served) if nxt is not None else 0.0, held)
                      for (unit, numel, asked, served, held), nxt in zip(timed, [*nexts, None]))
        mine = choose_window(steps, self.max_live_numel)
        if self.world.world_size > 1 and self.units:  # every rank has the same units (the same graph)
            agreed = torch.tensor([mine], dtype=torch.int64, device=self.units[0].flat.device)
            with self.world.counters.collective(WINDOW_OP, agreed.element_size()):
                self.world.all_reduce(agreed, "max")
            mine = int(agreed.item())
        self.bucket_numel = mine
        self.stats.window_numel = self.bucket_numel
        self.stats.measured = steps
        if self.world.rank == 0 and steps:
            log.info("zpp: stage 3 prefetch window %d elements (largest unit %d), chosen from a timed pass "
                     "(%d gathers %.3f s in line, compute %.3f s; predicted pass %.3f s, unbounded %.3f s)",
                     self.bucket_numel, max(m.numel for m in steps), len(steps), sum(m.gather_s for m in steps),
                     sum(m.compute_s for m in steps), simulate(steps, self.bucket_numel),
                     simulate(steps, sum(m.numel for m in steps)))

    def trace(self, grad: bool = True) -> list[Entry] | None:
        """The recorded trace of passes with (or without) grad, or None."""
        t = self._traces.get(grad)
        return list(t) if t is not None else None
