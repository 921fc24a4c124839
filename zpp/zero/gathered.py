"""``GatheredParameters``: full parameters outside forward, and modifications that stick.

    with zpp.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        if engine.global_rank == 0:
            model.embed.weight[pad_id].zero_()   # rank 0's change reaches every rank

As DeepSpeed's ``deepspeed.zero.GatheredParameters``. Collective: every rank enters and
leaves the block with the same parameters.

* Entering gathers the units holding ``params`` (:attr:`Phase.EXACT`: full precision from
  the primary shards) and pins them: no hook releases them inside the block. Parameters no
  zpp engine holds, and units that are never sharded (stages 0-2), need nothing.
* Leaving with ``modifier_rank=r``: rank ``r``'s values of the units' full buffers are
  broadcast to every rank and become the parameters everywhere: the owned range of the fp32
  master weights (only where the parameter changed, so bf16/fp16 parameters keep the
  master's extra bits elsewhere), the shard, and at stages 0-2 the full buffer. hpZ's
  secondary copy is dropped. Then the units are unpinned and released.
* Leaving with ``modifier_rank=None`` drops any modification (as DeepSpeed's at stage 3;
  at stages 0-2, where the parameters are the persistent full buffer and DeepSpeed's block
  does nothing, zpp restores the buffer as it was on entering, so a stray write never
  leaves ranks out of step).

Parameters created under :class:`zpp.zero.Init` and not yet given to an engine are
gathered and re-partitioned the same way (see :mod:`zpp.zero.init`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from zpp.zero import access
from zpp.zero.comm_api import Phase
from zpp.zero.unit import Unit


class GatheredParameters:
    """Gather ``params`` for the block; see the module docstring.

    Args:
        params: a parameter, or an iterable of them (others than zpp's pass through).
        modifier_rank: the rank whose changes inside the block are kept on every rank, or
            None (read only).
        fwd_module: accepted for DeepSpeed's signature (zpp's hooks need no registration).
        enabled: False makes the block a no-op.
    """

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None,
                 modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        del fwd_module
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[Unit] = []
        self._loose: list = []  # zpp.zero.Init parameters not yet in an engine
        self._saved: dict[int, torch.Tensor] = {}  # unit index -> full buffer on entry (stages 0-2)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        from zpp.zero import init as zinit

        seen: set[int] = set()
        for p in self.params:
            owner = access.owner_of(p)
            if isinstance(owner, zinit.InitOwner):
                self._loose.append(p)
                continue
            unit = getattr(owner, "unit_of", {}).get(id(p))
            if unit is None or id(unit) in seen:
                continue
            seen.add(id(unit))
            self._units.append(unit)
        self._units.sort(key=lambda u: u.index)  # the same order on every rank
        for u in self._units:
            _check_rank(self.modifier_rank, u.comms.world.world_size)
            if not u.shards_params and self.modifier_rank is None:
                self._saved[u.index] = u.flat.full.clone()
            u.gather(Phase.EXACT)
            u.pinned += 1
        for p in self._loose:
            zinit.gather_loose(p)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        from zpp.zero import init as zinit

        failed = exc[0] is not None
        try:
            if self.modifier_rank is not None and not failed:
                for u in self._units:
                    _keep_changes(u, self.modifier_rank)
            for u in self._units:
                saved = self._saved.pop(u.index, None)
                if saved is not None:
                    u.flat.full.copy_(saved)
        finally:
            for u in self._units:
                u.pinned -= 1
                u.release()
            for p in self._loose:
                zinit.repartition_loose(p, None if failed else self.modifier_rank)


def _check_rank(rank: int | None, world_size: int) -> None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"GatheredParameters: modifier_rank={rank!r} must be a rank in [0, {world_size}) or None")


def _keep_changes(u: Unit, rank: int) -> None:
    """Rank ``rank``'s full buffer becomes the unit's weights on every rank."""
    f, lay = u.flat, u.layout
    world = u.comms.world
    if world.world_size > 1:
        world.broadcast(f.full, rank)
    full = f.full[:lay.numel]
    with u.resident(modified=True):
        _keep(u, full)


def _keep(u: Unit, full: torch.Tensor) -> None:
    f, lay = u.flat, u.layout
    if f.master is not None:
        own = lay.owned(f.rank)
        padded = torch.zeros(lay.padded_numel, dtype=torch.float32, device=full.device)
        padded[:lay.numel] = full.float()
        new = padded[own]
        if f.dtype != torch.float32:  # keep the master's extra bits where the parameter did not change
            new = torch.where(f.master.detach().to(f.dtype).float() == new, f.master.detach(), new)
        u.load_flat(padded[:lay.numel], master=new)
    else:
        u.load_flat(full.float())
