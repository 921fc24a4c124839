"""From ``zpp bench`` rows to a :class:`~zpp.comm.plan.TunePlan`, and the plan as a table:
pure functions, no ranks.

[Note: how a plan is chosen]
A row is one (backend, op, compression, size) measurement (the JSON rows of ``zpp bench``
plus a ``backend`` key). At each measured size of each op the plan takes the fastest
eligible row (``time_us``; ties go to less compression, then to the backend listed
first). Eligible:

* ``#wrong`` is 0: no element outside the variant's own bound (a row that fails its check
  is a defect, never a choice);
* ``none`` (the plain collective) always: its only error is the float rounding of the sum,
  the reference the others are measured against;
* ``int8`` / ``int4``: the measured ``maxrelerr`` (max|y - exact| / max|exact|) is at
  most ``max_error``;
* ``1bit`` (all_reduce): only with ``allow_1bit``, and then regardless of ``maxrelerr``.
  One 1-bit call from zero error buffers approximates the mean by one sign and one scale
  per chunk, so its single-call error is large (tens of percent) by design; it is
  acceptable only because error feedback carries the residual into later steps (1-bit
  Adam, 0/1 Adam, 1-bit LAMB on momentum), which a one-call benchmark cannot measure.
  Using it is a training-recipe decision, hence the opt-in.

Sizes between two measured sizes ``a < b`` go to ``a``'s choice below the geometric
midpoint ``isqrt(a * b)`` and to ``b``'s from it on; below the smallest and above the
largest measured size the nearest choice extends (the first range starts at 0, the last
is open). Neighbouring ranges with the same (backend, compression) merge. The same is done
for each backend alone (``by_backend``: the best compression on that backend, which
:mod:`zpp.comm.tuned` uses when its transport is that backend).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zpp.comm.plan import COMPRESSIONS, OPS, PLAN_VERSION, Entry, TunePlan

__all__ = ["TABLE_COLUMNS", "boundaries", "build_plan", "eligible", "format_bytes", "format_table", "select",
           "table_rows"]

#: Less compression first: the tie-break between equal times.
_PREFERENCE = ("none", "int8", "int4", "1bit")


def format_bytes(n: int | None) -> str:
    """65536 -> ``"64K"``, 92681 -> ``"90.5K"``, None -> ``"inf"`` (3 significant digits)."""
    if n is None:
        return "inf"
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.3g}{unit}"
    return str(n)


def boundaries(sizes: Sequence[int]) -> list[tuple[int, int | None]]:
    """``[lo, hi)`` of each sorted measured size's bucket: from 0, split at the geometric
    midpoints, the last open (``hi`` None)."""
    sizes = sorted(set(sizes))
    if not sizes:
        return []
    cuts = [max(a + 1, math.isqrt(a * b)) for a, b in zip(sizes, sizes[1:])]
    return list(zip([0, *cuts], [*cuts, None]))


def eligible(row: Mapping[str, Any], *, max_error: float, allow_1bit: bool) -> str | None:
    """None if ``row`` may be chosen, else why not (see [Note: how a plan is chosen])."""
    op, compress = row.get("op"), row.get("compress")
    if compress not in COMPRESSIONS.get(op, ()):
        return "not tunable"
    if row.get("wrong"):
        return f"{row['wrong']} values outside its own error bound"
    t = row.get("time_us")
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        return "no time measured"
    if compress == "none":
        return None
    if compress == "1bit":
        return None if allow_1bit else "1bit needs --allow-1bit (error feedback across steps)"
    err = row.get("maxrelerr")
    if not isinstance(err, (int, float)) or not math.isfinite(err):
        return "no finite maxrelerr"
    if err > max_error:
        return f"maxrelerr > {max_error:g}"
    return None


def select(rows: Iterable[Mapping[str, Any]], backends: Sequence[str]) -> Mapping[str, Any]:
    """The fastest row; ties go to less compression, then to the backend listed first."""
    order = {b: i for i, b in enumerate(backends)}

    def key(r):
        return (r["time_us"], _PREFERENCE.index(r["compress"]), order.get(r["backend"], len(order)))

    return min(rows, key=key)


def _entries(rows: list[Mapping[str, Any]], backends: Sequence[str], plain_backend: str | None) -> list[Entry]:
    """Entries of the eligible ``rows`` (one op), one bucket per measured size, merged.
    ``plain_backend``: whose plain time each point is compared with (None: the chosen
    row's own backend)."""
    by_size: dict[int, list] = {}
    for r in rows:
        by_size.setdefault(int(r["size"]), []).append(r)
    plain = {(r["backend"], int(r["size"])): r["time_us"] for r in rows if r["compress"] == "none"}
    sizes = sorted(by_size)
    entries: list[Entry] = []
    for size, (lo, hi) in zip(sizes, boundaries(sizes)):
        best = select(by_size[size], backends)
        point = {
            "size": size,
            "time_us": best["time_us"],
            "plain_us": plain.get((plain_backend or best["backend"], size)),
            "maxrelerr": best.get("maxrelerr"),
        }
        last = entries[-1] if entries else None
        if last is not None and (last.backend, last.compress) == (best["backend"], best["compress"]):
            entries[-1] = Entry(last.op, last.min_bytes, hi, last.backend, last.compress, (*last.measured, point))
        else:
            entries.append(Entry(best["op"], lo, hi, best["backend"], best["compress"], (point,)))
    return entries


def build_plan(
    rows: Iterable[Mapping[str, Any]],
    *,
    world_size: int,
    ranks_per_node: int,
    max_error: float,
    allow_1bit: bool = False,
    backends: Sequence[str] | None = None,
    dtype: str = "float32",
    group_size: int = 2048,
    meta: Mapping[str, Any] | None = None,
) -> TunePlan:
    """The plan of ``rows`` (see [Note: how a plan is chosen]). ``backends``: the measured
    backends in preference order (Default: as they first appear in ``rows``); the first is
    the baseline of ``plain_us`` ("vs plain") in the overall entries. ``meta`` goes to the
    plan's ``meta`` with ``excluded``: what was left out and why. The result is validated
    (ValueError if no op has a row)."""
    rows = [dict(r) for r in rows]
    missing = [r for r in rows if "backend" not in r]
    if missing:
        raise ValueError(f"build_plan: a row has no 'backend': {missing[0]}")
    backends = list(backends or dict.fromkeys(r["backend"] for r in rows))
    if not (isinstance(max_error, (int, float)) and math.isfinite(max_error) and max_error >= 0):
        raise ValueError(f"build_plan: max_error={max_error!r} must be a finite number >= 0")
    keep: dict[tuple, dict] = {}
    excluded: dict[tuple, dict] = {}
    for r in rows:
        if r.get("op") not in COMPRESSIONS:
            continue
        why = eligible(r, max_error=max_error, allow_1bit=allow_1bit)
        if why is not None:
            k = (r["backend"], r["op"], r["compress"], why)
            worst = r.get("maxrelerr") if isinstance(r.get("maxrelerr"), (int, float)) else None
            e = excluded.setdefault(k, {"backend": k[0], "op": k[1], "compress": k[2], "reason": why,
                                        "sizes": 0, "maxrelerr": worst})
            e["sizes"] += 1
            if worst is not None and (e["maxrelerr"] is None or worst > e["maxrelerr"]):
                e["maxrelerr"] = worst
            continue
        k = (r["backend"], r["op"], r["compress"], int(r["size"]))
        if k not in keep or r["time_us"] < keep[k]["time_us"]:  # a repeated measurement: the best
            keep[k] = r
    chosen = list(keep.values())
    entries: list[Entry] = []
    by_backend: dict[str, list[Entry]] = {}
    for op in OPS:
        mine = [r for r in chosen if r["op"] == op]
        if not mine:
            continue
        entries += _entries(mine, backends, backends[0])
        for b in backends:
            theirs = [r for r in mine if r["backend"] == b]
            if theirs:
                by_backend.setdefault(b, []).extend(_entries(theirs, backends, None))
    doc = {
        "version": PLAN_VERSION,
        "world": {"size": world_size, "ranks_per_node": ranks_per_node},
        "max_error": float(max_error),
        "allow_1bit": bool(allow_1bit),
        "dtype": dtype,
        "group_size": group_size,
        "backends": backends,
        "entries": [e.to_dict() for e in entries],
        "by_backend": {b: [e.to_dict() for e in es] for b, es in by_backend.items()},
        "meta": {**dict(meta or {}), "baseline": backends[0] if backends else None,
                 "excluded": list(excluded.values())},
    }
    plan = TunePlan.from_dict(doc, source="build_plan")  # errors name the builder
    return dataclasses.replace(plan, path=None)


def _span(values: list[float], spec: str, suffix: str = "") -> str:
    lo, hi = min(values), max(values)
    a, b = format(lo, spec), format(hi, spec)
    return f"{a}{suffix}" if a == b else f"{a}-{b}{suffix}"


TABLE_COLUMNS = ("op", "sizes", "backend", "compress", "time(us)", "vs_plain", "maxrelerr", "points")
_WIDTHS = (14, 16, 7, 8, 19, 13, 9, 6)


def _fmt(cells) -> str:
    return "  ".join(str(c).ljust(w) if i < 4 else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(cells, _WIDTHS))).rstrip()


def table_rows(plan: TunePlan) -> list[tuple[str, ...]]:
    """One tuple of ``TABLE_COLUMNS`` cells per overall entry."""
    out = []
    for e in plan.entries:
        times = [m["time_us"] for m in e.measured if isinstance(m.get("time_us"), (int, float))]
        ratios = [m["time_us"] / m["plain_us"] for m in e.measured
                  if isinstance(m.get("time_us"), (int, float)) and isinstance(m.get("plain_us"), (int, float))
                  and m["plain_us"] > 0]
        errs = [m["maxrelerr"] for m in e.measured if isinstance(m.get("maxrelerr"), (int, float))]
        out.append((
            e.op,
            f"{format_bytes(e.min_bytes)}-{format_bytes(e.max_bytes)}",
            e.backend,
            e.compress,
            _span(times, ".1f") if times else "n/a",
            _span(ratios, ".2f", "x") if ratios else "n/a",
            format(max(errs), ".2e") if errs else "n/a",
            str(len(e.measured)),
        ))
    return out


def format_table(plan: TunePlan) -> str:
    """The plan for people: ``#`` lines (what was measured, what the columns mean, what was
    left out), then one row per size range."""
    w = plan.world
    backends = ", ".join(plan.backends)
    baseline = plan.meta.get("baseline") or (plan.backends[0] if plan.backends else "?")
    lines = [
        f"# zpp tune: world {w.size} ranks = {w.nodes} nodes x {w.ranks_per_node}; backends {backends}; "
        f"dtype {plan.dtype}; max error {plan.max_error:g}; "
        + ("1bit allowed (error feedback across steps)" if plan.allow_1bit
           else "1bit excluded (--allow-1bit to include)"),
        "# sizes: [lo, hi) logical bytes per call (K = 1024); time(us): measured at the points inside; "
        f"vs_plain: time / the plain op on {baseline} at the same size; maxrelerr: max|y-exact|/max|exact|",
        "# " + _fmt(TABLE_COLUMNS),
    ]
    prev = None
    for cells in table_rows(plan):
        if prev is not None and cells[0] != prev:
            lines.append("#")
        prev = cells[0]
        lines.append("  " + _fmt(cells))
    for x in plan.meta.get("excluded", ()):
        if x.get("reason") == "not tunable":
            continue
        err = f" (worst maxrelerr {x['maxrelerr']:.2e})" if isinstance(x.get("maxrelerr"), (int, float)) else ""
        lines.append(f"# excluded: {x['backend']} {x['op']}/{x['compress']} at {x['sizes']} size(s): "
                     f"{x['reason']}{err}")
    votes: dict[str, int] = {}
    for e in plan.entries:
        votes[e.backend] = votes.get(e.backend, 0) + e.weight
    total = sum(votes.values())
    b = plan.backend()
    lines.append(f"# backend: {b} (wins {votes[b]} of {total} measured sizes); "
                 "get_transport() uses it when ZPP_COMM_BACKEND is unset")
    return "\n".join(lines) + "\n"
