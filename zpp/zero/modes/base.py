"""The mode protocol: what a training mode may add to the engine's step and checkpoints.

[Note: modes]
A mode is a way of training that changes what happens around the engine's collectives but
not the collectives themselves (those are the strategies of :mod:`zpp.zero.gather` and
:mod:`zpp.zero.reduce`): fp16 loss scaling, the 1-bit optimizers, ZeRO-Offload, the
hierarchical outer sync. Each is one :class:`Mode` subclass in its own file of this package
and one line in ``MODES``; the engine builds those whose :meth:`Mode.build` returns an
object, in registry order, and calls every hook of each (the base hooks do nothing). So the
step reads, in :meth:`zpp.zero.engine.ZeroEngine.step`:

    reduce, ``after_reduce``, check and clip, ``before_optimizer_step``, the optimizer step,
    ``after_optimizer_step``, publish

and a skipped step (see [Note: skipped steps] in :mod:`zpp.zero.engine`) calls
``on_skipped_step`` instead of the three. Nothing in the engine or the checkpoint code names
a mode (as Lightning's trainer names no precision plugin, and as
``torch.distributed.checkpoint`` iterates over ``Stateful`` objects).

[Note: mode state in checkpoints]
A mode's state joins a checkpoint under one of three reshard rules, chosen by what it is:

* **per element of a unit's shard** (:meth:`Mode.unit_state`): saved in the shard files with
  the unit's optimizer state under ``"<name>.<key>"``, so it reshards like it (any world
  size, stage or bucket size); :meth:`Mode.load_unit_state` receives it for the range this
  rank owns now (None: the checkpoint has none, or the optimizer state is not loaded);
* **per rank** (``per_rank_file``): each rank writes ``<per_rank_file>_rankNNNNN.pt``
  holding ``{rank, world_size, save_id, <per_rank_key>: state_dict()}``; a load at the same
  job world size gives each rank its own, at another every rank gets rank 0's
  (``own=False``), and :meth:`Mode.check_state` may refuse it before anything changes;
* **replicated** (neither): rank 0 writes ``state_dict()`` into ``meta.pt``'s
  ``step_state[<name>]``, and every rank loads it.

A mode that keeps the optimizer's state itself (``owns_optimizer_state``: the 1-bit
optimizers over their own fused buffers) tells the loader not to set the optimizer's state
from the shard files.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zpp.comm.transport import Transport
    from zpp.zero.config import TrainConfig
    from zpp.zero.engine import ZeroEngine
    from zpp.zero.unit import Unit

__all__ = ["Mode"]


class Mode:
    """A training mode's hooks and state; every hook does nothing by default. See [Note: modes].

    Subclasses set :attr:`name` and implement :meth:`build`; the engine passes itself to
    :meth:`build` once its units and optimizer exist (a mode keeps what it needs of it)."""

    name: str = ""
    """The registry name; also the key of the mode's state in checkpoints."""
    per_rank_file: str | None = None
    """With per-rank state: the file name's prefix (see [Note: mode state in checkpoints])."""
    per_rank_key: str | None = None
    """The key of the state in the per-rank file (Default: :attr:`name`)."""
    owns_optimizer_state: bool = False
    """The optimizer's state is the mode's (its per-rank file), not the shard files'."""
    expects_overflows: bool = False
    """Non-finite gradients are part of the mode (dynamic loss scaling): ``zpp.nonfinite:
    "raise"`` does not raise for them."""
    grad_scale: float = 1.0
    """The factor the gradients carry from the loss (the fp16 loss scale); the engine
    divides it out before clipping."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def data_parallel_world(cls, world: Transport, config: TrainConfig) -> Transport:
        """The world ZeRO shards over when this mode is configured (Default: ``world``).
        Called before any unit exists (collective: every rank calls it)."""
        del config
        return world

    @classmethod
    def build(cls, engine: ZeroEngine) -> Mode | None:
        """The mode for ``engine``, or None when its config does not ask for it."""
        raise NotImplementedError(f"{cls.__name__}.build")

    # ------------------------------------------------------------------ the step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor ``backward`` runs on (Default: ``loss``)."""
        return loss

    def after_reduce(self, trained: Sequence[Unit]) -> None:
        """At the accumulation boundary, the gradients reduced, before they are checked."""

    def before_optimizer_step(self, trained: Sequence[Unit]) -> None:
        """The gradients checked, unscaled and clipped, before the optimizer steps."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, trained: Sequence[Unit]) -> bool:
        """Step ``optimizer`` in the mode's own way and return True, or return False to let the
        engine call ``optimizer.step()`` (the first mode that returns True steps it)."""
        del optimizer, trained
        return False

    def after_optimizer_step(self, trained: Sequence[Unit]) -> None:
        """After the optimizer stepped, before the engine publishes the masters."""

    def on_skipped_step(self, trained: Sequence[Unit]) -> str | None:
        """A step skipped for non-finite gradients (their gradients already dropped); may
        raise. Returns a note for the engine's log line, or None."""
        return None

    def after_skipped_step(self) -> None:
        """After every mode's :meth:`on_skipped_step` ran or one of them raised."""

    def zero_grad(self) -> None:
        """``engine.zero_grad()``: drop what the mode keeps of the gradients."""

    def close(self) -> None:
        """``engine.close()``: finish the mode's work in flight."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Any:
        """The per-rank or replicated state (see [Note: mode state in checkpoints])."""
        return None

    def check_state(self, state: Any, *, own: bool, path: str, where: str) -> Any:
        """Read phase of a load: the per-rank state read from the file ``path`` (None: the
        file is missing; ``where`` describes it for messages); raise to refuse it (no engine
        has changed yet). Returns what :meth:`load_state_dict` gets."""
        del own, path, where
        return state

    def load_state_dict(self, state: Any, *, own: bool) -> None:
        """Restore :meth:`state_dict`'s state (None: the checkpoint has none, or the
        optimizer state is not loaded). ``own``: the per-rank state is this rank's."""

    def swapped_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Optimizer state of ``unit``'s master that the mode keeps outside the optimizer
        between steps (the NVMe tier), saved with the optimizer's own under its own keys."""
        del unit
        return {}

    def after_load(self) -> None:
        """A checkpoint was loaded into the units and the optimizer."""

    def unit_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Per-element state of ``unit``'s shard (tensors of ``shard_numel`` elements)."""
        return {}

    def load_unit_state(self, unit: Unit, state: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`unit_state` for the range this rank owns now."""

    def optimizer_state_loaded(self, unit: Unit) -> None:
        """A load has just set ``unit``'s optimizer state (before the next unit's is built);
        :meth:`after_load` follows once every unit is loaded."""

    def state_bytes(self, nbytes: Callable[[torch.Tensor | None], int]) -> dict[str, int]:
        """Bytes of model states the mode holds, by :func:`zpp.zero.memory.model_state_bytes`'s
        keys (``nbytes`` counts each storage once)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
