"""ZeRO-Infinity's optimizer tier as a mode: per-element optimizer state on NVMe between steps.

``offload_optimizer.device: "nvme"`` (stages 1-3). The state lives in a swap file
(:class:`~zpp.zero.nvme.SwapFile`, see [Note: NVMe swap]); this mode steps the optimizer one
unit at a time, so only ``buffer_count`` units' state is in memory at once:

    read ahead (buffer_count - 1 units) -> step the unit -> write it back -> drop it

The optimizer is stepped once per unit with only that unit's master holding a gradient
(torch's optimizers skip parameters without one), which is the same arithmetic as one step
over all of them for any optimizer whose update of a tensor depends on that tensor alone
(Adam, AdamW, SGD: tests/test_zero_nvme.py checks the losses and weights equal the in-memory
run's to the bit). Between steps each master's state holds its scalars (``step``) only; the
per-element tensors are in the file, and a checkpoint reads them back (:meth:`swapped_state`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from zpp.zero.modes.base import Mode
from zpp.zero.nvme import Buffer, Region, SwapFile, Transfer, padded
from zpp.zero.unit import Unit

#: per-element state zpp reserves on disk at initialize, in fp32 tensors per parameter (Adam's two
#: moments); the file grows if the optimizer keeps more
RESERVED_STATES = 2


class NvmeMode(Mode):
    """Streams each unit's optimizer state between the swap file and a few host buffers."""

    name = "nvme"

    def __init__(self, optimizer: torch.optim.Optimizer, units: Sequence[Unit], swap: SwapFile,
                 buffer_count: int) -> None:
        self.optimizer = optimizer
        self.units = tuple(units)
        self._index = {id(u): k for k, u in enumerate(self.units)}  # unit -> its region's key
        self.swap = swap
        self.buffer_count = buffer_count
        self.regions: dict[int, Region] = {}  # unit index -> its state on disk
        self._free: list[Buffer] = []
        self._all: list[Buffer] = []  # every buffer, free or in a transfer
        self._writes: deque[Transfer] = deque()
        self.wait_s = 0.0

    @classmethod
    def build(cls, engine) -> NvmeMode | None:
        off = engine.train_config.zero.offload_optimizer
        if off.device != "nvme":
            return None
        from zpp.zero.checkpoint.agree import exchange, failure, raise_agreed

        units = [u for u in engine.units if u.trainable and u.flat.master is not None]
        reserve = sum(RESERVED_STATES * padded(u.flat.master.numel() * 4) for u in units)
        swap, err = None, None
        try:
            swap = SwapFile(off.nvme_path, engine.job_world.rank, engine.train_config.aio, reserve=reserve)
            mine = {"ok": True}
        except (ValueError, OSError) as e:
            err, mine = e, failure(e)
        try:  # a rank without room fails every rank, before training (see [Note: agreement])
            raise_agreed(exchange(engine.world, mine, during="creating the NVMe swap files"), own=err)
        except BaseException:
            if swap is not None:
                swap.close()
            raise
        return cls(engine.optimizer, units, swap, off.buffer_count)

    # ------------------------------------------------------------------ buffers
    def _buffer(self, nbytes: int) -> Buffer:
        """A free buffer of at least ``nbytes``, waiting for the oldest write if none is."""
        while not self._free and len(self._all) >= self.buffer_count and self._writes:
            self._free.append(self._wait(self._writes.popleft()))
        if self._free:
            buf = self._free.pop()
            if buf.nbytes >= nbytes:
                return buf
            self._all.remove(buf)  # too small (a larger unit, or new state): replaced
        buf = Buffer(nbytes)
        self._all.append(buf)
        return buf

    def _wait(self, t: Transfer) -> Buffer:
        start = time.perf_counter()
        try:
            return t.wait()
        finally:
            self.wait_s += time.perf_counter() - start

    def _finish_writes(self) -> None:
        while self._writes:
            self._free.append(self._wait(self._writes.popleft()))

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer, trained: Sequence[Unit]) -> bool:
        self._finish_writes()  # the last step's writes (they ran under the forward and backward)
        index = self._index
        todo = [u for u in trained if id(u) in index and u.flat.master.numel() > 0]
        grads = [u.flat.master.grad for u in todo]
        for u in todo:
            u.flat.master.grad = None
        if any(u.flat.master is not None and u.flat.master.grad is not None for u in trained):
            optimizer.step()  # what is not swapped (empty shards) steps in memory, once
        reads: dict[int, Transfer] = {}
        ahead = max(1, self.buffer_count - 1)

        def read(j: int) -> None:
            region = self.regions.get(index[id(todo[j])]) if j < len(todo) else None
            if region is not None:
                reads[j] = self.swap.read(region, self._buffer(region.nbytes))

        for j in range(min(ahead, len(todo))):
            read(j)
        try:
            for i, u in enumerate(todo):
                buf = self._wait(reads.pop(i)) if i in reads else None
                master, k = u.flat.master, index[id(u)]
                state = optimizer.state[master]
                if buf is not None:
                    for e in self.regions[k].entries:
                        state[e.key] = buf.view(e)
                master.grad = grads[i]
                optimizer.step()
                master.grad = None
                self._swap_out(k, master, buf)
                read(i + ahead)
        finally:
            for u, g in zip(todo, grads):
                u.flat.master.grad = g
            for t in reads.values():
                self._free.append(self._wait(t))
        return True

    def _swap_out(self, k: int, master: torch.Tensor, buf: Buffer | None) -> None:
        """Write unit ``k``'s per-element state (in ``buf`` or fresh tensors) to its region and
        drop it from the optimizer's state."""
        state = self.optimizer.state.get(master, {})
        tensors = {key: v for key, v in state.items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == master.shape}
        if not tensors:
            self.regions.pop(k, None)
            if buf is not None:
                self._free.append(buf)
            return
        region = self.regions.get(k)
        entries, nbytes = Region.layout(tensors)
        if region is None or region.entries != entries:  # first step, or the optimizer keeps new state
            region = self.regions[k] = Region(self.swap.allocate(nbytes), nbytes, entries)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                self._free.append(buf)
            buf = self._buffer(nbytes)
        for e in entries:
            view, t = buf.view(e), tensors[e.key]
            if view.data_ptr() != t.data_ptr():  # a tensor the optimizer made (or replaced)
                view.copy_(t)
            del state[e.key]
        self._writes.append(self.swap.write(region, buf))

    # ------------------------------------------------------------------ checkpoints
    def swapped_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The per-element optimizer state of ``unit`` read back from the file (copies)."""
        region = self.regions.get(self._index.get(id(unit)))
        if region is None:
            return {}
        self._finish_writes()
        buf = self._wait(self.swap.read(region, self._buffer(region.nbytes)))
        out = {e.key: buf.view(e).clone() for e in region.entries}
        self._free.append(buf)
        return out

    def after_load(self) -> None:
        """A checkpoint set the optimizer's state: write what it put in memory to the file."""
        self._finish_writes()
        for k, u in enumerate(self.units):
            master = u.flat.master
            if master not in self.optimizer.state:
                self.regions.pop(k, None)  # fresh state
            elif any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in self.optimizer.state[master].values()):
                self._swap_out(k, master, None)
        self._finish_writes()

    # ------------------------------------------------------------------ the rest
    def close(self) -> None:
        try:
            self._finish_writes()
        finally:
            self.swap.close()

    def state_bytes(self, nbytes) -> dict[str, int]:
        return {"optimizer": sum(b.nbytes for b in self._all)}

    def stats(self) -> dict[str, object]:
        """The swap file's counters and the seconds the step waited on it."""
        return {**self.swap.stats(), "buffers": len(self._all), "wait_s": self.wait_s}
