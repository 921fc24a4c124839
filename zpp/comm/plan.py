"""Tuning plans: which transport and which compression to use for each collective and
message size, as measured by ``zpp tune`` (see :mod:`zpp.tune`).

    plan = load_plan()                       # $ZPP_TUNE_FILE, or None when unset
    plan.choose("all_gather", 1 << 20)       # Choice(backend='torch', compress='int8')
    plan.backend()                           # the backend that wins most size buckets

Consumers: :func:`zpp.comm.registry.get_transport` takes the plan's backend when neither
an argument nor ``$ZPP_COMM_BACKEND`` names one (and warns when one of them overrides it),
:mod:`zpp.comm.tuned` picks plain, int8, int4 or 1bit per call, and :func:`zpp.initialize`
(the config's ``zpp.tune_plan``, else ``$ZPP_TUNE_FILE``) applies it to the ZeRO++ code
widths (see [Note: the plan in the engine] in :mod:`zpp.zero.plan_bits`).

[Note: plan file]
JSON, one object::

    {"version": 1,
     "world": {"size": 4, "ranks_per_node": 2},
     "max_error": 0.01,          # the bound every chosen compression met (maxrelerr)
     "allow_1bit": false,        # whether 1bit all-reduce could be chosen
     "dtype": "float32", "group_size": 2048,
     "backends": ["torch", "mpi"],                    # measured, in order
     "entries": [ENTRY, ...],                         # the overall choice
     "by_backend": {"torch": [ENTRY, ...], ...},      # the best compression per backend
     "meta": {...}}                                   # free-form: date, host, baseline, ...

    ENTRY = {"op": "all_gather", "min_bytes": 0, "max_bytes": 92681,
             "backend": "torch", "compress": "int8",
             "measured": [{"size": 65536, "time_us": 81.0, "plain_us": 120.5,
                           "maxrelerr": 0.0039}, ...]}

An entry covers message sizes ``min_bytes <= nbytes < max_bytes`` (``max_bytes`` null: no
upper end); for each op the entries are sorted, start at 0, touch, and the last one is
open-ended, so every size has exactly one entry. The message size is the logical bytes of
one call, as ``zpp bench`` counts them: the output of an all-gather, the input of a
reduce-scatter or all-reduce. ``measured`` lists the benchmarked sizes inside the entry's
range (an entry's weight in :meth:`TunePlan.backend` is their number, at least 1).
Compressions: none/int8/int4 for all_gather and reduce_scatter, none/int8/int4/1bit for
all_reduce (1bit only with ``allow_1bit``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "COMPRESSIONS",
    "OPS",
    "PLAN_VERSION",
    "TUNE_FILE_ENV",
    "Choice",
    "Entry",
    "TunePlan",
    "World",
    "load_plan",
]

PLAN_VERSION = 1
TUNE_FILE_ENV = "ZPP_TUNE_FILE"
#: The collectives a plan covers and the compressions each may choose.
COMPRESSIONS: dict[str, tuple[str, ...]] = {
    "all_gather": ("none", "int8", "int4"),
    "reduce_scatter": ("none", "int8", "int4"),
    "all_reduce": ("none", "int8", "int4", "1bit"),
}
OPS = tuple(COMPRESSIONS)


class Choice(NamedTuple):
    """What to run for one call: the transport backend and the compression."""

    backend: str
    compress: str


@dataclasses.dataclass(frozen=True, slots=True)
class World:
    """The world a plan was measured on."""

    size: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.ranks_per_node


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One op's choice over the message sizes ``[min_bytes, max_bytes)``."""

    op: str
    min_bytes: int
    max_bytes: int | None
    """Exclusive upper end; None: no upper end."""
    backend: str
    compress: str
    measured: tuple[dict, ...] = ()

    @property
    def weight(self) -> int:
        """Measured sizes (buckets) this entry stands for, at least 1."""
        return max(1, len(self.measured))

    def covers(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes and (self.max_bytes is None or nbytes < self.max_bytes)

    def to_dict(self) -> dict:
        return {"op": self.op, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
                "backend": self.backend, "compress": self.compress,
                "measured": [dict(m) for m in self.measured]}


@dataclasses.dataclass(frozen=True)
class TunePlan:
    """A validated plan (see [Note: plan file]). Build one with :meth:`from_dict` or
    :meth:`load`; the constructor checks nothing."""

    world: World
    max_error: float
    entries: tuple[Entry, ...]
    by_backend: Mapping[str, tuple[Entry, ...]] = dataclasses.field(default_factory=dict)
    allow_1bit: bool = False
    dtype: str = "float32"
    group_size: int = 2048
    backends: tuple[str, ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    path: str | None = dataclasses.field(default=None, compare=False)
    """The file it was loaded from or saved to, if any (named in error messages)."""

    # ------------------------------------------------------------------ queries
    @property
    def source(self) -> str:
        return self.path or "tune plan"

    def ops(self) -> tuple[str, ...]:
        """The collectives this plan has entries for."""
        return tuple(dict.fromkeys(e.op for e in self.entries))

    def entry(self, op: str, nbytes: int, backend: str | None = None) -> Entry:
        """The entry covering ``nbytes`` for ``op``: from ``backend``'s own list when the
        plan measured that backend, else from the overall choice. KeyError when the plan
        has no entry for ``op``."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{self.source}: message size {nbytes!r} must be a byte count >= 0")
        if op not in COMPRESSIONS:
            raise ValueError(f"{self.source}: unknown op {op!r}; a plan covers {', '.join(OPS)}")
        lists = [self.by_backend[backend]] if backend in self.by_backend else []
        lists.append(self.entries)
        for entries in lists:
            for e in entries:
                if e.op == op and e.covers(nbytes):
                    return e
        raise KeyError(f"{self.source}: no entry for {op!r} (the plan covers {', '.join(self.ops()) or 'nothing'})")

    def choose(self, op: str, nbytes: int, backend: str | None = None) -> Choice:
        """The fastest (backend, compression) measured for ``op`` at ``nbytes`` within the
        plan's error bound. With ``backend``, the best compression on that backend (when the
        plan measured it; otherwise the overall choice). KeyError if ``op`` is not in the
        plan; ValueError for an unknown op or a negative size."""
        e = self.entry(op, nbytes, backend)
        return Choice(e.backend, e.compress)

    def backend(self) -> str:
        """The backend that wins most of the overall entries, each weighted by the measured
        sizes (buckets) it covers; ties go to the backend measured first."""
        votes: dict[str, int] = {}
        for e in self.entries:
            votes[e.backend] = votes.get(e.backend, 0) + e.weight
        if not votes:
            raise ValueError(f"{self.source}: the plan has no entries")
        order = {b: i for i, b in enumerate(self.backends)}
        return max(sorted(votes), key=lambda b: (votes[b], -order.get(b, len(order))))

    def check_world(self, world_size: int, ranks_per_node: int | None = None, *, what: str = "this world") -> None:
        """ValueError naming both worlds when the plan was made for another world size or,
        when ``ranks_per_node`` is given, another number of ranks per node."""
        other_rpn = ranks_per_node is not None and ranks_per_node != self.world.ranks_per_node
        if world_size != self.world.size or other_rpn:
            theirs = f"{world_size} ranks" if ranks_per_node is None else (
                f"{world_size} ranks ({world_size // ranks_per_node} nodes x {ranks_per_node})")
            raise ValueError(
                f"{self.source}: the plan was made for a world of {self.world.size} ranks "
                f"({self.world.nodes} nodes x {self.world.ranks_per_node}), but {what} has "
                f"{theirs}; run `zpp tune` for this world"
            )

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "world": {"size": self.world.size, "ranks_per_node": self.world.ranks_per_node},
            "max_error": self.max_error,
            "allow_1bit": self.allow_1bit,
            "dtype": self.dtype,
            "group_size": self.group_size,
            "backends": list(self.backends),
            "entries": [e.to_dict() for e in self.entries],
            "by_backend": {b: [e.to_dict() for e in es] for b, es in self.by_backend.items()},
            "meta": dict(self.meta),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON (atomically: a temporary file renamed over ``path``)."""
        path = os.fspath(path)
        doc = _clean(self.to_dict())
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
        object.__setattr__(self, "path", path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TunePlan:
        """Read and validate a plan file; ValueError naming the file and the problem
        (FileNotFoundError when there is no such file)."""
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a zpp tune plan: invalid JSON ({e})") from None
        return cls.from_dict(doc, source=path)

    @classmethod
    def from_dict(cls, doc: Any, *, source: str | None = None) -> TunePlan:
        """Validate ``doc`` (see [Note: plan file]); ValueError naming ``source`` (the file
        it came from) and the problem."""
        def bad(problem: str) -> ValueError:
            return ValueError(f"{source or 'tune plan'}: {problem}")

        if not isinstance(doc, dict):
            raise bad(f"a plan is a JSON object, not {type(doc).__name__}")
        version = doc.get("version")
        if version != PLAN_VERSION or isinstance(version, bool):
            raise bad(f"version {version!r} is not supported (this zpp reads version {PLAN_VERSION})")
        world = doc.get("world")
        if not isinstance(world, dict):
            raise bad("'world' must be an object {\"size\": N, \"ranks_per_node\": R}")
        size, rpn = world.get("size"), world.get("ranks_per_node")
        if not _posint(size):
            raise bad(f"world.size {size!r} must be a positive integer")
        if not _posint(rpn) or size % rpn:
            raise bad(f"world.ranks_per_node {rpn!r} must be a positive integer dividing world.size {size}")
        max_error = doc.get("max_error")
        if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not (
                math.isfinite(max_error) and max_error >= 0):
            raise bad(f"max_error {max_error!r} must be a finite number >= 0")
        allow_1bit = doc.get("allow_1bit", False)
        if not isinstance(allow_1bit, bool):
            raise bad(f"allow_1bit {allow_1bit!r} must be true or false")
        dtype = doc.get("dtype", "float32")
        if not isinstance(dtype, str):
            raise bad(f"dtype {dtype!r} must be a string")
        group_size = doc.get("group_size", 2048)
        if not _posint(group_size) or group_size % 2:
            raise bad(f"group_size {group_size!r} must be a positive even integer")
        backends = doc.get("backends", [])
        if not isinstance(backends, list) or not all(isinstance(b, str) and b for b in backends):
            raise bad(f"backends {backends!r} must be a list of backend names")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise bad("meta must be an object")
        entries = _entries(doc.get("entries"), "entries", allow_1bit, bad)
        if not entries:
            raise bad("entries is empty: the plan chooses nothing")
        by_backend_doc = doc.get("by_backend", {})
        if not isinstance(by_backend_doc, dict):
            raise bad("by_backend must be an object {backend: [entries]}")
        by_backend = {}
        for b, es in by_backend_doc.items():
            found = _entries(es, f"by_backend.{b}", allow_1bit, bad)
            wrong = [e for e in found if e.backend != b]
            if wrong:
                raise bad(f"by_backend.{b}: an entry names backend {wrong[0].backend!r}")
            by_backend[b] = found
        return cls(world=World(size, rpn), max_error=float(max_error), entries=entries,
                   by_backend=by_backend, allow_1bit=allow_1bit, dtype=dtype, group_size=group_size,
                   backends=tuple(backends) or tuple(dict.fromkeys(e.backend for e in entries)),
                   meta=meta, path=source)


def _posint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _entries(raw: Any, where: str, allow_1bit: bool, bad) -> tuple[Entry, ...]:
    """Parse and check a list of entries: known ops and compressions, and for each op
    ranges that start at 0, touch and end open."""
    if not isinstance(raw, list):
        raise bad(f"{where} must be a list of entries")
    out: list[Entry] = []
    for i, e in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(e, dict):
            raise bad(f"{at} must be an object")
        op, compress, backend = e.get("op"), e.get("compress"), e.get("backend")
        if op not in COMPRESSIONS:
            raise bad(f"{at}: op {op!r} must be one of {', '.join(OPS)}")
        if compress not in COMPRESSIONS[op]:
            raise bad(f"{at}: compress {compress!r} is not one of {op}'s: {', '.join(COMPRESSIONS[op])}")
        if compress == "1bit" and not allow_1bit:
            raise bad(f"{at}: chooses 1bit but the plan has allow_1bit false")
        if not isinstance(backend, str) or not backend:
            raise bad(f"{at}: backend {backend!r} must be a backend name")
        lo, hi = e.get("min_bytes"), e.get("max_bytes")
        if isinstance(lo, bool) or not isinstance(lo, int) or lo < 0:
            raise bad(f"{at}: min_bytes {lo!r} must be an integer >= 0")
        if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int) or hi <= lo):
            raise bad(f"{at}: max_bytes {hi!r} must be null or an integer > min_bytes {lo}")
        measured = e.get("measured", [])
        if not isinstance(measured, list) or not all(isinstance(m, dict) for m in measured):
            raise bad(f"{at}: measured must be a list of objects")
        out.append(Entry(op, lo, hi, backend, compress, tuple(measured)))
    for op in OPS:
        mine = [e for e in out if e.op == op]
        if not mine:
            continue
        mine.sort(key=lambda e: e.min_bytes)
        if mine[0].min_bytes != 0:
            raise bad(f"{where}: {op} starts at {mine[0].min_bytes} bytes, not 0 (sizes below are uncovered)")
        for a, b in zip(mine, mine[1:]):
            if a.max_bytes != b.min_bytes:
                how = "overlap" if a.max_bytes is None or a.max_bytes > b.min_bytes else "leave a gap"
                raise bad(f"{where}: {op} ranges [{a.min_bytes}, {a.max_bytes}) and [{b.min_bytes}, "
                          f"{b.max_bytes}) {how}")
        if mine[-1].max_bytes is not None:
            raise bad(f"{where}: {op}'s last range ends at {mine[-1].max_bytes} bytes; it must be open (null)")
    return tuple(sorted(out, key=lambda e: (OPS.index(e.op), e.min_bytes)))


def _clean(x: Any) -> Any:
    """Non-finite floats -> null (JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


_CACHE: dict[str, tuple[tuple[int, int], TunePlan]] = {}


def load_plan(path: str | os.PathLike | None = None) -> TunePlan | None:
    """The plan at ``path``, else at ``$ZPP_TUNE_FILE``; None when neither is given.
    Cached per file until it changes (so per-call lookups cost a ``stat``). Raises
    ValueError for a malformed file and FileNotFoundError (naming the variable) for a
    missing one."""
    from_env = path is None
    if from_env:
        path = os.environ.get(TUNE_FILE_ENV) or None
        if path is None:
            return None
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        where = f" (from ${TUNE_FILE_ENV})" if from_env else ""
        raise FileNotFoundError(
            f"tune plan {path!r}{where} does not exist; make one with `zpp tune --out {path}`") from None
    key = (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    plan = TunePlan.load(path)
    _CACHE[path] = (key, plan)
    return plan

