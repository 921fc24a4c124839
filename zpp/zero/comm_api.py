"""The two pluggable collectives of a unit: how weights are gathered, how gradients are reduced.

A unit (:mod:`zpp.zero.unit`) holds a flat buffer cut into shards; the engine picks, once,
one :class:`WeightGather` per :class:`Phase` and one :class:`GradReduce` (see
:func:`zpp.zero.gather.build_gathers` and :func:`zpp.zero.reduce.build_reduce`) and every
unit calls them. A new variant is one file in ``zpp/zero/gather/`` or ``zpp/zero/reduce/``
and one line in that package's registry; a config names it (``zpp.weight_gather``,
``zpp.gradient_reduce``).
"""
from __future__ import annotations

import abc
import dataclasses
import enum
from typing import TYPE_CHECKING

import torch

from zpp.comm.transport import Transport, Work
from zpp.zero.config import TrainConfig

if TYPE_CHECKING:
    from zpp.comm.topology import Topology
    from zpp.zero.gather.hpz import Secondaries
    from zpp.zero.shard import FlatLayout, FlatShard


class Phase(enum.Enum):
    """Why a unit's full weights are gathered."""

    FORWARD = "forward"
    """Before a module's forward (ZeRO++'s qwZ may quantize it)."""
    BACKWARD = "backward"
    """Before a module's backward (full precision; hpZ keeps it inside the node)."""
    EXACT = "exact"
    """Full precision from the primary shards, never from a secondary copy (consolidating
    a state dict, reading parameters outside training, publishing updated shards)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Comms:
    """What a strategy may communicate over, fixed when the engine is built."""

    world: Transport
    """Every data-parallel rank."""
    topology: Topology | None
    """The node structure of ``world`` when a chosen strategy needs it (``needs``: hpZ,
    qgZ), else None."""
    config: TrainConfig
    """The engine's configuration (bits, group sizes)."""


class WeightGather(abc.ABC):
    """Fills a unit's full flat buffer from the shards of every rank."""

    name: str = ""
    """The registry name (``zpp.weight_gather``)."""
    needs: frozenset[str] = frozenset()
    """The resources it communicates over besides the world (names of
    :data:`zpp.zero.strategies.RESOURCES`: ``"topology"``); the engine builds them."""

    @abc.abstractmethod
    def start(self, flat: FlatShard, full: torch.Tensor) -> Work:
        """Start filling ``full`` (``flat.layout.padded_numel`` elements, ``flat.dtype``)
        from ``flat.shard`` and the other ranks'; return the work to wait for."""

    def finish(self, flat: FlatShard, full: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """After the work completed: keep what the strategy keeps from ``full`` (hpZ's
        secondary slice). Default: nothing."""

    def publish(self, flat: FlatShard) -> Work:
        """Start filling the persistent full buffer ``flat.full`` (of which ``flat.shard`` is
        a view) with every rank's updated shard, exactly: the step's publish at stages 1-2
        and for persistent units at stage 3. Only the :attr:`Phase.EXACT` gather is asked."""
        raise NotImplementedError(f"{type(self).__name__}.publish: this gather cannot publish updated shards")

    def kept(self, flat: FlatShard) -> list[torch.Tensor]:
        """What the strategy keeps for ``flat`` between gathers (for memory accounting).
        Default: nothing."""
        return []

    def weights_changed(self, flat: FlatShard | None = None, *,  # noqa: B027 - optional hook
                        replaced: bool = False) -> None:
        """The shards changed (an optimizer step, a skipped one; ``replaced``: set from outside
        the training, a checkpoint load or ``GatheredParameters``' modification): drop what
        the strategy keeps of ``flat`` (None: of every unit), or mark it out of date. Default:
        nothing."""

    def resumable(self) -> Secondaries | None:
        """What the strategy keeps across optimizer steps that a checkpoint must hold for a
        resumed run to continue bit for bit (the delta refresh's copies); None (the default):
        nothing, it rebuilds what it keeps from the loaded weights."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Reduction:
    """A gradient reduction started by :meth:`GradReduce.start`; :meth:`wait` returns its
    result (this rank's range of the mean) once the transport work behind it is done. The
    result is the caller's: a tensor the strategy keeps no reference to and never writes again
    (the unit makes the first one its gradient without a copy).

    [Note: reductions return work]
    The transports have no non-blocking reduce-scatter or all-to-all yet, so every
    strategy runs its reduction at :meth:`GradReduce.start` and returns a done
    ``Reduction``, except qgZ, which leaves its inter-node hop to ``wait()`` (a
    :attr:`GradReduce.pipelined` strategy). The overlap with the backward comes from the engine instead: with
    ``overlap_comm`` it runs ``start`` on a communication thread and hands the unit a
    :class:`~zpp.zero.reduce.overlap.ThreadReduction` to wait on (see [Note: overlapped
    reductions] in :mod:`zpp.zero.reduce.overlap`)."""

    __slots__ = ("_result", "_work", "held_numel")

    def __init__(self, result: torch.Tensor, work: Work | None = None, held_numel: int | None = None) -> None:
        self._result = result
        self._work = work
        #: fp32 elements' worth of memory the part left to ``wait()`` holds (None: the whole
        #: input until ``wait()`` returns); the overlapped reductions' memory bound reads it
        self.held_numel = held_numel

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        return self._result


class GradReduce(abc.ABC):
    """Averages a unit's flat fp32 gradient over the ranks into what this rank keeps."""

    name: str = ""
    """The registry name (``zpp.gradient_reduce``)."""
    needs: frozenset[str] = frozenset()
    """The resources it communicates over besides the world (see :attr:`WeightGather.needs`)."""
    averages: bool = True
    """The result is the mean over the ranks; False: each rank keeps its own gradient (the
    optimizer averages: 1-bit), which the gradient check treats as local."""
    pipelined: bool = False
    """What :meth:`start` leaves to the reduction's ``wait()`` runs over communicators that
    ``start`` does not use, so one reduction's ``wait()`` may run beside the next one's
    ``start`` on another thread (qgZ's inter-node hop beside the next unit's intra-node hop;
    see [Note: qgZ's hops pipelined] in :mod:`zpp.comm.collectives`)."""

    @abc.abstractmethod
    def start(self, flat: torch.Tensor, layout: FlatLayout) -> Reduction:
        """Start the reduction of ``flat``, this rank's gradient of the whole unit,
        ``layout.padded_numel`` fp32 elements (the callee may reuse it). Its ``wait()`` gives
        the mean over ranks of the range this rank owns (``layout.shard_numel`` elements;
        all of it when ``layout.degree`` is 1). See [Note: reductions return work]."""

    def __call__(self, flat: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        """:meth:`start`, waited for."""
        return self.start(flat, layout).wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
