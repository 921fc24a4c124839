"""Checkpoint files: written with a CRC32 computed while writing and fsync-ed, read back
only after their size and CRC32 match the record in ``meta.json``.

[Note: checksums]
Every file of a checkpoint but ``meta.json`` is recorded in ``meta.json`` as
``{"bytes": size, "crc32": crc}``; ``meta.json`` carries the CRC32 of its own other fields
(``manifest_crc32``). CRC32 (zlib, about 3 GB/s on one core here) detects accidental
damage: flipped bits, a truncated or zero-filled file, a file swapped in from another save
(with probability 1 - 2**-32 each); it is no defence against deliberate tampering. Each file
is read once into memory, checked, and unpickled from that same buffer, so what is checked
is what is loaded.

[Note: durability]
Each file is ``fsync``-ed after writing, and each directory after a rename in it, so once
``save_checkpoint`` returns, the tag and ``latest`` survive a power loss, not only a crash of
the process (on filesystems that honour fsync). The cost is the wait for the disk, which the
page cache would otherwise hide (perf/BENCHMARKS.md, "Checkpoints"). ``ZPP_CHECKPOINT_FSYNC=0``
turns the fsyncs off: a crash of the processes still leaves every tag whole, but after a
power loss ``latest`` may name a tag whose files never reached the disk; loading it then
raises CheckpointError (the checksums), and an older tag has to be named.
"""
from __future__ import annotations

import io
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from zpp.zero.checkpoint.errors import CheckpointError

Record = dict[str, int]  # {"bytes": size, "crc32": crc}


class ChecksumWriter:
    """A write-only file object that passes every write to ``f`` and keeps the size and the
    CRC32 of what it passed (``torch.save`` writes through it). The first error of ``f``
    is kept in ``error``: torch's writer replaces it by one of its own that does not say
    what happened (e.g. "unexpected pos 64 vs 0" for a full disk)."""

    def __init__(self, f) -> None:
        self._f = f
        self.size = 0
        self.crc = 0
        self.error: BaseException | None = None

    def write(self, data) -> int:
        try:
            n = self._f.write(data)
        except BaseException as e:
            self.error = self.error or e
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()

    def record(self) -> Record:
        return {"bytes": self.size, "crc32": self.crc}


def write_torch(obj: Any, path: Path, *, durable: bool = True) -> Record:
    """``torch.save(obj)`` into a new file ``path``, fsync-ed if ``durable``; its record."""
    with open(path, "xb") as f:
        w = ChecksumWriter(f)
        try:
            torch.save(obj, w)
        except Exception as e:
            if w.error is not None:
                raise w.error from e
            raise
        f.flush()
        if durable:
            os.fsync(f.fileno())
    return w.record()


def write_bytes(data: bytes, path: Path, *, durable: bool = True) -> Record:
    """``data`` into a new file ``path``, fsync-ed if ``durable``; its record."""
    with open(path, "xb") as f:
        w = ChecksumWriter(f)
        w.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    return w.record()


def fsync_dir(path: Path, durable: bool = True) -> None:
    if not durable:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(path: Path, tag: str) -> str:
    """How errors name a file: its name, the tag, and the directory."""
    return f"{path.name} of checkpoint tag {tag!r} ({path.parent})"


def check_present(path: Path, record: Record, tag: str) -> None:
    """Raise CheckpointError unless ``path`` exists with the recorded size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {describe(path, tag)} is missing") from None
    _check(path, size, lambda: record["crc32"], record, tag)


def read_verified(path: Path, record: Record | None, tag: str) -> bytes:
    """The bytes of ``path`` after checking them against ``record`` (None: unchecked, a
    format-1 checkpoint); see [Note: checksums]."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {describe(path, tag)} is missing") from None
    if record is not None:
        _check(path, len(data), lambda: zlib.crc32(data), record, tag)
    return data


def _check(path: Path, size: int, crc, record: Record, tag: str) -> None:
    """Raise CheckpointError unless ``size`` and ``crc()`` match ``record``."""
    if size != record["bytes"]:
        raise CheckpointError(
            f"load_checkpoint: {describe(path, tag)} has {size} bytes, meta.json records {record['bytes']}: "
            f"the file is {'truncated' if size < record['bytes'] else 'damaged'}")
    got = crc()
    if got != record["crc32"]:
        raise CheckpointError(
            f"load_checkpoint: {describe(path, tag)} is corrupt: its CRC32 is {got:#010x}, meta.json "
            f"records {record['crc32']:#010x} (damaged on disk, or a file of another save)")


def load_torch(path: Path, record: Record | None, tag: str, *, mapped: bool = False) -> Any:
    """Read, check and unpickle a file written by :func:`write_torch`. ``mapped``: the file is
    checked through a read-only memory map and its tensors are unpickled onto that map
    (``torch.load(mmap=True)``), so its bytes are read from disk once and never copied into
    an intermediate buffer; for files whose tensors the caller copies (the shards, the 1-bit
    state), not for objects handed to the user."""
    if not mapped:
        data = read_verified(path, record, tag)
        source: Any = io.BytesIO(data)
    else:
        fd = _open(path, tag)
        try:
            st = os.fstat(fd)
            if record is not None:
                _check(path, st.st_size, lambda: _crc_mapped(fd, st.st_size), record, tag)
        finally:
            os.close(fd)
        source = path
    try:
        obj = torch.load(source, map_location="cpu", weights_only=False, mmap=mapped)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the file is unreadable
        raise CheckpointError(
            f"load_checkpoint: {describe(path, tag)} cannot be unpickled ({type(e).__name__}: {e})") from e
    if mapped:
        now = os.stat(path)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise CheckpointError(f"load_checkpoint: {describe(path, tag)} was replaced while it was read "
                                  "(a save into the same directory?)")
    return obj


def _open(path: Path, tag: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {describe(path, tag)} is missing") from None


def _crc_mapped(fd: int, size: int) -> int:
    if size == 0:
        return zlib.crc32(b"")
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
        return zlib.crc32(m)
