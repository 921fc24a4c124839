"""DeepSpeed's ``deepspeed.runtime.config``: the :class:`DeepSpeedConfig` object and the
optimizer-name constants, as scripts compare them with ``engine.optimizer_name()``:

    args.use_lamb = engine.optimizer_name() == deepspeed.runtime.config.LAMB_OPTIMIZER
    cfg = deepspeed.runtime.config.DeepSpeedConfig("ds_config.json")
    cfg.train_batch_size, cfg.zero_optimization_stage, cfg.zero_config.offload_param

The values are DeepSpeed's (lower-case names). zpp's engine builds ``ZPP_OPTIMIZERS`` from a
config's ``optimizer.type``; the rest are names DeepSpeed knows and zpp refuses.
"""
from __future__ import annotations

import os
from typing import Any

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]
#: The names zpp's engine builds from a config (``zpp.zero.config.OPTIMIZERS``; "sgd" is
#: torch's, which DeepSpeed reaches through ``torch.optim``).
ZPP_OPTIMIZERS = [ADAM_OPTIMIZER, ADAMW_OPTIMIZER, "sgd", ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER,
                  ONEBIT_LAMB_OPTIMIZER]

# extra parameters of DeepSpeed's Adam/AdamW in the config
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True


class DeepSpeedConfig:
    """A DeepSpeed config (a dict or a JSON path) read as DeepSpeed 0.19.8 reads it, with its
    attribute names, for scripts that build one (``DeepSpeedConfig(config, mpu=None,
    mesh_device=None)``).

    The config goes through zpp's translation (:func:`zpp.zero.from_deepspeed`: the same
    checks, the same errors, what zpp refuses refused) and its batch sizes are resolved for
    the data-parallel world (``torch.distributed``'s world size when it is initialized, else
    1), as ``initialize`` resolves them: ``train_batch_size = micro * gas * world``, any two
    determining the third. ``train_config`` is zpp's typed config; ``zero_config`` is the
    ``zero_optimization`` section as :class:`~zpp.runtime.zero.config.DeepSpeedZeroConfig`.
    ``mpu`` / ``mesh_device`` (model-parallel groups) are refused: zpp's world is all data
    parallel.
    """

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        from zpp.compat.runtime.zero.config import DeepSpeedZeroConfig
        from zpp.zero.deepspeed_config import _load, from_deepspeed

        for name, value in (("mpu", mpu), ("mesh_device", mesh_device)):
            if value is not None:
                raise NotImplementedError(f"DeepSpeedConfig: {name}= is not implemented: zpp's world is all data "
                                          "parallel")
        if isinstance(config, (str, os.PathLike)) and not os.path.exists(config):
            raise ValueError(f"DeepSpeedConfig: {os.fspath(config)!r} is not a file (a dict or a JSON path)")
        self._param_dict = dict(_load(config))
        self.global_rank, self.world_size = _rank_and_world()
        cfg = from_deepspeed(self._param_dict).with_world(self.world_size)
        self._take_batch(cfg)
        self.steps_per_print = cfg.steps_per_print
        self.gradient_clipping = cfg.gradient_clipping
        self.prescale_gradients = bool(self._param_dict.get("prescale_gradients", False))
        self.gradient_predivide_factor = self._param_dict.get("gradient_predivide_factor", 1.0)
        self.gradient_allreduce_op = "mean"
        zero = self._param_dict.get("zero_optimization", {})
        self.zero_config = DeepSpeedZeroConfig(**({"stage": int(zero)} if isinstance(zero, bool) else zero))
        self.zero_optimization_stage = cfg.zero.stage
        self.zero_enabled = cfg.zero.stage > 0
        self.fp16_enabled = cfg.precision == "fp16"
        self.bfloat16_enabled = cfg.precision == "bf16"
        self.fp16_auto_cast = cfg.fp16.auto_cast
        self.loss_scale = cfg.fp16.loss_scale
        optimizer, scheduler = self._param_dict.get("optimizer") or {}, self._param_dict.get("scheduler") or {}
        # as the user wrote them (DeepSpeed's names, lower-cased; zpp's OptimizerConfig may differ:
        # "adam" with adam_w_mode is zpp's "adamw")
        self.optimizer_name = optimizer["type"].lower() if "type" in optimizer else None
        self.optimizer_params = optimizer.get("params") if optimizer else None
        self.scheduler_name = scheduler.get("type")
        self.scheduler_params = scheduler.get("params")
        self.zero_allow_untested_optimizer = bool(self._param_dict.get("zero_allow_untested_optimizer", False))
        self.wall_clock_breakdown = bool(self._param_dict.get("wall_clock_breakdown", False))
        self.memory_breakdown = bool(self._param_dict.get("memory_breakdown", False))
        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.monitor_config = cfg.monitor

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's: resolve ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
        ``gradient_accumulation_steps`` as set on this object (any two determine the third)
        for the world; ``AssertionError`` when they disagree, as DeepSpeed's does."""
        import dataclasses

        if self.train_batch_size is None and self.train_micro_batch_size_per_gpu is None:
            raise AssertionError("DeepSpeedConfig: give train_batch_size or train_micro_batch_size_per_gpu "
                                 f"(gradient_accumulation_steps={self.gradient_accumulation_steps} alone sets "
                                 "no batch)")
        given = dataclasses.replace(self.train_config, train_batch_size=self.train_batch_size,
                                    train_micro_batch_size_per_gpu=self.train_micro_batch_size_per_gpu,
                                    gradient_accumulation_steps=self.gradient_accumulation_steps)
        try:
            self._take_batch(given.with_world(self.world_size))
        except ValueError as e:
            raise AssertionError(str(e)) from e

    def _take_batch(self, cfg) -> None:
        """``cfg`` (batch sizes resolved) becomes ``train_config`` and the batch attributes."""
        self.train_config = cfg
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps

    def print(self, name: str) -> None:
        """Log the config's attributes, as DeepSpeed's ``print``."""
        from zpp.log import logger

        logger.info("%s:", name)
        for key, value in sorted(vars(self).items()):
            if not key.startswith("_"):
                logger.info("  %s %s", key.ljust(30, "."), value)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


__all__ = [name for name in dir() if name.isupper()] + ["DeepSpeedConfig"]
