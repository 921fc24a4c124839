"""The ZeRO engine: composes the policy, the units, the hooks, the optimizer and checkpoints.

Build it with :func:`zpp.initialize` (:mod:`zpp.zero.api`). Where each concern lives:

==========================  =============================================================
:mod:`~zpp.zero.policy`     what is sharded (a frozen :class:`ShardingPolicy` from the config)
:mod:`~zpp.zero.planning`   which parameters form a unit; which modules need which units
:mod:`~zpp.zero.unit`       a unit's flat shard and its life (gather, release, reduce, publish)
:mod:`~zpp.zero.gather`     the weight gathers (plain, qwZ, hpZ), chosen once
:mod:`~zpp.zero.reduce`     the gradient reductions (all-reduce, reduce-scatter, qgZ, local)
:mod:`~zpp.zero.hooks`      the forward/backward hooks; :mod:`~zpp.zero.prefetch` gathers ahead
:mod:`~zpp.zero.optimizer`  the optimizer and schedule over the fp32 masters (1-bit routing)
:mod:`~zpp.zero.gradnorm`   gradient norm, the non-finite check, unscaling and clipping
:mod:`~zpp.zero.loss_scale` fp16 loss scaling (DeepSpeed's static and dynamic rules)
:mod:`~zpp.zero.checkpoint` sharded, reshardable checkpoints; the consolidated state dict
:mod:`~zpp.zero.memory`     model-state bytes per rank
==========================  =============================================================

[Note: skipped steps]
At every accumulation boundary the engine checks the step's gradients on every rank (the
check rides on the gradient-norm computation; see [Note: the non-finite check rides on the
norm] in :mod:`zpp.zero.gradnorm`). If any rank's gradient holds NaN or Inf (under fp16:
the loss scale overflowed), every rank skips the step as DeepSpeed's fp16 optimizers do,
for every dtype: the gradients are dropped, the optimizer and its state (1-bit error
feedback and counters included) and the learning-rate schedule do not move, the weights
stay bit-identical; ``skipped_steps`` counts it, rank 0 logs it, ``global_steps`` still
advances, ``was_step_applied()`` and ``optimizer.overflow`` say so, and the fp16 loss
scale follows [Note: dynamic loss scale] in :mod:`zpp.zero.loss_scale`. With
``zpp.nonfinite: "raise"`` the step is skipped the same way and then every rank raises
:class:`~zpp.comm.nonfinite.NonFiniteGradientError` naming the step (except under dynamic
fp16 loss scaling, where overflows are expected: the scale handles them, and the run fails
only when the scale cannot go lower). ``optimizer.overflow``, ``optimizer.cur_scale`` and
``optimizer.loss_scale`` (DeepSpeed's fp16 optimizer attributes) are plain attributes the
engine sets on its optimizer after every step: read them, do not write them.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from zpp.comm.nonfinite import NonFiniteGradientError
from zpp.comm.transport import Transport
from zpp.utils.logging import logger
from zpp.zero import access, checkpoint
from zpp.zero.agreement import check_same_parameters
from zpp.zero.comm_api import Comms, Phase
from zpp.zero.config import TrainConfig
from zpp.zero.gather import build_gathers
from zpp.zero.gradnorm import check_grads, unscale_and_clip
from zpp.zero.hooks import EngineHooks
from zpp.zero.loss_scale import LossScaler
from zpp.zero.memory import model_state_bytes
from zpp.zero.optimizer import build_lr_scheduler, build_optimizer
from zpp.zero.planning import plan_units
from zpp.zero.policy import ShardingPolicy
from zpp.zero.prefetch import Prefetcher, PrefetchStats
from zpp.zero.reduce import build_reduce
from zpp.zero.unit import Unit, UnitComms

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MODEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroEngine:
    """Wraps a module for ZeRO data-parallel training. Build it with :func:`initialize`.

    Attributes:
        module: the wrapped model.
        config: the :class:`TrainConfig` in force.
        policy: the :class:`ShardingPolicy` derived from it.
        world: the transport over every rank.
        comms: what the units share (:class:`UnitComms`: policy, gathers, reduction).
        units: the communication units, in flat order.
        optimizer: the torch optimizer over the fp32 master shards.
        lr_scheduler: the schedule, or None.
        onebit_views: with a 1-bit optimizer, the per-parameter views it steps, else None.
        global_steps: optimizer steps taken (skipped ones included, as DeepSpeed counts);
            micro_steps: ``step()`` calls.
        skipped_steps: optimizer steps skipped for non-finite gradients (fp16 overflows
            included); see [Note: skipped steps].
        loss_scaler: the fp16 :class:`~zpp.zero.loss_scale.LossScaler` (scale 1 without fp16).
    """

    def __init__(self, module: torch.nn.Module, *, config: TrainConfig, world: Transport,
                 optimizer: Any = None, lr_scheduler: Any = None,
                 trainable: set[int] | None = None) -> None:
        self.module = module
        self.config = config
        self.world = world
        self.policy = policy = ShardingPolicy.from_config(config)
        config.check_world(world.world_size)
        if config.zpp.check_metadata is not None:
            world.check_metadata = config.zpp.check_metadata
        if config.precision in _MODEL_DTYPES:  # fp32 masters: see Unit._materialize
            module.to(_MODEL_DTYPES[config.precision])
        for name, p in module.named_parameters():
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"zpp.initialize: parameter {name} has dtype {p.dtype}; "
                                f"expected one of {_PARAM_DTYPES}")
        managed = [n for n, p in module.named_parameters() if access.owned(p)]
        if managed:
            raise ValueError(f"zpp.initialize: parameters {managed[:5]} are partitioned by another zpp engine; "
                             "call that engine's close() first (it restores the full parameters)")
        self._broadcast_buffers()
        if config.zpp.check_parameters:
            check_same_parameters(world, list(module.named_parameters()))
        comms = Comms(world=world, topology=self._topology(), config=config)
        self.comms = UnitComms(world=world, policy=policy, gathers=build_gathers(comms, policy),
                               reduce=build_reduce(comms, policy))
        plan = plan_units(module, policy=policy, config=config, trainable=trainable, make_unit=self._make_unit)
        self.units: tuple[Unit, ...] = plan.units
        self._prefetch = Prefetcher(self.units, bucket_numel=config.zero.prefetch_bucket_size,
                                    enabled=policy.shard_parameters and config.zpp.prefetch, world=world)
        self.hooks = EngineHooks(module, plan, policy=policy, prefetcher=self._prefetch)
        self.hooks.install()
        self.optimizer, self.onebit_views = build_optimizer(config, optimizer, self.units, world)
        self.lr_scheduler = build_lr_scheduler(config, lr_scheduler, self.optimizer)
        self.global_steps = 0
        self.micro_steps = 0
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self._step_applied = False
        self._mirror_overflow(False)

    # ------------------------------------------------------------------ construction
    def _make_unit(self, index: int, named: list[tuple[str, torch.nn.Parameter]], trainable: bool) -> Unit:
        return Unit(index, [n for n, _ in named], [p for _, p in named], trainable=trainable, comms=self.comms)

    def _topology(self):
        """The world's node structure when a collective needs it (hpZ, qgZ), else None."""
        zero = self.config.zero
        if not (self.policy.secondary_degree > 1 or (self.policy.shard_parameters and zero.quantized_gradients)):
            return None
        from zpp.comm.topology import topology_of

        topology = topology_of(self.world)
        h = self.policy.secondary_degree
        if h > 1 and (self.world.world_size % h or h != topology.ranks_per_node):
            raise ValueError(
                f"zero_hpz_partition_size={h} must divide world_size={self.world.world_size} and equal the "
                f"ranks per node ({topology.ranks_per_node}); the ranks per node come from ZPP_RANKS_PER_NODE, "
                "else the launcher's LOCAL_WORLD_SIZE, else the MPI shared-memory split")
        return topology

    def _broadcast_buffers(self) -> None:
        for _name, b in self.module.named_buffers():
            if b.numel():
                t = b.data if b.is_contiguous() else b.data.contiguous()
                self.world.broadcast(t, 0)
                if t is not b.data:
                    b.data.copy_(t)

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale under
        fp16, in fp32, as DeepSpeed's); with sharded gradients, flush the units whose
        gradients did not all arrive (see [Note: stage 3 hooks] in :mod:`zpp.zero.hooks`),
        then release every gathered unit. Returns ``loss`` as given."""
        gas = self.gradient_accumulation_steps
        scaled = loss / gas if gas > 1 else loss
        if self.loss_scaler.enabled:
            scaled = scaled.float() * self.loss_scaler.cur_scale
        scaled.backward()
        if self.policy.reduce_each_micro_step:
            for u in self.units:
                if u.trainable and (not u.reduced or u.has_unreduced_grads):
                    u.reduce_grads()
        self._prefetch.end_pass()
        for u in self.units:
            u.reset_micro_step()
            u.release()
            if not u.trainable:  # left out of model_parameters but requires_grad
                for p in u.params:
                    p.grad = None
        return loss

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary reduce (unless reduced at every
        micro-step), check the gradients on every rank, then either skip the step (see
        [Note: skipped steps]) or unscale (fp16) and clip them, run the optimizer on the
        master shards, publish the new weights and advance the schedule."""
        self._step_applied = False
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps:
            return
        trained = [u for u in self.units if u.trainable]
        if not self.policy.reduce_each_micro_step:
            for u in trained:
                u.reduce_grads()
                u.reduced = False
        clip, scale = self.config.gradient_clipping, self.loss_scaler.cur_scale
        check = check_grads(trained, world=self.world, clip=clip, sharded=self.comms.degree > 1,
                            local=self.onebit_views is not None, scale=scale)
        if not check.finite:
            self._skip_step(trained)
            return
        self.loss_scaler.update(False, step=self.global_steps + 1)
        self.last_grad_norm = unscale_and_clip(trained, norm=check.norm, clip=clip, scale=scale,
                                               unscaled=check.unscaled)
        views = self.onebit_views or ()
        for u, slot, v in views:
            v.grad = u.flat.grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if not views:
            for u in trained:
                u.stage_grad()
        self.optimizer.step()
        for v in views:
            v.param.grad = None
        for u in trained:
            u.publish()
        for u in self.units:
            u.flat.invalidate_secondary()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._step_applied = True
        self._mirror_overflow(False)
        self._count_step()

    def _skip_step(self, trained: list[Unit]) -> None:
        """The step's gradients are not finite on some rank (every rank agrees, see
        :mod:`zpp.zero.gradnorm`): drop them, count, log, update the loss scale, raise if
        the config says so. See [Note: skipped steps]."""
        step = self.global_steps + 1
        for u in trained:
            u.flat.grad = None
            if u.flat.master is not None:
                u.flat.master.grad = None
        for u in self.units:
            u.flat.invalidate_secondary()  # as after a step: the next passes gather as they would
        self.last_grad_norm = float("inf")
        self.skipped_steps += 1
        self._count_step()
        scaler = self.loss_scaler
        try:
            change = scaler.update(True, step=step)  # may raise at min_loss_scale (every rank)
        finally:
            self._mirror_overflow(True)
        if self.world.rank == 0:
            what = f"[zpp] OVERFLOW! Skipping optimizer step {step}: gradients hold NaN or Inf on some rank"
            if scaler.enabled:
                logger.info(f"{what}; {change.describe()} (skipped so far: {self.skipped_steps})")
            else:
                logger.warning(f"{what} (skipped so far: {self.skipped_steps})")
        if self.config.zpp.nonfinite == "raise" and not scaler.dynamic:
            raise NonFiniteGradientError(
                f"zpp: optimizer step {step} (micro-step {self.micro_steps}): gradients hold NaN or Inf on some "
                "rank; the step was not applied on any rank (zpp.nonfinite='raise'; 'skip' skips such steps)")

    def _count_step(self) -> None:
        self.global_steps += 1
        spp = self.config.steps_per_print
        if spp and self.global_steps % spp == 0 and self.world.rank == 0:
            print(f"[zpp] step={self.global_steps} skipped={self.skipped_steps} lr={self.get_lr()} "
                  f"grad_norm={self.last_grad_norm}", flush=True)

    def _mirror_overflow(self, overflow: bool) -> None:
        """DeepSpeed's fp16 optimizer attributes on the engine's optimizer; see [Note: skipped steps]."""
        opt = self.optimizer
        opt.overflow = overflow
        opt.cur_scale = opt.loss_scale = self.loss_scaler.cur_scale

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the weights: False between accumulation
        boundaries and for a skipped step (DeepSpeed's)."""
        return self._step_applied

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16). DeepSpeed's ``loss_scale()``
        returns the configured ``fp16.loss_scale`` (0 under dynamic scaling); the scale in
        force is what a script wants to log, so zpp returns it (``optimizer.cur_scale``)."""
        return self.loss_scaler.cur_scale

    def zero_grad(self) -> None:
        """Drop accumulated gradients (both ``.grad`` and the reduced shards)."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.flat.grad = None
            u.reset_micro_step()
        for v in self.onebit_views or ():
            v.param.grad = None

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """What stage 3 prefetch did (counts of prefetched, used, dropped gathers and of
        passes that fell back); see [Note: stage 3 prefetch] in :mod:`zpp.zero.prefetch`."""
        return self._prefetch.stats

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model ``state_dict`` (every key, tied names included), on every rank.
        Collective with sharded parameters (gathers one unit at a time)."""
        return checkpoint.consolidated_state_dict(self)

    def step_state(self) -> dict[str, Any]:
        """What checkpoints keep of the step path besides the optimizer: the loss scaler's
        state and the count of skipped steps (plain numbers, for the checkpoint's meta)."""
        return {"loss_scaler": self.loss_scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_step_state(self, state: dict[str, Any] | None) -> None:
        """Restore a :meth:`step_state` (None, from a checkpoint without it: nothing)."""
        if not state:
            return
        self.loss_scaler.load_state_dict(state.get("loss_scaler", {}))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._mirror_overflow(False)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now; see :func:`zpp.zero.memory.model_state_bytes`."""
        return model_state_bytes(self.units, self.optimizer)

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None) -> str:
        """Collective: write a sharded checkpoint (see :mod:`zpp.zero.checkpoint`)."""
        return checkpoint.save_checkpoint(self, save_dir, tag)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None) -> str:
        """Collective: load a checkpoint saved at any world size or stage."""
        return checkpoint.load_checkpoint(self, load_dir, tag)

    def close(self) -> None:
        """Remove every hook the engine installed and, with sharded parameters, gather them
        back (collective: every rank calls it): the module holds its full weights again and
        may be trained or wrapped anew."""
        if self.policy.shard_parameters and self.hooks.handles:
            self._prefetch.end_pass()
            for u in self.units:
                u.gather(Phase.EXACT)
        self.hooks.remove()
