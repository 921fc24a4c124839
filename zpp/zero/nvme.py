"""The NVMe tier: a rank's swap file and the host buffers its state streams through.

[Note: NVMe swap]
``zero_optimization.offload_optimizer.device: "nvme"`` keeps each unit's per-element
optimizer state (Adam's two moments: 8 bytes per parameter of the 16 that ZeRO counts) in one
file per rank, ``<nvme_path>/zpp_swap/optimizer_rankNNNNN.swp``, between steps. The step
streams it through ``buffer_count`` host buffers, unit by unit (:mod:`zpp.zero.modes.nvme`):
the next units' state is read while one unit steps, and each unit's updated state is written
back while the next steps; the writes of the last units finish under the next forward.

* A unit's state is one region of the file (its tensors back to back, each padded to 4 KiB)
  and one region of a buffer, so each transfer is one range, split into ``aio.block_size``
  requests run by ``aio.thread_count * aio.queue_depth`` worker threads with
  ``pread``/``pwrite``, which release the GIL. The buffers are anonymous memory maps (page
  aligned), so the file is opened with ``O_DIRECT`` and bypasses the page cache; a file
  system that refuses it (tmpfs) gets buffered I/O, logged and counted
  (:attr:`SwapFile.direct` False, ``fallbacks``).
* The file is preallocated at initialize (``posix_fallocate``) for the state zpp expects
  (two moments), so a disk without room fails then, on every rank, naming the path, and not
  in the middle of a step; it grows if the optimizer keeps more.
* Every request's CRC32 is kept in memory when it is written (in the worker, which releases
  the GIL) and checked when it is read back: a file changed under zpp (the disk, another
  process) raises ``OSError`` naming the file and offset, in the step or in the checkpoint
  that read it, and never enters the optimizer or a checkpoint.
* The file is not a checkpoint: it is truncated when opened (a crashed run's file is never
  read), locked (``flock``) against a second job on the same path, and removed at
  ``engine.close()``. ``save_checkpoint`` writes the state into the usual verified shard
  files from read-only memory maps of the swap file (:meth:`SwapFile.mapped`, CRCs checked
  first), so a save holds no copy of the offloaded state in the process's own memory (the
  page cache holds what it reads, and the kernel can drop it); a load hands each unit's
  state to the file as it is applied (:meth:`~zpp.zero.modes.nvme.NvmeMode.optimizer_state_loaded`),
  one unit at a time.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zpp.zero.offload_config import AioConfig

log = logging.getLogger("zpp.zero")

ALIGN = 4096
SWAP_DIR = "zpp_swap"


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to the 4 KiB that direct I/O reads and writes in."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One state tensor of a region: its key, dtype and shape, and where it starts."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset inside the region (4 KiB aligned)

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """One unit's state in the file: ``[offset, offset + nbytes)``, its tensors in order."""

    offset: int
    nbytes: int
    entries: tuple[Entry, ...]

    @staticmethod
    def layout(tensors: dict[str, torch.Tensor]) -> tuple[tuple[Entry, ...], int]:
        entries, at = [], 0
        for k, t in tensors.items():
            entries.append(Entry(k, t.dtype, tuple(t.shape), at))
            at += padded(t.numel() * t.element_size())
        return tuple(entries), at


class Buffer:
    """A page-aligned host buffer (an anonymous memory map) of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, e: Entry) -> torch.Tensor:
        """The tensor of entry ``e`` in this buffer (shares its memory)."""
        return self.bytes[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape)

    def memory(self, nbytes: int) -> memoryview:
        return memoryview(self._map)[:nbytes]


class BufferPool:
    """The host buffers a mode streams state through: at most ``count`` (one more only while a
    layout change needs a fresh one, see :meth:`release`), and the writes that hold some of
    them; a buffer is free again once its write is done. ``wait_s`` counts the seconds spent
    waiting on transfers."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.free: list[Buffer] = []
        self.all: list[Buffer] = []  # every buffer, free or in a transfer
        self.writes: deque[Transfer] = deque()
        self.wait_s = 0.0

    def get(self, nbytes: int, *, wait: bool = True) -> Buffer | None:
        """A free buffer of at least ``nbytes``: waiting for the oldest write if none is free
        and ``count`` are out, or None then if not ``wait``."""
        while self.writes and self.writes[0].done():
            self.free.append(self.wait(self.writes.popleft()))
        while not self.free and len(self.all) >= self.count and self.writes:
            if not wait:
                return None
            self.free.append(self.wait(self.writes.popleft()))
        if self.free:
            buf = self.free.pop()
            if buf.nbytes >= nbytes:
                return buf
            self.all.remove(buf)  # too small (a larger unit, or new state): replaced
        buf = Buffer(nbytes)
        self.all.append(buf)
        return buf

    def wait(self, t: Transfer) -> Buffer:
        """``t``'s buffer once ``t`` is done (its error raised)."""
        start = time.perf_counter()
        try:
            return t.wait()
        finally:
            self.wait_s += time.perf_counter() - start

    def put(self, buf: Buffer) -> None:
        self.free.append(buf)

    def release(self, buf: Buffer) -> None:
        """``buf`` back, or dropped if a layout change made one more than ``count``."""
        if len(self.all) > self.count:
            self.all.remove(buf)
        else:
            self.free.append(buf)

    def written(self, t: Transfer) -> None:
        """A write in flight: its buffer is free when it is done."""
        self.writes.append(t)

    def finish_writes(self) -> None:
        while self.writes:
            self.free.append(self.wait(self.writes.popleft()))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.all)


class Transfer:
    """Requests in flight for one region; :meth:`wait` returns once all are done and raises
    the first error (an ``OSError`` naming the file)."""

    def __init__(self, futures: list[Future], buffer: Buffer) -> None:
        self.futures = futures
        self.buffer = buffer

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> Buffer:
        first = None
        for f in self.futures:
            exc = f.exception()
            first = first or exc
        if first is not None:
            raise first
        return self.buffer


class SwapFile:
    """One rank's swap file under ``nvme_path`` (see [Note: NVMe swap])."""

    def __init__(self, nvme_path: str, rank: int, aio: AioConfig, *, reserve: int = 0,
                 kind: str = "optimizer") -> None:
        #: "optimizer" (offload_optimizer) or "param" (offload_param): the file's name and the
        #: config section its errors name
        self.kind = kind
        self.path = Path(nvme_path) / SWAP_DIR / f"{kind}_rank{rank:05d}.swp"
        self.aio = aio
        self.direct = True
        self.fallbacks = 0
        self.read_bytes = self.written_bytes = 0
        self.end = 0
        self.busy_s = 0.0  # wall seconds with at least one request in flight
        self._crcs: dict[int, int] = {}  # file offset of each request -> CRC32 of what was written there
        self._view: weakref.ref | None = None  # the read-only map a save reads from (see mapped)
        self._active, self._since = 0, 0.0
        self._lock = threading.Lock()
        where = f"offload_{kind}.nvme_path={nvme_path!r}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = self._open()
        except OSError as e:
            raise ValueError(f"{where}: cannot create the swap file {self.path}: {e.strerror or e}") from e
        # the descriptor opened first holds the lock until close; a fallback to buffered I/O adds
        # a second one for the transfers (see _reopen_buffered), so the lock never lapses
        self._fds = [self.fd]
        self._direct_fd = self.fd if self.direct else None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self.fd)
            raise ValueError(f"{where}: the swap file {self.path} is in use by another process (two jobs on one "
                             "nvme_path and rank); give each job its own nvme_path") from e
        os.ftruncate(self.fd, 0)  # a crashed run's state is never read back
        # removed at close, or at interpreter exit if no close came (a killed process leaves it)
        self._remove = weakref.finalize(self, _remove, self._fds, self.path)
        try:
            self.reserve(reserve)
        except BaseException:
            self._remove()  # the descriptor and the lock go now, not with the traceback
            raise
        self.pool = ThreadPoolExecutor(aio.workers, thread_name_prefix="zpp-nvme")

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self.path, flags | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        self._fall_back("the file system refuses O_DIRECT")
        return os.open(self.path, flags, 0o600)

    def _fall_back(self, why: str) -> None:
        self.direct = False
        self.fallbacks += 1
        log.warning("zpp: NVMe swap %s: %s; buffered I/O instead (through the page cache)", self.path, why)

    def reserve(self, nbytes: int) -> None:
        """Make sure the file holds ``nbytes`` on disk (``OSError`` ENOSPC if it cannot)."""
        if nbytes > 0:
            try:
                os.posix_fallocate(self.fd, 0, padded(nbytes))
            except OSError as e:
                free = os.statvfs(self.path.parent)
                raise ValueError(f"offload_{self.kind}.nvme_path={str(self.path.parent.parent)!r}: cannot reserve "
                                 f"{padded(nbytes):,} bytes for the swap file {self.path} "
                                 f"({free.f_bavail * free.f_frsize:,} bytes free): {e.strerror or e}") from e

    def allocate(self, nbytes: int) -> int:
        """A new region of ``nbytes`` (4 KiB aligned) at the end of the file; its offset."""
        offset, self.end = self.end, self.end + padded(nbytes)
        self.reserve(self.end)
        return offset

    # ------------------------------------------------------------------ transfers
    def write(self, region: Region, buffer: Buffer) -> Transfer:
        """Write ``region``'s bytes from ``buffer`` (asynchronous)."""
        self.written_bytes += region.nbytes
        return self._submit(self._pwrite, region, buffer)

    def read(self, region: Region, buffer: Buffer) -> Transfer:
        """Read ``region`` into ``buffer`` (asynchronous)."""
        self.read_bytes += region.nbytes
        return self._submit(self._pread, region, buffer)

    def _submit(self, fn, region: Region, buffer: Buffer) -> Transfer:
        mem, bs = buffer.memory(region.nbytes), self.aio.block_size
        return Transfer([self.pool.submit(fn, mem[i:i + bs], region.offset + i)
                         for i in range(0, region.nbytes, bs)], buffer)

    def _pwrite(self, mem: memoryview, offset: int) -> None:
        self._crcs[offset] = zlib.crc32(mem)  # before the write: what the file must give back
        self._io(os.pwrite, mem, offset)

    def mapped(self, region: Region) -> dict[str, torch.Tensor]:
        """``region``'s tensors as views of the file itself (a private memory map, read only
        by zpp), each request's CRC32 checked first: their pages are the page cache's, which
        the kernel can drop and read again, not a copy in the process's memory. A checkpoint
        writes a unit's state from them with no buffer (see [Note: NVMe swap])."""
        mm = self._view() if self._view is not None else None
        if mm is None or len(mm) < region.offset + region.nbytes:
            # one map of the whole file while any tensor of it lives (a save), not one per
            # region: Python's mmap keeps a descriptor open per map
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, self.end, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            self._view = weakref.ref(mm)
        with memoryview(mm) as mem:
            for i in range(0, region.nbytes, self.aio.block_size):
                at = region.offset + i
                with mem[at:at + min(self.aio.block_size, region.nbytes - i)] as part:
                    self._check_crc(part, at)
        self.read_bytes += region.nbytes
        return {e.key: torch.frombuffer(mm, dtype=e.dtype, count=e.numel, offset=region.offset + e.start)
                .view(e.shape) for e in region.entries}

    def _pread(self, mem: memoryview, offset: int) -> None:
        self._io(lambda fd, m, off: os.preadv(fd, [m], off), mem, offset)
        self._check_crc(mem, offset)

    def _check_crc(self, mem: memoryview, offset: int) -> None:
        want, got = self._crcs.get(offset), zlib.crc32(mem)
        if got != want:
            raise OSError(errno.EIO, f"NVMe swap {self.path} is corrupt: the {len(mem):,} bytes at offset {offset:,} "
                                     f"have CRC32 {got:#010x}, written as "
                                     f"{'never' if want is None else f'{want:#010x}'} (the disk, or another "
                                     "process, changed the file); the "
                                     f"{'optimizer state' if self.kind == 'optimizer' else 'parameter shard'} "
                                     "there is lost: load the last checkpoint")

    def _io(self, call, mem: memoryview, offset: int) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1
        try:
            self._transfer(call, mem, offset)
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.busy_s += time.perf_counter() - self._since

    def _transfer(self, call, mem: memoryview, offset: int) -> None:
        done = 0
        while done < len(mem):
            fd = self.fd
            try:
                n = call(fd, mem[done:], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and fd == self._direct_fd:  # refused as a direct transfer
                    self._reopen_buffered()
                    continue  # on the buffered descriptor, whichever worker opened it
                raise OSError(e.errno, f"NVMe swap {self.path}: {e.strerror}") from e
            if n == 0:
                raise OSError(errno.EIO, f"NVMe swap {self.path}: short transfer at byte {offset + done}")
            done += n

    def _reopen_buffered(self) -> None:
        """Switch the transfers to a buffered descriptor of the same file, once: workers
        refused at the same moment all retry on it. The direct descriptor stays open (it holds
        the lock, and a worker may still be using its number) until :meth:`close`."""
        with self._lock:
            if self.direct:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                self._fds.append(fd)
                self.fd = fd
                self._fall_back("a direct transfer was refused (EINVAL)")

    def close(self) -> None:
        """Stop the workers, close and remove the file."""
        self.pool.shutdown(wait=True)
        self._remove()
        self.fd = -1

    def stats(self) -> dict[str, object]:
        return {"path": str(self.path), "direct": self.direct, "fallbacks": self.fallbacks,
                "read_bytes": self.read_bytes, "written_bytes": self.written_bytes, "file_bytes": self.end,
                "busy_s": self.busy_s}


def _remove(fds: list[int], path: Path) -> None:
    for fd in fds:
        os.close(fd)
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # other ranks' files are still there


def open_agreed(make, world) -> SwapFile:
    """``make()`` (a :class:`SwapFile`) on every rank of ``world``, or, if it fails on any rank
    (no room, an unwritable path, a second job on the path), its error raised on every rank
    before training starts (see [Note: agreement]); collective."""
    from zpp.zero.checkpoint.agree import exchange, failure, raise_agreed

    swap, err = None, None
    try:
        swap = make()
        mine = {"ok": True}
    except (ValueError, OSError) as e:
        err, mine = e, failure(e)
    try:
        raise_agreed(exchange(world, mine, during="creating the NVMe swap files"), own=err)
    except BaseException:
        if swap is not None:
            swap.close()
        raise
    return swap

