"""Where the optimizer states and parameters live between uses: the ``offload_optimizer`` and
``offload_param`` sections of ``zero_optimization``, and the ``aio`` section that tunes the
NVMe tier's reads and writes (DeepSpeed's keys, defaults and meanings; see
[Note: offload] in :mod:`zpp.zero.offload` and [Note: NVMe swap] in :mod:`zpp.zero.nvme`).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from zpp.zero.checks import check_bool, check_choice, check_int, check_str

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class OffloadConfig:
    """Where optimizer states (``offload_optimizer``) or parameters (``offload_param``) live
    between uses."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """"none": on the training device; "cpu": in host memory (on a CPU job they are there
    already); "nvme": in a swap file under :attr:`nvme_path`, read back through a few host
    buffers when needed (Default: "none")."""
    pin_memory: bool = False
    """Page-locked host buffers, for overlapped copies on a CUDA job (Default: False)."""
    nvme_path: str | None = None
    """With device "nvme": the folder the swap files go in, on a fast local disk (required)."""
    buffer_count: int = 4
    """With device "nvme": host buffers the swapped state streams through, each the size of
    one unit's state (or parameter shard); at least 2 (one is used while the next is read)
    (Default: 4)."""

    def __post_init__(self) -> None:
        w = "OffloadConfig"
        check_choice(w, "device", self.device, OFFLOAD_DEVICES)
        check_bool(w, "pin_memory", self.pin_memory)
        check_int(w, "buffer_count", self.buffer_count, lo=2)
        if self.nvme_path is not None:
            check_str(w, "nvme_path", self.nvme_path)
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError(f"{w}: device='nvme' needs nvme_path (a folder on a local disk), got "
                             f"nvme_path={self.nvme_path!r}")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class AioConfig:
    """DeepSpeed's ``"aio"`` section: how the NVMe tier reads and writes. zpp's I/O is a pool
    of ``thread_count * queue_depth`` workers, each reading or writing ``block_size`` bytes
    at a time with ``pread``/``pwrite`` (``O_DIRECT`` where the file system takes it)."""

    block_size: int = 1_048_576
    """Bytes per read or write request (Default: 1 MiB)."""
    queue_depth: int = 8
    """Requests in flight per thread (Default: 8)."""
    thread_count: int = 1
    """I/O threads (Default: 1)."""
    single_submit: bool = False
    """DeepSpeed submits requests one at a time; zpp's workers always do (accepted)."""
    overlap_events: bool = True
    """DeepSpeed overlaps submission and completion; zpp's workers always do (accepted)."""

    def __post_init__(self) -> None:
        w = "AioConfig"
        check_int(w, "block_size", self.block_size, lo=4096)
        if self.block_size % 4096:
            raise ValueError(f"{w}: block_size={self.block_size} must be a multiple of 4096 (direct I/O)")
        check_int(w, "queue_depth", self.queue_depth, lo=1)
        check_int(w, "thread_count", self.thread_count, lo=1)
        check_bool(w, "single_submit", self.single_submit)
        check_bool(w, "overlap_events", self.overlap_events)

    @property
    def workers(self) -> int:
        return self.thread_count * self.queue_depth
