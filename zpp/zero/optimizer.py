"""Building the optimizer and the learning-rate schedule over the engine's fp32 master shards.

The engine's optimizer never sees the model's parameters: it steps the fp32 masters of the
units this rank owns (one flat tensor per trainable unit), built from the config's
``optimizer`` section or rebuilt from a torch optimizer / factory the caller passes.

[Note: 1-bit optimizers]
``optimizer.type`` OneBitAdam, ZeroOneAdam or OneBitLamb (ZeRO stage 0 only; TrainConfig
says why) builds :mod:`zpp.optim`'s optimizer on the engine's transport. It averages the
gradients itself (full precision in warm-up, 1-bit compressed afterwards), so:

* the engine never averages gradients: its reduction is
  :class:`~zpp.zero.reduce.local.LocalGrad`, so at the accumulation boundary each unit's
  locally accumulated gradient (the micro-steps' ``loss / gas`` gradients summed in
  ``.grad``) moves to its fp32 ``flat.grad`` as it is, and the optimizer communicates
  once per step;
* the optimizer is built over one fp32 view of the unit masters per model parameter
  (:class:`OneBitView`), in model order, so it sees what it would see on a plain model:
  1-bit LAMB's trust ratios stay per parameter tensor and no bucket padding enters the
  1-bit buffer;
* gradient clipping uses the rms of the ranks' local norms (see :mod:`zpp.zero.gradnorm`);
* non-finite gradients: the engine's check (the rms all-reduce, or a 4-byte flag without
  clipping) runs before the optimizer, which is built with ``nonfinite=None`` and never
  stepped on a skipped step, so its error-feedback buffers and counters stay untouched;
* checkpoints: every rank writes its optimizer ``state_dict`` (error-feedback buffers,
  phase and counters, and its own weights, which differ between ranks between 0/1 Adam's
  syncs); see [Note: 1-bit optimizer state] in :mod:`zpp.zero.modes.onebit`.

[Note: the caller's optimizer]
A torch optimizer passed to ``initialize`` is the engine's optimizer: the same object, its
parameter groups (and their options) kept, each group's ``params`` replaced by the fp32
masters of that group's units and its state cleared (as DeepSpeed's ZeRO optimizers take
the groups over). So whatever the caller built on it keeps working: a scheduler created on
it before ``initialize`` (or accelerate's ``prepare``, or Lightning's
``configure_optimizers``) moves the learning rate the engine steps with, and the optimizer
is never rebuilt from ``defaults`` (which failed for torch 2.13's AdamW, whose ``defaults``
hold ``decoupled_weight_decay`` that its constructor does not take). ``initialize`` returns
this object.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from zpp.comm.transport import Transport
from zpp.optim._common import FusedOneBitOptimizer
from zpp.zero.config import ONEBIT_OPTIMIZERS, OPTIMIZER_PARAMS, OptimizerConfig, TrainConfig
from zpp.zero.param_groups import ParamGroups
from zpp.zero.schedulers import build_scheduler
from zpp.zero.shard import Slot
from zpp.zero.unit import Unit

#: the torch optimizers a config may name (lower-case ``type``)
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


class OneBitView(NamedTuple):
    """One model parameter as a 1-bit optimizer sees it: a view of its unit's fp32 master."""

    unit: Unit
    slot: Slot
    param: torch.nn.Parameter


def build_optimizer(config: TrainConfig, given: Any, units: Sequence[Unit], world: Transport,
                    groups: ParamGroups) -> tuple[torch.optim.Optimizer | None, tuple[OneBitView, ...] | None]:
    """The optimizer over the trainable units' masters, one optimizer group per parameter
    group (with that group's options), and the 1-bit views when the optimizer is a 1-bit
    one from the config (None otherwise).

    ``given``: a torch optimizer (the caller's object itself, its groups pointed at the
    masters: see [Note: the caller's optimizer]) or a factory ``param_groups ->
    optimizer``; only when the config has no ``optimizer``. Neither: ``(None, None)``, an
    engine for evaluation (as DeepSpeed's ``initialize`` without an optimizer)."""
    check_optimizer_args(config, given, groups)
    cfg = config.optimizer
    if cfg is None and given is None:
        return None, None
    if cfg is not None and cfg.onebit:
        views = _onebit_views(units)
        by_group = [{"params": [v.param for v in views if v.unit.group == g], **groups.options[g]}
                    for g in range(len(groups))]
        return _build_onebit(cfg, by_group, world), views
    param_groups = [{"params": [u.flat.master for u in units if u.group == g], **groups.options[g]}
                    for g in range(len(groups))]
    if cfg is not None:
        return OPTIMIZERS[cfg.type](param_groups, **cfg.params), None
    if isinstance(given, FusedOneBitOptimizer):
        built = given
    elif isinstance(given, torch.optim.Optimizer):
        built = adopt(given, param_groups)
    elif callable(given):
        built = given(param_groups)
    else:
        raise TypeError(f"zpp.initialize: optimizer={given!r} must be a torch optimizer or a factory "
                        "taking a list of parameters")
    if isinstance(built, FusedOneBitOptimizer):  # given, or made by a factory
        raise ValueError(
            f"zpp.initialize: a {type(built).__name__} given through optimizer= would run over the "
            "engine's flat buckets next to the engine's own gradient all-reduce; set it in the config "
            "instead: {'optimizer': {'type': ..., 'params': {...}}}")
    return built, None


def adopt(given: torch.optim.Optimizer, param_groups: list[dict]) -> torch.optim.Optimizer:
    """The caller's optimizer, stepping the masters: see [Note: the caller's optimizer]."""
    if len(given.param_groups) != len(param_groups):
        raise ValueError(f"zpp.initialize: the optimizer has {len(given.param_groups)} parameter groups, the "
                         f"engine built {len(param_groups)}")
    for group, mine in zip(given.param_groups, param_groups):
        group["params"] = mine["params"]
    given.state.clear()
    return given


def check_optimizer_args(config: TrainConfig, given: Any, groups: ParamGroups) -> None:
    """The errors :func:`build_optimizer` would raise about its arguments, raised before the
    engine shards anything."""
    cfg = config.optimizer
    if cfg is not None and given is not None:
        raise ValueError("zpp.initialize: an optimizer is given both in the config and as optimizer=")
    if cfg is not None:
        _check_group_options(cfg, groups)
    elif given is not None and not isinstance(given, torch.optim.Optimizer) and not callable(given):
        raise TypeError(f"zpp.initialize: optimizer={given!r} must be a torch optimizer or a factory "
                        "taking a list of parameters")


def _check_group_options(cfg: OptimizerConfig, groups: ParamGroups) -> None:
    allowed = OPTIMIZER_PARAMS[cfg.type] | {"name"}
    for g, opts in enumerate(groups.options):
        bad = sorted(set(opts) - allowed - {"exp_avg_mask"})
        if bad:
            raise ValueError(f"zpp.initialize: parameter group {g} sets {bad}, which optimizer {cfg.type!r} does "
                             f"not take; it takes {sorted(allowed)}")
        if "exp_avg_mask" in opts and not cfg.onebit:
            raise ValueError(f"zpp.initialize: parameter group {g} sets exp_avg_mask, which only the 1-bit "
                             f"optimizers take (optimizer.type={cfg.type!r})")


def build_lr_scheduler(config: TrainConfig, given: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    """The schedule: the config's ``scheduler``, else ``given`` (an object, or a factory
    ``optimizer -> scheduler``), else None. None without an optimizer (an evaluation
    engine; DeepSpeed builds none either)."""
    if optimizer is None:
        return None
    if config.scheduler is not None:
        if given is not None:
            raise ValueError("zpp.initialize: a scheduler is given both in the config and as lr_scheduler")
        return build_scheduler(config.scheduler, optimizer)
    if callable(given) and not hasattr(given, "step"):
        return given(optimizer)
    return given


def _onebit_views(units: Sequence[Unit]) -> tuple[OneBitView, ...]:
    views = []
    for u in units:
        if not u.trainable:
            continue
        master = u.flat.master.detach()
        for slot in u.layout.slots:
            v = torch.nn.Parameter(master[slot.offset:slot.offset + slot.numel].view(slot.shape))
            views.append(OneBitView(u, slot, v))
    return tuple(views)


def _build_onebit(cfg: OptimizerConfig, params: list[dict], world: Transport) -> FusedOneBitOptimizer:
    import zpp.optim as zo

    backend = cfg.params.get("comm_backend_name")
    if isinstance(backend, str):
        wants = zo.COMM_BACKENDS.get(backend.lower())
        if wants is not None and world.name in zo.COMM_BACKENDS.values() and wants != world.name:
            raise ValueError(
                f"zpp.initialize: optimizer.params.comm_backend_name={backend!r} asks for the {wants!r} "
                f"transport but the engine runs on {world.name!r} (zpp.transport or transport=), "
                "which the optimizer shares")
    # nonfinite=None: the engine checks every step itself (see [Note: skipped steps] in zpp.zero.engine)
    return zo.build(ONEBIT_OPTIMIZERS[cfg.type], params, transport=world, nonfinite=None, **cfg.params)
