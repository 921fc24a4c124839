"""Unit planning: which parameters are communicated together, and which modules need which units.

[Note: stage 3 units]
With sharded parameters, units are made at *unit roots*, in post-order: a unit root takes
every parameter of its subtree not yet in a unit, and the model's root takes what is left
(FSDP2's ``fully_shard(block)`` calls, then ``fully_shard(model)``). A ZeRO-3 leaf module
(DeepSpeed's ``_z3_leaf`` flag, set by :mod:`zpp.zero.leaf_modules` or by the config's
``zero_optimization.leaf_module``, whose default names the Mixtral and Qwen MoE blocks) is
a unit root before any rule below, and nothing inside it is one: it is gathered whole. The other unit roots are,
first match wins:

1. ``zpp.unit_classes``: every module whose class name is listed (a name that matches no
   module is an error naming the classes the model has);
2. ``zpp.unit_min_numel`` (an integer): size-based, like FSDP's size wrapping: a module
   whose subtree holds at least that many parameters not yet in a unit (0: every module
   that holds parameters);
3. by default, the model's transformer blocks: the classes a Hugging Face model lists in
   ``_no_split_modules``, else every class of which a container (``nn.ModuleList``,
   ``nn.Sequential``, ``nn.ModuleDict``) holds two or more instances with parameters (the
   layers of a GPT, ``nn.TransformerEncoder.layers``...); every instance of those classes
   is a unit root, but only the outermost (a block inside a block stays in its block);
4. where none is found, every module holding parameters.

A block as one unit is gathered whole before the block's forward, so whatever the block's
submodules read of each other's parameters (``nn.MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``) is there; reads across units are caught
by [Note: parameter access]. A tied parameter belongs to the first module that names it.
A module's hooks gather the units it created plus the units of its direct parameters;
gathers are reference-counted, so a child inside its ancestor's unit costs nothing.

[Note: persistent parameters]
With sharded parameters, a parameter with fewer than
``zero_optimization.stage3_param_persistence_threshold`` elements (DeepSpeed's default 1e5)
is not sharded: such parameters (biases, norms, small embeddings) are bucketed as at stage
2 and stay whole on every rank (their optimizer state and gradients stay sharded, and the
updated shards are all-gathered after each step), which saves two small gathers per use
for one gather per step. 0 shards everything (the ZeRO-3 memory formula exactly).

[Note: buckets]
Without sharded parameters (stages 0-2) the parameters are cut, in model order, into
buckets of at most ``min(reduce_bucket_size, allgather_bucket_size)`` elements (a larger
parameter is a bucket of its own): one gradient reduction and one all-gather per bucket.
With the optimizer state on NVMe, ``sub_group_size`` caps them too: the swapped state
streams one unit at a time (see [Note: NVMe swap] in :mod:`zpp.zero.nvme`).

Either way a unit holds parameters of one dtype and one optimizer group (or all frozen):
see :mod:`zpp.zero.param_groups`.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import torch

from zpp.zero.leaf_modules import apply_leaf_module_config, z3_leaf_module
from zpp.zero import init as zinit
from zpp.zero.config import TrainConfig
from zpp.zero.param_groups import ParamGroups
from zpp.zero.policy import ShardingPolicy
from zpp.zero.unit import Unit

Named = list[tuple[str, torch.nn.Parameter]]
MakeUnit = Callable[[int, Named, int, bool], Unit]


@dataclasses.dataclass(frozen=True, slots=True)
class UnitPlan:
    """The units of an engine and, with sharded parameters, what each module needs."""

    units: tuple[Unit, ...]
    """Every unit, in flat order (the order of every flush and checkpoint)."""
    needs: tuple[tuple[torch.nn.Module, tuple[Unit, ...]], ...]
    """Each module that must have units gathered while it runs, with those units (stage 3;
    see [Note: stage 3 units])."""


def plan_units(module: torch.nn.Module, *, policy: ShardingPolicy, config: TrainConfig,
               groups: ParamGroups, make_unit: MakeUnit) -> UnitPlan:
    """Plan the units of ``module``; ``make_unit(index, named, group, persistent)`` builds
    each (``group``: the optimizer group of its parameters, or ``param_groups.FROZEN``;
    ``persistent``: see [Note: persistent parameters])."""
    units: list[Unit] = []
    owner: dict[int, Unit] = {}
    created: dict[int, list[Unit]] = collections.defaultdict(list)
    owned = _owned_parameters(module)

    def key(p: torch.nn.Parameter) -> tuple[int, torch.dtype]:
        return (groups.group(p), p.dtype)

    def add(named: Named, group: int, at: torch.nn.Module | None = None, persistent: bool = False) -> None:
        u = make_unit(len(units), named, group, persistent)
        units.append(u)
        for _, p in named:
            owner[id(p)] = u
        if at is not None:
            created[id(at)].append(u)

    threshold = config.zero.param_persistence_threshold if policy.shard_parameters else 0
    small = {id(p): (n, p) for own in owned.values() for n, p in own if zinit.numel_of(p) < threshold}
    if small:
        owned = {m: [(n, p) for n, p in own if id(p) not in small] for m, own in owned.items()}
        _buckets(list(small.values()), config, key, lambda named, k: add(named, k[0], persistent=True))
    if policy.shard_parameters:
        leaf = config.zero.leaf_module
        apply_leaf_module_config(module, leaf.classes, leaf.names, leaf.name_suffixes)
        min_numel = config.zpp.unit_min_numel
        roots = None if min_numel is not None and not config.zpp.unit_classes else unit_roots(module, config)
        if roots is None and min_numel is None:  # no block found: every module holding parameters
            min_numel = 0
        visited: set[int] = set()

        def is_unit_root(m: torch.nn.Module, acc: Named) -> bool:
            if roots is not None:
                return id(m) in roots
            return sum(zinit.numel_of(p) for _, p in acc) >= min_numel

        def visit(m: torch.nn.Module, is_root: bool, in_leaf: bool = False) -> Named:
            visited.add(id(m))
            leaf = not in_leaf and z3_leaf_module(m)
            acc = list(owned.get(id(m), []))
            for c in m.children():
                if id(c) not in visited:
                    acc.extend(visit(c, False, in_leaf or leaf))
            if acc and (is_root or leaf or (not in_leaf and is_unit_root(m, acc))):
                by_key: dict[tuple, Named] = collections.defaultdict(list)
                for n, p in acc:
                    by_key[key(p)].append((n, p))
                for (group, _dt), named in by_key.items():
                    add(named, group, m)
                return []
            return acc

        visit(module, True)
    else:
        _buckets([(n, p) for own in owned.values() for n, p in own], config, key,
                 lambda named, k: add(named, k[0]))
    needs = []
    for m in module.modules():
        us = list(created.get(id(m), []))
        for p in m._parameters.values():
            if p is not None and id(p) not in small and owner[id(p)] not in us:
                us.append(owner[id(p)])
        if us:
            needs.append((m, tuple(us)))
    return UnitPlan(tuple(units), tuple(needs))


def _buckets(named: Named, config: TrainConfig, key: Callable, add: Callable[[Named, tuple], None]) -> None:
    """Cut ``named`` (in order) into buckets of one key and at most ``min(reduce_bucket_size,
    allgather_bucket_size)`` elements (see [Note: buckets])."""
    cap = min(config.zero.reduce_bucket_size, config.zero.allgather_bucket_size)
    if config.zero.offload_optimizer.device == "nvme":  # the swapped step's tile
        cap = min(cap, config.zero.sub_group_size)
    open_: dict[tuple, Named] = {}
    sizes: dict[tuple, int] = {}
    for n, p in named:
        k = key(p)
        if open_.get(k) and sizes[k] + zinit.numel_of(p) > cap:
            add(open_.pop(k), k)
        if k not in open_:
            open_[k], sizes[k] = [], 0
        open_[k].append((n, p))
        sizes[k] += zinit.numel_of(p)
    for k, bucket in open_.items():
        add(bucket, k)


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


def unit_roots(module: torch.nn.Module, config: TrainConfig) -> set[int] | None:
    """Ids of the modules that start a unit, by ``zpp.unit_classes`` or by block detection;
    None where no block is found (then every module holding parameters is a unit). See
    [Note: stage 3 units]."""
    classes = config.zpp.unit_classes
    if classes:
        present = {type(m).__name__ for m in module.modules()}
        missing = sorted(set(classes) - present)
        if missing:
            raise ValueError(f"zpp.unit_classes: {missing} match no module of the model; its module classes are "
                             f"{sorted(present)}")
        return {id(m) for m in module.modules() if type(m).__name__ in classes}
    blocks = block_classes(module)
    if not blocks:
        return None
    roots: set[int] = set()

    def outermost(m: torch.nn.Module) -> None:
        for c in m.children():
            if type(c) in blocks:
                roots.add(id(c))
            else:
                outermost(c)

    outermost(module)
    return roots or None


def block_classes(module: torch.nn.Module) -> set[type]:
    """The module classes that are the model's repeated blocks: a Hugging Face model's
    ``_no_split_modules`` where it names classes the model has, else every class of which
    a container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``) holds two or more
    instances with parameters."""
    by_name = {type(m).__name__: type(m) for m in module.modules()}
    for m in module.modules():
        named = getattr(m, "_no_split_modules", None)
        if named:
            found = {by_name[n] for n in named if n in by_name}
            if found:
                return found
    found: set[type] = set()
    for m in module.modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        count: dict[type, int] = {}
        for c in m.children():
            if next(c.parameters(), None) is not None:
                count[type(c)] = count.get(type(c), 0) + 1
        found.update(cls for cls, n in count.items() if n >= 2)
    return found
