"""The 1-bit optimizers as a mode: the optimizer steps per-parameter views of the masters and
keeps its state (error feedback, phase, counters, its own weights) per rank.

See [Note: 1-bit optimizers] in :mod:`zpp.zero.optimizer` for how the engine is built around
them (the ``local`` gradient reduction, the views). In the step the mode hands each view its
slice of the unit's gradient before the optimizer steps and drops it after; in checkpoints
see [Note: 1-bit optimizer state].

[Note: 1-bit optimizer state]
Each rank saves ``onebit_optim_rankR.pt``, its optimizer ``state_dict`` (error-feedback
buffers, phase and counters, and its own weights, which differ between ranks between 0/1
Adam's syncs). At the same world size every rank restores its own file and weights; at
another world size every rank loads rank 0's (the replicated state; error feedback
restarts, and the optimizer warns). The shard files' per-unit optimizer state is not the
optimizer's (``owns_optimizer_state``). A checkpoint without the file (saved with another
optimizer) is refused with ``FileNotFoundError``, one over other sizes with ``ValueError``,
before anything is loaded.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zpp.optim._common import FusedOneBitOptimizer
from zpp.zero.modes.base import Mode
from zpp.zero.optimizer import OneBitView
from zpp.zero.unit import Unit


class OneBitMode(Mode):
    """The engine's 1-bit optimizer and its views (``engine.onebit_views``)."""

    name = "onebit"
    per_rank_file = "onebit_optim"
    per_rank_key = "optimizer"
    owns_optimizer_state = True

    def __init__(self, engine, views: tuple[OneBitView, ...]) -> None:
        self.engine = engine
        self.optimizer: FusedOneBitOptimizer = engine.optimizer
        self.views = views

    @classmethod
    def build(cls, engine) -> OneBitMode | None:
        views = engine.onebit_views
        return None if views is None else cls(engine, views)

    def before_optimizer_step(self, trained: Sequence[Unit]) -> None:
        for u, slot, v in self.views:
            v.grad = u.flat.grad[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def after_optimizer_step(self, trained: Sequence[Unit]) -> None:
        self.zero_grad()

    def zero_grad(self) -> None:
        for v in self.views:
            v.param.grad = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def check_state(self, state: Any, *, own: bool, path: str, where: str) -> Any:
        opt = self.optimizer
        who = type(opt).__name__
        if state is None:
            raise FileNotFoundError(
                f"load_checkpoint: {path} missing: the checkpoint holds no {who} state (saved with "
                "another optimizer?); pass load_optimizer_states=False to load the weights and start the optimizer "
                "afresh")
        groups = [len(g["params"]) for g in state.get("param_groups", ())]
        if state.get("algorithm") != who or state.get("numel") != opt.flat.numel or groups != [
                len(r) for r in opt.flat.group_params]:
            raise ValueError(f"load_checkpoint: {where} holds {state.get('algorithm')} state over "
                             f"{state.get('numel')} elements in groups of {groups}; the engine's {who} has "
                             f"{opt.flat.numel} in {[len(r) for r in opt.flat.group_params]}")
        return state

    def load_state_dict(self, state: Any, *, own: bool) -> None:
        if state is None:
            return
        self.optimizer.load_state_dict(state)
        self.optimizer.flat.write_params()  # this rank's own weights (0/1 Adam's local steps)
        for u in self.engine.units:
            if u.trainable:
                u.publish()

    def state_bytes(self, nbytes) -> dict[str, int]:
        """The optimizer's fused fp32 parameter and gradient copies, moments and error feedback."""
        o = self.optimizer
        owned = [o.flat.master, o.flat.grad, *o.buffers.values()]
        if o.compressor is not None:
            owned += [o.compressor.worker_error, o.compressor.server_error]
        return {"optimizer": sum(nbytes(t) for t in owned)}

