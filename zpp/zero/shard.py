"""Flat shard state: where a unit's parameters live, one explicit object per unit.

A unit's parameters are laid end to end in one flat buffer (:class:`FlatLayout`), padded so
that it splits into ``degree`` equal, aligned shards; rank ``r`` owns shard ``r``. The
tensors a rank holds for the unit, and whether the full buffer is currently materialized,
live in a :class:`FlatShard`; nothing is stored on the ``nn.Parameter`` objects except
their ``.data``, which points into the full buffer while it is gathered.

[Note: what each stage holds]
With ``P`` the padded unit size and ``S = P / degree`` the shard size:

========  ==================  ===================  ==========================================
stage     full buffer (P)     shard (S)            master (fp32, S)
========  ==================  ===================  ==========================================
0         persistent          = full (degree 1)    aliases full if fp32, else its own copy
1, 2      persistent          view of full         aliases the shard if fp32, else a copy
3         only while gathered own storage          aliases the shard if fp32, else a copy
========  ==================  ===================  ==========================================

Gradients are accumulated in fp32 over the owned range (``FlatShard.grad``) and handed to
the optimizer as ``master.grad``. The padding positions always hold zeros in parameters,
gradients and optimizer state.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

#: Shards are padded to a multiple of this many elements (keeps int4 payloads byte-aligned
#: and quantization groups even).
SHARD_ALIGN = 16


class ShardState(enum.Enum):
    """Whether the unit's full flat buffer is materialized on this rank."""

    SHARDED = "sharded"
    """Only the owned shard is held; parameters' ``.data`` are empty (stage 3 between uses)."""
    GATHERING = "gathering"
    """An asynchronous gather (a prefetch) is writing into ``full``; parameters' ``.data``
    are still empty. The unit's :meth:`~zpp.zero.unit.Unit.gather` waits for it."""
    GATHERED = "gathered"
    """The full buffer is valid and every parameter's ``.data`` is a view of it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in the flat buffer."""

    name: str
    """Qualified name of the parameter (its first name when tied)."""
    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    """Offsets of a unit's parameters in the flat buffer, and the shard geometry.

    Args:
        names, shapes: the parameters, in order.
        degree: number of shards (1 for stage 0, the world size otherwise).
    """

    __slots__ = ("slots", "numel", "degree", "shard_numel", "padded_numel")

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], degree: int) -> None:
        if degree < 1:
            raise ValueError(f"FlatLayout: degree={degree} must be >= 1")
        slots, off = [], 0
        for name, shape in zip(names, shapes, strict=True):
            n = 1
            for d in shape:
                n *= int(d)
            slots.append(Slot(name, off, n, torch.Size(shape)))
            off += n
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.numel = off
        self.degree = degree
        per = -(-off // degree)
        self.shard_numel = max(SHARD_ALIGN, -(-per // SHARD_ALIGN) * SHARD_ALIGN)
        self.padded_numel = self.shard_numel * degree

    def owned(self, rank: int) -> slice:
        """The range of the flat buffer that shard ``rank`` covers."""
        if self.degree == 1:
            return slice(0, self.padded_numel)
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a full flat buffer."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def flatten(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """A new zero-padded flat buffer holding ``tensors`` (None reads as zeros)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for s, t in zip(self.slots, tensors, strict=True):
            if t is not None:
                flat[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        return flat

    def __repr__(self) -> str:
        return (f"FlatLayout(params={len(self.slots)}, numel={self.numel}, degree={self.degree}, "
                f"shard_numel={self.shard_numel})")


class FlatShard:
    """What one rank holds for one unit; see [Note: what each stage holds].

    Attributes:
        layout: the unit's flat layout.
        rank: this rank's shard index (0 when ``layout.degree == 1``).
        dtype: the parameters' dtype (fp32 or bf16).
        device: where the parameters compute and the full buffer lives.
        state: :class:`ShardState`.
        full: the full flat buffer (``layout.padded_numel``, ``dtype``) while gathering or
            gathered, else None.
        shard: the owned range in ``dtype``.
        master: fp32 master weights of the owned range (None for frozen units).
        grad: fp32 gradient accumulated over the owned range since the last step, or None.

    What a gather strategy keeps of the weights between gathers (hpZ's secondary shard) is
    the strategy's own (see :mod:`zpp.zero.gather.hpz`).
    """

    __slots__ = ("layout", "rank", "dtype", "device", "state", "full", "shard", "master", "grad")

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        #: where the parameters compute (the shard may live in host memory: ZeRO-Offload)
        self.device = torch.device("cpu") if device is None else device
        self.state = ShardState.SHARDED
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.master: torch.nn.Parameter | None = None
        self.grad: torch.Tensor | None = None

    def compute_shard(self) -> torch.Tensor:
        """The shard on :attr:`device`: itself, or a device copy of a host shard (offloaded
        parameters; made for each gather, not kept)."""
        if self.shard.device == self.device:
            return self.shard
        return self.shard.to(self.device, non_blocking=self.shard.is_pinned())

    @property
    def master_aliases_shard(self) -> bool:
        return self.master is not None and self.master.data_ptr() == self.shard.data_ptr()

    def attach(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Point every parameter at its view of ``full`` (which must be set)."""
        if self.full is None:
            raise RuntimeError("FlatShard.attach: the full buffer is not materialized")
        for p, v in zip(params, self.layout.views(self.full), strict=True):
            p.data = v
        self.state = ShardState.GATHERED

    def detach(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Drop the full buffer; parameters keep an empty tensor until the next gather."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in params:
            p.data = empty
        self.full = None
        self.state = ShardState.SHARDED

    def add_grad(self, g: torch.Tensor, *, owned: bool = False) -> None:
        """Accumulate a reduced gradient of the owned range. ``owned``: nothing else holds
        ``g`` (a reduction's result, see :class:`~zpp.zero.comm_api.Reduction`), so the first
        one becomes ``grad`` as it is (no copy of each unit's shard per step); otherwise it is
        copied."""
        if self.grad is None:
            self.grad = g.float() if g.dtype != torch.float32 else g if owned else g.clone()
        else:
            self.grad.add_(g)

    def __repr__(self) -> str:
        return (f"FlatShard({self.layout!r}, rank={self.rank}, dtype={self.dtype}, "
                f"state={self.state.name})")
