"""DeepSpeed's engine accessors (``engine.global_rank``, ``train_batch_size()``,
``get_lr()``, ``deepspeed_io``, ...) with its names and return values, as a mixin of
:class:`~zpp.zero.engine.ZeroEngine`: read-only views of the engine's config, world and
counters, kept apart from the training path."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeepSpeedAccessors"]


class DeepSpeedAccessors:
    """Mixed into :class:`~zpp.zero.engine.ZeroEngine`; reads ``config``, ``job_world``,
    ``units``, ``optimizer``, ``loss_scaler``, ``last_grad_norm`` and ``_step_applied``."""

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: Any = None, pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Any = None, num_local_io_workers: int | None = None):
        """A ``DataLoader`` over ``dataset`` for this rank, as DeepSpeed's: a
        ``DistributedSampler`` over the data-parallel ranks (shuffled; call
        ``loader.sampler.set_epoch(e)`` per epoch) unless ``data_sampler`` is given, and
        ``train_micro_batch_size_per_gpu`` samples per batch unless ``batch_size`` is."""
        from torch.utils.data import DataLoader, DistributedSampler

        del route  # DeepSpeed's train/eval routing only picks defaults
        bs = batch_size if batch_size is not None else self.train_config.train_micro_batch_size_per_gpu
        if bs is None:
            raise ValueError("zpp.initialize: training_data= needs train_micro_batch_size_per_gpu (or "
                             "train_batch_size) in the config")
        sampler = data_sampler if data_sampler is not None else DistributedSampler(
            dataset, num_replicas=self.job_world.world_size, rank=self.job_world.rank)
        return DataLoader(dataset, batch_size=bs, sampler=sampler, collate_fn=collate_fn,
                          num_workers=num_local_io_workers or 0,
                          pin_memory=pin_memory and torch.cuda.is_available())

    @property
    def global_rank(self) -> int:
        return self.job_world.rank

    @property
    def world_size(self) -> int:
        return self.job_world.world_size

    @property
    def dp_world_size(self) -> int:
        return self.job_world.world_size

    @property
    def local_rank(self) -> int:
        from zpp.comm.topology import Layout

        return Layout.from_node_keys(self.job_world.rank, self.job_world.nodes).local_rank

    @property
    def device(self) -> torch.device:
        u = next(iter(self.units), None)
        return u.flat.device if u is not None else torch.device("cpu")

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.train_config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        return self.train_config.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.train_config.gradient_accumulation_steps

    def fp16_enabled(self) -> bool:
        return self.train_config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.train_config.precision == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.train_config.zero.stage

    def zero_optimization(self) -> bool:
        return self.train_config.zero.stage > 0

    def optimizer_name(self) -> str | None:
        """The config's optimizer type as DeepSpeed spells it, or the class name of the
        optimizer passed in."""
        from zpp.zero.config import ONEBIT_OPTIMIZERS

        cfg = self.train_config.optimizer
        if cfg is None:
            return type(self.optimizer).__name__
        return ONEBIT_OPTIMIZERS.get(cfg.type, cfg.type)

    def gradient_clipping(self) -> float:
        return self.train_config.gradient_clipping

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the weights: False between accumulation
        boundaries and for a skipped step (DeepSpeed's)."""
        return self._step_applied

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16). DeepSpeed's ``loss_scale()``
        returns the configured ``fp16.loss_scale`` (0 under dynamic scaling); the scale in
        force is what a script wants to log, so zpp returns it (``optimizer.cur_scale``)."""
        return self.loss_scaler.cur_scale

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm
