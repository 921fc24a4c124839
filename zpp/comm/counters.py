"""Wire-byte accounting.

[Note: what is counted]
Every transport call records, for the calling rank, the *logical* bytes of the call and the
bytes this rank must send to peers on its own node ("intra") and on other nodes ("inter").
Sent bytes follow the direct-exchange model, the least any algorithm must send, the same
for every backend:

* ``all_gather(out, inp)``: ``inp`` to every peer.
* ``all_to_all(out, inp)`` and ``reduce_scatter(out, inp)``: slice ``j`` of ``inp`` to peer ``j``.
* ``all_reduce(t)``: a reduce-scatter plus an all-gather, ``2 * t / world`` to every peer.
* ``broadcast(t, src)``: the source sends ``t`` to every peer; the others send nothing.

Logical bytes are the bytes the caller asked to move (the output of an all-gather, the input
of the others). Backends may move more (gloo's reduce-scatter moves about 1.5x, see
CLUSTER-EMULATION.md); the model is what compression is judged against.

A compressed collective wraps its transport calls in :meth:`WireCounters.collective`, so its
wire bytes are booked under its own name together with the logical bytes of the
uncompressed data it stands for; compression ratios are then measured, not assumed.
Sub-transports share their parent's counters, and may run on another thread (the
hierarchical engine's outer sync, :mod:`zpp.zero.outer`): the stack of open collectives is
per thread and the totals are updated under a lock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading


@dataclasses.dataclass
class OpStats:
    calls: int = 0
    logical_bytes: int = 0
    intra_bytes: int = 0
    inter_bytes: int = 0

    @property
    def wire_bytes(self) -> int:
        return self.intra_bytes + self.inter_bytes

    @property
    def compression_ratio(self) -> float:
        """Logical bytes per wire byte (inf when nothing was sent).

        Not 1 for uncompressed ops: a plain all_gather, reduce_scatter or all_to_all gives
        W/(W-1), an all_reduce W/(2(W-1)); divide by that for the compression against the
        plain collective."""
        return self.logical_bytes / self.wire_bytes if self.wire_bytes else float("inf")


class WireCounters:
    """Per-rank byte counters, keyed by transport op or by enclosing collective."""

    def __init__(self) -> None:
        self._stats: dict[str, OpStats] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> list[list]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def record(self, op: str, logical: int, intra: int, inter: int) -> None:
        stack = self._stack()
        if stack:
            frame = stack[-1]
            frame[1] += intra
            frame[2] += inter
            return
        self._add(op, logical, intra, inter)

    def _add(self, op: str, logical: int, intra: int, inter: int, calls: int = 1) -> None:
        with self._lock:
            s = self._stats.setdefault(op, OpStats())
            s.calls += calls
            s.logical_bytes += logical
            s.intra_bytes += intra
            s.inter_bytes += inter

    @contextlib.contextmanager
    def collective(self, name: str, logical_bytes: int, *, continued: bool = False):
        """Book every transport call inside the block under ``name``, as one call whose
        logical size is ``logical_bytes``; ``continued``: the rest of a call already booked
        (a later hop started at ``wait()``), which adds its bytes but no call."""
        frame = [name, 0, 0]
        stack = self._stack()
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()
            if stack:  # nested: the outer collective owns the bytes
                stack[-1][1] += frame[1]
                stack[-1][2] += frame[2]
            else:
                self._add(name, logical_bytes, frame[1], frame[2], calls=0 if continued else 1)

    def snapshot(self) -> dict[str, OpStats]:
        """A copy of the counters: ``{op or collective name: OpStats}``."""
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in self._stats.items()}

    def total(self) -> OpStats:
        t = OpStats()
        for s in self.snapshot().values():
            t.calls += s.calls
            t.logical_bytes += s.logical_bytes
            t.intra_bytes += s.intra_bytes
            t.inter_bytes += s.inter_bytes
        return t

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()
