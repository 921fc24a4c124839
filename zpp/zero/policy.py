"""What the engine shards, as one frozen policy derived once from the config.

ZeRO's stages are points on a few independent axes; the engine asks the axis, never the
stage number (as FSDP2 asks ``reshard_after_forward`` and its mesh):

=====  ======================  ===============  ================  =====================
stage  shard_optimizer_state   shard_gradients  shard_parameters  reshard_after_forward
=====  ======================  ===============  ================  =====================
0      no                      no               no                (no parameters to drop)
1      yes                     no               no                (no parameters to drop)
2      yes                     yes              no                (no parameters to drop)
3      yes                     yes              yes               ``zpp.reshard_after_forward``
=====  ======================  ===============  ================  =====================

Derived once here: :attr:`ShardingPolicy.reduce_each_micro_step` (gradients leave the
parameters at every backward instead of at the accumulation boundary) and
:attr:`ShardingPolicy.gather_after_step` (stages 1-2 all-gather the updated shards into the
persistent full buffer). Which collective does each job (plain, qwZ, hpZ, qgZ) is not the
policy's business: see :mod:`zpp.zero.gather` and :mod:`zpp.zero.reduce`.
"""
from __future__ import annotations

import dataclasses

from zpp.zero.config import TrainConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardingPolicy:
    """Which model states are partitioned over the data-parallel ranks."""

    shard_optimizer_state: bool = False
    """Each rank keeps fp32 masters and optimizer state for its ``1/W`` range only
    (ZeRO stage >= 1) (Default: False)."""
    shard_gradients: bool = False
    """Gradients are reduce-scattered at every backward and only the owned range is kept
    (ZeRO stage >= 2) (Default: False)."""
    shard_parameters: bool = False
    """Between uses a rank holds only its parameter shard; modules gather their units
    before forward and backward (ZeRO stage 3) (Default: False)."""
    reshard_after_forward: bool = True
    """With sharded parameters: drop the gathered parameters after each module's forward
    and gather again for its backward (ZeRO-3's traffic), or keep them from forward to the
    end of backward (one gather per pass: a full unit stays alive meanwhile). Meaningless
    without ``shard_parameters`` (Default: True)."""
    secondary_degree: int = 1
    """hpZ: ranks over which a secondary copy of the gathered weights is kept (the ranks of
    one node), so that later gathers before the next optimizer step stay inside the node;
    1: off (Default: 1)."""

    def __post_init__(self) -> None:
        if self.shard_gradients and not self.shard_optimizer_state:
            raise ValueError("ShardingPolicy: shard_gradients=True needs shard_optimizer_state=True")
        if self.shard_parameters and not self.shard_gradients:
            raise ValueError("ShardingPolicy: shard_parameters=True needs shard_gradients=True")
        d = self.secondary_degree
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"ShardingPolicy: secondary_degree={d!r} must be a positive integer")
        if d > 1 and not self.shard_parameters:
            raise ValueError(f"ShardingPolicy: secondary_degree={d} needs shard_parameters=True")

    @classmethod
    def from_config(cls, config: TrainConfig) -> ShardingPolicy:
        """The policy of a ZeRO stage and its switches."""
        stage = config.zero.stage
        return cls(shard_optimizer_state=stage >= 1, shard_gradients=stage >= 2, shard_parameters=stage == 3,
                   reshard_after_forward=config.zpp.reshard_after_forward,
                   secondary_degree=config.zero.hpz_partition_size if stage == 3 else 1)

    def degree(self, world_size: int) -> int:
        """Number of shards each unit's flat buffer is cut into."""
        return world_size if self.shard_optimizer_state else 1

    @property
    def reduce_each_micro_step(self) -> bool:
        """Gradients are reduced as they arrive, at every backward (stages 2-3); otherwise
        they accumulate in ``.grad`` and are reduced once per optimizer step (stages 0-1;
        see [Note: stage 1 bytes] in :mod:`zpp.zero.unit`)."""
        return self.shard_gradients

    @property
    def gather_after_step(self) -> bool:
        """The updated shards are all-gathered into the persistent full parameters after
        each optimizer step (stages 1-2)."""
        return self.shard_optimizer_state and not self.shard_parameters
