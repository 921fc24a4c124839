"""ZeRO-Infinity's optimizer tier as a mode: per-element optimizer state on NVMe between steps.

With ``offload_param.device: "nvme"`` (alone: the state stays in memory) each unit's shard and
gradient come from :mod:`zpp.zero.param_swap` for its update; the shard goes back after it.

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

[Note: NVMe step order]
A unit's read is issued as soon as a buffer is free for it: right after the wait for the
previous unit's read if one is free then (so it runs under that unit's step), else after that
unit's write is issued (waiting for the oldest write to free its buffer). With
``buffer_count = 2`` one of each unit's two transfers overlaps a step, whichever frees a
buffer first; with more buffers both do. A layout change of a unit's state (the optimizer keeps
a new tensor) is copied into a fresh buffer, never over the views it is copied from. An I/O
error (or a CRC mismatch, or no room to grow the file) on any rank raises on every rank of the
ZeRO world at the end of the step, before the publish (:meth:`NvmeMode._agree`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zpp.comm.transport import Transport
from zpp.zero.modes.base import Mode
from zpp.zero.nvme import Buffer, BufferPool, Region, SwapFile, Transfer, open_agreed, padded
from zpp.zero.param_swap import ParamSwap
from zpp.zero.unit import Unit

#: per-element state zpp reserves on disk at initialize, in fp32 tensors per parameter (Adam's two
#: moments); the file grows if the optimizer keeps more
RESERVED_STATES = 2


class NvmeMode(Mode):
    """Streams each unit's optimizer state between the swap file and a few host buffers."""

    name = "nvme"

    def __init__(self, optimizer: torch.optim.Optimizer, units: Sequence[Unit], swap: SwapFile | None,
                 buffer_count: int, world: Transport, *, params: ParamSwap | None = None) -> None:
        self.optimizer = optimizer
        self.world = world  # the ranks a step's outcome is agreed over (they publish together)
        self.units = tuple(units)
        self._index = {id(u): k for k, u in enumerate(self.units)}  # unit -> its region's key
        self.swap = swap  # the optimizer state's file; None: the state stays in memory (only params on disk)
        self.params = params  # the parameter shards' tier (offload_param nvme), or None
        self.regions: dict[int, Region] = {}  # unit index -> its state on disk
        self.buffers = BufferPool(buffer_count)

    @classmethod
    def build(cls, engine) -> NvmeMode | None:
        off = engine.train_config.zero.offload_optimizer
        params = engine.comms.params_swap
        if off.device != "nvme" and params is None:
            return None
        units = [u for u in engine.units if u.trainable and u.flat.master is not None]
        swap = None
        if off.device == "nvme":
            reserve = sum(RESERVED_STATES * padded(u.flat.master.numel() * 4) for u in units)
            swap = open_agreed(lambda: SwapFile(off.nvme_path, engine.job_world.rank, engine.train_config.aio,
                                                reserve=reserve), engine.job_world)
        return cls(engine.optimizer, units, swap, off.buffer_count, engine.world, params=params)

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer, trained: Sequence[Unit]) -> bool:
        self.buffers.finish_writes()  # the last step's writes (they ran under the forward and backward)
        index = self._index
        todo = [u for u in trained if id(u) in index and u.flat.master.numel() > 0]
        grads = [u.flat.master.grad for u in todo]
        for u in todo:
            u.flat.master.grad = None
        reads: dict[int, Transfer] = {}
        ahead = max(1, self.buffers.count - 1)
        issued = 0  # the units whose reads were issued: todo[:issued] (in order)

        def read_ahead(upto: int, *, wait: bool) -> None:
            """Issue the reads of todo[issued:upto]; without ``wait`` only while a buffer is
            free now (so they run under the step that follows, see [Note: NVMe step order])."""
            nonlocal issued
            while issued < min(upto, len(todo)):
                region = self.regions.get(index[id(todo[issued])])
                if region is not None:
                    buf = self.buffers.get(region.nbytes, wait=wait)
                    if buf is None:
                        return
                    reads[issued] = self.swap.read(region, buf)
                issued += 1

        failure: BaseException | None = None
        try:
            if any(u.flat.master is not None and u.flat.master.grad is not None for u in trained):
                optimizer.step()  # what is not swapped (empty shards) steps in memory, once
            read_ahead(ahead, wait=True)
            for i, u in enumerate(todo):
                if self.params is not None:
                    self.params.ensure(u)  # (and the next units' shards are read ahead)
                    if grads[i] is None and self.params.grad_on_disk(u):
                        grads[i] = self.params.take_grad(u)  # dropped after the unit's step
                    if i + 1 < len(todo):
                        self.params.read_grad_ahead(todo[i + 1])
                buf = self.buffers.wait(reads.pop(i)) if i in reads else None
                read_ahead(i + 1 + ahead, wait=False)
                master, k = u.flat.master, index[id(u)]
                state = optimizer.state[master]
                if buf is not None:
                    for e in self.regions[k].entries:
                        state[e.key] = buf.view(e)
                master.grad = grads[i]
                optimizer.step()
                master.grad = None
                if u.flat.grad is None:  # read from the file for this step: not kept
                    grads[i] = None
                if self.params is not None and self.params.manages(u):
                    if not u.flat.master_aliases_shard:  # what publish does, before the shard leaves
                        u.flat.shard.copy_(master.detach())
                    self.params.evict(u, dirty=True)
                if self.swap is not None:
                    self._swap_out(k, master, buf)
                read_ahead(i + 1 + ahead, wait=True)
        except (OSError, ValueError) as e:  # a file: an I/O error, a CRC mismatch, no room to grow
            failure = e
        finally:
            for u, g in zip(todo, grads):
                u.flat.master.grad = g
            for t in reads.values():
                try:
                    self.buffers.put(self.buffers.wait(t))
                except OSError as e:
                    failure = failure or e
        self._agree(failure)
        return True

    def _agree(self, failure: BaseException | None) -> None:
        """Raise ``failure`` (this rank's, or a peer's) on every rank of the world, or return
        if there is none: one 8-byte all-reduce per step, then, only on a failure, the
        messages (see [Note: agreement]). Without it a rank whose file failed would raise
        alone and its peers would wait in the publish until the transport's timeout."""
        from zpp.zero.checkpoint.agree import exchange, failure as record, raise_agreed

        flag = torch.tensor([0.0 if failure is None else 1.0], dtype=torch.float64)
        self.world.all_reduce(flag, "max")
        if flag.item() == 0.0:
            return
        mine = {"ok": True} if failure is None else record(failure)
        raise_agreed(exchange(self.world, mine, during="the NVMe optimizer step"), own=failure,
                     suffix="; the optimizer state is not consistent across ranks: load the last checkpoint",
                     types=(OSError,))

    def _swap_out(self, k: int, master: torch.Tensor, buf: Buffer | None) -> None:
        """Write unit ``k``'s per-element state (in ``buf`` or fresh tensors) to its region and
        drop it from the optimizer's state."""
        state = self.optimizer.state.get(master, {})
        tensors = {key: v for key, v in state.items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == master.shape}
        if not tensors:
            self.regions.pop(k, None)
            if buf is not None:
                self.buffers.put(buf)
            return
        region = self.regions.get(k)
        entries, nbytes = Region.layout(tensors)
        moved = region is None or region.entries != entries  # first step, or the optimizer keeps new state
        if moved:
            region = self.regions[k] = Region(self.swap.allocate(nbytes), nbytes, entries)
        old = None
        if buf is None or buf.nbytes < nbytes or moved:  # never copied over the views it copies from
            old, buf = buf, self.buffers.get(nbytes)
        for e in entries:
            view, t = buf.view(e), tensors[e.key]
            if view.data_ptr() != t.data_ptr():  # a tensor the optimizer made (or replaced)
                view.copy_(t)
            del state[e.key]
        if old is not None:
            self.buffers.release(old)
        self.buffers.written(self.swap.write(region, buf))

    # ------------------------------------------------------------------ checkpoints
    def swapped_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The per-element optimizer state of ``unit``: read-only views of the file (checked;
        no copy in memory, see [Note: NVMe swap])."""
        region = self.regions.get(self._index.get(id(unit)))
        if region is None or self.swap is None:
            return {}
        self.buffers.finish_writes()
        return self.swap.mapped(region)

    def optimizer_state_loaded(self, unit: Unit) -> None:
        """A load set ``unit``'s optimizer state: to the file now, so a load holds one unit's
        state at a time (buffer_count buffers), not the whole optimizer's."""
        k = self._index.get(id(unit))
        master = unit.flat.master
        if self.swap is not None and k is not None and master in self.optimizer.state:
            self._swap_out(k, master, None)

    def after_load(self) -> None:
        """A checkpoint set the optimizer's state: write what it put in memory to the file."""
        if self.swap is None:
            return
        self.buffers.finish_writes()
        for k, u in enumerate(self.units):
            master = u.flat.master
            if master not in self.optimizer.state:
                self.regions.pop(k, None)  # fresh state
            elif any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in self.optimizer.state[master].values()):
                self._swap_out(k, master, None)
        self.buffers.finish_writes()

    # ------------------------------------------------------------------ the rest
    def after_optimizer_step(self, trained: Sequence[Unit]) -> None:
        if self.params is not None:
            self.params.end_step()

    def after_skipped_step(self) -> None:
        if self.params is not None:
            self.params.end_step()

    def close(self) -> None:
        try:
            self.buffers.finish_writes()
        finally:
            if self.swap is not None:
                self.swap.close()  # (the parameters' file closes with the engine, after its last gathers)

    def state_bytes(self, nbytes) -> dict[str, int]:
        out = {"optimizer": self.buffers.nbytes}
        if self.params is not None:
            out["params"] = self.params.state_bytes()
        return out

    def stats(self) -> dict[str, object]:
        """The swap files' counters and the seconds the step waited on them (``params``: the
        parameter tier's, with ``offload_param`` nvme)."""
        out = {}
        if self.swap is not None:
            out = {**self.swap.stats(), "buffers": len(self.buffers.all), "wait_s": self.buffers.wait_s}
        if self.params is not None:
            out["params"] = self.params.stats_dict()
        return out
