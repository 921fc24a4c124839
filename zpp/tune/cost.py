"""The cost model: bytes, time and memory of one training step for each zpp mode, from a
cluster (two links) and a profile (compute time and the memory beside the model states);
pure functions, no ranks.

    from zpp.tune.cost import Cluster, LINKS, MODES, Profile, predict
    c = Cluster(nodes=2, ranks_per_node=2, intra=LINKS["loopback"], inter=LINKS["100mbit"])
    rows = predict(MODES.values(), units=even_units(25_351_168, 9), cluster=c,
                   profile=Profile(compute_s=2.0))

[Note: the cost model]
*Units.* A step moves each unit of the engine (a transformer block at stage 3, a bucket at
stages 1-2) through the mode's collectives. A unit of ``n`` elements on ``W`` ranks has a
shard of ``s = max(A, ceil(ceil(n / W) / A) * A)`` elements (``A`` = ``SHARD_ALIGN``) and a
padded buffer of ``p = W s`` (zpp/zero/shard.py). ``b`` is the parameters' element size.

*Bytes per rank (the counters' direct-exchange model, [Note: what is counted]).* A rank
with ``R - 1`` peers on its node and ``W - R`` on other nodes books, per call on the world:
all_gather of ``m`` bytes: ``m`` to each peer; reduce_scatter / all_to_all of ``M``: ``M / W``
to each peer; all_reduce of ``M``: ``floor(2 M / W)`` to each peer. Per unit and step:

* stages 1-2: the gradient reduce-scatter (``M = 4p``) and the all-gather of the updated
  shard (``m = b s``);
* stage 3: two gathers (forward, backward) and the reduce-scatter. qwZ sends the forward
  gather's shard as ``q(s, bits, g)`` = codes ``ceil(s/g) g bits / 8`` + 4 bytes per group,
  ``g`` = ``min(weight_group_size, s)`` made even and <= s + (s odd); hpZ gathers the
  backward from the node: ``m = b p / R`` to the ``R - 1`` local peers only; qgZ replaces the
  reduce-scatter by two all-to-alls of codes: ``(R-1)/R q(W c)`` inside the node and
  ``(N-1)/N q(N c)`` across (``c``: the slice rounded up to whole groups);
* with gradient accumulation (``micro_steps`` backward passes per optimizer step) stage 3's
  gathers and the reduce-scatters of stages 2-3 repeat at every backward; stages 0-1 reduce,
  and stages 1-2 publish, once per optimizer step;
* the gradient norm: one all_reduce of 8 bytes per step (stages 1-3); 1-bit optimizers:
  a 4-byte finiteness flag instead, and after ``freeze_step`` the 1-bit all-reduce of the
  fused gradient (frames of ``c/8 + 4`` bytes, ``c = ceil(n / 8W) 8``: one to every peer,
  then on several nodes of several ranks one to the ``N - 1`` peers of this local rank and
  ``N`` frames to the ``R - 1`` local peers), before it the fp32 all-reduce of ``4n``;
* the hierarchical mode (``outer``): the inner steps are the ZeRO stage over the node
  (``W = R``, no inter-node bytes); every ``H`` steps each of the ``F`` fragments of this
  rank's ``Psi/R`` shard is all-reduced over the ``N`` nodes (fp32: ``2 (N-1)/N 4 Psi/R``;
  int8/int4: the quantized reduce-scatter then gather). Per step: that divided by ``H``
  (a mean; fragments are taken as equal parts, so this row is not exact to the byte). The
  sync runs beside the inner steps (``delay`` > 0): its time shows in a step only where a
  period's syncs take longer than the period's steps.

*Bytes on the node link.* The kernel sees what the backend's algorithm sends, not the
direct-exchange model: gloo (and MPICH for large messages) run all_gather,
reduce_scatter and all_reduce on the world as a ring, where each node has one outgoing
edge, so a node sends ``(W - 1)`` chunks per ring pass against the model's ``R (W - R)``;
all_to_all is a direct exchange. Everything else (the node's inter-node groups, one rank per
node) is exact. Ethernet and TCP/IP headers add ``WIRE_OVERHEAD`` (measured: the kernel's
counters over this rule on the emulated 2 x 2, perf/BENCHMARKS.md "The cost model").

*Time.* Per collective call: ``max(t_inter, t_intra)`` with ``t_inter = alpha_e k + node
bytes * WIRE_OVERHEAD / B_e`` (the node's link is shared by its ranks) and ``t_intra =
alpha_i k + rank's intra bytes / B_i`` (``k``: the algorithm's sequential steps, ``W - 1``
for a ring, 1 for a direct exchange). Stage 3's gathers are prefetched (started ahead on
the asynchronous all-gather, zpp/zero/prefetch.py): the forward's run under the forward's
compute (a third of forward + backward, ``FORWARD_SHARE``), the backward's under the
backward's. With ``overlap_comm`` (stage 3's default; stage 2 where set) the reductions run
on the reduction thread under the backward's compute too, beside its gathers on the same
links, except the last unit's (the first in forward order), which the step waits for. The
step is ``max(F c, forward gathers) + max((1 - F) c, backward gathers + reductions) + the
other calls x (1 - overlap)``; without ``overlap_comm`` the backward's gathers and the
reductions count in line (``overlap``: a further fraction hidden, 0 by default). ``compute_s`` comes from a profile:
measured (a run whose communication time the model knows, less that time) or from FLOPs
(``6 Psi tokens / (peak flops x mfu)``).

*Memory per rank (model states).* Parameters: ``b Psi`` unsharded, ``b Psi / W`` sharded
(+ the hpZ secondary ``b Psi / R`` while valid; at stage 3 the gathered full buffers:
twice the largest unit, or what the prefetch bucket starts ahead where that is more,
:func:`gathered_ahead`); gradients: the fp32 full buffers while a unit's backward runs,
the reduced fp32 shard kept until the step (``4 Psi / W`` from stage 2, ``4 Psi`` below);
optimizer: Adam's two fp32 moments ``8 Psi / W`` from stage 1 (``8 Psi`` at stage 0; in
host memory with ``offload``; on NVMe ``buffer_count`` host buffers of the largest unit's
moments); the outer mode adds ``8 Psi / R``. The peak adds the profile's
``other_bytes`` (activations, the framework), measured once per model.

[Note: the resident peak]
:func:`resident_peak` splits ``other_bytes`` where the optimizer tier changes it: a rank's
resident peak above what it held before the model is the larger of the backward at its start
(the states at rest, the gathered units, a unit's full gradient and one micro-batch's
activations; the reduced gradient shards only from a second micro-step on, since the step
before dropped them and they grow back as the activations are freed) and the optimizer step
(the states, the gradient shards and torch's AdamW temporaries: about two fp32 copies of the
largest tensor it steps on the host, where torch runs the single-tensor loop; zpp steps one
flat master per unit), each plus the runtime a rank holds once it has stepped (glibc's heap
and arenas, threads, the communicators: 86-87 MiB per CPU rank here, not model state).
The measured terms come from runs apart from the ZeRO run they predict (perf/memory_bench.py's
calibration): the activations and temporaries per element from a plain torch run of the
model, the runtime from a ZeRO run of a one-block model in the same setting.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zpp.quant.types import quantized_nbytes
from zpp.tune.links import LINKS, Link
from zpp.zero.checks import check_int, check_number
from zpp.zero.config import DEFAULT_GRADIENT_GROUP_SIZE, DEFAULT_PREFETCH_BUCKET_SIZE, DEFAULT_WEIGHT_GROUP_SIZE
from zpp.zero.outer_config import DEFAULT_SYNC_EVERY
from zpp.zero.shard import SHARD_ALIGN

__all__ = [
    "Call", "Cluster", "LINKS", "Link", "MODES", "Mode", "Prediction", "Profile", "Traffic", "UnitShape",
    "FORWARD_SHARE", "WIRE_OVERHEAD", "all_reduce_link_bytes", "compute_from_step", "even_units", "memory",
    "gathered_ahead", "outer_times", "predict", "resident_peak", "step_time", "traffic", "units_from_trace",
]

FORWARD_SHARE = 1.0 / 3.0
"""The forward's part of forward + backward compute (the backward computes two products per
one of the forward)."""

WIRE_OVERHEAD = 1.035
"""Bytes the kernel sends on an Ethernet link per byte of payload (headers): 236.1 MB on the
node link for 228.3 MB of ring payload (zpp stage 3, 25M GPT, 2 x 2, 100 Mbit)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        check_int("Cluster", "nodes", self.nodes, lo=1)
        check_int("Cluster", "ranks_per_node", self.ranks_per_node, lo=1)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclasses.dataclass(frozen=True, slots=True)
class OuterSpec:
    """The hierarchical mode's outer sync (``zpp.outer``): H, fragments, compression; the
    defaults are the mode's (zpp/zero/outer_config.py, [Note: the mode's defaults])."""

    sync_every: int = DEFAULT_SYNC_EVERY
    fragments: int = 4
    compression: str = "int4"
    delay: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    """One candidate: the ZeRO stage and zpp's switches (DeepSpeed's names in :meth:`config`)."""

    name: str
    stage: int
    weight_bits: int | None = None
    """qwZ's code width (None: the forward gather is plain)."""
    hpz: bool = False
    gradient_bits: int | None = None
    """qgZ's code width (None: the plain reduce-scatter)."""
    onebit: bool = False
    """1-bit Adam after its freeze step (stage 0: the engine's 1-bit optimizers)."""
    outer: OuterSpec | None = None
    offload: bool = False
    prefetch: bool = True
    """Stage 3 gathers started ahead (``zpp.prefetch``); off, every gather waits in line."""
    prefetch_bucket: int = DEFAULT_PREFETCH_BUCKET_SIZE
    """``stage3_prefetch_bucket_size`` (DeepSpeed's default): the elements of gathers started
    ahead of use, at least one unit; what stage 3 holds gathered (:func:`memory`)."""
    overlap_comm: bool | None = None
    """Gradient reductions on the reduction thread (``overlap_comm``; None: the engine's
    default, on at stage 3)."""
    weight_group_size: int = DEFAULT_WEIGHT_GROUP_SIZE
    gradient_group_size: int = DEFAULT_GRADIENT_GROUP_SIZE
    weight_delta_bits: int | None = None
    """hpZ's node copy kept across steps and refreshed by weight differences of this width
    (``zpp.weight_delta_bits``); None: the copy is gathered over the world after each step."""

    @property
    def two_hop_gathers(self) -> bool:
        """The engine's world gathers run in two hops (``zpp.hierarchical_gather``'s default:
        where hpZ or qgZ has the engine build the node topology; stage 3 here)."""
        return self.stage == 3 and (self.hpz or self.gradient_bits is not None)

    @property
    def reductions_beside_backward(self) -> bool:
        """The reductions run on the reduction thread while the backward goes on: stages 2-3
        (which reduce each unit as its gradients are ready) with ``overlap_comm`` on."""
        on = self.stage == 3 if self.overlap_comm is None else self.overlap_comm
        return on and self.stage >= 2 and not self.onebit

    @property
    def same_optimizer(self) -> bool:
        """The user's optimizer step on the averaged gradient each step (ZeRO stages and
        ZeRO++), so steps compare by time; 1-bit Adam and the outer mode change what a step
        learns and compare by time to a target loss."""
        return not self.onebit and self.outer is None

    def config(self, ranks_per_node: int) -> dict[str, Any]:
        """The config this mode runs with on nodes of ``ranks_per_node`` ranks:
        ``zero_optimization`` and, where needed, ``zpp`` and ``optimizer`` sections (merged
        over the user's config by ``zpp tune``)."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.weight_bits is not None:
            zero["zero_quantized_weights"] = True
        if self.hpz:
            zero["zero_hpz_partition_size"] = ranks_per_node
        if self.gradient_bits is not None:
            zero["zero_quantized_gradients"] = True
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        out: dict[str, Any] = {"zero_optimization": zero}
        zpp: dict[str, Any] = {}
        if self.weight_bits not in (None, 8):
            zpp["weight_bits"] = self.weight_bits
        if self.gradient_bits not in (None, 4):
            zpp["gradient_bits"] = self.gradient_bits
        if self.weight_delta_bits is not None and self.hpz and ranks_per_node > 1:
            # (with one rank per node there is no node copy to refresh: the mode is ZeRO++)
            zpp["weight_delta_bits"] = self.weight_delta_bits
        if not self.prefetch:
            zpp["prefetch"] = False
        elif self.stage == 3 and self.prefetch_bucket != DEFAULT_PREFETCH_BUCKET_SIZE:
            zero["stage3_prefetch_bucket_size"] = self.prefetch_bucket
        if self.overlap_comm is not None:
            zero["overlap_comm"] = self.overlap_comm
        if self.outer is not None:
            zpp["outer"] = {"sync_every": self.outer.sync_every, "fragments": self.outer.fragments,
                            "compression": self.outer.compression, "delay": self.outer.delay}
        if zpp:
            out["zpp"] = zpp
        if self.onebit:
            out["optimizer"] = {"type": "OneBitAdam"}
        return out


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("zero1", 1), Mode("zero2", 2), Mode("zero3", 3),
    Mode("zero3-qwz", 3, weight_bits=8), Mode("zero3-hpz", 3, hpz=True), Mode("zero3-qgz", 3, gradient_bits=4),
    Mode("zero3-zeropp", 3, weight_bits=8, hpz=True, gradient_bits=4),
    Mode("zero3-zeropp-delta4", 3, weight_bits=8, hpz=True, gradient_bits=4, weight_delta_bits=4),
    Mode("onebit-adam", 0, onebit=True),
    Mode("outer-int4", 2, outer=OuterSpec()),
)}


@dataclasses.dataclass(frozen=True, slots=True)
class UnitShape:
    """One engine unit: its element count (padding follows from the world) and, at stage 3,
    the phases of its gathers in one step, in order (the engine's prefetch trace,
    :meth:`zpp.zero.prefetch.Prefetcher.trace`): a block is gathered once for its forward and once for its
    backward; a unit whose parameters several modules use (a container's leftovers) is
    gathered once per use."""

    numel: int
    persistent: bool = False
    """Stage 3: parameters kept whole on every rank (``stage3_param_persistence_threshold``):
    reduced and re-gathered once per step, as at stage 2."""
    gathers: tuple[str, ...] = ("forward", "backward")

    def shard(self, world: int) -> int:
        per = -(-self.numel // world)
        return max(SHARD_ALIGN, -(-per // SHARD_ALIGN) * SHARD_ALIGN)


def units_from_trace(numels: Sequence[int], persistent: Sequence[bool],
                     trace: Iterable[tuple[int, str]]) -> list[UnitShape]:
    """:class:`UnitShape` s from an engine's units and its gather trace ``(unit index,
    phase)`` (units missing from the trace are gathered in neither phase)."""
    phases: dict[int, list[str]] = {}
    for index, phase in trace:
        phases.setdefault(index, []).append(phase)
    return [UnitShape(n, p, tuple(phases.get(i, ()))) for i, (n, p) in enumerate(zip(numels, persistent, strict=True))]


def even_units(params: int, count: int) -> list[UnitShape]:
    """``params`` elements in ``count`` equal units (the last takes the remainder): a model
    described by its size alone (its transformer blocks)."""
    check_int("even_units", "params", params, lo=1)
    check_int("even_units", "count", count, lo=1)
    each = params // count
    return [UnitShape(each)] * (count - 1) + [UnitShape(params - each * (count - 1))]


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One collective call of a rank: the counters' bytes and the node link's."""

    what: str
    intra: int
    inter: int
    node_link: float
    """Bytes this rank's node sends on its link for the call (all its ranks together)."""
    steps: int
    """Sequential message steps (latency terms)."""
    weight: float = 1.0
    """Calls per step (1/H for the outer sync)."""
    background: bool = False
    """Runs beside the steps (the outer sync with ``delay`` > 0): only what the steps
    cannot cover shows in the step time."""
    prefetched: bool = False
    """A stage 3 forward gather started ahead of its use (zpp.zero.prefetch): it runs under
    the forward's compute."""
    beside_backward: bool = False
    """Runs under the backward's compute: a stage 3 backward gather started ahead, or a
    reduction on the reduction thread (``overlap_comm``), except the last one's."""


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
    calls: tuple[Call, ...]

    @property
    def intra_bytes(self) -> float:
        return sum(c.intra * c.weight for c in self.calls)

    @property
    def inter_bytes(self) -> float:
        return sum(c.inter * c.weight for c in self.calls)

    @property
    def node_link_bytes(self) -> float:
        return sum(c.node_link * c.weight for c in self.calls) * WIRE_OVERHEAD

    def by_what(self) -> dict[str, tuple[float, float]]:
        out: dict[str, list[float]] = {}
        for c in self.calls:
            acc = out.setdefault(c.what, [0.0, 0.0])
            acc[0] += c.inter * c.weight
            acc[1] += c.intra * c.weight
        return {k: (v[0], v[1]) for k, v in out.items()}


class _Book:
    """Collective calls on a cluster, booked as the transports book them."""

    def __init__(self, cluster: Cluster, nodes: int | None = None, rpn: int | None = None) -> None:
        self.N = cluster.nodes if nodes is None else nodes
        self.R = cluster.ranks_per_node if rpn is None else rpn
        self.W = self.N * self.R
        self.calls: list[Call] = []
        self.background = False
        self.prefetched = False
        self.beside_backward = False
        self.repeat = 1
        """Calls per optimizer step of what is booked now (the micro-steps of an accumulation)."""

    def _peers(self, group: str) -> tuple[int, int]:
        """(peers on this node, peers on other nodes) in ``group``."""
        return {"world": (self.R - 1, self.W - self.R), "intra": (self.R - 1, 0),
                "inter": (0, self.N - 1)}[group]

    def _ring_node(self, group: str, chunk: float) -> float:
        """A node's link bytes for one ring pass of ``chunk`` bytes per rank and step."""
        if group == "world":
            return (self.W - 1) * chunk if self.N > 1 else 0.0
        if group == "inter":
            return self.R * (self.N - 1) * chunk  # R rings, one per local rank, each crossing once
        return 0.0

    def _size(self, group: str) -> int:
        return {"world": self.W, "intra": self.R, "inter": self.N}[group]

    def add(self, what: str, group: str, per_peer: int, node_link: float, steps: int, weight: float) -> None:
        pi, pe = self._peers(group)
        if self._size(group) > 1:
            self.calls.append(Call(what, pi * per_peer, pe * per_peer, node_link, steps, weight * self.repeat,
                                   self.background, self.prefetched, self.beside_backward))

    def all_gather(self, what: str, m: int, group: str = "world", weight: float = 1.0) -> None:
        self.add(what, group, m, self._ring_node(group, m), self._size(group) - 1, weight)

    def reduce_scatter(self, what: str, nbytes: int, group: str = "world", weight: float = 1.0) -> None:
        g = self._size(group)
        self.add(what, group, nbytes // g, self._ring_node(group, nbytes / g), g - 1, weight)

    def all_reduce(self, what: str, nbytes: int, group: str = "world", weight: float = 1.0) -> None:
        g = self._size(group)
        self.add(what, group, 2 * nbytes // g, 2 * self._ring_node(group, nbytes / g), 2 * (g - 1), weight)

    def all_to_all(self, what: str, nbytes: int, group: str = "world", weight: float = 1.0) -> None:
        g = self._size(group)
        _, pe = self._peers(group)
        self.add(what, group, nbytes // g, self.R * pe * (nbytes // g), 1, weight)


def _group(gs: int, s: int) -> int:
    """:func:`zpp.comm.collectives.effective_group_size` of the strategy's ``min(gs, s)``."""
    g = min(gs, s)
    return min(g, max(2, s + (s & 1)))


def _qgz(book: _Book, what: str, padded: int, bits: int, gs: int, weight: float = 1.0) -> None:
    """qgZ's two all-to-alls of codes and scales (zpp.comm.collectives.quantized_reduce_scatter)."""
    W, R, N = book.W, book.R, book.N
    s = padded // W
    g = _group(gs, s)
    chunk = -(-s // g) * g
    for group, elems, parts in (("intra", W * chunk, R), ("inter", N * chunk, N)):
        if parts == 1:
            continue
        for nbytes in (elems * bits // 8, elems // g * 4):  # codes, then scales: two all-to-alls
            book.all_to_all(what, nbytes, group, weight)


def _world_gather(book: _Book, what: str, m: int, hier: bool) -> None:
    """An all-gather of ``m`` bytes per rank over the world: one ring, or with ``hier`` the
    two hops of zpp.comm.collectives.hierarchical_all_gather_async (inter-node among equal
    local ranks, started ahead when prefetched; then intra-node, in line at the wait)."""
    if not (hier and book.N > 1 and book.R > 1):
        book.all_gather(what, m)
        return
    book.all_gather(what, m, "inter")
    ahead, book.prefetched, book.beside_backward = (book.prefetched, book.beside_backward), False, False
    book.all_gather(what, book.N * m, "intra")
    book.prefetched, book.beside_backward = ahead


def _quantized_all_gather(book: _Book, what: str, s: int, bits: int, gs: int, group: str = "world",
                          weight: float = 1.0, hier: bool = False) -> None:
    # codes and fp32 scales in one message (zpp.comm.collectives.quantized_all_gather_async)
    m = quantized_nbytes(s, bits, _group(gs, s))
    if hier and group == "world":
        _world_gather(book, what, m, True)
        return
    book.all_gather(what, m, group, weight)


def _node_copy_gather(book: _Book, what: str, mode: Mode, m: int) -> None:
    """hpZ's gather of the node's secondary shards (``m`` bytes each); with weight deltas
    they are in the counterparts layout, gathered one node's row at a time
    (zpp.zero.gather.hpz, [Note: which entries a secondary shard holds])."""
    rows = book.N if mode.weight_delta_bits is not None and book.N > 1 else 1
    for _ in range(rows):
        book.all_gather(what, m // rows, "intra")


def traffic(mode: Mode, units: Sequence[UnitShape], cluster: Cluster, *, param_bytes: int = 4,
            grad_bytes: int = 4, micro_steps: int = 1) -> Traffic:
    """Every collective call of one optimizer step of ``mode`` (see [Note: the cost model]).
    ``grad_bytes``: zpp reduces gradients in fp32 (4); 2 models a library that reduces them
    in the parameters' 16-bit type (DeepSpeed's default), for comparisons. ``micro_steps``:
    backward passes per optimizer step (gradient accumulation): stage 3 gathers and stages
    2-3 reduce at each, stages 0-1 reduce once (their gradients accumulate in ``.grad``)."""
    check_int("traffic", "micro_steps", micro_steps, lo=1)
    if mode.outer is not None:
        return _outer_traffic(mode, units, cluster, param_bytes, micro_steps)
    book = _Book(cluster)
    W = book.W
    if W == 1:
        return Traffic(())
    if mode.onebit:
        n = sum(u.numel for u in units)
        book.all_reduce("nonfinite flag", 4)
        c = -(-n // (8 * W)) * 8
        frame = c // 8 + 4
        book.all_to_all("onebit_all_reduce", W * frame)
        if 1 < book.N < W:
            book.all_gather("onebit_all_reduce", frame, "inter")
            book.all_gather("onebit_all_reduce", book.N * frame, "intra")
        else:
            book.all_gather("onebit_all_reduce", frame)
        return Traffic(tuple(book.calls))
    hier = mode.two_hop_gathers
    beside = mode.reductions_beside_backward
    each_micro = micro_steps if mode.stage >= 2 else 1  # [Note: stage 1 bytes] in zpp/zero/unit.py
    for k, u in enumerate(units):
        s = u.shard(W)
        p = s * W
        # the backward reduces the units in reverse: the first unit's reduction is the last, in line
        book.beside_backward = beside and k > 0
        book.repeat = each_micro
        if mode.stage == 3 and not u.persistent:
            for i, phase in enumerate(u.gathers):
                what = f"{phase} gather"
                book.prefetched = mode.prefetch and phase == "forward"
                book.beside_backward = beside and mode.prefetch and phase != "forward"
                # hpZ: only a step's first gather crosses the world; every later one, of this
                # and the next micro-steps, reads the node's secondary shards
                world = each_micro
                if mode.hpz and book.R > 1:
                    world = 1 if i == 0 else 0
                    if each_micro > world:
                        book.repeat = each_micro - world
                        _node_copy_gather(book, what, mode, param_bytes * p // book.R)
                book.repeat = world
                if world and mode.weight_delta_bits is not None and mode.hpz and book.R > 1:
                    # a step's first gather refreshes the node's copy: the shards' differences'
                    # codes over the inter-node group, then the updated secondary shards inside
                    # the node (steady state: the unit's very first gather went over the world
                    # as qwZ's)
                    _quantized_all_gather(book, what, s, mode.weight_delta_bits, mode.weight_group_size, "inter")
                    _node_copy_gather(book, what, mode, param_bytes * p // book.R)
                elif world and phase == "forward" and mode.weight_bits is not None:
                    _quantized_all_gather(book, what, s, mode.weight_bits, mode.weight_group_size, hier=hier)
                elif world:
                    _world_gather(book, what, param_bytes * s, hier)
                book.repeat = each_micro
            book.prefetched = False
            book.beside_backward = beside and k > 0  # the gathers above set it per phase
            if mode.gradient_bits is not None:
                _qgz(book, "gradient reduce-scatter", p, mode.gradient_bits, mode.gradient_group_size)
            else:
                book.reduce_scatter("gradient reduce-scatter", grad_bytes * p)
        elif mode.stage >= 1:
            if mode.stage == 3 and mode.gradient_bits is not None:
                _qgz(book, "gradient reduce-scatter", p, mode.gradient_bits, mode.gradient_group_size)
            else:
                book.reduce_scatter("gradient reduce-scatter", grad_bytes * p)
            book.beside_backward = False  # the publish, in the step
            book.repeat = 1
            _world_gather(book, "weight all-gather", param_bytes * s, hier)
        else:
            book.all_reduce("gradient all-reduce", grad_bytes * u.numel)
    book.beside_backward = False
    book.repeat = 1
    if mode.stage >= 1:
        book.all_reduce("gradient norm", 8)
    return Traffic(tuple(book.calls))


def _outer_traffic(mode: Mode, units: Sequence[UnitShape], cluster: Cluster, param_bytes: int,
                   micro_steps: int = 1) -> Traffic:
    assert mode.outer is not None
    R, N = cluster.ranks_per_node, cluster.nodes
    inner = traffic(dataclasses.replace(mode, outer=None), units,
                    Cluster(1, R, cluster.intra, cluster.inter), param_bytes=param_bytes, micro_steps=micro_steps)
    book = _Book(cluster)
    if N > 1:
        psi = sum(u.numel for u in units)
        frag = -(-psi // (R * mode.outer.fragments))  # elements of one fragment of this rank's shard
        weight = 1.0 / mode.outer.sync_every
        sub = _Book(Cluster(N, 1, cluster.intra, cluster.inter))  # the nodes' group: one rank each
        sub.background = mode.outer.delay > 0
        for _ in range(mode.outer.fragments):
            if mode.outer.compression == "none":
                sub.all_reduce("outer sync", 4 * frag, weight=weight)
            else:
                bits = {"int8": 8, "int4": 4}.get(mode.outer.compression)
                if bits is None:
                    raise NotImplementedError(
                        f"cost model: outer compression {mode.outer.compression!r} is not modelled")
                padded = -(-frag // N) * N
                _qgz(sub, "outer sync", padded, bits, 2048, weight)
                _quantized_all_gather(sub, "outer sync", padded // N, bits, 2048, weight=weight)
        # the nodes' groups run side by side: R of them share each node's link
        book.calls.extend(dataclasses.replace(c, node_link=c.node_link * R) for c in sub.calls)
    return Traffic(tuple(inner.calls) + tuple(book.calls))


def all_reduce_link_bytes(compression: str, numel: int, nodes: int, ranks_per_node: int, *,
                          across_nodes: bool) -> float:
    """Bytes one node sends on its link for an all-reduce of ``numel`` fp32 elements: over the
    whole world (``zpp bench``'s all_reduce row) or, ``across_nodes``, as the outer sync runs
    it (each local rank's ``1/R`` share over the ``N`` nodes, ``R`` groups side by side).
    ``compression``: none, int8 or int4 (zpp's quantized all-reduce)."""
    bits = {"none": None, "int8": 8, "int4": 4}[compression]
    if across_nodes:
        book, share, times = _Book(Cluster(nodes, 1, LINKS["loopback"], LINKS["loopback"])), ranks_per_node, \
            ranks_per_node
    else:
        book, share, times = _Book(Cluster(nodes, ranks_per_node, LINKS["loopback"], LINKS["loopback"])), 1, 1
    n = -(-numel // share)
    if bits is None:
        book.all_reduce("all_reduce", 4 * n)
    else:
        padded = -(-n // book.W) * book.W
        _qgz(book, "all_reduce", padded, bits, 2048)
        _quantized_all_gather(book, "all_reduce", padded // book.W, bits, 2048)
    return times * sum(c.node_link for c in book.calls) * WIRE_OVERHEAD


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """What the model costs without communication, per rank and step."""

    compute_s: float
    """Forward, backward and optimizer time of one step (the measured step without shaping,
    or from FLOPs: :meth:`from_flops`)."""
    other_bytes: int = 0
    """Peak memory beside the model states (activations, the framework)."""
    overlap: float = 0.0
    """Fraction of the communication hidden behind compute (0: zpp today)."""

    @staticmethod
    def from_flops(params: int, tokens_per_step: int, *, peak_flops: float, mfu: float = 0.4,
                   other_bytes: int = 0) -> Profile:
        check_number("Profile.from_flops", "mfu", mfu, lo=0, hi=1, lo_open=True)
        return Profile(6.0 * params * tokens_per_step / (peak_flops * mfu), other_bytes)


def call_time(c: Call, cluster: Cluster) -> float:
    """One call's seconds (see [Note: the cost model])."""
    t_inter = (cluster.inter.latency_s * c.steps + c.node_link * WIRE_OVERHEAD / cluster.inter.bandwidth
               if c.inter else 0.0)
    t_intra = cluster.intra.latency_s * c.steps + c.intra / cluster.intra.bandwidth if c.intra else 0.0
    return max(t_inter, t_intra)


def _comm_parts(t: Traffic, cluster: Cluster) -> tuple[float, float, float, float]:
    """Seconds per step of ``t``'s calls in line, under the forward (stage 3's prefetched
    forward gathers), under the backward (prefetched backward gathers and overlapped
    reductions) and in the background (the outer sync)."""
    parts = [0.0, 0.0, 0.0, 0.0]
    for c in t.calls:
        k = 3 if c.background else 1 if c.prefetched else 2 if c.beside_backward else 0
        parts[k] += call_time(c, cluster) * c.weight
    return parts[0], parts[1], parts[2], parts[3]


def step_time(t: Traffic, cluster: Cluster, profile: Profile) -> tuple[float, float]:
    """(step seconds, communication seconds) of one step: ``max(F c, under the forward) +
    max((1 - F) c, under the backward) + in line x (1 - overlap)``; background calls (the
    outer sync with ``delay`` > 0) show only where they exceed the step they run beside."""
    sync, ahead, behind, bg = _comm_parts(t, cluster)
    fwd = profile.compute_s * FORWARD_SHARE
    step = max(fwd, ahead) + max(profile.compute_s - fwd, behind) + sync * (1.0 - profile.overlap)
    return step + max(0.0, bg - step), sync + ahead + behind + bg


def outer_times(mode: Mode, units: Sequence[UnitShape], cluster: Cluster, profile: Profile, *,
                param_bytes: int = 4, micro_steps: int = 1) -> tuple[float, float]:
    """(inner step seconds, seconds of one fragment's sync) of the hierarchical ``mode``: the
    step without the outer sync, and the sync's calls for one fragment on ``cluster``'s links
    (what :func:`zpp.tune.outer.period` turns into ``delay`` and H)."""
    if mode.outer is None:
        raise ValueError(f"outer_times: mode {mode.name!r} has no outer sync")
    every = dataclasses.replace(mode, outer=dataclasses.replace(mode.outer, sync_every=1, delay=1))
    t = traffic(every, units, cluster, param_bytes=param_bytes, micro_steps=micro_steps)
    inner = Traffic(tuple(c for c in t.calls if not c.background))
    sync = sum(call_time(c, cluster) for c in t.calls if c.background) / mode.outer.fragments
    return step_time(inner, cluster, profile)[0], sync


def compute_from_step(step_s: float, t: Traffic, cluster: Cluster) -> float:
    """The compute of a measured step whose calls are ``t``: :func:`step_time` solved for
    ``compute_s`` (it is continuous and nondecreasing in it; bisection); 0 when the
    communication alone explains the step."""
    def at(c: float) -> float:
        return step_time(t, cluster, Profile(c))[0]
    if at(0.0) >= step_s:
        return 0.0
    lo, hi = 0.0, max(step_s, 1e-9)
    while at(hi) < step_s:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < step_s else (lo, mid)
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi


def _zero_world(mode: Mode, cluster: Cluster) -> int:
    """The ranks a unit is sharded over: the node under the hierarchical mode, else the world."""
    return cluster.ranks_per_node if mode.outer is not None else cluster.world


def _largest_stepped(mode: Mode, units: Sequence[UnitShape], W: int) -> int:
    """Elements of the largest tensor the optimizer steps at once: one unit's master shard
    (the whole unit at stage 0)."""
    return max((u.shard(W) if mode.stage >= 1 else u.numel for u in units), default=0)


def gathered_ahead(mode: Mode, units: Sequence[UnitShape], world: int) -> int:
    """Stage 3: the most elements of full buffers started ahead of use at once in a step
    (the engine's ``PrefetchStats.peak_inflight_numel``), by the prefetcher's rule
    (:func:`zpp.zero.prefetch_depth.peak_ahead`) over a canonical pass: every gathered unit
    once in the forward in unit order, then once in the backward in reverse order. On
    tests/gpt.py's GPT (15 units, whose root unit the real pass gathers twice, first and last)
    it was within 3.1% of the measured peak at every bucket tried (13,216 against 13,632
    elements at 12,000; exact at 1, 2,000 and 5,000, 1.5% over with 5e7, the whole model
    ahead; tests/test_zero_prefetch.py). 0 without prefetch."""
    if mode.stage != 3 or not mode.prefetch:
        return 0
    from zpp.zero.prefetch_depth import Measured, peak_ahead

    def entries(phase: str, order) -> list[Measured]:
        return [Measured(i, units[i].shard(world) * world, 0.0, 0.0) for i in order
                if not units[i].persistent and phase in units[i].gathers]
    n = len(units)
    return peak_ahead(entries("forward", range(n)) + entries("backward", reversed(range(n))), mode.prefetch_bucket)


def memory(mode: Mode, units: Sequence[UnitShape], cluster: Cluster, *, param_bytes: int = 4,
           prefetch_units: int = 1, nvme_buffers: int = 0, live_numel: int | None = None,
           param_nvme_buffers: int = 0) -> dict[str, float]:
    """Model-state bytes per rank: at rest (between steps) and at the peak of a step.
    ``nvme_buffers``: the moments are on NVMe (``offload_optimizer.device: "nvme"``) and
    this many host buffers of one unit's moments stand for them; ``live_numel``: the
    gathered elements held at once at stage 3, where measured (else the biggest unit times
    ``1 + prefetch_units``, or what the prefetch bucket starts ahead where that is more:
    :func:`gathered_ahead`; the quantity perf/memory_bench.py measures as
    ``live_units_numel``, ``max(peak started ahead, 2 x the largest unit)``, on which the
    formula was checked: it leaves out the unit running beside what is started, which the
    measured rest absorbs); ``param_nvme_buffers``: stage 3's parameter shards and reduced
    gradients are on NVMe too (``offload_param.device: "nvme"``, [Note: parameters on NVMe]):
    this many host buffers of one unit's shard stand for them at rest, and in a step the
    shards of the units being gathered (``live_numel / W``) and one reduced gradient shard."""
    W, R = _zero_world(mode, cluster), cluster.ranks_per_node
    psi = sum(u.numel for u in units)
    shard = sum(u.shard(W) for u in units)
    biggest = max((u.shard(W) * W for u in units), default=0)
    if param_nvme_buffers and mode.stage != 3:
        raise ValueError(f"memory: param_nvme_buffers={param_nvme_buffers} needs stage 3 (offload_param), "
                         f"not {mode.name}")
    if mode.stage == 3:
        params = param_bytes * shard
        live_elems = (max(biggest * (1 + prefetch_units), gathered_ahead(mode, units, W)) if live_numel is None
                      else live_numel)
        live = param_bytes * live_elems
        secondary = param_bytes * shard * W // R if mode.hpz and R > 1 else 0
    else:
        params, live, secondary = param_bytes * psi, 0, 0
    optim = 8 * (shard if mode.stage >= 1 else psi)
    if nvme_buffers:  # each buffer holds one unit's two moments
        optim = nvme_buffers * 8 * _largest_stepped(mode, units, W)
    host = optim if mode.offload else 0
    optim -= host
    grads = 4 * (shard if mode.stage >= 2 else psi)
    unit_grad = 4 * biggest if mode.stage >= 2 else 0
    if param_nvme_buffers:  # the pool (shards and gradients pass through it), and what a step reads in
        u = _largest_stepped(mode, units, W)
        params = param_nvme_buffers * max(param_bytes, 4) * u
        live += param_bytes * -(-live_elems // W)  # a gathered unit's shard, until its gather is done
        grads = 4 * u  # one reduced gradient shard: being added up, or read ahead of its update
    if secondary and mode.weight_delta_bits is not None:
        # the node's copy stays between steps; a refresh holds its slice's differences in fp32
        # until they are added: every unit in flight
        params += secondary
        secondary = 0
        live += 4 * -(-live_elems // R)
    outer = 8 * -(-psi // R) if mode.outer is not None else 0
    if mode.onebit:  # fused fp32 copies of parameters and gradients, moments, two error buffers
        optim = 4 * psi * 5
    rest = params + optim + outer
    return {"rest": rest, "peak": rest + secondary + live + grads + unit_grad, "host": host, "grads": grads}


def resident_peak(mode: Mode, units: Sequence[UnitShape], cluster: Cluster, *, activations: float,
                  step_temporaries: float, nvme_buffers: int = 0, live_numel: int | None = None,
                  param_bytes: int = 4, param_nvme_buffers: int = 0, runtime: float = 0.0,
                  accumulating: bool = False) -> dict[str, float]:
    """A rank's peak resident bytes above what it held before the model (fp32 AdamW on the
    host; [Note: the resident peak]): the larger of the backward at its start (:func:`memory`'s
    peak plus one micro-batch's ``activations``, without the reduced gradient shards unless
    ``accumulating``: an earlier micro-step's are kept) and the optimizer step (the states at
    rest, the reduced gradients and torch's temporaries: ``step_temporaries`` bytes per fp32
    element of the largest tensor stepped, one unit's master, as zpp steps unit by unit in
    memory and on NVMe alike), both plus ``runtime``, what a rank holds beside its model once
    it has stepped (the allocator's heap, threads, communicators; measured on a small model)."""
    m = memory(mode, units, cluster, param_bytes=param_bytes, nvme_buffers=nvme_buffers, live_numel=live_numel,
               param_nvme_buffers=param_nvme_buffers)
    stepped = _largest_stepped(mode, units, _zero_world(mode, cluster))
    # at the backward's start the reduced shards are not there yet (the last step dropped them);
    # with the parameters on NVMe the one shard in memory is counted (it is not the step's)
    held = m["grads"] if accumulating or param_nvme_buffers else 0
    backward = m["peak"] - m["grads"] + held + activations + runtime
    step = m["rest"] + m["grads"] + step_temporaries * 4 * stepped + runtime
    if param_nvme_buffers:  # the unit stepping: its shard read in beside its gradient
        step += param_bytes * stepped
    return {"states": m["rest"] + m["grads"], "backward": backward, "step": step, "peak": max(backward, step)}


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    mode: str
    step_s: float
    comm_s: float
    inter_bytes: float
    intra_bytes: float
    node_link_bytes: float
    state_rest: float
    state_peak: float
    peak_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict(modes: Iterable[Mode], *, units: Sequence[UnitShape], cluster: Cluster, profile: Profile
            | Mapping[str, Profile], param_bytes: int = 4, micro_steps: int = 1) -> list[Prediction]:
    """One :class:`Prediction` per mode and optimizer step of ``micro_steps`` backward passes;
    ``profile`` may differ per mode (a measured profile includes each mode's own quantization
    work)."""
    out = []
    for m in modes:
        prof = profile[m.name] if isinstance(profile, Mapping) else profile
        t = traffic(m, units, cluster, param_bytes=param_bytes, micro_steps=micro_steps)
        step, comm = step_time(t, cluster, prof)
        mem = memory(m, units, cluster, param_bytes=param_bytes)
        out.append(Prediction(m.name, step, comm, t.inter_bytes, t.intra_bytes, t.node_link_bytes,
                              mem["rest"], mem["peak"], mem["peak"] + prof.other_bytes))
    return out


def format_predictions(rows: Sequence[Prediction], cluster: Cluster) -> str:
    """A table; "fastest" among the modes that keep the optimizer (see :attr:`Mode.same_optimizer`)."""
    head = (f"# {cluster.nodes} nodes x {cluster.ranks_per_node} ranks, intra {cluster.intra.name}, "
            f"inter {cluster.inter.name}\n"
            f"{'mode':<14}{'step_s':>10}{'comm_s':>10}{'inter_MB':>10}{'intra_MB':>10}{'link_MB':>10}"
            f"{'state_GB':>10}{'peak_GB':>9}")
    lines = [head]
    same = [r.step_s for r in rows if MODES[r.mode].same_optimizer] if all(r.mode in MODES for r in rows) else []
    best = min(same) if same else math.nan
    for r in rows:
        lines.append(f"{r.mode:<14}{r.step_s:>10.4g}{r.comm_s:>10.4g}{r.inter_bytes / 1e6:>10.2f}"
                     f"{r.intra_bytes / 1e6:>10.2f}{r.node_link_bytes / 1e6:>10.2f}{r.state_rest / 1e9:>10.3f}"
                     f"{r.peak_bytes / 1e9:>9.3f}{'  <- fastest' if r.step_s == best else ''}")
    lines.append("# onebit-adam and outer-* change what a step learns: compare them by time to a target loss")
    return "\n".join(lines)
