"""The DeepSpeed-facing entry point: :func:`initialize`, with ``deepspeed.initialize``'s signature.

    engine, optimizer, loader, lr_scheduler = zpp.initialize(args=args, model=model,
                                                             model_parameters=model.parameters(),
                                                             training_data=dataset)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

Launch one process per rank (``torchrun --nproc-per-node 4 train.py``, ``mpiexec -n 4``);
the transport is ``zpp.comm.get_transport(config.zpp.transport)`` unless one is passed.
A ``zpp tune`` plan (``zpp.tune_plan``, else ``$ZPP_TUNE_FILE``) chooses the backend where
nothing above it in [Note: which transport] (:mod:`zpp.comm.registry`) does, and the
ZeRO++ code widths ([Note: the plan in the engine] in :mod:`zpp.zero.plan_bits`). Under
``zpp tune --job`` (``$ZPP_TUNE_TRIAL``) the candidate's sections replace the job's and the
process ends after the trial's steps ([Note: tune trials] in :mod:`zpp.zero.trial`).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from zpp.comm.plan import TUNE_FILE_ENV, TunePlan, load_plan
from zpp.comm.transport import Transport
from zpp.zero.config import TrainConfig
from zpp.zero.deepspeed_config import deepspeed_dict, from_args
from zpp.zero.engine import ZeroEngine
from zpp.zero.param_groups import ParamGroups
from zpp.zero import trial as tune_trial
from zpp.zero.plan_bits import check_plan_world


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None, config_params: Any = None,
               *, transport: Transport | None = None):
    """Build a :class:`~zpp.zero.engine.ZeroEngine`, as ``deepspeed.initialize`` builds its engine.

    Args:
        args: an ``argparse`` namespace; ``args.deepspeed_config`` names the config when
            ``config`` is None (``zpp.add_config_arguments`` adds it), ``args.zpp_config`` a
            JSON file of zpp's own keys.
        model: any ``nn.Module`` with fp32, bf16 or fp16 parameters. Weights that differ
            between ranks are replaced by rank 0's (``zpp.check_parameters``).
        optimizer: a torch optimizer (the engine steps this object, its groups pointed at
            the fp32 master shards, so a scheduler built on it keeps working; see [Note: the
            caller's optimizer] in :mod:`zpp.zero.optimizer`) or a factory ``param_groups ->
            optimizer``, when the config has no "optimizer". With neither, the engine is for
            evaluation: ``backward`` and ``step`` raise, the returned optimizer is None.
        model_parameters: what to train: parameters, a generator of them, or parameter-group
            dicts with their own options (``weight_decay``, ``lr``, the 1-bit optimizers'
            ``exp_avg_mask``); the others are frozen (Default: every parameter that requires
            grad). Ignored when ``optimizer`` is a torch optimizer: its groups decide, as in
            DeepSpeed.
        training_data: a ``torch.utils.data.Dataset``; the third return value is then a
            ``DataLoader`` over it with a ``DistributedSampler`` and the config's
            ``train_micro_batch_size_per_gpu`` (with ``collate_fn``).
        lr_scheduler: a scheduler object or a factory ``optimizer -> scheduler``, when the
            config has no "scheduler".
        distributed_port: accepted for DeepSpeed's signature; the launcher's ``MASTER_PORT``
            (or zpp's launch detection) sets the rendezvous.
        mpu: model parallelism is not implemented: anything but None raises
            ``NotImplementedError``.
        dist_init_required: None or True: the transport initializes ``torch.distributed``
            when it needs it and is not initialized yet; False: the caller initialized it
            (on the torch transport, a ``RuntimeError`` when it did not, as DeepSpeed raises).
        collate_fn: the data loader's ``collate_fn``.
        config: a DeepSpeed dict, a JSON path, or a :class:`~zpp.zero.config.TrainConfig`.
        mesh_param: device meshes are not implemented: anything but None raises
            ``NotImplementedError``.
        config_params: DeepSpeed's older name of ``config``.
        transport: zpp's own: the transport to run on (Default:
            ``zpp.comm.get_transport(config.zpp.transport)``). One whose backend differs
            from the tune plan's is used, with a warning on rank 0 and a note in its
            ``chosen_by``.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``, as DeepSpeed:
        ``training_dataloader`` is None without ``training_data``.
    """
    if model is None:
        raise ValueError("zpp.initialize: model= is required")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zpp.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise NotImplementedError("zpp.initialize: mpu= (model parallelism) is not implemented: zpp is data "
                                  "parallel (ZeRO, ZeRO++), over one world")
    if mesh_param is not None:
        raise NotImplementedError("zpp.initialize: mesh_param= (device meshes) is not implemented")
    if config is not None and config_params is not None:
        raise ValueError("zpp.initialize: pass config or config_params, not both")
    given = config if config is not None else config_params
    trial = tune_trial.active()
    if trial is not None:  # a `zpp tune --job` trial: the candidate's sections over the job's config
        if isinstance(given, TrainConfig):
            raise ValueError("zpp tune --job: the job passes a TrainConfig; a trial needs its config as a DeepSpeed "
                             "dict or JSON file, to put the candidate's sections over it")
        given = tune_trial.apply(deepspeed_dict(args, given), trial)
        if args is not None:
            args = copy.copy(args)
            args.deepspeed_config = args.deepscale_config = None
    cfg = from_args(args, given)
    plan, plan_note = _tune_plan(cfg.zpp.tune_plan)
    if plan is not None and cfg.zpp.tune_plan is None:  # every rank must run the same plan: agreed with the config
        cfg = dataclasses.replace(cfg, zpp=dataclasses.replace(cfg.zpp, tune_plan=plan.path))
    from zpp.comm import registry

    if transport is None and dist_init_required is False:
        from zpp.comm.dist import is_initialized

        backend, _ = registry.resolve_backend(cfg.zpp.transport)
        if backend == "torch" and not is_initialized():
            raise RuntimeError("zpp.initialize(dist_init_required=False): torch.distributed is not initialized; "
                               "initialize it first (zpp.init_distributed()), or leave dist_init_required unset")
    if transport is None:
        timeout = {} if cfg.zpp.timeout_s is None else {"timeout_s": cfg.zpp.timeout_s}
        transport = registry.get_transport(cfg.zpp.transport, plan=plan, **timeout)
    elif plan is not None:
        made = getattr(transport, "chosen_by", None)
        registry.note_override(transport, transport.name, "the transport passed to zpp.initialize"
                               + (f" (chosen by {made})" if made else ""), plan)
    if plan is not None:
        if plan_note is not None and transport.rank == 0:
            warnings.warn(plan_note, UserWarning, stacklevel=2)
        check_plan_world(plan, transport)
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = ParamGroups.of_optimizer(optimizer)
    elif optimizer is None and cfg.optimizer is None:  # for evaluation: nothing trains
        groups = ParamGroups.none()
    else:
        groups = ParamGroups.of(model_parameters)
    engine = ZeroEngine(model, config=cfg, world=transport, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        groups=groups, ds_config=deepspeed_dict(args, given), tune_plan=plan)
    loader = engine.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
    engine.training_dataloader = loader
    if trial is not None:
        tune_trial.attach(engine, trial)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _tune_plan(path: str | None) -> tuple[TunePlan | None, str | None]:
    """The plan in force: the config's ``zpp.tune_plan``, else ``$ZPP_TUNE_FILE``'s, else
    None; and, when both name different files, the warning that the config's wins."""
    env = os.environ.get(TUNE_FILE_ENV) or None
    if path is None:
        return load_plan(), None
    note = None
    if env is not None and os.path.realpath(env) != os.path.realpath(path):
        note = (f"zpp.initialize: the config's zpp.tune_plan={path!r} overrides ${TUNE_FILE_ENV}={env!r}; "
                f"the job follows {path!r}")
    return load_plan(path), note
