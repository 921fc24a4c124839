"""Collectives that follow a tuning plan (see :mod:`zpp.comm.plan`, made by ``zpp tune``).

    from zpp.comm import tuned
    tuned.all_gather(full, shard, transport=world)            # plain, int8 or int4 qwZ
    tuned.reduce_scatter(grad_shard, grad, topology=topo)     # plain or int8/int4 qgZ (mean)
    tuned.all_reduce(m, transport=world, onebit=ef)            # plain, int8/int4 or 1-bit (mean)
    tuned.choices()            # {"all_gather/int8": 12, "all_reduce/none": 3, ...}

Each call looks up the plan's choice for its message size (the logical bytes, as ``zpp
bench`` counts them: the all-gather's output, the reduce-scatter's and all-reduce's input)
on the backend of the transport it is given: the best compression the plan measured on that
backend, else the plan's overall choice. ``plan=None`` reads ``$ZPP_TUNE_FILE`` (cached
until the file changes); with no plan at all every call is the plain collective. Every call
is counted under ``"op/compression"`` in :func:`choices`, so what ran is never a guess.

Results match the corresponding collective exactly: ``Transport.all_gather``,
``Transport.reduce_scatter(op="mean")`` and ``Transport.all_reduce(op="mean")`` for plain,
:func:`~zpp.comm.collectives.quantized_all_gather` /
:func:`~zpp.comm.collectives.quantized_reduce_scatter` /
:func:`~zpp.comm.collectives.quantized_all_reduce` with the plan's quantization group size
for int8/int4, and the caller's :class:`~zpp.comm.onebit.OneBitAllReduce` for 1bit
(whose error-feedback buffers must live across steps, so the caller owns it; a plan that
chooses 1bit for a call without ``onebit=`` raises ValueError).

A plan made for another world size raises ValueError naming both sizes; one made for the
same size but another number of ranks per node warns (its timings may not carry over).
"""
from __future__ import annotations

import os
import warnings
from collections import Counter

import torch

from zpp.comm.collectives import quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.plan import TunePlan, load_plan
from zpp.comm.transport import Transport

__all__ = ["all_gather", "all_reduce", "choices", "reduce_scatter", "reset_choices"]

_BITS = {"int8": 8, "int4": 4}
_CHOICES: Counter[str] = Counter()


def choices() -> dict[str, int]:
    """Calls so far in this process, by ``"op/compression"`` actually run."""
    return dict(_CHOICES)


def reset_choices() -> None:
    _CHOICES.clear()


def _resolve(plan: TunePlan | str | os.PathLike | None) -> TunePlan | None:
    if plan is None:
        return load_plan()
    if isinstance(plan, TunePlan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise TypeError(f"plan must be a TunePlan, a path or None, not {type(plan).__name__}")


def _pick(plan: TunePlan | str | os.PathLike | None, op: str, nbytes: int,
          transport: Transport) -> tuple[str, TunePlan | None]:
    """The compression to run (and the plan it came from); the caller counts it when it runs."""
    plan = _resolve(plan)
    compress = "none"
    if plan is not None:
        plan.check_world(transport.world_size, what=f"the {transport.name} transport")
        nodes = len(set(transport.nodes)) or 1
        if transport.world_size // nodes != plan.world.ranks_per_node:
            warnings.warn(
                f"{plan.source}: the plan was measured with {plan.world.ranks_per_node} ranks per node, this "
                f"{transport.name} world has {transport.world_size // nodes}; its choices may not be the fastest here",
                stacklevel=3,
            )
        try:
            compress = plan.choose(op, nbytes, backend=transport.name).compress
        except KeyError:  # the plan did not tune this op: plain
            compress = "none"
    return compress, plan


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(out: torch.Tensor, shard: torch.Tensor, *, transport: Transport,
               plan: TunePlan | str | os.PathLike | None = None) -> torch.Tensor:
    """``out`` (``world_size * shard.numel()`` elements) receives every rank's shard, plain
    or quantized (qwZ) as the plan chooses for ``out``'s bytes. Returns ``out``."""
    compress, plan = _pick(plan, "all_gather", _nbytes(out), transport)
    _CHOICES[f"all_gather/{compress}"] += 1
    if compress == "none":
        transport.all_gather(out, shard)
    else:
        quantized_all_gather(out, shard, transport=transport, bits=_BITS[compress], group_size=plan.group_size)
    return out


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, *, topology,
                   plan: TunePlan | str | os.PathLike | None = None) -> torch.Tensor:
    """``out`` (``ceil(inp.numel() / world_size)`` elements) receives this rank's slice of the
    MEAN of every rank's ``inp``, plain (``topology.world.reduce_scatter``) or two-hop
    quantized (qgZ) as the plan chooses for ``inp``'s bytes. Any ``inp`` size, as
    :func:`~zpp.comm.collectives.quantized_reduce_scatter` (the plain path zero-pads).
    Returns ``out``."""
    world = topology.world
    compress, plan = _pick(plan, "reduce_scatter", _nbytes(inp), world)
    _CHOICES[f"reduce_scatter/{compress}"] += 1
    if compress != "none":
        return quantized_reduce_scatter(out, inp, topology=topology, bits=_BITS[compress],
                                        group_size=plan.group_size)
    W, n = world.world_size, inp.numel()
    s = -(-n // W)
    if out.numel() != s:
        raise ValueError(f"tuned.reduce_scatter: out has {out.numel()} elements, expected "
                         f"ceil(inp.numel() / world_size) = ceil({n} / {W}) = {s}")
    if n != s * W:  # the same zero-padded layout as qgZ
        padded = torch.zeros(s * W, dtype=inp.dtype, device=inp.device)
        padded[:n] = inp.reshape(-1)
        inp = padded
    world.reduce_scatter(out, inp, op="mean")
    return out


def all_reduce(t: torch.Tensor, *, transport: Transport, plan: TunePlan | str | os.PathLike | None = None,
               onebit: OneBitAllReduce | None = None) -> torch.Tensor:
    """Replace ``t`` by the MEAN over ranks, plain, int8/int4 (quantized reduce-scatter and
    all-gather over ``topology_of(transport)``) or 1-bit compressed with error feedback as
    the plan chooses for ``t``'s bytes. 1bit runs ``onebit(t)`` (the caller's stateful
    :class:`~zpp.comm.onebit.OneBitAllReduce` for this tensor); ValueError when the plan
    chooses 1bit and none is given. Returns ``t``."""
    nbytes = _nbytes(t)
    compress, plan = _pick(plan, "all_reduce", nbytes, transport)
    if compress == "1bit":
        if onebit is None:
            raise ValueError(
                f"{plan.source}: the plan chooses 1bit for an all-reduce of {nbytes} bytes, which needs "
                f"error-feedback state that lives across steps: pass onebit=OneBitAllReduce({t.numel()}, "
                f"transport) (one per tensor, kept by the caller)"
            )
        _CHOICES["all_reduce/1bit"] += 1
        return onebit(t)
    if compress in _BITS:
        from zpp.comm.topology import topology_of

        _CHOICES[f"all_reduce/{compress}"] += 1
        return quantized_all_reduce(t, topology=topology_of(transport), bits=_BITS[compress],
                                    group_size=plan.group_size)
    _CHOICES["all_reduce/none"] += 1
    transport.all_reduce(t, op="mean")
    return t
