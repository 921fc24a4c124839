"""MPICH's shared-memory segments: remove the ones a job of ours leaves behind.

    with ShmWatch(proc.pid):          # proc: the mpiexec of the job
        proc.wait()                   # however it ends, its segments are gone afterwards

[Note: MPICH segments]
MPICH (ch4, POSIX shared memory) creates ``/dev/shm/mpich_shm_<hex>_<n>`` (2-4 MB each) when
a job starts and unlinks them in ``MPI_Finalize``; a job that is killed, aborted or times out
leaves them until the machine reboots. Their names say nothing about the job, so
:class:`ShmWatch` watches: while the job runs it reads the memory maps
(``/proc/<pid>/maps``) of the job's processes (the launcher and its descendants, or the
processes a ``pids`` function names) every ``interval_s`` and records the MPICH segments
they map. When the job has ended it removes each recorded segment that still exists and
that no living process maps. A segment of another job is never touched: it is never
recorded, and one that is still mapped is kept. A job killed within one interval of its
``MPI_Init`` can leave a segment that was never seen (a known gap, at most one interval
wide).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["SHM_DIR", "ShmWatch", "descendants", "mapped_segments"]

SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            found.append(c)
            stack.append(c)
    return found


def mapped_segments(pids: Iterable[int], shm_dir: str = SHM_DIR, prefix: str = PREFIX) -> set[str]:
    """The MPICH segments (paths) that the processes ``pids`` map now."""
    start = os.path.join(shm_dir, prefix)
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(start)
                    if i >= 0:
                        found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


class ShmWatch:
    """Record the MPICH segments a job maps; remove them once it has ended. See [Note: MPICH
    segments].

    Args:
        root_pid: the job's launcher; it and its descendants are watched.
        pids: instead of ``root_pid``, a function returning the job's processes now.
        interval_s: seconds between samples (Default: 0.1).
        shm_dir: where the segments live (Default: /dev/shm).

    Attributes:
        seen: segments recorded so far. removed: segments removed at the end.
    """

    def __init__(self, root_pid: int | None = None, *, pids: Callable[[], Iterable[int]] | None = None,
                 interval_s: float = 0.1, shm_dir: str = SHM_DIR) -> None:
        if (root_pid is None) == (pids is None):
            raise ValueError("ShmWatch: give root_pid or pids, not both")
        self._pids = pids if pids is not None else (lambda: [root_pid, *descendants(root_pid)])
        self.interval_s = interval_s
        self.shm_dir = shm_dir
        self.seen: set[str] = set()
        self.removed: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Record what the job's processes map now."""
        self.seen |= mapped_segments(self._pids(), self.shm_dir)

    def __enter__(self) -> ShmWatch:
        if os.path.isdir(self.shm_dir) and os.path.isdir("/proc"):
            self._thread = threading.Thread(target=self._run, name="zpp-shm-watch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.sample()
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self.stop()
        self.clean()

    def stop(self) -> None:
        """Stop sampling (the job has ended); :meth:`clean` may follow."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def clean(self, settle_s: float = 3.0) -> list[str]:
        """Remove the recorded segments that exist and that no living process maps. A
        recorded segment is this job's, so one still mapped is mapped by a rank that is
        still dying: wait for it up to ``settle_s``."""
        deadline = time.monotonic() + settle_s
        while True:
            left = [p for p in sorted(self.seen) if os.path.exists(p)]
            if not left:
                return list(self.removed)
            everyone = [int(e) for e in os.listdir("/proc") if e.isdigit()]
            busy = mapped_segments(everyone, self.shm_dir)
            for path in left:
                if path not in busy:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        self.removed.append(path)
            if not busy.intersection(left) or time.monotonic() > deadline:
                return list(self.removed)
            time.sleep(0.1)
