"""1-bit optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB, for replicated data-parallel models.

>>> opt = zpp.optim.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=400, transport=world)
>>> loss.backward(); opt.step()          # no DDP wrapper: step() does the communication
>>> opt = zpp.optim.build("OneBitLamb", model.parameters(), freeze_step=400)   # config path

Names and defaults follow DeepSpeed's (``freeze_step``, ``comm_backend_name``, ...). Each
rank must save its own ``state_dict()`` (error-feedback buffers are per rank).
"""
from __future__ import annotations

import torch

from zpp.optim._common import COMM_BACKENDS, FusedOneBitOptimizer
from zpp.optim.onebit_adam import OneBitAdam
from zpp.optim.onebit_lamb import OneBitLamb
from zpp.optim.zero_one_adam import ZeroOneAdam

__all__ = ["COMM_BACKENDS", "OPTIMIZERS", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "build"]

#: DeepSpeed optimizer ``type`` names -> classes (lookup ignores case, as DeepSpeed's does).
OPTIMIZERS: dict[str, type[FusedOneBitOptimizer]] = {
    "OneBitAdam": OneBitAdam,
    "ZeroOneAdam": ZeroOneAdam,
    "OneBitLamb": OneBitLamb,
}


def build(name: str, params, **kwargs) -> torch.optim.Optimizer:
    """The optimizer called ``name`` (e.g. a DeepSpeed config's ``optimizer.type``) over
    ``params``, with ``kwargs`` (its ``optimizer.params``, plus ``transport=``)."""
    by_lower = {k.lower(): v for k, v in OPTIMIZERS.items()}
    cls = by_lower.get(str(name).lower())
    if cls is None:
        raise ValueError(f"zpp.optim.build: unknown optimizer {name!r}; choices: {sorted(OPTIMIZERS)}")
    return cls(params, **kwargs)
