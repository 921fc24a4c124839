"""Which parameters the engine trains, in which optimizer group, with which options.

A DeepSpeed script names them through ``model_parameters`` (parameters, a generator, or a
list of parameter-group dicts with their own options such as ``weight_decay``, ``lr``, or
the 1-bit optimizers' ``exp_avg_mask``) or through the groups of the torch optimizer it
passes. Parameters in no group are frozen. A unit never mixes groups (see
:mod:`zpp.zero.planning`), so each group becomes a group of the engine's optimizer over its
units' fp32 masters, with the group's options.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

FROZEN = -1
"""The group index of a parameter the engine does not train."""


@dataclasses.dataclass(frozen=True, slots=True)
class ParamGroups:
    """The trained parameters by group.

    Attributes:
        group_of: parameter id -> group index (absent: frozen, unless ``everything``).
        options: per group, its options (the group dict without ``params``).
        everything: no groups were given: every parameter that requires grad is trained, in
            group 0 with no options of its own.
    """

    group_of: Mapping[int, int]
    options: tuple[dict[str, Any], ...]
    everything: bool = False

    @classmethod
    def all_parameters(cls) -> ParamGroups:
        return cls({}, ({},), everything=True)

    @classmethod
    def none(cls) -> ParamGroups:
        """Nothing is trained: an engine for evaluation (no optimizer)."""
        return cls({}, ())

    @classmethod
    def of(cls, model_parameters: Iterable | None) -> ParamGroups:
        """From ``model_parameters`` as DeepSpeed takes it (None: every parameter)."""
        if model_parameters is None:
            return cls.all_parameters()
        items = list(model_parameters)
        if not items:
            raise ValueError("zpp.initialize: model_parameters is empty; pass the parameters to train")
        if all(isinstance(i, torch.Tensor) for i in items):
            return cls({id(p): 0 for p in items}, ({},))
        if not all(isinstance(i, Mapping) for i in items):
            kinds = sorted({type(i).__name__ for i in items})
            raise TypeError(f"zpp.initialize: model_parameters mixes {kinds}; give tensors or parameter-group "
                            "dicts with a 'params' key")
        group_of: dict[int, int] = {}
        options = []
        for g, item in enumerate(items):
            if "params" not in item:
                raise ValueError(f"zpp.initialize: parameter group {g} has no 'params' (keys: {sorted(item)})")
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            for p in ps:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"zpp.initialize: parameter group {g} holds a {type(p).__name__}, not a tensor")
                if id(p) in group_of and group_of[id(p)] != g:
                    raise ValueError(f"zpp.initialize: a parameter of shape {tuple(p.shape)} is in parameter groups "
                                     f"{group_of[id(p)]} and {g}")
                group_of[id(p)] = g
            options.append({k: v for k, v in item.items() if k != "params"})
        return cls(group_of, tuple(options))

    @classmethod
    def of_optimizer(cls, optimizer: torch.optim.Optimizer) -> ParamGroups:
        """From the groups of a torch optimizer built over the model's parameters."""
        return cls.of([dict(g) for g in optimizer.param_groups])

    def group(self, p: torch.nn.Parameter) -> int:
        """The group of ``p``, or :data:`FROZEN`."""
        if not p.requires_grad:
            return FROZEN
        if self.everything:
            return 0
        return self.group_of.get(id(p), FROZEN)

    def __len__(self) -> int:
        return len(self.options)
