"""The DeepSpeed-facing entry point: :func:`initialize`.

    engine, optimizer, _, lr_scheduler = zpp.initialize(model=model, config=ds_config)
    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()

Launch one process per rank (``torchrun --nproc-per-node 4 train.py``); the transport is
``zpp.comm.get_transport(config.zpp.transport)`` unless one is passed.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zpp.comm.transport import Transport
from zpp.zero.config import as_config
from zpp.zero.engine import ZeroEngine


def initialize(model: torch.nn.Module, model_parameters: Iterable | None = None, optimizer: Any = None,
               config: Any = None, lr_scheduler: Any = None, *, transport: Transport | None = None,
               training_data: Any = None, config_params: Any = None, **kwargs):
    """DeepSpeed-style entry point.

    Args:
        model: any ``nn.Module`` with fp32 or bf16 parameters, identical on every rank.
        model_parameters: parameters to train (Default: every parameter that requires grad);
            the others stay frozen.
        optimizer: a torch optimizer (rebuilt with its ``defaults`` over the master shards)
            or a factory ``params -> optimizer``, when the config has no "optimizer".
        config: a DeepSpeed dict, a JSON path, or a :class:`TrainConfig`.
        lr_scheduler: a scheduler object or a factory ``optimizer -> scheduler``, when the
            config has no "scheduler".
        transport: the transport to run on (Default: ``zpp.comm.get_transport(config.zpp.transport)``).

    Returns:
        ``(engine, optimizer, None, lr_scheduler)``, like ``deepspeed.initialize``.
    """
    if kwargs:
        raise TypeError(f"zpp.initialize: unexpected arguments {sorted(kwargs)}")
    if training_data is not None:
        raise NotImplementedError("zpp.initialize: training_data= (a DeepSpeed data loader) is not implemented")
    if config is not None and config_params is not None:
        raise ValueError("zpp.initialize: pass config or config_params, not both")
    cfg = as_config(config if config is not None else config_params)
    if transport is None:
        from zpp.comm import registry

        transport = registry.get_transport(cfg.zpp.transport)
    engine = ZeroEngine(model, config=cfg, world=transport, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        trainable=_trainable_ids(model_parameters))
    return engine, engine.optimizer, None, engine.lr_scheduler


def _trainable_ids(model_parameters: Iterable | None) -> set[int] | None:
    if model_parameters is None:
        return None
    ids: set[int] = set()
    for item in model_parameters:
        if isinstance(item, dict):
            extra = sorted(set(item) - {"params", "name"})
            if extra:
                raise NotImplementedError(
                    f"zpp.initialize: parameter groups with their own options ({extra}) are not supported")
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else ps
            ids.update(id(p) for p in ps)
        else:
            ids.add(id(item))
    return ids
