"""The full model ``state_dict`` gathered from the shards, on every rank."""
from __future__ import annotations

import collections

import torch


def consolidated_state_dict(engine, *, exclude_frozen: bool = False, shared: bool = False,
                            device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """The full model ``state_dict`` (every key, tied names included), on every rank.
    Collective with sharded parameters (gathers one unit at a time, exact).

    ``exclude_frozen`` leaves out parameters that do not require grad; ``shared`` gives tied
    names one tensor (as ``nn.Module.state_dict``), else each its own copy; ``device``
    moves the copies there (Default: where the parameters are)."""
    from zpp.zero.comm_api import Phase

    keys = list(engine.module.state_dict(keep_vars=True).keys())
    names: dict[int, list[str]] = collections.defaultdict(list)
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        if not (exclude_frozen and not p.requires_grad):
            names[id(p)].append(n)

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device, copy=True) if device is not None else t.detach().clone()

    out: dict[str, torch.Tensor] = {}
    for u in engine.units:
        was = u.gathered
        u.gather(Phase.EXACT)  # full precision, from the primary shards
        for p in u.params:
            first = None
            for n in names[id(p)]:
                out[n] = first if shared and first is not None else copy(p)
                first = out[n]
        if not was:
            u.release()
    for n, b in engine.module.named_buffers(remove_duplicate=False):
        out[n] = copy(b)
    return {k: out[k] for k in keys if k in out}
