"""hpZ: a secondary copy of the gathered weights inside the node.

Wraps the gather over the world (plain or qwZ). After a world gather, each rank keeps the
``1/k`` slice of the full buffer that its local rank owns among the ``k`` ranks of its node
(the *secondary shard*); until the weights change (the optimizer step, a skipped step, a
checkpoint load: :meth:`SecondaryGather.weights_changed`), gathers are all-gathers of the
secondary shards over the node (``topology.intra``) and cross no node link. The secondary
holds exactly the weights the world gather produced (quantized ones under qwZ; refreshed by
quantized differences under :mod:`~zpp.zero.gather.delta`), so forward and backward of a
micro-step see the same weights. Extra memory: ``numel / k`` elements per unit.

[Note: the secondary shard belongs to hpZ]
The secondary shards are this strategy's state, held in one :class:`Secondaries` per
engine, which the forward and the backward gathers share (the forward gather leaves the
slice, the backward one reads it). Nothing else reads or invalidates them: the engine and
the units say only that the weights changed (``UnitComms.weights_changed``), which every
gather hears.

[Note: which entries a secondary shard holds]
Two layouts, chosen once per store. Contiguous (plain hpZ): local rank ``l`` holds the
``l``-th of ``k`` equal ranges of the full buffer, and the node's all-gather of the slices
is the full buffer as it lands. Counterparts (the delta refresh's, ``counterparts=True``):
local rank ``l`` holds the primary shards of its counterparts, the ranks ``m * k + l`` with
its local rank on every node ``m`` (node order), which is exactly what the first hop of a
two-hop gather brings it over ``topology.inter``; so a change of the weights reaches every
copy of an entry by that hop alone, and every rank's own primary range is a piece of its own
slice. The node gathers such slices in one all-gather per node's row of the buffer (row
``m``: node ``m``'s shards in local-rank order), each into its place. Both layouts hold
``numel / k`` entries; with one node they are the same.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from zpp.comm.transport import Work, agreed, dtype_code
from zpp.zero.comm_api import Comms, WeightGather

if TYPE_CHECKING:
    from zpp.comm.topology import Topology
    from zpp.zero.shard import FlatShard
    from zpp.zero.unit import Unit


_ROWS_TAG = 0x48525A  # "HRZ": the node gather of counterpart slices, told apart from other check_agree calls


class SecondaryState(enum.Enum):
    """hpZ's secondary shard of a unit (a ``1/k`` slice of the full buffer, ``k`` = ranks per node)."""

    ABSENT = "absent"
    """Not held: the next gather goes over the world."""
    VALID = "valid"
    """Holds the weights of the last world gather; gathers stay inside the node until the
    weights change."""
    STALE = "stale"
    """Holds the weights as they were before they changed; only a gather that refreshes it
    from what changed (:class:`~zpp.zero.gather.delta.DeltaSecondaryGather`) keeps stale
    shards, the others drop them."""


class Secondaries:
    """The secondary shards of an engine's units (see [Note: the secondary shard belongs to hpZ])."""

    def __init__(self, topology: Topology, *, counterparts: bool = False) -> None:
        self.topology = topology
        #: the slice's layout (see [Note: which entries a secondary shard holds])
        self.counterparts = counterparts and topology.nodes > 1
        self._held: dict[int, tuple[FlatShard, torch.Tensor]] = {}  # id(flat) -> (flat, its slice)
        self._stale: set[int] = set()  # ids of held slices whose weights changed since
        self._changes_all = 0  # changes of every unit's weights
        self._changes: dict[int, int] = {}  # id(flat) -> changes of that unit's alone

    def generation(self, flat: FlatShard) -> int:
        """How often ``flat``'s weights changed: a gather that started at one generation and
        ends at another delivered weights that are out of date."""
        return self._changes_all + self._changes.get(id(flat), 0)

    def _changed(self, flat: FlatShard | None) -> None:
        if flat is None:
            self._changes_all += 1
        else:
            self._changes[id(flat)] = self._changes.get(id(flat), 0) + 1

    def get(self, flat: FlatShard) -> torch.Tensor | None:
        """The valid secondary slice of ``flat``, or None (absent or stale)."""
        held = self._held.get(id(flat))
        return None if held is None or id(flat) in self._stale else held[1]

    def held(self, flat: FlatShard) -> torch.Tensor | None:
        """The secondary slice of ``flat`` whether valid or stale, or None."""
        held = self._held.get(id(flat))
        return None if held is None else held[1]

    def state(self, flat: FlatShard) -> SecondaryState:
        if id(flat) not in self._held:
            return SecondaryState.ABSENT
        return SecondaryState.STALE if id(flat) in self._stale else SecondaryState.VALID

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's secondary entries of ``full`` (a view; strided with ``counterparts``)."""
        t = self.topology
        if self.counterparts:  # full as (node, local rank, shard): ranks are node-major
            return full.view(t.nodes, t.ranks_per_node, -1)[:, t.local_rank]
        return full.view(t.ranks_per_node, -1)[t.local_rank]

    def own(self, secondary: torch.Tensor) -> torch.Tensor:
        """This rank's primary shard's entries in its secondary slice (a view; ``counterparts``
        layout only: there every rank's secondary holds its own primary range)."""
        if not self.counterparts and self.topology.nodes > 1:
            raise RuntimeError("Secondaries.own: the contiguous layout holds other ranks' primary ranges")
        return secondary.view(self.topology.nodes, -1)[self.topology.node]

    def keep(self, flat: FlatShard, full: torch.Tensor) -> None:
        """Keep this rank's slice of a world-gathered ``full`` (valid)."""
        held = self.slice_of(full).clone(memory_format=torch.contiguous_format).view(-1)
        self._held[id(flat)] = (flat, held)
        self._stale.discard(id(flat))

    def gather_async(self, full: torch.Tensor, secondary: torch.Tensor) -> Work:
        """The node's all-gather of the secondary slices into ``full``, in rank order."""
        intra = self.topology.intra
        if not self.counterparts:
            return intra.all_gather_async(full, secondary)
        # one all-gather per node's row of the buffer: row m holds the shards of node m's
        # ranks in local-rank order, so each lands in place (no staging buffer, no reordering)
        nodes = self.topology.nodes
        rows, parts = full.view(nodes, -1), secondary.view(nodes, -1)
        # one round trip for the rows' checks (see [Note: agreed calls] in zpp.comm.transport)
        intra.check_agree("hpz_gather", (_ROWS_TAG, nodes, secondary.numel(), dtype_code(secondary.dtype)),
                          ("call", "rows", "slice numel", "dtype#"))
        with agreed():
            works = [intra.all_gather_async(rows[m], parts[m]) for m in range(nodes)]

        def finish() -> None:
            for work in works:
                work.wait()
        return Work("hpz_gather", finish, asynchronous=any(w.asynchronous for w in works))

    def refreshed(self, flat: FlatShard) -> None:
        """A stale slice was brought up to the current weights in place: valid again."""
        self._stale.discard(id(flat))

    def mark_stale(self, flat: FlatShard | None = None) -> None:
        """The weights of ``flat`` (None: every unit) changed; keep the slices, stale."""
        self._changed(flat)
        self._stale.update(self._held if flat is None else [id(flat)] if id(flat) in self._held else [])

    # ------------------------------------------------------------------ checkpoints
    def where(self) -> dict[str, Any]:
        """Where this rank's slices sit: a copy saved elsewhere holds other entries. In the
        counterparts layout the ranks with one local rank hold the same entries on every
        node, bit for bit (see [Note: the delta refresh]): the local rank says which."""
        t = self.topology
        return {"layout": "counterparts" if self.counterparts else "contiguous", "world_size": t.world_size,
                "nodes": t.nodes, "ranks_per_node": t.ranks_per_node, "slot": self.saved_by()}

    def saved_by(self) -> int:
        """The rank of this store's world whose saved slices this rank holds again: in the
        counterparts layout its counterpart on the first node (the others hold the same
        slices and do not write them), else itself."""
        return self.topology.local_rank if self.counterparts else self.topology.rank

    def state_dict(self, units: Sequence[Unit]) -> dict[str, Any]:
        """This rank's slices of ``units`` (each with its parameter names and whether it is
        stale) and :meth:`where` they sit; see [Note: the copies in checkpoints] in
        :mod:`~zpp.zero.gather.delta`. The slices themselves, not copies of them."""
        held = {}
        for u in units:
            slot = self._held.get(id(u.flat))
            if slot is not None:
                held[u.index] = {"names": list(u.names), "copy": slot[1], "stale": id(u.flat) in self._stale}
        return {**self.where(), "units": held}

    def plan(self, state: dict[str, Any] | None, units: Sequence[Unit],
             loaded: Callable[[Unit], bool]) -> tuple[dict[int, dict[str, Any]], str | None]:
        """What :meth:`restore` would set from a saved :meth:`state_dict` (nothing changes):
        the saved slices by unit index, and why none or only some can be used (None: all).
        A unit's slice is used when it sits where it sat, its unit has the same parameter
        names and padded size, and ``loaded(unit)`` (its weights came from the same
        checkpoint)."""
        if state is None:
            return {}, "the checkpoint holds no copies (saved without weight deltas, or by an older zpp)"
        here = self.where()
        moved = [f"{k} {state.get(k)!r} -> {v!r}" for k, v in here.items() if state.get(k) != v]
        if moved:
            return {}, "the copies sat elsewhere (" + ", ".join(moved) + ")"
        saved = state["units"]
        width = self.topology.ranks_per_node
        use = {}
        for u in units:
            s = saved.get(u.index)
            if (s is not None and s["names"] == list(u.names) and loaded(u)
                    and s["copy"].numel() * width == u.layout.padded_numel and s["copy"].dtype == u.flat.dtype):
                use[u.index] = s
        skipped = len(saved) - len(use)
        return use, (f"{skipped} of the {len(saved)} saved copies do not fit this model's units" if skipped else None)

    def restore(self, use: dict[int, dict[str, Any]], units: Sequence[Unit]) -> None:
        """Hold the slices :meth:`plan` chose, in their saved state (after the units' weights
        were loaded, which dropped what was held)."""
        for u in units:
            s = use.get(u.index)
            if s is None:
                continue
            copy = torch.empty(s["copy"].numel(), dtype=u.flat.dtype, device=u.flat.device)
            copy.copy_(s["copy"])
            self._held[id(u.flat)] = (u.flat, copy)
            if s["stale"]:
                self._stale.add(id(u.flat))
            else:
                self._stale.discard(id(u.flat))

    def drop(self, flat: FlatShard | None = None) -> None:
        """Drop ``flat``'s secondary shard (None: every unit's)."""
        self._changed(flat)
        if flat is None:
            self._held.clear()
            self._stale.clear()
        else:
            self._held.pop(id(flat), None)
            self._stale.discard(id(flat))


class SecondaryGather(WeightGather):
    """The intra-node gather of the secondary shards when they are valid, else ``inner``
    (which then leaves this rank's secondary slice behind). ``secondaries``: the store
    shared with the engine's other hpZ gather (Default: a new one)."""

    name = "hpz"
    needs = frozenset({"topology"})

    def __init__(self, comms: Comms, inner: WeightGather, secondaries: Secondaries | None = None) -> None:
        if comms.topology is None:
            raise ValueError("SecondaryGather: hpZ needs the topology of the world")
        h, world_size, k = comms.config.zero.hpz_partition_size, comms.world.world_size, comms.topology.ranks_per_node
        if h > 1 and (world_size % h or h != k):
            raise ValueError(
                f"zero_hpz_partition_size={h} must divide world_size={world_size} and equal the ranks per node "
                f"({k}); the ranks per node come from ZPP_RANKS_PER_NODE, else the launcher's LOCAL_WORLD_SIZE, "
                "else the MPI shared-memory split")
        self.topology = comms.topology
        self.inner = inner
        self.secondaries = secondaries if secondaries is not None else Secondaries(comms.topology)
        self._world: dict[int, int] = {}  # id(flat) -> generation at the start of its world gather

    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        secondary = self.secondaries.get(flat)
        if secondary is not None:
            return self.secondaries.gather_async(full, secondary)
        self._world[id(flat)] = self.secondaries.generation(flat)
        return self.inner.start(flat, full)

    def finish(self, flat: FlatShard, full: torch.Tensor) -> None:
        started = self._world.pop(id(flat), None)
        if started is None:
            return  # gathered from the secondary shards
        self.inner.finish(flat, full)
        self.secondaries.keep(flat, full)
        if self.secondaries.generation(flat) != started:  # the weights changed while it was on its way
            self.outdated(flat)

    def outdated(self, flat: FlatShard) -> None:
        """The slice just kept holds weights that changed since its gather started: drop it."""
        self.secondaries.drop(flat)

    def kept(self, flat: FlatShard) -> list[torch.Tensor]:
        secondary = self.secondaries.get(flat)
        return [] if secondary is None else [secondary]

    def weights_changed(self, flat: FlatShard | None = None, *, replaced: bool = False) -> None:
        self.secondaries.drop(flat)
        self.inner.weights_changed(flat, replaced=replaced)

    def __repr__(self) -> str:
        return f"SecondaryGather({self.inner!r}, k={self.topology.ranks_per_node})"
