"""Activation checkpointing: the config's ``activation_checkpointing`` section.

Scripts reach it by DeepSpeed's names, ``deepspeed.checkpointing`` (:mod:`zpp.checkpointing`,
which adds Megatron's RNG tracker)::

    import zpp.checkpointing as checkpointing           # deepspeed.checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    h = checkpointing.checkpoint(block, h)              # inside a model's forward

:func:`checkpoint` runs ``function(*args)`` without keeping its activations and runs it again
in backward (``torch.utils.checkpoint``, re-entrant like DeepSpeed's, RNG state restored).
At ZeRO stage 3 the re-run forward gathers its parameters again through the engine's
hooks (see [Note: stage 3 hooks] in :mod:`zpp.zero.hooks`).

The ``activation_checkpointing`` config section, by field:

* ``partition_activations``: DeepSpeed splits checkpointed activations across the ranks of
  a model-parallel group. zpp has no model parallelism (every rank holds whole
  activations), so there is nothing to split: accepted, logged once.
* ``cpu_checkpointing``: the tensors a checkpoint keeps for backward are moved to host
  memory (``torch.autograd.graph.save_on_cpu``, pinned) and back when backward needs
  them. On a CPU job they are in host memory already.
* ``contiguous_memory_optimization`` / ``number_checkpoints``: DeepSpeed copies the kept
  activations into one preallocated buffer against fragmentation; zpp leaves placement to
  the allocator: accepted, logged once.
* ``synchronize_checkpoint_boundary``: the device is synchronized before and after each
  checkpointed forward (CUDA; a no-op on CPU).
* ``profile``: each checkpointed forward and its re-run in backward are timed and logged
  (rank 0, the ``zpp`` logger at INFO).

The engine calls :func:`configure` with its config when the section is present, as
DeepSpeed's engine does; a script may call it itself (Megatron-style).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tuc

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

log = logging.getLogger("zpp.checkpointing")

_settings: Any = None  # the ActivationCheckpointingConfig in force, None until configure()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set the checkpointing options, as ``deepspeed.checkpointing.configure``: from
    ``deepspeed_config`` (a DeepSpeed dict, JSON path or :class:`~zpp.zero.config.TrainConfig`),
    then the keyword arguments that are not None. ``mpu_`` (model parallelism) must be None."""
    global _settings
    import dataclasses

    from zpp.zero.config import ActivationCheckpointingConfig, TrainConfig

    if mpu_ is not None:
        raise NotImplementedError("zpp.checkpointing.configure: mpu_ (model parallelism) is not implemented; "
                                  "pass None")
    if deepspeed_config is None:
        base = ActivationCheckpointingConfig()
    elif isinstance(deepspeed_config, TrainConfig):
        base = deepspeed_config.activation_checkpointing
    else:
        from zpp.zero.deepspeed_config import from_deepspeed

        base = from_deepspeed(deepspeed_config).activation_checkpointing
    overrides = {k: v for k, v in (("partition_activations", partition_activations),
                                   ("contiguous_memory_optimization", contiguous_checkpointing),
                                   ("number_checkpoints", num_checkpoints), ("cpu_checkpointing", checkpoint_in_cpu),
                                   ("synchronize_checkpoint_boundary", synchronize), ("profile", profile))
                 if v is not None}
    _settings = dataclasses.replace(base, **overrides)
    if _settings.partition_activations:
        log.info("activation_checkpointing.partition_activations: no model-parallel group to split "
                 "activations over in zpp; each rank keeps its own whole")
    if _settings.contiguous_memory_optimization or _settings.number_checkpoints is not None:
        log.info("activation_checkpointing.contiguous_memory_optimization/number_checkpoints: zpp leaves the "
                 "placement of kept activations to the allocator")


def is_configured() -> bool:
    """Whether :func:`configure` was called (since the last :func:`reset`)."""
    return _settings is not None


def reset() -> None:
    """Forget the configuration (DeepSpeed also frees its contiguous buffers here)."""
    global _settings
    _settings = None


def checkpoint(function: Callable, *args) -> Any:
    """``function(*args)`` without keeping its activations; re-run in backward (re-entrant,
    as DeepSpeed's). Honors the configured options (see the module docstring)."""
    return _run(function, args, reentrant=True)


def non_reentrant_checkpoint(function: Callable, *args) -> Any:
    """As :func:`checkpoint`, on torch's non-re-entrant implementation (DeepSpeed's name)."""
    return _run(function, args, reentrant=False)


def _run(function: Callable, args: tuple, reentrant: bool) -> Any:
    s = _settings
    offload = s is not None and s.cpu_checkpointing and any(
        isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
    sync = s is not None and s.synchronize_checkpoint_boundary and torch.cuda.is_available()
    profile = s is not None and s.profile
    fn = _timed(function) if profile else function
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
    with ctx:  # a re-entrant checkpoint keeps only its inputs: offload needs the non-re-entrant one
        out = tuc.checkpoint(fn, *args, use_reentrant=reentrant and not offload, preserve_rng_state=True)
    if sync:
        torch.cuda.synchronize()
    if profile:
        log.info("checkpoint %s: forward %.3f ms", getattr(function, "__name__", type(function).__name__),
                 (time.perf_counter() - start) * 1e3)
    return out


def _timed(function: Callable) -> Callable:
    """``function``, logging the time of each run inside backward (the re-computation)."""
    name = getattr(function, "__name__", type(function).__name__)

    def run(*args):
        if torch._C._current_graph_task_id() == -1:
            return function(*args)
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            log.info("checkpoint %s: recompute %.3f ms", name, (time.perf_counter() - start) * 1e3)

    return run
