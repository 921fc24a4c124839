"""hpZ refreshed by quantized weight deltas: what crosses the node link after a step is the
change of the weights, not the weights (``zpp.weight_delta_bits``).

Plain hpZ (:mod:`~zpp.zero.gather.hpz`) drops the node's secondary copy at every optimizer
step, and the next forward gathers every unit over the world again (qwZ: int8 codes of the
weights). But one step moves the weights little (AdamW: about ``lr`` per entry), so here the
copy is kept and refreshed: each rank sends ``Q(w - c)``, the block-quantized difference
between its updated shard ``w`` and the copy ``c`` of that shard every rank holds, and every
rank adds ``dequantize(Q(w - c))`` to its copies. The residual is not lost: the next
difference starts from the copy, so the copy's error after any number of steps is the
quantization error of one difference (error feedback): in fp32 about half that of int8
codes of the weights themselves (tests/test_zero_weight_delta.py: 0.47-0.59x at lr 3e-3;
in bf16 the copy's own rounding bounds both), for half their bytes.

[Note: the delta refresh]
The copies are held in the counterparts layout ([Note: which entries a secondary shard
holds]): local rank ``l`` of every node holds the primary shards of the ranks with local
rank ``l``, its own among them, so the copy of an entry is held by exactly one rank per
node, and those ranks are one ``topology.inter`` group. At a refresh every rank quantizes
``compute_shard - own`` (``own``: its primary range in its slice, as every copy holds it)
and all-gathers the codes over its inter-node group only; each rank dequantizes the
``nodes`` differences it receives, adds them to its slice with one fp32 addition and cast
(every copy of an entry sees the same old value and the same difference: the copies agree
bit for bit), and the node's all-gather of the updated slices fills the full buffer. So the
node link carries the int4 differences once, as the first hop of a two-hop gather would,
nothing quantized crosses inside the node, and each rank dequantizes and adds ``numel / k``
entries, not ``numel``. The hops run one after the other: the node's gather waits for the
additions. A unit's first gather, and the first after its weights were replaced from outside
training (a checkpoint load, ``GatheredParameters``), goes over the world through the wrapped
gather (qwZ or plain) and starts the copies from what it delivered.

Memory: the secondary slice stays between steps (``numel / k`` elements per unit, in the
parameters' dtype), where plain hpZ frees it at the step; a refresh in flight holds its
slice's differences in fp32 (``numel / k`` elements) until it is waited. Forward and backward
of a step see the same weights (the refreshed copy).

A refresh that completes after the weights changed again (a gather started before a step
and waited after it) leaves the copy marked out of date, so the next gather refreshes it
once more.

[Note: the copies in checkpoints]
A copy is not the weights (it trails them by one quantization error) and no rank can
rebuild it from the weights alone, so ``save_checkpoint`` writes the slices, with whether
each is out of date: each rank of the first node to a file of its own
(``hpz_copies_rankNNNNN.pt``, checksummed with the rest); the other nodes hold the same
slices bit for bit and read their counterpart's. ``load_checkpoint`` holds them again after
the weights are loaded: the resumed run's forward weights, losses and updates are those of
the uninterrupted run, bit for bit (tests/test_zero_weight_delta.py). Disk: one copy of the
weights in their dtype (``numel / k`` elements per unit and rank of the first node). A slice
is used only where it sits where it was saved (the same world size, nodes and ranks per
node, layout and local rank), its unit has the same parameter names and padded size, and
its weights came from the same checkpoint; the ranks agree on that before any is used (one
rank's world gather beside another's node gather would not be one collective). Where they cannot be used (another world, another model's
units, a checkpoint saved without deltas), the units start again from a world gather, as
every unit's first gather does, and rank 0 logs how many and why.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zpp.comm.collectives import quantized_all_gather_async
from zpp.comm.transport import Work
from zpp.zero.comm_api import Comms, WeightGather
from zpp.zero.gather.hpz import Secondaries, SecondaryGather, SecondaryState

if TYPE_CHECKING:
    from zpp.zero.shard import FlatShard


class DeltaSecondaryGather(SecondaryGather):
    """hpZ whose secondary copies survive the optimizer step and are refreshed by quantized
    differences (see [Note: the delta refresh]); ``inner`` fills a unit's copies the first
    time. ``secondaries``: the store shared with the engine's other delta gather, in the
    counterparts layout (Default: a new one). ``bits``: the code width of the differences
    (``zpp.weight_delta_bits``); ``group_size``: entries per fp32 scale
    (``zpp.weight_group_size``, capped at the shard)."""

    name = "hpz-delta"

    def __init__(self, comms: Comms, inner: WeightGather, secondaries: Secondaries | None = None) -> None:
        if secondaries is None and comms.topology is not None:
            secondaries = Secondaries(comms.topology, counterparts=True)
        super().__init__(comms, inner, secondaries)
        if self.topology.nodes > 1 and not self.secondaries.counterparts:
            raise ValueError("DeltaSecondaryGather: its secondary shards must be held in the counterparts layout "
                             "(Secondaries(topology, counterparts=True))")
        self.bits = comms.config.zpp.weight_delta_bits
        if self.bits is None:
            raise ValueError("DeltaSecondaryGather: zpp.weight_delta_bits is not set")
        self.group_size = comms.config.zpp.weight_group_size
        #: refreshes by differences and world gathers that (re)started the copies
        self.refreshes = 0
        self.world_gathers = 0

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        state = self.secondaries.state(flat)
        if state is not SecondaryState.STALE:
            if state is SecondaryState.ABSENT:
                self.world_gathers += 1
            return super().start(flat, full)
        secondary = self.secondaries.held(flat)
        own = self.secondaries.own(secondary)
        generation = self.secondaries.generation(flat)
        shard = flat.compute_shard()
        deltas = torch.empty(secondary.numel(), dtype=torch.float32, device=shard.device)
        work = quantized_all_gather_async(deltas, shard.float() - own.float(), transport=self.topology.inter,
                                          bits=self.bits, group_size=self.group_size)
        self.refreshes += 1

        def refresh() -> None:
            # applied when the work is waited, even by a unit that then throws the gather away
            # (Unit.drop_started): every rank's copies move together
            work.wait()
            # one fp32 addition and cast for every copy of an entry: the copies agree bit for bit
            if secondary.dtype == torch.float32:
                secondary.add_(deltas)
            else:  # the same fp32 sum (addition commutes), in the differences' buffer
                secondary.copy_(deltas.add_(secondary))
            if self.secondaries.generation(flat) == generation:  # else the weights changed since: still stale
                self.secondaries.refreshed(flat)
            self.secondaries.gather_async(full, secondary).wait()
        return Work("hpz_delta_gather", refresh, asynchronous=work.asynchronous)

    def outdated(self, flat: FlatShard) -> None:
        self.secondaries.mark_stale(flat)  # (kept: the next gather refreshes it from what it holds)

    def resumable(self) -> Secondaries:
        return self.secondaries

    def kept(self, flat: FlatShard) -> list[torch.Tensor]:
        held = self.secondaries.held(flat)
        return [] if held is None else [held]

    def weights_changed(self, flat: FlatShard | None = None, *, replaced: bool = False) -> None:
        if replaced:
            self.secondaries.drop(flat)
        else:
            self.secondaries.mark_stale(flat)
        self.inner.weights_changed(flat, replaced=replaced)

    def __repr__(self) -> str:
        return (f"DeltaSecondaryGather({self.inner!r}, k={self.topology.ranks_per_node}, bits={self.bits}, "
                f"group_size={self.group_size})")
