"""Unit planning: which parameters are communicated together, and which modules need which units.

[Note: stage 3 units]
With sharded parameters a unit is made at a module when the parameters of its subtree not
yet in a unit reach ``zpp.unit_min_numel`` (Default 0: every module that holds parameters is
a unit), and at the root for whatever is left, in post-order; a tied parameter belongs to
the first module that names it. A module's hooks gather the units it created plus the units
of its direct parameters; gathers are reference-counted, so a child inside its ancestor's
unit costs nothing.

[Note: buckets]
Without sharded parameters (stages 0-2) the parameters are cut, in model order, into
buckets of at most ``min(reduce_bucket_size, allgather_bucket_size)`` elements (a larger
parameter is a bucket of its own): one gradient reduction and one all-gather per bucket.

Either way a unit holds parameters of one dtype that are all trained or all frozen.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import torch

from zpp.zero.config import TrainConfig
from zpp.zero.policy import ShardingPolicy
from zpp.zero.unit import Unit

Named = list[tuple[str, torch.nn.Parameter]]
MakeUnit = Callable[[int, Named, bool], Unit]


@dataclasses.dataclass(frozen=True, slots=True)
class UnitPlan:
    """The units of an engine and, with sharded parameters, what each module needs."""

    units: tuple[Unit, ...]
    """Every unit, in flat order (the order of every flush and checkpoint)."""
    needs: tuple[tuple[torch.nn.Module, tuple[Unit, ...]], ...]
    """Each module that must have units gathered while it runs, with those units (stage 3;
    see [Note: stage 3 units])."""


def plan_units(module: torch.nn.Module, *, policy: ShardingPolicy, config: TrainConfig,
               trainable: set[int] | None, make_unit: MakeUnit) -> UnitPlan:
    """Plan the units of ``module``; ``make_unit(index, named, trainable)`` builds each. ``trainable``: ids of the parameters to train
    (None: every parameter that requires grad)."""
    units: list[Unit] = []
    owner: dict[int, Unit] = {}
    created: dict[int, list[Unit]] = collections.defaultdict(list)
    owned = _owned_parameters(module)

    def key(p: torch.nn.Parameter) -> tuple[bool, torch.dtype]:
        return (p.requires_grad and (trainable is None or id(p) in trainable), p.dtype)

    def add(named: Named, train: bool, at: torch.nn.Module | None = None) -> None:
        u = make_unit(len(units), named, train)
        units.append(u)
        for _, p in named:
            owner[id(p)] = u
        if at is not None:
            created[id(at)].append(u)

    if policy.shard_parameters:
        min_numel = config.zpp.unit_min_numel
        visited: set[int] = set()

        def visit(m: torch.nn.Module, is_root: bool) -> Named:
            visited.add(id(m))
            acc = list(owned.get(id(m), []))
            for c in m.children():
                if id(c) not in visited:
                    acc.extend(visit(c, False))
            if acc and (is_root or sum(p.numel() for _, p in acc) >= min_numel):
                groups: dict[tuple, Named] = collections.defaultdict(list)
                for n, p in acc:
                    groups[key(p)].append((n, p))
                for (train, _dt), named in groups.items():
                    add(named, train, m)
                return []
            return acc

        visit(module, True)
    else:
        cap = min(config.zero.reduce_bucket_size, config.zero.allgather_bucket_size)
        open_: dict[tuple, Named] = {}
        sizes: dict[tuple, int] = {}
        for own in owned.values():
            for n, p in own:
                k = key(p)
                if open_.get(k) and sizes[k] + p.numel() > cap:
                    add(open_.pop(k), k[0])
                if k not in open_:
                    open_[k], sizes[k] = [], 0
                open_[k].append((n, p))
                sizes[k] += p.numel()
        for k, named in open_.items():
            add(named, k[0])
    needs = []
    for m in module.modules():
        us = list(created.get(id(m), []))
        for p in m._parameters.values():
            if p is not None and owner[id(p)] not in us:
                us.append(owner[id(p)])
        if us:
            needs.append((m, tuple(us)))
    return UnitPlan(tuple(units), tuple(needs))


def _owned_parameters(module: torch.nn.Module) -> dict[int, Named]:
    """Per module (by id, in ``named_modules`` order), the parameters it names first, with
    their qualified names; a tied parameter goes to the first module that names it."""
    seen: set[int] = set()
    owned: dict[int, Named] = {}
    for mname, m in module.named_modules():
        own = []
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            own.append((f"{mname}.{pname}" if mname else pname, p))
        owned[id(m)] = own
    return owned
