"""ZeRO-Offload as a mode: the reduced gradients' host copies folded before the step.

Where the states live is :class:`~zpp.zero.offload.Offload`'s business (the units place
their masters and shards by it, see [Note: offload] in :mod:`zpp.zero.offload`); what the
step adds is one hook: at the accumulation boundary, wait for the asynchronous copies of the
reduced gradients to the host and add them into the units' host gradients. Built only when
something moves (a CUDA job; on a CPU job the states are in host memory already).
"""
from __future__ import annotations

from collections.abc import Sequence

from zpp.zero.modes.base import Mode
from zpp.zero.offload import settle
from zpp.zero.unit import Unit


class OffloadMode(Mode):
    """Folds the host copies of the reduced gradients (``Unit.host_grads``)."""

    name = "offload"

    @classmethod
    def build(cls, engine) -> OffloadMode | None:
        return cls() if engine.offload.active else None

    def after_reduce(self, trained: Sequence[Unit]) -> None:
        settle()
        for u in trained:
            u.fold_host_grads()
