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
:mod:`~zpp.zero.gradnorm`   gradient norm and clipping
:mod:`~zpp.zero.checkpoint` sharded, reshardable checkpoints; the consolidated state dict
:mod:`~zpp.zero.memory`     model-state bytes per rank
==========================  =============================================================
"""
from __future__ import annotations

import os
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero import checkpoint
from zpp.zero.agreement import check_same_parameters
from zpp.zero.comm_api import Comms
from zpp.zero.config import TrainConfig
from zpp.zero.gather import build_gathers
from zpp.zero.gradnorm import clip_grads
from zpp.zero.hooks import install_hooks
from zpp.zero.memory import model_state_bytes
from zpp.zero.optimizer import build_lr_scheduler, build_optimizer
from zpp.zero.planning import plan_units
from zpp.zero.policy import ShardingPolicy
from zpp.zero.prefetch import Prefetcher, PrefetchStats
from zpp.zero.reduce import build_reduce
from zpp.zero.unit import Unit, UnitComms

_PARAM_DTYPES = (torch.float32, torch.bfloat16)


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
        global_steps: optimizer steps taken; micro_steps: ``step()`` calls.
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
        if config.precision == "bf16":
            module.to(torch.bfloat16)
        for name, p in module.named_parameters():
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"zpp.initialize: parameter {name} has dtype {p.dtype}; "
                                f"expected one of {_PARAM_DTYPES}")
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
        self._handles = install_hooks(module, plan, policy=policy, prefetcher=self._prefetch)
        self.optimizer, self.onebit_views = build_optimizer(config, optimizer, self.units, world)
        self.lr_scheduler = build_lr_scheduler(config, lr_scheduler, self.optimizer)
        self.global_steps = 0
        self.micro_steps = 0
        self.last_grad_norm: float | None = None

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
        """Backward of ``loss / gradient_accumulation_steps``; with sharded gradients, flush
        the units whose gradients did not all arrive (see [Note: stage 3 hooks] in
        :mod:`zpp.zero.hooks`), then release every gathered unit."""
        gas = self.gradient_accumulation_steps
        (loss / gas if gas > 1 else loss).backward()
        if self.policy.reduce_each_micro_step:
            for u in self.units:
                if u.trainable and not u.reduced:
                    u.reduce_grads()
        self._prefetch.end_pass()
        for u in self.units:
            u.reduced = False
            u.pending = u.expected_grads
            u.release()
            if not u.trainable:  # left out of model_parameters but requires_grad
                for p in u.params:
                    p.grad = None
        return loss

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary reduce (unless reduced at every
        micro-step), clip, run the optimizer on the master shards, publish the new weights,
        advance the schedule."""
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps:
            return
        trained = [u for u in self.units if u.trainable]
        if not self.policy.reduce_each_micro_step:
            for u in trained:
                u.reduce_grads()
                u.reduced = False
        self.last_grad_norm = clip_grads(trained, world=self.world, clip=self.config.gradient_clipping,
                                         sharded=self.comms.degree > 1, local=self.onebit_views is not None)
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
        self.global_steps += 1
        spp = self.config.steps_per_print
        if spp and self.global_steps % spp == 0 and self.world.rank == 0:
            print(f"[zpp] step={self.global_steps} lr={self.get_lr()} grad_norm={self.last_grad_norm}", flush=True)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (both ``.grad`` and the reduced shards)."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.flat.grad = None
            u.pending = u.expected_grads
            u.reduced = False
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

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now; see :func:`zpp.zero.memory.model_state_bytes`."""
        return model_state_bytes(self.units, self.optimizer)

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: dict = {},  # noqa: B006 - DeepSpeed's signature; never mutated
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective: write a verified, atomically published sharded checkpoint; DeepSpeed's
        signature, returns True. See :func:`zpp.zero.checkpoint.save_checkpoint`."""
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Collective: load a checkpoint saved at any world size or stage; DeepSpeed's
        signature, returns ``(load_path, client_state)`` or ``(None, None)``. See
        :func:`zpp.zero.checkpoint.load_checkpoint`."""
        return checkpoint.load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                          load_lr_scheduler_states, load_module_only)

    def close(self) -> None:
        """Remove every hook the engine installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
