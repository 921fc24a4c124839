"""The benchmarked variants: each (op, compression) pair, the call it times, the exact
collective it is checked against and the error bound that decides ``#wrong``.

| op | none | int8 / int4 | 1bit |
|---|---|---|---|
| all_gather | ``Transport.all_gather`` | ``quantized_all_gather`` (qwZ) | |
| reduce_scatter | ``Transport.reduce_scatter`` (mean); 2hop: ``hierarchical_reduce_scatter`` | ``quantized_reduce_scatter`` (qgZ) | |
| all_reduce | ``Transport.all_reduce`` (mean) | ``quantized_all_reduce`` (qgZ, then qwZ of the mean) | ``OneBitAllReduce`` |
| all_to_all | ``Transport.all_to_all`` | | |

[Note: inputs]
A call of ``count`` logical elements gives every rank ``count`` elements (all_reduce,
all_to_all, reduce_scatter) or ``count / world`` (all_gather), generated as ``world`` blocks
(one for all_gather) of ``randn * (1 + src % 4)`` from a seed of (seed, op, count, rank,
block). Any rank can regenerate any rank's block, so the exact result is computed locally,
in fp32 from the values actually sent (after the cast to the benchmark dtype), without
communication and outside the timed loop. A rank regenerates ``count`` elements for the
first three ops and ``world * count`` for all_reduce, like nccl-tests' expected values.

[Note: error bounds]
``#wrong`` counts, per rank, the elements of its output outside the variant's bound (NaN
and Inf are always outside); the table sums the ranks. With ``eps`` the machine epsilon of
the benchmark dtype and ``step = 2**bits - 2``:

* all_gather and all_to_all, none: any difference from the exact result.
* reduce_scatter and all_reduce, none (and reduce_scatter 2hop, which sums in fp32 and rounds
  once): ``eps * (sum_r |x_r| + |exact|)``, the rounding of a ``world``-term sum in the
  benchmark dtype (backends add in any order).
* all_gather, int8/int4: ``absmax(g) / step``, ``g`` the element's quantization group in the
  source rank's shard (half the quantization step of a symmetric code).
* reduce_scatter, int8/int4 (qgZ), per group ``g`` of the rank's slice:
  ``(sum_r absmax_r(g) + sum_nodes absmax(partial_node(g))) / step / world``; the second
  term only when both hops run (more than one node and more than one rank per node), with
  ``absmax(partial)`` bounded by the exact node sum's absmax plus its first-stage error.
* all_reduce, int8/int4: per slice of the mean (the rank that reduced it), the reduce-scatter's
  bound above plus ``absmax(|exact mean| + that bound)`` of the slice's group over ``step``
  (the all-gather's requantization of the mean).
* all_reduce, 1bit: no element-wise bound exists (one sign and one scale per chunk is an
  approximation by design; error feedback repays it over later calls). Wrong elements are
  the non-finite ones and those that differ from rank 0's result (every rank must hold the
  same replica). ``maxrelerr`` shows the approximation of one call from zero error buffers.

Float rounding of the dequantize and sum arithmetic (fp32) and of the output dtype is added
to the quantized bounds: ``eps * (|exact| + bound)`` plus a few fp32 ulps of the summed
magnitudes.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from zpp.bench.config import VARIANT_NAMES, applicable
from zpp.comm.collectives import (
    effective_group_size, hierarchical_reduce_scatter, quantized_all_gather, quantized_all_reduce,
    quantized_reduce_scatter,
)
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.transport import Transport

__all__ = ["Case", "Check", "Env", "Variant", "VARIANTS", "select"]

_EPS32 = torch.finfo(torch.float32).eps


class Check(NamedTuple):
    """One rank's comparison of one call's output with the exact collective."""

    wrong: int
    max_err: float
    """max |y - exact| over this rank's output."""
    max_exact: float
    """max |exact| over this rank's output."""


@dataclasses.dataclass(slots=True)
class Case:
    """A variant at one size, its buffers allocated."""

    run: Callable[[], object]
    """One call of the collective, as timed."""
    check: Callable[[], Check]
    """One call on fresh inputs, compared with the exact result (never timed)."""


@dataclasses.dataclass(slots=True)
class Env:
    """What every variant builds on."""

    world: Transport
    topology: object
    """:class:`zpp.comm.topology.Topology` of ``world`` (qgZ's two hops)."""
    dtype: torch.dtype
    group_size: int
    seed: int

    def block(self, op: str, count: int, src: int, index: int, numel: int) -> torch.Tensor:
        """Block ``index`` of rank ``src``'s input, in the benchmark dtype (see [Note: inputs])."""
        key = f"{self.seed}:{op}:{count}:{src}:{index}".encode()
        g = torch.Generator().manual_seed(zlib.crc32(key))
        return (torch.randn(numel, generator=g) * (1 + src % 4)).to(self.dtype)

    def blocks(self, op: str, count: int, src: int) -> torch.Tensor:
        """Rank ``src``'s whole input: ``world`` blocks of ``count / world`` elements."""
        W = self.world.world_size
        return torch.cat([self.block(op, count, src, b, count // W) for b in range(W)])

    @property
    def eps(self) -> float:
        return torch.finfo(self.dtype).eps


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    op: str
    compress: str
    counter: str
    """The :class:`~zpp.comm.counters.WireCounters` key its traffic is booked under."""
    build: Callable[[Env, int, "Variant"], Case]
    bound: str
    """What ``#wrong`` counts for it (see [Note: error bounds])."""
    bits: int = 0

    def bus_factor(self, world: int) -> float:
        """nccl-tests' busbw factor: all_reduce ``2(n-1)/n``, the others ``(n-1)/n``."""
        if self.op == "all_reduce":
            return 2 * (world - 1) / world
        return (world - 1) / world

    def make(self, env: Env, count: int) -> Case:
        """Buffers and calls for ``count`` logical elements (a multiple of the world size)."""
        return self.build(env, count, self)


# ---------------------------------------------------------------------------- checks
def _compare(y: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor | None) -> Check:
    """Elements of ``y`` outside ``exact +- tol`` (``tol=None``: any difference)."""
    yf = y.reshape(-1).float()
    if yf.numel() == 0:
        return Check(0, 0.0, 0.0)
    diff = (yf - exact).abs()
    bad = (yf != exact) if tol is None else ~(diff <= tol)  # NaN is always bad
    return Check(int(bad.sum()), float(diff.max()), float(exact.abs().max()))


def _group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per element, the absmax of its quantization group (groups start at ``x[0]``)."""
    n = x.numel()
    groups = -(-n // group_size)
    padded = torch.zeros(groups * group_size)
    padded[:n] = x.abs()
    return padded.view(groups, group_size).amax(1).repeat_interleave(group_size)[:n]


def _sum_tolerance(env: Env, parts: list[torch.Tensor], exact: torch.Tensor) -> torch.Tensor:
    total_abs = torch.zeros_like(exact)
    for p in parts:
        total_abs += p.abs()
    return env.eps * (total_abs + exact.abs())


def _quantized_tolerance(env: Env, exact: torch.Tensor, bound: torch.Tensor, terms: int) -> torch.Tensor:
    """``bound`` plus output rounding and the fp32 arithmetic of ``terms`` summed values."""
    return bound + env.eps * (exact.abs() + bound) + 4 * terms * _EPS32 * bound


# ---------------------------------------------------------------------------- all_gather
def _all_gather(env: Env, count: int, v: Variant) -> Case:
    t, W = env.world, env.world.world_size
    n = count // W
    shard = env.block(v.op, count, t.rank, 0, n)
    out = torch.empty(count, dtype=env.dtype)

    def call(dst: torch.Tensor) -> None:
        if v.bits:
            quantized_all_gather(dst, shard, transport=t, bits=v.bits, group_size=env.group_size)
        else:
            t.all_gather(dst, shard)

    def check() -> Check:
        y = torch.full((count,), float("nan"), dtype=env.dtype)
        call(y)
        shards = [env.block(v.op, count, j, 0, n).float() for j in range(W)]
        exact = torch.cat(shards)
        if not v.bits:
            return _compare(y, exact, None)
        step = 2**v.bits - 2
        bound = torch.cat([_group_absmax(s, env.group_size) for s in shards]) / step
        return _compare(y, exact, _quantized_tolerance(env, exact, bound, 1))

    return Case(run=lambda: call(out), check=check)


# ---------------------------------------------------------------------------- reduce_scatter
def _reduce_scatter(env: Env, count: int, v: Variant) -> Case:
    t, W = env.world, env.world.world_size
    s = count // W
    inp = env.blocks(v.op, count, t.rank)
    out = torch.empty(s, dtype=env.dtype)

    def call(dst: torch.Tensor) -> None:
        if v.bits:
            quantized_reduce_scatter(dst, inp, topology=env.topology, bits=v.bits,
                                     group_size=env.group_size)
        elif v.compress == "2hop":
            hierarchical_reduce_scatter(dst, inp, topology=env.topology)
        else:
            t.reduce_scatter(dst, inp, op="mean")

    def check() -> Check:
        y = torch.full((s,), float("nan"), dtype=env.dtype)
        call(y)
        mine = [env.block(v.op, count, j, t.rank, s).float() for j in range(W)]  # my slice, every rank
        exact = _ordered_sum(mine) / W
        if not v.bits:
            return _compare(y, exact, _sum_tolerance(env, mine, exact))
        return _compare(y, exact, _qgz_tolerance(env, mine, exact, v.bits))

    return Case(run=lambda: call(out), check=check)


def _qgz_tolerance(env: Env, mine: list[torch.Tensor], exact: torch.Tensor, bits: int) -> torch.Tensor:
    """The two-stage bound of [Note: error bounds], per element of this rank's slice."""
    W = len(mine)
    R, N = env.topology.ranks_per_node, env.topology.nodes
    gs, step = env.group_size, 2**bits - 2
    amax = [_group_absmax(x, gs) for x in mine]
    total = _ordered_sum(amax)
    if R > 1 and N > 1:  # hop 1 requantizes each node's partial sum
        for node in range(N):
            members = range(node * R, (node + 1) * R)
            partial = _ordered_sum([mine[j] for j in members])
            first_error = _ordered_sum([amax[j] for j in members]) / step  # constant per group
            total = total + _group_absmax(partial, gs) + first_error
    bound = total / step / W
    return _quantized_tolerance(env, exact, bound, W + N)


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc


# ---------------------------------------------------------------------------- all_reduce
def _exact_mean(env: Env, op: str, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = [env.blocks(op, count, j).float() for j in range(env.world.world_size)]
    return _ordered_sum(inputs) / len(inputs), inputs


def _all_reduce(env: Env, count: int, v: Variant) -> Case:
    t = env.world
    inp = env.blocks(v.op, count, t.rank)
    work = inp.clone()

    def check() -> Check:
        y = inp.clone()
        t.all_reduce(y, op="mean")
        exact, inputs = _exact_mean(env, v.op, count)
        return _compare(y, exact, _sum_tolerance(env, inputs, exact))

    return Case(run=lambda: t.all_reduce(work, op="mean"), check=check)


def _quantized_all_reduce(env: Env, count: int, v: Variant) -> Case:
    t, W = env.world, env.world.world_size
    inp = env.blocks(v.op, count, t.rank)
    work = inp.clone()

    def call(y: torch.Tensor) -> None:
        quantized_all_reduce(y, topology=env.topology, bits=v.bits, group_size=env.group_size)

    def check() -> Check:
        y = inp.clone()
        call(y)
        exact, inputs = _exact_mean(env, v.op, count)
        s, step = count // W, 2**v.bits - 2
        gs = effective_group_size(env.group_size, s)
        bound = []
        for j in range(W):  # slice j: reduced by rank j, then requantized for the all-gather
            ex = exact[j * s:(j + 1) * s]
            rs = _qgz_tolerance(env, [x[j * s:(j + 1) * s] for x in inputs], ex, v.bits)
            bound.append(rs + _group_absmax(ex.abs() + rs, gs) / step)
        bound = torch.cat(bound)
        return _compare(y, exact, _quantized_tolerance(env, exact, bound, 1))

    return Case(run=lambda: call(work), check=check)


def _onebit_all_reduce(env: Env, count: int, v: Variant) -> Case:
    t = env.world
    inp = env.blocks(v.op, count, t.rank)
    work = inp.clone()
    timed = OneBitAllReduce(count, t)

    def check() -> Check:
        y = inp.clone()
        OneBitAllReduce(count, t)(y)  # zero error buffers: one call's approximation
        replica = y.clone()
        t.broadcast(replica, 0)
        exact, _ = _exact_mean(env, v.op, count)
        yf = y.float()
        bad = ~torch.isfinite(yf) | (y != replica)
        return Check(int(bad.sum()), float((yf - exact).abs().max()), float(exact.abs().max()))

    return Case(run=lambda: timed(work), check=check)


# ---------------------------------------------------------------------------- all_to_all
def _all_to_all(env: Env, count: int, v: Variant) -> Case:
    t, W = env.world, env.world.world_size
    s = count // W
    inp = env.blocks(v.op, count, t.rank)
    out = torch.empty(count, dtype=env.dtype)

    def check() -> Check:
        y = torch.full((count,), float("nan"), dtype=env.dtype)
        t.all_to_all(y, inp)
        exact = torch.cat([env.block(v.op, count, i, t.rank, s).float() for i in range(W)])
        return _compare(y, exact, None)

    return Case(run=lambda: t.all_to_all(out, inp), check=check)


# ---------------------------------------------------------------------------- the table
_EXACT = "any difference from the exact result"
_SUM = "outside the rounding of a world-term sum: eps*(sum_r|x_r|+|exact|)"
_QWZ = "outside absmax(source group)/(2^bits-2)"
_QGZ = "outside (sum_r slice-group absmax + sum_nodes partial absmax)/(2^bits-2)/world"
_QAR = "outside the qgZ bound of its slice plus absmax(slice group of the mean)/(2^bits-2)"
_ONEBIT = "non-finite, or differs from rank 0's result (no element-wise bound)"

VARIANTS: dict[tuple[str, str], Variant] = {
    (v.op, v.compress): v
    for v in (
        Variant(op="all_gather", compress="none", counter="all_gather", build=_all_gather, bound=_EXACT),
        Variant(op="all_gather", compress="int8", counter="quantized_all_gather", build=_all_gather,
                bound=_QWZ, bits=8),
        Variant(op="all_gather", compress="int4", counter="quantized_all_gather", build=_all_gather,
                bound=_QWZ, bits=4),
        Variant(op="reduce_scatter", compress="none", counter="reduce_scatter", build=_reduce_scatter,
                bound=_SUM),
        Variant(op="reduce_scatter", compress="2hop", counter="hierarchical_reduce_scatter",
                build=_reduce_scatter, bound=_SUM),
        Variant(op="reduce_scatter", compress="int8", counter="quantized_reduce_scatter",
                build=_reduce_scatter, bound=_QGZ, bits=8),
        Variant(op="reduce_scatter", compress="int4", counter="quantized_reduce_scatter",
                build=_reduce_scatter, bound=_QGZ, bits=4),
        Variant(op="all_reduce", compress="none", counter="all_reduce", build=_all_reduce, bound=_SUM),
        Variant(op="all_reduce", compress="int8", counter="quantized_all_reduce", build=_quantized_all_reduce,
                bound=_QAR, bits=8),
        Variant(op="all_reduce", compress="int4", counter="quantized_all_reduce", build=_quantized_all_reduce,
                bound=_QAR, bits=4),
        Variant(op="all_reduce", compress="1bit", counter="onebit_all_reduce", build=_onebit_all_reduce,
                bound=_ONEBIT),
        Variant(op="all_to_all", compress="none", counter="all_to_all", build=_all_to_all, bound=_EXACT),
    )
}


assert set(VARIANTS) == {(op, c) for op, cs in VARIANT_NAMES.items() for c in cs}


def select(ops: tuple[str, ...], compress: tuple[str, ...]) -> tuple[list[Variant], list[str]]:
    """The variants of ``ops x compress`` that exist, in op then compression order, and the
    ``"op/compress"`` pairs that do not apply (see :func:`zpp.bench.config.applicable`)."""
    chosen, skipped = applicable(ops, compress)
    return [VARIANTS[k] for k in chosen], skipped
