"""The sweep: for every op, size and variant, one checked call, warm-up, timed calls, and one
row of numbers gathered from every rank.

[Note: what a row measures]
* ``size``: logical bytes of one call as the wire counters book them (the output of an
  all-gather, the input of the others); ``count`` its elements. A requested size is rounded
  down to a multiple of ``world * element size`` (at least one element per rank).
* ``time``: each rank times its ``iters`` calls after a barrier and divides by ``iters``;
  the row shows the largest of these means (the slowest rank sets the pace). The
  cross-rank metadata check of the transports is off while timing (it is on for the
  checked call), so the time is the collective's alone.
* ``algbw = size / time``; ``busbw = algbw * factor`` (nccl-tests' factors).
* ``inter`` / ``intra``: bytes a rank sent per timed call to other nodes / its own node,
  from the wire counters; the row shows the largest over ranks.
* ``ratio``: bytes the uncompressed collective sends per rank (``size * factor``: the
  counters' model of the plain op, see [Note: what is counted] in
  :mod:`zpp.comm.counters`) divided by the bytes this variant sent (counters, largest
  rank): 1 for the plain ops, the compression on the wire for the others. The counters' own
  ``logical / wire`` goes to the JSON as ``logical_per_wire``.
* ``#wrong`` and ``maxrelerr`` come from the checked call (see [Note: error bounds] in
  :mod:`zpp.bench.variants`): ``#wrong`` summed over ranks, ``maxrelerr`` =
  max over ranks of max|y - exact| / max over ranks of max|exact|.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import platform
import time
from collections.abc import Callable

import torch

import zpp
from zpp.bench.config import BenchConfig
from zpp.bench.variants import Env, Variant, select
from zpp.comm.transport import Transport

__all__ = ["Row", "count_for", "iterations", "run_sweep", "sweep_meta"]

#: Sizes up to this many bytes run the full warmup/iters; larger ones proportionally fewer.
FULL_ITERS_BYTES = 1 << 20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATS = 7  # time, wrong, max_err, max_exact, inter, intra, logical


@dataclasses.dataclass(slots=True)
class Row:
    """One line of the table (see [Note: what a row measures])."""

    op: str
    compress: str
    size: int
    count: int
    dtype: str
    time_us: float
    algbw: float
    """GB/s (1e9 bytes per second), as nccl-tests."""
    busbw: float
    wrong: int
    inter_bytes: int
    intra_bytes: int
    wire_bytes: int
    ratio: float | None
    """None where nothing is sent by either (one rank)."""
    logical_per_wire: float | None
    maxrelerr: float
    max_abs_err: float
    warmup: int
    iters: int


def count_for(size: int, world: int, element_size: int) -> int:
    """Elements of a call of about ``size`` bytes: a positive multiple of ``world``."""
    return max(1, size // (element_size * world)) * world


def iterations(size: int, warmup: int, iters: int) -> tuple[int, int]:
    """(warmup, iters) at ``size`` bytes: as given up to ``FULL_ITERS_BYTES``, then shrunk in
    proportion to the size, so each large size costs about the same time; at least one
    timed call (and one warm-up call when ``warmup > 0``)."""
    if size <= FULL_ITERS_BYTES:
        return warmup, iters
    scale = FULL_ITERS_BYTES / size
    return (max(1, math.ceil(warmup * scale)) if warmup else 0), max(1, math.ceil(iters * scale))


def sweep_meta(cfg: BenchConfig, world: Transport, topology, backend: str) -> dict:
    """The header block: what ran, where, when."""
    from zpp.quant.dispatch import kernels_for

    kernels = kernels_for(torch.device("cpu"))
    variants, _ = select(cfg.ops, cfg.compress)
    return {
        "zpp": zpp.__version__,
        "torch": torch.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "backend": backend,
        "transport": str(getattr(world, "backend", None) or type(world).__name__),  # e.g. gloo
        "world_size": world.world_size,
        "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "dtype": cfg.dtype,
        "sizes": list(cfg.sizes),
        "warmup": cfg.warmup,
        "iters": cfg.iters,
        "full_iters_up_to_bytes": FULL_ITERS_BYTES,
        "group_size": cfg.group_size,
        "seed": cfg.seed,
        "quant_kernels": getattr(kernels, "NAME", None) or getattr(kernels, "__name__", type(kernels).__name__),
        "variants": [{"op": v.op, "compress": v.compress, "counter": v.counter, "wrong_means": v.bound}
                     for v in variants],
    }


def run_sweep(
    cfg: BenchConfig,
    world: Transport,
    topology,
    *,
    on_op: Callable[[str], None] | None = None,
    on_row: Callable[[Row], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Run the sweep on every rank of ``world`` (collective). Returns the rows on rank 0 and
    ``[]`` elsewhere; ``on_op`` / ``on_row`` are called on rank 0 as ops start and rows are
    ready (the table is printed while the sweep runs)."""
    variants, _ = select(cfg.ops, cfg.compress)
    if not variants:
        raise ValueError(f"nothing to run for ops={cfg.ops} compress={cfg.compress}")
    dtype = _DTYPES[cfg.dtype]
    env = Env(world=world, topology=topology, dtype=dtype, group_size=cfg.group_size, seed=cfg.seed)
    esize = torch.empty((), dtype=dtype).element_size()
    lead = world.rank == 0
    rows: list[Row] = []
    for op in cfg.ops:
        mine = [v for v in variants if v.op == op]
        if not mine:
            continue
        if lead and on_op:
            on_op(op)
        for size in cfg.sizes:
            count = count_for(size, world.world_size, esize)
            for v in mine:
                if lead and progress:
                    progress(f"{op} {v.compress} {count * esize} B")
                row = _measure(cfg, env, v, count)
                if lead:
                    rows.append(row)
                    if on_row:
                        on_row(row)
    return rows


def _measure(cfg: BenchConfig, env: Env, v: Variant, count: int) -> Row | None:
    """One row (collective): checked call, warm-up, timed calls, stats from every rank.
    The row on rank 0, None elsewhere."""
    world = env.world
    case = v.make(env, count)
    checked = case.check()
    warmup, iters = iterations(count * env.dtype.itemsize, cfg.warmup, cfg.iters)
    transports = _transports(env)
    saved = [t.check_metadata for t in transports]
    for t in transports:
        t.check_metadata = False
    try:
        for _ in range(warmup):
            case.run()
        world.counters.reset()
        world.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            case.run()
        elapsed = (time.perf_counter() - start) / iters
        stats = world.counters.snapshot().get(v.counter)
    finally:
        for t, flag in zip(transports, saved):
            t.check_metadata = flag
    calls = stats.calls if stats and stats.calls else 1
    mine = torch.tensor(
        [elapsed, checked.wrong, checked.max_err, checked.max_exact,
         stats.inter_bytes / calls if stats else 0, stats.intra_bytes / calls if stats else 0,
         stats.logical_bytes / calls if stats else 0],
        dtype=torch.float64,
    )
    everyone = torch.empty(world.world_size * _STATS, dtype=torch.float64)
    world.all_gather(everyone, mine)
    world.counters.reset()
    if world.rank != 0:
        return None
    return _row(v, env, count, everyone.view(world.world_size, _STATS), warmup, iters)


def _row(v: Variant, env: Env, count: int, stats: torch.Tensor, warmup: int, iters: int) -> Row:
    W = env.world.world_size
    t, wrong, err, exact, inter, intra, logical = (stats[:, i] for i in range(_STATS))
    seconds = float(t.max())
    size = int(logical[0]) or count * env.dtype.itemsize
    factor = v.bus_factor(W)
    wire = int((inter + intra).max())
    algbw = size / seconds / 1e9 if seconds > 0 else float("inf")
    max_exact = float(exact.max())
    max_err = float(err.max())  # NaN if any rank saw NaN
    return Row(
        op=v.op,
        compress=v.compress,
        size=size,
        count=count,
        dtype=str(env.dtype).removeprefix("torch."),
        time_us=seconds * 1e6,
        algbw=algbw,
        busbw=algbw * factor,
        wrong=int(wrong.sum()),
        inter_bytes=int(inter.max()),
        intra_bytes=int(intra.max()),
        wire_bytes=wire,
        ratio=size * factor / wire if wire else None,
        logical_per_wire=size / wire if wire else None,
        maxrelerr=max_err / max_exact if max_exact > 0 else (0.0 if max_err == 0 else float("inf")),
        max_abs_err=max_err,
        warmup=warmup,
        iters=iters,
    )


def _transports(env: Env) -> list[Transport]:
    """The world and the topology's sub-transports (whose metadata checks are paused)."""
    found = [env.world]
    for name in ("intra", "inter"):
        t = getattr(env.topology, name, None)
        if t is not None and all(t is not f for f in found):
            found.append(t)
    return found
