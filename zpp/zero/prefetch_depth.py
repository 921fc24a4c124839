"""How far ahead stage 3 gathers: the prefetch window chosen from a measured pass.

    window = choose_window(steps, limit=max_live_parameters)   # elements
    seconds = simulate(steps, window)                          # the pass it predicts

[Note: the prefetch window from the measured link]
With ``stage3_prefetch_bucket_size: "auto"`` (given to zpp directly: the Hugging Face Trainer
replaces "auto" by 0.9 x hidden^2 before zpp sees it)
an engine's first two passes with grad gather every unit at its point of use, in line: the
first records the order (as every first pass does), the second, past the first pass's
warm-up (allocations, communicators made on first use), is timed: each gather
(``gather_s``: the link and the transport for that unit, nothing else overlapping it on
this thread), the compute that follows it up to the next gather (``compute_s``; after the
last gather nothing is counted: no gather can hide behind the pass's tail, and the
reductions' wait is in it), and which units are still gathered once it is served (``held``;
the prefetcher does not start those). On a GPU the timed pass waits for the device around
each gather, so the times are the device's, not the launches'. Passes without grad before
the window is chosen run in line. Those times give a model of a prefetched pass:

* the transport runs started gathers one after another (one queue);
* a gather that was not started ahead starts when it is asked for, behind the queue;
* the prefetcher's rule (zpp.zero.prefetch): after serving entry ``i`` it starts entries
  ``i + 1, ...`` while the elements started but not yet used are fewer than the window,
  stopping at a unit already started or still gathered (``held`` after entry ``i``).

:func:`simulate` plays a pass through that model; :func:`choose_window` takes the smallest
window that lets ``k`` gathers of any size start ahead (``(k - 1)`` largest gathers and one
element) whose predicted pass is within ``TOLERANCE`` of an unbounded window's, then lets
twice as many start (``HEADROOM``): the timed gathers ran in line, with the cores free;
prefetched, they share the cores with the compute and run longer than timed (the first
version, one gather more than the model's k, was measured 1.04-1.16x slower than gathering
everything ahead on 4 ranks over 2 cores; perf/BENCHMARKS.md). A link slower than the compute gains nothing from a deep
window (the link is the bottleneck once one gather is queued behind the running one);
uneven units (an embedding's gather behind a run of small blocks, a backward's intra-node
gathers after the forward's inter-node ones) need a deeper one, and the model finds how
deep. What the window saves is memory: the elements gathered ahead are full buffers held
beside the running unit (``PrefetchStats.peak_inflight_numel``).

Every rank measures its own pass; the engine takes the largest window over ranks (one
all-reduce of one integer at the end of the timed pass, counted as ``"prefetch_window"``),
because the window decides when gathers are issued relative to the other collectives of a
pass, which must be the same on every rank. What the model leaves out: work the gather
does on this thread besides the link (dequantizing qwZ's codes, reading a shard from NVMe)
counts as link time; reductions running in line count as compute.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["HEADROOM", "TOLERANCE", "Measured", "ahead", "choose_window", "peak_ahead", "simulate"]

TOLERANCE = 0.02
"""A window is deep enough when its predicted pass is within this fraction of an unbounded
window's."""
HEADROOM = 2
"""The window lets this many times the gathers start ahead that the model needs: the timed
pass's gathers ran while the cores had nothing else to do; prefetched, they share the cores
with the compute (4 ranks on 2 cores here: up to twice as long), which the model cannot see."""


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """One gather of a pass run without prefetch."""

    unit: int
    """The unit gathered (``Unit.index``)."""
    numel: int
    """Elements of its full buffer (what a prefetch holds while it waits)."""
    gather_s: float
    """Seconds the gather took at its point of use."""
    compute_s: float
    """Seconds from the gather's end to the next gather asked for (0 after the last)."""
    held: frozenset[int] = frozenset()
    """Units gathered (or being gathered) once this one was served: none of them is started
    ahead from here."""


def simulate(steps: Sequence[Measured], window: int) -> float:
    """Seconds of a pass with ``window`` elements of gathers allowed ahead of use, predicted
    from a pass measured without prefetch (see [Note: the prefetch window from the measured
    link])."""
    return _walk(steps, window, "simulate")[0]


def peak_ahead(steps: Sequence[Measured], window: int) -> int:
    """The most elements started ahead and not yet used at once in a pass like ``steps``
    with ``window`` (the engine's ``PrefetchStats.peak_inflight_numel``); the times do not
    matter, only the order, the sizes and ``held``. ``zpp tune`` predicts stage 3's gathered
    memory from it (zpp.tune.cost.memory)."""
    return _walk(steps, window, "peak_ahead")[1]


def _walk(steps: Sequence[Measured], window: int, who: str) -> tuple[float, int]:
    """(seconds, most elements started ahead at once) of a pass under the prefetcher's rule;
    ``who`` names the caller in the error for a negative window."""
    if window < 0:
        raise ValueError(f"{who}: window={window} must be >= 0")
    now = link_free = 0.0
    ready: dict[int, float] = {}  # entry -> when its gather ends, for entries started ahead
    started_numel = peak = 0
    started_units: set[int] = set()
    nxt = 0
    for i, s in enumerate(steps):
        if i in ready:  # started ahead: wait for it
            now = max(now, ready.pop(i))
            started_numel -= s.numel
            started_units.discard(s.unit)
        else:  # gathered in line, behind whatever the transport is still running
            link_free = max(now, link_free) + s.gather_s
            now = link_free
        j = max(i + 1, nxt)
        while j < len(steps):
            t = steps[j]
            if t.unit == s.unit or t.unit in s.held or t.unit in started_units or started_numel >= window:
                break
            link_free = max(now, link_free) + t.gather_s
            ready[j] = link_free
            started_numel += t.numel
            started_units.add(t.unit)
            j += 1
        nxt = j
        peak = max(peak, started_numel)
        now += s.compute_s
    return now, peak


def ahead(k: int, biggest: int) -> int:
    """The smallest window that lets ``k`` gathers of up to ``biggest`` elements each start
    ahead under the prefetcher's rule (counted before each start)."""
    return (k - 1) * biggest + 1 if k > 0 else 0


def choose_window(steps: Sequence[Measured], limit: int | None = None) -> int:
    """The prefetch window (elements) for passes like ``steps``: the smallest
    :func:`ahead` ``(k)`` within :data:`TOLERANCE` of an unbounded window's predicted pass,
    then :data:`HEADROOM` times as many gathers, and at most ``limit``. 0 when nothing is
    gathered."""
    if limit is not None and limit < 0:
        raise ValueError(f"choose_window: limit={limit} must be >= 0")
    if not steps:
        return 0
    biggest = max(s.numel for s in steps)
    best = simulate(steps, sum(s.numel for s in steps))
    k = 1
    while k < len(steps) and simulate(steps, ahead(k, biggest)) > best * (1 + TOLERANCE):
        k += 1
    window = ahead(k * HEADROOM, biggest)
    return window if limit is None else min(window, limit)
