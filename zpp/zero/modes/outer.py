"""The hierarchical mode (``zpp.outer``) as a mode: ZeRO inside each node, the outer sync
across nodes after every inner step (see [Note: hierarchical mode] in
:mod:`zpp.zero.outer.sync`, where :class:`~zpp.zero.outer.OuterSync` does the work).

The mode narrows the engine's data-parallel world to the node before any unit exists, calls
the sync after every applied step and for every skipped one (see [Note: skipped steps and
the outer schedule]: a skipped step that lands a sync publishes the masters it moved), and
joins checkpoints with both per-element state (the anchor and momentum of each unit's shard,
``outer.anchor`` / ``outer.momentum``) and per-rank state (``outer_rankR.pt``: schedule
position, pending syncs, error feedback); see [Note: outer state in checkpoints].
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero.config import TrainConfig
from zpp.zero.modes.base import Mode
from zpp.zero.outer import OuterSync, build_outer, node_world
from zpp.zero.unit import Unit


class OuterMode(Mode):
    """The engine's :class:`OuterSync` (``engine.outer``) in the step and checkpoints."""

    name = "outer"
    per_rank_file = "outer"

    def __init__(self, sync: OuterSync) -> None:
        self.sync = sync

    @classmethod
    def data_parallel_world(cls, world: Transport, config: TrainConfig) -> Transport:
        return node_world(world, config)

    @classmethod
    def build(cls, engine) -> OuterMode | None:
        sync = build_outer(engine)
        return None if sync is None else cls(sync)

    def after_optimizer_step(self, trained: Sequence[Unit]) -> None:
        self.sync.after_inner_step()  # an applied inner step: a sync may land or start

    def on_skipped_step(self, trained: Sequence[Unit]) -> str | None:
        if self.sync.after_inner_step():  # see [Note: skipped steps and the outer schedule]
            for u in trained:
                u.publish()
        return None

    def close(self) -> None:
        self.sync.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return self.sync.state_dict()

    def load_state_dict(self, state: Any, *, own: bool) -> None:
        self.sync.load_state_dict(state, own=own)

    def unit_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        return self.sync.unit_state(unit)

    def load_unit_state(self, unit: Unit, state: dict[str, torch.Tensor] | None) -> None:
        self.sync.load_unit_state(unit, state)

    def state_bytes(self, nbytes) -> dict[str, int]:
        return {"outer": self.sync.state_bytes()}
