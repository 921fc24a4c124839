"""DeepSpeed's engine methods that the front-ends call beside the training path, with
DeepSpeed 0.19.8's names, signatures and return values, as a mixin of
:class:`~zpp.zero.engine.ZeroEngine`.

Who calls what (see ``shared/FRONTENDS.md``): accelerate sets the accumulation boundary
before every backward and calls ``step()`` only at the boundary; accelerate and the Trainer
export a ZeRO-3 model through ``zero_gather_16bit_weights_on_model_save()`` and
``_zero3_consolidated_16bit_state_dict()``; Lightning and scripts call
``save_16bit_model``; ``empty_partition_cache`` and ``destroy`` end a phase or a run.

[Note: the accumulation boundary]
DeepSpeed decides at each ``backward``/``step`` whether this micro-batch ends an
accumulation: by default when ``(micro_steps + 1) % gradient_accumulation_steps == 0``,
where ``micro_steps`` counts ``step()`` calls; after ``set_gradient_accumulation_boundary(b)``
it is ``b`` until set again. accelerate sets it before every backward and calls ``step()``
only when it is True, so ``micro_steps`` counts optimizer steps there and the optimizer
steps once per ``gradient_accumulation_steps`` micro-batches all the same; counting
``step()`` calls against the config instead (as zpp did) stepped half as often.
"""
from __future__ import annotations

import os

import torch

__all__ = ["DeepSpeedMethods"]


class DeepSpeedMethods:
    """Mixed into :class:`~zpp.zero.engine.ZeroEngine`; reads ``config``, ``policy``,
    ``micro_steps``, ``module``, ``units``, ``job_world`` and ``_boundary``."""

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the micro-batches from now on end an accumulation (until set again); see
        [Note: the accumulation boundary]."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary: is_boundary={is_boundary!r} must be a bool")
        self._boundary = is_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-batch ends an accumulation: the value set by
        :meth:`set_gradient_accumulation_boundary`, else ``(micro_steps + 1) %
        gradient_accumulation_steps == 0``."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.train_config.gradient_accumulation_steps == 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save``: whether a ZeRO-3 model
        is exported whole (front-ends ask before :meth:`_zero3_consolidated_16bit_state_dict`)."""
        return self.train_config.zero.gather_16bit_weights_on_model_save

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` (stages 0-2: whole on every rank). With sharded
        parameters use :meth:`_zero3_consolidated_16bit_state_dict`."""
        if self.policy.shard_parameters:
            raise ValueError("module_state_dict: the parameters are sharded (ZeRO-3); use "
                             "engine._zero3_consolidated_16bit_state_dict() or engine.consolidated_state_dict()")
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = type(sd)((k, v) for k, v in sd.items() if k not in frozen)
        return sd

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Collective (every rank calls it): the whole model's ``state_dict`` in the model's
        dtype, on the CPU, on rank 0 (tied names share one tensor, non-persistent buffers
        left out, as ``nn.Module.state_dict``); None on the other ranks. ZeRO-3 only."""
        if not self.policy.shard_parameters:
            raise ValueError("_zero3_consolidated_16bit_state_dict: this function requires ZeRO-3 mode")
        from zpp.zero.checkpoint import consolidated_state_dict

        sd = consolidated_state_dict(self, exclude_frozen=exclude_frozen_parameters, shared=True, device="cpu")
        return sd if self.job_world.rank == 0 else None

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: rank 0 writes the whole model's weights (``torch.save`` of the state
        dict) to ``save_dir/save_filename``. Returns False, writing nothing, at ZeRO-3 when
        ``stage3_gather_16bit_weights_on_model_save`` is off (the shards alone are no model)."""
        if self.policy.shard_parameters:
            if not self.zero_gather_16bit_weights_on_model_save():
                from zpp.log import logger

                logger.info(f"Did not save the model {os.path.join(save_dir, save_filename)} because "
                            "stage3_gather_16bit_weights_on_model_save is False")
                return False
            sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        else:
            sd = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.job_world.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(sd, os.path.join(save_dir, save_filename))
        self.job_world.barrier()
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def empty_partition_cache(self) -> None:
        """Release every gathered unit (ZeRO-3), e.g. between training and evaluation."""
        self._prefetch.end_pass()
        for u in self.units:
            u.release()

    def destroy(self) -> None:
        """End the engine: :meth:`close` (hooks removed, a ZeRO-3 module's weights gathered
        back whole, unless its parameters are on NVMe: a model that may not fit in memory
        whole is left empty). DeepSpeed's leaves the module partitioned; zpp hands it back
        usable where it fits."""
        self.close(gather_weights=self.train_config.zero.offload_param.device != "nvme")
