"""zpp's logger, with DeepSpeed's names (``deepspeed.utils.logging``).

    from zpp.utils import logger, log_dist
    log_dist("loaded the data", ranks=[0])

``logger`` is the ``"zpp"`` logger: level INFO (``ZPP_LOG_LEVEL`` overrides), one handler to
stdout, not propagated to the root logger, like DeepSpeed's ``"DeepSpeed"`` logger.
Importing this module does not import torch.
"""
from __future__ import annotations

import functools
import logging
import os
import sys

__all__ = ["get_log_level_from_string", "log_dist", "log_dist_once", "logger", "set_log_level_from_string",
           "should_log_le"]

log_levels = {
    "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
#: Launcher variables holding the process's global rank, in the order they are read.
RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO``; ``ValueError`` naming the string otherwise."""
    level = log_levels.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {list(log_levels)}")
    return level


def _create_logger(name: str, level: int) -> logging.Logger:
    log = logging.getLogger(name)
    log.setLevel(level)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
    return log


logger = _create_logger("zpp", get_log_level_from_string(os.environ.get("ZPP_LOG_LEVEL", "info")))


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set ``logger``'s (or ``custom_logger``'s) level and its handlers' from a name."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def should_log_le(max_log_level_str: str) -> bool:
    """Whether ``logger`` logs messages of level ``max_log_level_str``."""
    return logger.getEffectiveLevel() <= get_log_level_from_string(max_log_level_str)


def process_rank() -> int:
    """This process's global rank: ``torch.distributed``'s if it is initialized, else MPI's
    if mpi4py is initialized, else the launcher's variable (``RANK_VARS``), else -1. Imports
    nothing that is not imported already."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return -1


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` (prefixed ``[Rank r]``) on the ranks listed (``[-1]``: every rank).

    DeepSpeed logs on every rank until ``torch.distributed`` is initialized; zpp knows the
    rank from the launcher before that (see :func:`process_rank`), so ``ranks=[0]`` means
    rank 0 from the start. With no rank known at all (a lone process), it logs.
    """
    rank = process_rank()
    ranks = list(ranks or [])
    if rank == -1 or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")


_ONCE: set[tuple] = set()


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist` once per process for each distinct (message, ranks, level)."""
    key = (message, tuple(ranks) if ranks else None, level)
    if key not in _ONCE:
        _ONCE.add(key)
        log_dist(message, ranks, level)


@functools.lru_cache(None)
def warning_once(*args, **kwargs) -> None:
    """``logger.warning`` once per process for each distinct message (DeepSpeed's
    ``logger.warning_once``)."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once
