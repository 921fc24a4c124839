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
:mod:`~zpp.zero.modes`     the training modes, hooked into the step and checkpoints: fp16
                            loss scaling, 1-bit optimizers, offload, the outer sync
:mod:`~zpp.zero.loss_scale` fp16 loss scaling (DeepSpeed's static and dynamic rules)
:mod:`~zpp.zero.checkpoint` sharded, reshardable checkpoints; the consolidated state dict
:mod:`~zpp.zero.memory`     model-state bytes per rank
:mod:`~zpp.zero.outer`      the hierarchical mode (``zpp.outer``): DiLoCo across nodes
:mod:`~zpp.zero.plan_bits`  the ``zpp tune`` plan applied to the qwZ/qgZ code widths
:mod:`~zpp.zero.offload`    ZeRO-Offload: optimizer state and parameter shards in host memory
:mod:`~zpp.zero.precision`  bf16/fp16 casts of the model and (``fp16.auto_cast``) its inputs
:mod:`~zpp.zero.accessors`  DeepSpeed's engine accessors (``global_rank``, ``get_lr()``, ...)
:mod:`~zpp.zero.deepspeed_methods`  DeepSpeed's other engine methods (accumulation boundary, 16-bit export)
:mod:`~zpp.zero.api`        ``initialize``, DeepSpeed's signature
==========================  =============================================================

[Note: a module initialized again]
DeepSpeed lets ``initialize`` wrap a module that an earlier engine wraps (Lightning builds
an evaluation engine over the trained module after ``fit``; the Trainer does the same for
``evaluate``). zpp's engines own their parameters (hooks, shards, the access registry), so
the new engine first closes the earlier one: its hooks are removed and, at stage 3, its
parameters gathered back whole (collective; ``initialize`` runs on every rank at the same
point), then the new engine takes them. The earlier engine is unusable afterwards. (An
engine stays alive while it holds parameters, even when the caller dropped it, as the
front-ends do, so that it can be closed here.)

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

import logging
import os
from typing import Any

import torch

from zpp.comm.nonfinite import NonFiniteGradientError
from zpp.comm.plan import TunePlan
from zpp.comm.transport import Transport
from zpp.log import logger
from zpp.zero import access, checkpoint
from zpp.zero import init as zinit
from zpp.zero.accessors import DeepSpeedAccessors
from zpp.zero.agreement import check_same_config, check_same_parameters
from zpp.zero.comm_api import Phase
from zpp.zero.config import TrainConfig
from zpp.zero.deepspeed_methods import DeepSpeedMethods
from zpp.zero.gather import build_gathers
from zpp.zero.gradnorm import check_grads, unscale_and_clip
from zpp.zero.hooks import EngineHooks
from zpp.zero.memory import model_state_bytes
from zpp.zero.modes import ModeAttributes, build_modes, data_parallel_world
from zpp.zero.monitor import MonitorMaster
from zpp.zero.nvme import SwapFile, open_agreed
from zpp.zero.offload import Offload
from zpp.zero.optimizer import build_lr_scheduler, build_optimizer, check_optimizer_args
from zpp.zero.param_groups import ParamGroups
from zpp.zero.param_swap import ParamSwap
from zpp.zero.plan_bits import apply_plan
from zpp.zero.planning import plan_units
from zpp.zero.policy import ShardingPolicy
from zpp.zero.precision import MODEL_DTYPES, cast_module, to_half
from zpp.zero.prefetch import Prefetcher, PrefetchStats
from zpp.zero.reduce import build_reduce, reduce_name
from zpp.zero.reduce.overlap import LinkWaits, ReductionThread, overlap_world
from zpp.zero.strategies import build_comms, build_reduce_comms
from zpp.zero.unit import Unit, UnitComms

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
log = logging.getLogger("zpp.zero")


class ZeroEngine(ModeAttributes, DeepSpeedAccessors, DeepSpeedMethods, torch.nn.Module):
    """Wraps a module for ZeRO data-parallel training, as DeepSpeed's engine does (an
    ``nn.Module`` holding the model as ``module``). Build it with :func:`initialize`.

    Attributes:
        module: the wrapped model.
        train_config: the :class:`TrainConfig` in force (batch sizes resolved for the world).
        config: the DeepSpeed config as given to ``initialize`` (a dict, for reading, as
            DeepSpeed's ``engine.config``; empty when a :class:`TrainConfig` was given).
        policy: the :class:`ShardingPolicy` derived from it.
        world: the data-parallel transport ZeRO shards over: every rank, or the ranks of this
            rank's node in the hierarchical mode (``zpp.outer``).
        job_world: the transport over every rank of the job (data, checkpoints, batch sizes).
        modes: the training modes in force (:mod:`zpp.zero.modes`), in hook order.
        outer: the hierarchical mode's :class:`~zpp.zero.outer.OuterSync`, else None.
        tune_plan: the ``zpp tune`` plan applied to the qwZ/qgZ code widths (see [Note: the
            plan in the engine] in :mod:`zpp.zero.plan_bits`), else None.
        comms: what the units share (:class:`UnitComms`: policy, gathers, reduction).
        units: the communication units, in flat order.
        optimizer: the torch optimizer over the fp32 master shards (one group per parameter
            group; a script may write each group's ``lr``).
        lr_scheduler: the schedule, or None.
        training_dataloader: the loader :func:`initialize` built from ``training_data``, or None.
        onebit_views: with a 1-bit optimizer, the per-parameter views it steps, else None.
        global_steps: optimizer steps taken (skipped ones included, as DeepSpeed counts);
            micro_steps: ``step()`` calls; global_samples: samples trained on, over every rank.
        skipped_steps: optimizer steps skipped for non-finite gradients (fp16 overflows
            included); see [Note: skipped steps].
        loss_scaler: the fp16 :class:`~zpp.zero.loss_scale.LossScaler` (scale 1 without fp16).
    """

    def __init__(self, module: torch.nn.Module, *, config: TrainConfig, world: Transport,
                 optimizer: Any = None, lr_scheduler: Any = None, groups: ParamGroups | None = None,
                 ds_config: dict | None = None, tune_plan: TunePlan | None = None) -> None:
        super().__init__()
        self.module = module
        self.config = ds_config if ds_config is not None else {}
        self.train_config = config = config.with_world(world.world_size)
        self.job_world = self.world = world
        self.policy = policy = ShardingPolicy.from_config(config)
        check_same_config(world, config)
        if config.zpp.check_metadata is not None:
            world.check_metadata = config.zpp.check_metadata
        if config.precision in MODEL_DTYPES:  # fp32 masters: see Unit._materialize
            cast_module(module, MODEL_DTYPES[config.precision])
        for name, p in module.named_parameters():
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"zpp.initialize: parameter {name} has dtype {p.dtype}; "
                                f"expected one of {_PARAM_DTYPES}")
        self._close_earlier_engines(module)
        self._broadcast_buffers()
        if config.zpp.check_parameters:  # (zpp.zero.Init's loose shards have no replicas to compare)
            synced = check_same_parameters(world, [(n, p) for n, p in module.named_parameters()
                                                   if not zinit.is_loose(p)],
                                           on_mismatch=config.zpp.parameter_mismatch)
            if synced and world.rank == 0:
                log.warning("zpp.initialize: %d parameters differed between ranks (first: %r); rank 0's were "
                            "broadcast to every rank (seed the model identically to avoid this, or set "
                            "zpp.parameter_mismatch='raise')", len(synced), synced[0])
        world = self.world = data_parallel_world(world, config)  # zpp.outer: ZeRO inside the node
        comms = build_comms(world, config, policy)  # with what the chosen strategies need
        first = next(module.parameters(), None)
        self.offload = Offload.from_config(config, first.device if first is not None else torch.device("cpu"))
        self.comms = self._build_unit_comms(comms)
        groups = groups if groups is not None else ParamGroups.all_parameters()
        check_optimizer_args(config, optimizer, groups)  # before anything is sharded
        plan = plan_units(module, policy=policy, config=config, groups=groups, make_unit=self._make_unit)
        self.units: tuple[Unit, ...] = plan.units
        if self.comms.reducer is not None:  # see [Note: overlapped reductions]: two units' gradients
            largest = max((u.layout.padded_numel for u in self.units if u.trainable), default=0)
            self.comms.reducer.max_numel = min(config.zero.reduce_bucket_size, 2 * largest)
        self._prefetch = Prefetcher(self.units, bucket_numel=config.zero.prefetch_bucket_size,
                                    max_live_numel=config.zero.max_live_parameters,
                                    enabled=policy.shard_parameters and config.zpp.prefetch, world=world)
        self.hooks = EngineHooks(module, plan, policy=policy, prefetcher=self._prefetch)
        self.hooks.close_engine = self.close  # the registry keeps this engine until it is closed
        self.hooks.install()
        self.tune_plan = tune_plan
        try:
            if tune_plan is not None:  # see [Note: the plan in the engine] in zpp.zero.plan_bits
                for level, line in apply_plan(tune_plan, units=self.units, gathers=self.comms.gathers,
                                              reduce=self.comms.reduce, config=config, world=world):
                    if self.job_world.rank == 0:
                        getattr(log, level)("%s", line)
            self.optimizer, self.onebit_views = build_optimizer(config, optimizer, self.units, world, groups)
            self.lr_scheduler = build_lr_scheduler(config, lr_scheduler, self.optimizer)
            self.modes = build_modes(self)
        except Exception:
            self.close()  # the model is whole and free again (every rank fails alike here)
            raise
        if config.activation_checkpointing.enabled:  # as DeepSpeed's engine: checkpoint() reads it
            from zpp.zero import activation_checkpointing

            activation_checkpointing.configure(None, deepspeed_config=config)
        self.training_dataloader = None
        self._boundary: bool | None = None  # see [Note: the accumulation boundary] in deepspeed_methods
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self._step_applied = False
        self.monitor = MonitorMaster(config.monitor, rank=self.job_world.rank)  # see zpp.zero.monitor

    # ------------------------------------------------------------------ construction
    def _build_unit_comms(self, comms) -> UnitComms:
        """The units' collectives; with ``overlap_comm`` the reduction is built over a
        duplicate of the world and run on a thread (see [Note: overlapped reductions] in
        :mod:`zpp.zero.reduce.overlap`). ``overlap_reason`` says why not, when not."""
        config, policy, world = self.train_config, self.policy, self.world
        waits = LinkWaits()
        local = reduce_name(comms, policy) == "local"
        wanted = config.zero.overlaps_reductions and not local
        duplicate, self.overlap_reason = overlap_world(world, wanted)
        if local and config.zero.overlap_comm:
            self.overlap_reason = "the 1-bit optimizers reduce in their step"
        reducer = None
        if duplicate is not None:
            reduce = build_reduce(build_reduce_comms(duplicate, config, policy), policy)
            reducer = ReductionThread(reduce, world=duplicate, max_numel=config.zero.reduce_bucket_size, clock=waits,
                                      pipeline=config.zpp.pipeline_reductions)
        else:
            reduce = build_reduce(comms, policy)
            if config.zero.overlap_comm and world.rank == 0:
                log.warning("zpp: overlap_comm=true, but the gradient reductions run in line: %s",
                            self.overlap_reason)
        return UnitComms(world=world, policy=policy, gathers=build_gathers(comms, policy), reduce=reduce,
                         offload=self.offload, reducer=reducer, waits=waits, params_swap=self._params_swap())

    def _params_swap(self) -> ParamSwap | None:
        """The parameter tier on NVMe (``offload_param.device: "nvme"``, stage 3), its swap
        file opened on every rank or the failure raised on every rank; see [Note: parameters
        on NVMe] in :mod:`zpp.zero.param_swap`."""
        config = self.train_config
        off = config.zero.offload_param
        if off.device != "nvme" or not self.policy.shard_parameters:
            return None
        swap = open_agreed(lambda: SwapFile(off.nvme_path, self.job_world.rank, config.aio, kind="param"),
                           self.job_world)
        return ParamSwap(swap, off.buffer_count)

    def _close_earlier_engines(self, module: torch.nn.Module) -> None:
        """See [Note: a module initialized again]."""
        earlier = {}
        for p in module.parameters():
            owner = access.owner_of(p) if not zinit.is_loose(p) else None
            if owner is not None:
                earlier[id(owner)] = owner
        for owner in earlier.values():
            closer = getattr(owner, "close_engine", None)
            if closer is None:  # zpp.zero.Init's owner keeps only loose shards, skipped above
                raise ValueError("zpp.initialize: the module's parameters are held by another zpp owner "
                                 f"({type(owner).__name__}); close it first")
            closer()
            if self.job_world.rank == 0:
                log.info("zpp.initialize: the module was wrapped by an earlier engine; that engine is closed "
                         "(hooks removed, sharded weights gathered back) and this one takes the parameters")

    def _make_unit(self, index: int, named: list[tuple[str, torch.nn.Parameter]], group: int,
                   persistent: bool) -> Unit:
        return Unit(index, [n for n, _ in named], [p for _, p in named], group=group, comms=self.comms,
                    persistent=persistent)

    def _broadcast_buffers(self) -> None:
        for _name, b in self.module.named_buffers():
            if b.numel():
                t = b.data if b.is_contiguous() else b.data.contiguous()
                self.world.broadcast(t, 0)
                if t is not b.data:
                    b.data.copy_(t)

    # ------------------------------------------------------------------ training API
    def forward(self, *args, **kwargs):
        """The module's forward; with ``fp16.auto_cast``, floating-point tensors in the
        arguments (also inside lists, tuples and dicts) are cast to fp16 first, as DeepSpeed's."""
        if self.train_config.fp16.enabled and self.train_config.fp16.auto_cast:
            args, kwargs = to_half(args), to_half(kwargs)
        with self.comms.waits.span("zpp.forward"):
            return self.module(*args, **kwargs)

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{what}(): this engine was built without an optimizer (for evaluation); "
                               "pass optimizer= or set config['optimizer'] to train")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (``scale_wrt_gas=False``: of
        ``loss``; times the loss scale under fp16, in fp32, as DeepSpeed's); with sharded
        gradients, flush the units whose gradients did not all arrive (see [Note: stage 3
        hooks] in :mod:`zpp.zero.hooks`), then release every gathered unit. Returns the loss
        divided by the accumulation steps (as given with ``scale_wrt_gas=False``), as
        DeepSpeed 0.19.8 does."""
        self._require_optimizer("backward")
        gas = self.train_config.gradient_accumulation_steps
        returned = scaled = loss / gas if gas > 1 and scale_wrt_gas else loss
        for m in self.modes:
            scaled = m.scale_loss(scaled)
        with self.comms.waits.span("zpp.backward"):
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException:
                self._drop_reductions()  # a failed pass (an OOM the caller skips) leaves nothing behind
                raise
            if self.policy.reduce_each_micro_step:
                for u in self.units:
                    if u.trainable and (not u.reduced or u.has_unreduced_grads):
                        u.reduce_grads()
                self._wait_reductions()
        self._prefetch.end_pass()
        for u in self.units:
            u.reset_micro_step()
            u.release()
            if not u.trainable:  # left out of model_parameters but requires_grad
                for p in u.params:
                    p.grad = None
        return returned

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at the accumulation boundary (see [Note: the accumulation
        boundary] in :mod:`zpp.zero.deepspeed_methods`) reduce (unless reduced at every
        micro-step), check the gradients on every rank, then either skip the step (see
        [Note: skipped steps]) or unscale and clip them, run the optimizer on the master
        shards, publish the new weights and advance the schedule
        (``lr_scheduler.step(**lr_kwargs)``); the modes' hooks run between (see [Note:
        modes] in :mod:`zpp.zero.modes.base`)."""
        self._require_optimizer("step")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with self.comms.waits.span("zpp.step"):
            self._boundary_step(lr_kwargs)

    def _boundary_step(self, lr_kwargs: dict | None) -> None:
        """:meth:`step` at the accumulation boundary."""
        self._wait_reductions()  # started by the hooks of a backward not run by engine.backward
        if self.train_config.train_batch_size is not None:
            self.global_samples += self.train_config.train_batch_size
        trained = [u for u in self.units if u.trainable]
        if not self.policy.reduce_each_micro_step:
            for u in trained:
                u.reduce_grads()
                u.reduced = False
            self._wait_reductions()
        for m in self.modes:
            m.after_reduce(trained)
        clip, scale = self.train_config.gradient_clipping, self._grad_scale()
        check = check_grads(trained, world=self.world, clip=clip, sharded=self.comms.degree > 1,
                            local=not self.comms.reduce.averages, scale=scale,
                            waiting=lambda: self.comms.waits.waiting("norm", "gradient norm"))
        if not check.finite:
            self._skip_step(trained)
            return
        self.last_grad_norm = unscale_and_clip(trained, norm=check.norm, clip=clip, scale=scale,
                                               unscaled=check.unscaled)
        for m in self.modes:
            m.before_optimizer_step(trained)
        for u in trained:
            u.stage_grad()
        if not any(m.optimizer_step(self.optimizer, trained) for m in self.modes):
            self.optimizer.step()
        for m in self.modes:
            m.after_optimizer_step(trained)
        for u in trained:
            u.publish()
        self.comms.weights_changed()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self._step_applied = True
        self._count_step()
        self.monitor.write_step(self)

    def _wait_reductions(self) -> None:
        """Wait for the reductions on the reduction thread (overlap_comm) and add them up;
        every unit's, before the first failure is raised."""
        if self.comms.reducer is None:
            return
        failure = None
        for u in self.units:
            try:
                u.finish_reductions()
            except BaseException as exc:  # noqa: BLE001 - the rest are waited, then it is raised
                u.drop_reductions()
                failure = failure or exc
        self.comms.reducer.forget_done()
        if failure is not None:
            raise failure

    def _drop_reductions(self) -> None:
        """Every unit's :meth:`~zpp.zero.unit.Unit.drop_reductions`: a failed backward,
        ``zero_grad``."""
        if self.comms.reducer is None:
            return
        for u in self.units:
            u.drop_reductions()
        self.comms.reducer.forget_done()

    def link_waits(self) -> dict[str, float]:
        """Seconds this rank's training thread waited on communication since the last call,
        per phase (``forward_gather``, ``backward_gather``, ``exact_gather``, ``reduce``, ``norm``,
        ``publish``, ``metadata``); see :class:`~zpp.zero.reduce.overlap.LinkWaits`."""
        return self.comms.waits.take()

    def _grad_scale(self) -> float:
        """The factor the gradients carry from the loss (the fp16 loss scale), 1 without."""
        scale = 1.0
        for m in self.modes:
            if m.grad_scale != 1.0:
                scale = m.grad_scale
        return scale

    def _skip_step(self, trained: list[Unit]) -> None:
        """The step's gradients are not finite on some rank (every rank agrees, see
        :mod:`zpp.zero.gradnorm`): drop them, count, let the modes know (the fp16 loss scale
        moves), log, raise if the config says so. See [Note: skipped steps]."""
        step = self.global_steps + 1
        for u in trained:
            u.drop_grad()
            if u.flat.master is not None:
                u.flat.master.grad = None
        self.comms.weights_changed()  # as after a step: the next passes gather as they would
        self.last_grad_norm = float("inf")
        self.skipped_steps += 1
        self._count_step()
        notes = []
        try:
            for m in self.modes:
                note = m.on_skipped_step(trained)  # may raise (fp16: the scale cannot go lower)
                if note:
                    notes.append(note)
        finally:
            for m in self.modes:
                m.after_skipped_step()
        if self.world.rank == 0:
            what = f"[zpp] OVERFLOW! Skipping optimizer step {step}: gradients hold NaN or Inf on some rank"
            if notes:
                logger.info(f"{what}; {'; '.join(notes)} (skipped so far: {self.skipped_steps})")
            else:
                logger.warning(f"{what} (skipped so far: {self.skipped_steps})")
        self.monitor.write_step(self)
        if self.train_config.zpp.nonfinite == "raise" and not any(m.expects_overflows for m in self.modes):
            raise NonFiniteGradientError(
                f"zpp: optimizer step {step} (micro-step {self.micro_steps}): gradients hold NaN or Inf on some "
                "rank; the step was not applied on any rank (zpp.nonfinite='raise'; 'skip' skips such steps)")

    def _count_step(self) -> None:
        self.global_steps += 1
        spp = self.train_config.steps_per_print
        if spp and self.global_steps % spp == 0 and self.job_world.rank == 0:
            print(f"[zpp] step={self.global_steps} skipped={self.skipped_steps} lr={self.get_lr()} "
                  f"grad_norm={self.last_grad_norm}", flush=True)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (both ``.grad`` and the reduced shards, and the
        reductions still in flight)."""
        self._drop_reductions()
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.drop_grad()
            u.host_grads.clear()
            u.reset_micro_step()
        for m in self.modes:
            m.zero_grad()

    @property
    def replicas(self) -> int:
        """Replicas of the model the job trains: one per node in the hierarchical mode (its
        data-parallel world is the node), else 1."""
        return self.job_world.world_size // self.world.world_size

    @property
    def replica(self) -> int:
        """Which replica this rank trains (ranks are node-major)."""
        return self.job_world.rank // self.world.world_size

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """What stage 3 prefetch did (counts of prefetched, used, dropped gathers and of
        passes that fell back); see [Note: stage 3 prefetch] in :mod:`zpp.zero.prefetch`."""
        return self._prefetch.stats

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model ``state_dict`` (every key, tied names included), on every rank.
        Collective with sharded parameters (gathers one unit at a time). In the hierarchical
        mode: this node's replica, gathered inside the node."""
        return checkpoint.consolidated_state_dict(self)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now; see :func:`zpp.zero.memory.model_state_bytes`."""
        return model_state_bytes(self.units, self.optimizer, self.modes, self.comms.gathers.values())

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

    def close(self, gather_weights: bool = True) -> None:
        """Remove every hook the engine installed and, with sharded parameters, gather them
        back (collective: every rank calls it): the module holds its full weights again and
        may be trained or wrapped anew. The modes' work in flight is finished first (the
        hierarchical mode's syncs: their updates are not applied).

        ``gather_weights=False`` leaves sharded parameters empty instead (nothing is
        gathered, and with ``offload_param`` nvme the shards' file is removed): for a model
        that does not fit in memory whole, after its last ``save_checkpoint``."""
        for m in getattr(self, "modes", ()):
            m.close()
        comms = getattr(self, "comms", None)
        if comms is not None and comms.reducer is not None:
            comms.reducer.close()
        if self.policy.shard_parameters and self.hooks.handles:
            self._prefetch.end_pass()
            for u in self.units:
                if gather_weights:
                    u.gather(Phase.EXACT)
                else:
                    u.pinned = 0
                    u.drop_started()
                    u.release()
            if not gather_weights and self.job_world.rank == 0:
                log.info("zpp: engine closed without gathering its sharded parameters: they hold empty tensors")
        if comms is not None:
            comms.weights_changed(replaced=True)  # the gathers let go of what they keep (hpZ's copies)
        self.hooks.remove()
        if comms is not None and comms.params_swap is not None:
            comms.params_swap.close()
