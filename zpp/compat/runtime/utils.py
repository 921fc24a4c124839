"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that scripts call: ``see_memory_usage``
and ``move_to_device``."""
from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from zpp.compat.accelerator import get_accelerator
from zpp.log import logger, process_rank

__all__ = ["move_to_device", "see_memory_usage"]

_GB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's allocated and peak memory (for the CPU: the
    process's resident and peak resident set), on rank 0 and only with ``force``, then reset
    the peak, as DeepSpeed's does."""
    if not force or process_rank() not in (0, -1):
        return
    gc.collect()
    acc = get_accelerator()
    logger.info("%s | MA %.2f GB Max_MA %.2f GB", message, acc.memory_allocated() / _GB,
                acc.max_memory_allocated() / _GB)
    acc.reset_peak_memory_stats()


def move_to_device(item: Any, device: torch.device | str,
                   criterion_func: Callable[[Any], bool] = lambda x: isinstance(x, torch.Tensor)) -> Any:
    """``item`` with every element for which ``criterion_func`` holds (tensors, by default)
    moved to ``device``, through lists, tuples and dicts."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    return item
