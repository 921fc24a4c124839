"""The full model ``state_dict`` gathered from the shards, on every rank."""
from __future__ import annotations

import collections

import torch


def consolidated_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full model ``state_dict`` (every key, tied names included), on every rank.
    Collective with sharded parameters (gathers one unit at a time, exact)."""
    from zpp.zero.comm_api import Phase

    keys = list(engine.module.state_dict(keep_vars=True).keys())
    names: dict[int, list[str]] = collections.defaultdict(list)
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names[id(p)].append(n)
    out: dict[str, torch.Tensor] = {}
    for u in engine.units:
        was = u.gathered
        u.gather(Phase.EXACT)  # full precision, from the primary shards
        for p in u.params:
            for n in names[id(p)]:
                out[n] = p.detach().clone()
        if not was:
            u.release()
    for n, b in engine.module.named_buffers(remove_duplicate=False):
        out[n] = b.detach().clone()
    return {k: out[k] for k in keys if k in out}
