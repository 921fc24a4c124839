"""The outer sync of the hierarchical mode: one object per engine, called after every applied
inner optimizer step.

[Note: hierarchical mode]
With ``zpp.outer`` the engine's data-parallel world is the node (``topology.intra``): the
ZeRO stage and the ZeRO++ switches shard and reduce among the ranks of one node, over the
fast links, and every node trains its own replica on its own data. Each rank keeps, for its
ZeRO shard, the weights at the last sync (``anchor``, fp32) and, with momentum, the outer
momentum; both are equal on every node. After the inner steps the schedule names (see
[Note: staggered schedule] in :mod:`~zpp.zero.outer.schedule`) a fragment's pseudo-gradient
``anchor - master`` is averaged with the counterparts on the other nodes
(``topology.inter``, :mod:`~zpp.zero.outer.reduce`) and the outer step of
:mod:`~zpp.zero.outer.algorithm` moves ``anchor``; the fragment's masters then take the new
anchor (or merge with it, after a delay), and the engine's publish (the same call that
follows every optimizer step) casts and all-gathers them into the parameters inside the node.
Inner optimizer states stay per node, as in DiLoCo.

[Note: background outer sync]
With ``delay`` > 0 a sync runs on one worker thread per engine while the next inner steps
compute; the transports have no non-blocking reduce-scatter or all-to-all, so the blocking
collectives run there. This is safe because the inter-node transport is used by that thread
alone after construction (the engine's own collectives run on the intra-node transport, and
checkpoints and the user's own collectives on the job's world; with one rank per node the
inter-node ranks are the whole world, so the sync runs on a duplicate of the world with a
communicator of its own, :meth:`~zpp.comm.transport.Transport.duplicate`), and every rank
submits its syncs in the same order (the schedule is a function of the step count), so the
worker threads of the ranks of one ``topology.inter`` group run the same collectives in the
same order. The pseudo-gradient is
copied into a fresh buffer before it is submitted, so the inner steps never touch what the
thread reads; the result is read only after ``Future.result()``. An error in the thread
(a lost peer) is raised by the step that lands the sync. Wire bytes are booked from both
threads into the shared counters (their per-thread collective stacks keep them apart).
Without delay the step runs the sync itself; so it does, counted in ``stats.foreground``, when
the inter-node transport is not ``thread_safe`` (MPI without ``MPI_THREAD_MULTIPLE``).

[Note: skipped steps and the outer schedule]
A step whose gradients are not finite is skipped by every rank of its node (the engine's
check runs inside the node; agreeing across nodes would cost a round trip on the slow link
every step), so another node may apply it. The schedule still counts it: the engine calls
:meth:`OuterSync.after_inner_step` for skipped steps too, so every node starts and lands each
sync at the same step. Otherwise a node behind would start its half of a sync a step later
than the others, and a checkpoint (a collective over every rank) taken in between would wait
on a background sync that the node behind only joins after the checkpoint: a deadlock.

[Note: outer state in checkpoints]
The anchor and the momentum are per-element state of each unit's shard: they are saved with
the unit's optimizer state (keys ``outer.anchor``, ``outer.momentum``), so they reshard like
it (any ranks per node, stage or bucket size). The rest is per rank (:meth:`state_dict`):
the schedule position, the syncs started and not yet landed (their averaged pseudo-gradient:
a save waits for any still in flight, which every node reaches at the same step) and the
1-bit error feedback. It is restored only into the same layout (nodes, shard sizes,
fragments, compression; every rank decides alike); elsewhere the position is kept and the
pending syncs and error feedback are dropped with a warning: their fragments' weights keep
their local progress, which the next sync of the fragment folds in.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero.config import OuterConfig
from zpp.zero.outer.algorithm import merge, outer_step
from zpp.zero.outer.reduce import OuterReduce, build_outer_reduce
from zpp.zero.outer.schedule import Fragment, Schedule, cut
from zpp.zero.unit import Unit

__all__ = ["OuterStats", "OuterSync"]

STATE_VERSION = 1
log = logging.getLogger("zpp.zero")


@dataclasses.dataclass
class OuterStats:
    """What the outer sync did since the engine was built."""

    started: int = 0
    """Fragment syncs started."""
    landed: int = 0
    """Outer updates applied."""
    dropped: int = 0
    """Syncs that a checkpoint load into another layout dropped (see [Note: outer state in
    checkpoints])."""
    wait_s: float = 0.0
    """Seconds the steps spent waiting for a sync to finish (without delay: the whole sync)."""
    chosen_delay: int | None = None
    """With ``delay: "auto"``: the delay chosen when the first update landed (None before)."""
    foreground: int = 0
    """Syncs with ``delay`` > 0 run inside the step instead of in the background, because the
    inter-node transport cannot run on a second thread (``Transport.thread_safe`` false: an
    MPI library without ``MPI_THREAD_MULTIPLE``); their results are the same, applied as late."""


@dataclasses.dataclass
class _Pending:
    start: int
    delta: torch.Tensor
    future: concurrent.futures.Future | None
    delay: int = 0  # steps from start to landing (the schedule's when the sync started)


class OuterSync:
    """The outer optimizer over this rank's trainable unit shards; see [Note: hierarchical mode].

    Args:
        units: the engine's units (the trainable ones are synced).
        config: the ``zpp.outer`` section.
        inter: the ranks of this local rank on every node (``topology.inter``).
        node: this rank's node index (which replica it trains).
    """

    def __init__(self, units: Sequence[Unit], config: OuterConfig, inter: Transport, *, node: int,
                 world: Transport | None = None, owns_inter: bool = False) -> None:
        self.config = config
        self.inter = inter
        self.owns_inter = owns_inter  # a duplicate made for the sync: freed at close
        self.node = node
        self.units = tuple(u for u in units if u.trainable)
        if not self.units:
            raise ValueError("zpp.outer: the model has no trainable parameters to sync")
        self.auto = config.delay == "auto"  # see [Note: delay auto]
        self.world = world if world is not None else inter  # where the ranks agree on the chosen delay
        self.schedule = Schedule(config.sync_every, config.fragments, 1 if self.auto else config.delay)
        self._sync_s: list[float] = []  # seconds of each sync, as its worker (or the step) ran it
        self._step_at: list[float] = []  # when each inner step ended (until the delay is chosen)
        self.fragments: tuple[Fragment, ...] = cut([u.layout.shard_numel for u in self.units], config.fragments)
        self.lr, self.momentum, self.nesterov = config.outer_lr, config.outer_momentum, config.nesterov
        self.anchors = [u.flat.master.detach().clone() for u in self.units]
        self.momenta = [torch.zeros_like(a) for a in self.anchors] if self.momentum else None
        self.reducers: list[OuterReduce] = [
            build_outer_reduce(config.compression, inter, f.numel, config.group_size, device=self.anchors[0].device)
            for f in self.fragments]
        self.position = 0
        self.stats = OuterStats()
        self._slot = {id(u): i for i, u in enumerate(self.units)}
        self._pending: dict[int, _Pending] = {}
        background = self.schedule.delay > 0 and inter.world_size > 1
        self._foreground = background and not inter.thread_safe
        if self._foreground and inter.rank == 0:
            log.warning("zpp.outer: the %s transport cannot run collectives on a second thread (MPI without "
                        "MPI_THREAD_MULTIPLE): the syncs with delay=%d run inside the step (counted in "
                        "engine.outer.stats.foreground)", inter.name, self.schedule.delay)
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zpp-outer")
                        if background and not self._foreground else None)

    @property
    def replicas(self) -> int:
        """Nodes (replicas) in the job."""
        return self.inter.world_size

    # ------------------------------------------------------------------ the step
    def after_inner_step(self) -> bool:
        """Count an inner step (applied or skipped, see [Note: skipped steps and the outer
        schedule]); land the syncs due and start those the schedule names. True when an
        update landed: the caller publishes the masters (as after every optimizer step)."""
        self.position += 1
        p, s = self.position, self.schedule
        landed = self.stats.landed
        if self.auto and self.stats.chosen_delay is None:
            self._step_at.append(time.perf_counter())
        if s.delay:  # each pending sync lands the delay it started with after its start
            for f in sorted(f for f, q in self._pending.items() if q.delay and p - q.start >= q.delay):
                self._land(f)
        if self.auto and self.stats.chosen_delay is None and self.stats.landed > 0:
            self._choose_delay()
        starting = s.starting(p)
        for f in starting:
            self._start(f)
        if not s.delay:
            for f in starting:
                self._land(f)
        return self.stats.landed > landed

    def _choose_delay(self) -> None:
        """[Note: delay auto] At the step the first outer update lands (the same step on
        every rank), the delay becomes the fewest inner steps covering the slowest sync
        measured (at least 1, below H), agreed as the maximum over every rank of the job."""
        steps = [b - a for a, b in zip(self._step_at, self._step_at[1:])]
        step_s = sum(steps) / len(steps) if steps else 0.0
        sync_s = max(self._sync_s, default=0.0)
        want = math.ceil(sync_s / step_s) if step_s > 0 else 1
        d = torch.tensor([float(min(max(want, 1), self.schedule.sync_every - 1))])
        self.world.all_reduce(d, op="max")
        chosen = int(d.item())
        self.schedule = Schedule(self.schedule.sync_every, self.schedule.fragments, chosen)
        self.stats.chosen_delay = chosen
        self._step_at.clear()
        if self.world.rank == 0:
            log.info("zpp.outer: delay 'auto' chose %d (slowest sync %.3f s, inner step %.3f s on rank 0)", chosen,
                     sync_s, step_s)

    def _start(self, f: int) -> None:
        frag = self.fragments[f]
        delta = torch.empty(frag.numel, dtype=torch.float32, device=self.anchors[0].device)
        off = 0
        for pc in frag.pieces:
            master = self.units[pc.unit].flat.master.detach()
            torch.sub(self.anchors[pc.unit][pc.lo:pc.hi], master[pc.lo:pc.hi], out=delta[off:off + pc.numel])
            off += pc.numel
        reducer = self.reducers[f]
        if self._worker is not None:  # see [Note: background outer sync]
            future = self._worker.submit(self._timed, reducer, delta)
        else:
            t0 = time.perf_counter()
            self._timed(reducer, delta)
            self.stats.wait_s += time.perf_counter() - t0
            self.stats.foreground += self._foreground
            future = None
        self._pending[f] = _Pending(self.position, delta, future, self.schedule.delay)
        self.stats.started += 1

    def _timed(self, reducer: OuterReduce, delta: torch.Tensor) -> None:
        t0 = time.perf_counter()
        reducer(delta)
        if self.auto and self.stats.chosen_delay is None:
            self._sync_s.append(time.perf_counter() - t0)

    def _land(self, f: int) -> None:
        pending = self._pending.pop(f, None)
        if pending is None:  # dropped by a load into another layout
            return
        if pending.future is not None:
            t0 = time.perf_counter()
            pending.future.result()
            self.stats.wait_s += time.perf_counter() - t0
        delta, off = pending.delta, 0
        for pc in self.fragments[f].pieces:
            anchor = self.anchors[pc.unit][pc.lo:pc.hi]
            buf = self.momenta[pc.unit][pc.lo:pc.hi] if self.momenta is not None else None
            outer_step(anchor, delta[off:off + pc.numel], buf, lr=self.lr, momentum=self.momentum,
                       nesterov=self.nesterov)
            weights = self.units[pc.unit].flat.master.detach()[pc.lo:pc.hi]
            merge(weights, anchor, self.config.mix if self.schedule.delay else 0.0)
            off += pc.numel
        self.stats.landed += 1

    def wait(self) -> None:
        """Finish every sync in flight (their results stay pending until their step)."""
        for p in self._pending.values():
            if p.future is not None:
                p.future.result()
                p.future = None

    def close(self) -> None:
        """Finish the syncs in flight and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self.owns_inter:
                self.owns_inter = False
                self.inter.free()

    # ------------------------------------------------------------------ checkpoints
    def unit_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The per-element outer state of ``unit``'s shard (empty for a frozen unit), saved
        with its optimizer state; see [Note: outer state in checkpoints]."""
        i = self._slot.get(id(unit))
        if i is None:
            return {}
        out = {"anchor": self.anchors[i].detach().clone()}
        if self.momenta is not None:
            out["momentum"] = self.momenta[i].detach().clone()
        return out

    def load_unit_state(self, unit: Unit, state: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`unit_state` into the shard this rank owns now; None (or a missing
        key): the anchor becomes the unit's (just loaded) weights, the momentum zero."""
        i = self._slot.get(id(unit))
        if i is None:
            return
        state = state or {}
        anchor = state.get("anchor")
        self.anchors[i].copy_(anchor if anchor is not None else unit.flat.master.detach())
        if self.momenta is not None:
            m = state.get("momentum")
            if m is None:
                self.momenta[i].zero_()
            else:
                self.momenta[i].copy_(m)

    def signature(self) -> dict[str, Any]:
        """What a per-rank state must match to be restored (the same on every rank)."""
        c = self.config
        return {"version": STATE_VERSION, "nodes": self.inter.world_size,
                "shards": [u.layout.shard_numel for u in self.units], "fragments": c.fragments,
                "sync_every": c.sync_every, "delay": c.delay, "compression": c.compression,
                "group_size": c.group_size}

    def state_dict(self) -> dict[str, Any]:
        """This rank's schedule position, pending syncs (waited for) and error feedback."""
        self.wait()
        return {"signature": self.signature(), "position": self.position, "node": self.node,
                "chosen_delay": self.stats.chosen_delay,
                "pending": {f: {"start": p.start, "delta": p.delta.clone()} for f, p in self._pending.items()},
                "reduce": [r.state_dict() for r in self.reducers],
                "stats": dataclasses.asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any] | None, *, own: bool) -> None:
        """Restore :meth:`state_dict`; ``own``: the state is this rank's (same job world),
        else another rank's (only its position is used). None: start the schedule afresh."""
        self.wait()
        dropped = len(self._pending)
        self._pending.clear()
        if state is None:
            self.position = 0
            for r in self.reducers:
                r.reset()
            self.stats.dropped += dropped
            return
        self.position = int(state["position"])
        if self.auto and state.get("chosen_delay") is not None:  # chosen before the save: kept
            chosen = int(state["chosen_delay"])
            self.schedule = Schedule(self.schedule.sync_every, self.schedule.fragments, chosen)
            self.stats.chosen_delay = chosen
        if own and state.get("signature") == self.signature():
            for f, p in state["pending"].items():
                self._pending[int(f)] = _Pending(int(p["start"]), p["delta"].clone(), None, self.schedule.delay)
            for r, sd in zip(self.reducers, state["reduce"], strict=True):
                if sd:
                    r.load_state_dict(sd)
            return
        lost = len(state.get("pending", {}))
        for r in self.reducers:
            r.reset()
        self.stats.dropped += lost
        if self.inter.rank == 0 and (lost or any(state.get("reduce", ()))):
            warnings.warn(f"zpp.outer: the checkpoint's outer sync state is for another layout "
                          f"({state.get('signature')}, this engine {self.signature()}): {lost} pending fragment "
                          "update(s) and the error feedback were dropped; the schedule continues at position "
                          f"{self.position}", stacklevel=3)

    def state_bytes(self) -> int:
        """Bytes of outer state this rank holds now: anchors, momenta, the pending syncs'
        buffers and the error feedback (see :mod:`zpp.zero.memory`)."""
        tensors = [*self.anchors, *(self.momenta or ()), *(p.delta for p in self._pending.values())]
        tensors += [b for r in self.reducers for b in r.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

