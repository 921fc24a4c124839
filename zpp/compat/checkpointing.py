"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing
(:mod:`zpp.zero.activation_checkpointing`, where the options are documented) and the RNG
tracker Megatron-style scripts seed model-parallel dropout with.

    import zpp.checkpointing as checkpointing           # deepspeed.checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    h = checkpointing.checkpoint(block, h)              # inside a model's forward
"""
from __future__ import annotations

import contextlib

import torch

from zpp.zero.activation_checkpointing import checkpoint, configure, is_configured, non_reentrant_checkpoint, reset

__all__ = ["CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "reset"]


# ---------------------------------------------------------------------- RNG (Megatron-style scripts)
class CudaRNGStatesTracker:
    """Named RNG states (DeepSpeed's tracker for model-parallel dropout). zpp has no model
    parallelism, so a forked region draws from its own named state of the default generator
    (CUDA's where available)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: state {name!r} already exists")
        saved = _rng_state()
        _manual_seed(seed)
        self.states_[name] = _rng_state()
        _set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker: state {name!r} is not added")
        saved = _rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _rng_state()
            _set_rng_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator and the tracker's model-parallel state (one model-parallel
    rank: the offset DeepSpeed adds per rank is 0)."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add("model-parallel-rng", seed + 2718)


def _rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
