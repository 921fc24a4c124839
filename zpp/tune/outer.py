"""The hierarchical mode's settings from measured all-reduces (``zpp tune --outer-params``):
pure functions, no ranks.

[Note: choosing zpp.outer]
A sync of one fragment moves ``4 Psi / F`` fp32 bytes of pseudo-gradient across the nodes
(``Psi`` trainable elements, ``F`` fragments): each node's ranks all-reduce their shards of it
over the other nodes, which puts on each node link what one world all-reduce of that many
bytes puts there in two hops (reduce inside the node, exchange across, gather inside;
zpp/zero/outer/reduce.py). So ``zpp bench``'s all_reduce row at that size, per compression,
is the sync's time ``t`` (beyond the largest measured size, the last two sizes' time per byte
carries on linearly: large messages are bandwidth-bound; below the smallest, the smallest
size's time). Measured on 2 nodes x 2 at 10 Mbit, that row's int4 sends about 1.5x the
mode's bytes per rank across the nodes (394,752 against about 263 KB per 4 MiB): the advice
errs on the safe side (perf/BENCHMARKS.md, "What limits the mode"). With inner steps of
``s`` seconds and ``HEADROOM`` = 1.25 (a sync 25% slower than measured, or a step 20%
faster, must still not stall the steps):

* ``delay`` (tau) = ``ceil(1.25 t / s)``: the inner steps during which the sync runs in the
  background; with fewer, the step that applies it waits for the link;
* ``sync_every`` (H) = ``max(ceil(1.25 F t / s), tau + 1, 5)``: the link must carry the F
  fragments' syncs of one period within the period's compute, and tau < H (the config's
  rule); never below the mode's default H = 5 (shorter H lost loss: zpp/zero/outer_config.py,
  [Note: the mode's defaults]);
* link busy = ``F t / (H s)`` at that H (at most 0.8 unless tau + 1 or 5 sets H).

The advice is the variant with the smallest H (ties: less compression); 1bit only when
allowed. Fewer inner steps between syncs is what keeps the replicas close to synchronous
training (DiLoCo's loss rises with H), while int8 and int4 outer gradients cost no measurable
loss (INTELLECT-1, Streaming DiLoCo; on the benchmark GPT int4 ended at 1.079 of DDP's loss
against 1.082 in fp32, perf/BENCHMARKS.md). When even that H is above ``max_sync_every`` the
advice says the link is the limit.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zpp.tune.cost import all_reduce_link_bytes
from zpp.zero.checks import check_int, check_number
from zpp.zero.outer_config import DEFAULT_SYNC_EVERY, OUTER_COMPRESSIONS

__all__ = ["OuterAdvice", "OuterOption", "advise", "format_advice", "period", "sync_seconds"]

HEADROOM = 1.25
"""Margin on the measured sync time (see [Note: choosing zpp.outer])."""


@dataclasses.dataclass(frozen=True, slots=True)
class OuterOption:
    """One compression's numbers (see [Note: choosing zpp.outer])."""

    compression: str
    backend: str
    sync_s: float
    """Seconds of one fragment's sync."""
    delay: int
    sync_every: int
    """The smallest H the link allows."""
    link_busy: float
    """Fraction of the period the link carries syncs at that H."""
    extrapolated: bool
    """The fragment is larger than the largest measured size."""


@dataclasses.dataclass(frozen=True, slots=True)
class OuterAdvice:
    params: int
    step_s: float
    fragments: int
    max_sync_every: int
    options: tuple[OuterOption, ...]
    chosen: OuterOption
    link_bound: bool
    """Even the chosen H is above ``max_sync_every``."""

    def config(self) -> dict[str, Any]:
        """The ``"zpp": {"outer": ...}`` section that applies the advice."""
        c = self.chosen
        return {"method": "diloco", "sync_every": c.sync_every, "fragments": self.fragments, "delay": c.delay,
                "compression": c.compression}

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "step_s": self.step_s, "fragments": self.fragments,
                "max_sync_every": self.max_sync_every, "link_bound": self.link_bound,
                "options": [dataclasses.asdict(o) for o in self.options], "config": self.config()}


def sync_seconds(points: Sequence[tuple[int, float]], nbytes: int) -> tuple[float, bool]:
    """Seconds for an all-reduce of ``nbytes`` logical bytes from measured ``(size, time_us)``
    points: linear between the two measured sizes around it, the last two sizes' slope beyond
    the largest, the smallest size's time below it. Returns ``(seconds, extrapolated)``."""
    pts = sorted({int(s): float(t) for s, t in points}.items())
    if not pts:
        raise ValueError("sync_seconds: no measured points")
    if nbytes <= pts[0][0]:
        return pts[0][1] * 1e-6, False
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if nbytes <= b:
            return (ta + (tb - ta) * (nbytes - a) / (b - a)) * 1e-6, False
    if len(pts) == 1:  # one size: time proportional to bytes
        s, t = pts[0]
        return t * nbytes / s * 1e-6, True
    (a, ta), (b, tb) = pts[-2], pts[-1]
    slope = max((tb - ta) / (b - a), 0.0)  # a noisy negative slope: hold the last time
    return (tb + slope * (nbytes - b)) * 1e-6, True


def period(step_s: float, sync_s: float, fragments: int, *, min_sync_every: int = 1) -> tuple[int, int]:
    """``(delay, sync_every)`` for inner steps of ``step_s`` seconds and syncs of ``sync_s``
    per fragment (see [Note: choosing zpp.outer]); H at least ``min_sync_every``."""
    check_number("period", "step_s", step_s, lo=0, lo_open=True)
    check_number("period", "sync_s", sync_s, lo=0)
    check_int("period", "fragments", fragments, lo=1)
    check_int("period", "min_sync_every", min_sync_every, lo=1)
    delay = max(1, math.ceil(HEADROOM * sync_s / step_s))
    return delay, max(math.ceil(HEADROOM * fragments * sync_s / step_s), delay + 1, min_sync_every)


def advise(rows: Iterable[Mapping[str, Any]], *, params: int, step_s: float, fragments: int = 4,
           max_sync_every: int = 100, allow_1bit: bool = False, nodes: int | None = None,
           ranks_per_node: int | None = None) -> OuterAdvice:
    """The ``zpp.outer`` settings for a model of ``params`` trainable elements whose inner
    step takes ``step_s`` seconds, from ``zpp bench`` all_reduce rows (each with
    ``backend``); see [Note: choosing zpp.outer]. Rows with wrong values are ignored; for each
    compression the fastest backend at the fragment's size is taken."""
    check_int("advise", "params", params, lo=1)
    check_int("advise", "fragments", fragments, lo=1)
    check_int("advise", "max_sync_every", max_sync_every, lo=2)
    check_number("advise", "step_s", step_s, lo=0, lo_open=True)
    nbytes = math.ceil(4 * params / fragments)
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        t = r.get("time_us")
        if r.get("op") != "all_reduce" or r.get("wrong") or not isinstance(t, (int, float)) or not t > 0:
            continue
        if r.get("compress") not in OUTER_COMPRESSIONS or (r["compress"] == "1bit" and not allow_1bit):
            continue
        points.setdefault((r["compress"], r.get("backend", "?")), []).append((int(r["size"]), float(t)))
    options = []
    for compression in OUTER_COMPRESSIONS:  # less compression first
        timed = [(sync_seconds(p, nbytes), b) for (c, b), p in points.items() if c == compression]
        if not timed:
            continue
        (sync_s, extrapolated), backend = min(timed, key=lambda x: x[0][0])
        if nodes is not None and ranks_per_node is not None and nodes > 1 and compression != "1bit":
            numel = -(-nbytes // 4)
            sync_s *= (all_reduce_link_bytes(compression, numel, nodes, ranks_per_node, across_nodes=True)
                       / all_reduce_link_bytes(compression, numel, nodes, ranks_per_node, across_nodes=False))
        delay, every = period(step_s, sync_s, fragments, min_sync_every=DEFAULT_SYNC_EVERY)
        options.append(OuterOption(compression, backend, sync_s, delay, every,
                                   fragments * sync_s / (every * step_s), extrapolated))
    if not options:
        raise ValueError("advise: no all_reduce row to advise from (run the sweep with --ops including "
                         "all_reduce)")
    chosen = min(options, key=lambda o: (o.sync_every, OUTER_COMPRESSIONS.index(o.compression)))
    return OuterAdvice(params, float(step_s), fragments, max_sync_every, tuple(options), chosen,
                       chosen.sync_every > max_sync_every)


def format_advice(a: OuterAdvice) -> str:
    """The advice for people: ``#`` lines, one row per compression, the config to use."""
    lines = [
        f"# zpp.outer for {a.params:,} parameters, {a.step_s:g} s inner steps, {a.fragments} fragment(s) of "
        f"{4 * a.params / a.fragments / 2**20:.3g} MiB fp32 (sync time: the all_reduce at that size; "
        "* = beyond the largest measured size)",
        f"# {'compression':<12}{'backend':<8}{'sync_s':>10}{'delay':>7}{'min H':>7}{'link busy':>11}",
    ]
    for o in a.options:
        mark = "*" if o.extrapolated else " "
        pick = "  <- chosen" if o is a.chosen else ""
        lines.append(f"  {o.compression:<12}{o.backend:<8}{o.sync_s:>9.3f}{mark}{o.delay:>7}{o.sync_every:>7}"
                     f"{o.link_busy:>10.0%}{pick}")
    if a.link_bound:
        lines.append(f"# link-bound: no compression syncs within H <= {a.max_sync_every}; the best needs "
                     f"H = {a.chosen.sync_every}")
    lines.append('# config: "zpp": {"outer": ' + json.dumps(a.config()) + "}")
    return "\n".join(lines) + "\n"
