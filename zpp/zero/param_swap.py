"""ZeRO-Infinity's parameter tier: stage 3's parameter shards in a swap file between uses.

[Note: parameters on NVMe]
``zero_optimization.offload_param.device: "nvme"`` (stage 3) keeps each sharded unit's
parameter shard (and its fp32 master where that is a separate tensor: bf16 parameters) in a
second swap file per rank, ``<nvme_path>/zpp_swap/param_rankNNNNN.swp`` (the same
:class:`~zpp.zero.nvme.SwapFile` as the optimizer tier: direct I/O, CRC32 per request,
truncated at open, removed at close). Between uses the tensors keep their shapes, dtypes and
every view of them (the master the optimizer steps, ``ds_tensor``), but their storages are
resized to zero bytes (as FSDP frees a flat parameter's storage); a use grows the storage
again and fills it from the file, so nothing else in zpp holds a second reference to keep
valid. Nothing may read a shard while it is on disk (its storage holds no memory; torch does
not check): zpp's own readers ask for it first (:meth:`ParamSwap.ensure`, or
:meth:`zpp.zero.unit.Unit.resident`), and the parameters' ``ds_tensor`` (the DeepSpeed
attribute user code reads) is an empty tensor meanwhile.

A unit's shard is needed three times a step, and :class:`ParamSwap` brings it in for each
and lets it go right after:

* the forward's gather and the backward's gather (:meth:`zpp.zero.unit.Unit.start_gather`
  asks for it; once the gather completes the full buffer has what it needs and the shard is
  freed: no write, the file still holds it);
* the optimizer step (:mod:`zpp.zero.modes.nvme` steps one unit at a time): the updated
  shard is written back through one of ``buffer_count`` host buffers and freed.

Reads run ahead of use. The order in which the units are asked for over one optimizer step
(forward, backward, step, for every micro-step) is recorded on the first step (the trace),
and while a later step follows it, each use issues the reads of the next units of the trace
(wrapping into the next step) into free buffers, at most ``buffer_count - 1`` in flight: the
disk works under the compute of the unit in use. A step that departs from the trace (an
evaluation pass between steps, a data-dependent graph) stops reading ahead for the rest of
that step (``mismatches``) and becomes the new trace; its reads are made at the point of use
(``sync_reads``). Nothing but speed depends on the trace.

[Note: gradients on NVMe]
The reduced gradient shards (``4 Psi / W`` at the step) go to the same file: each unit's is
written as soon as its reduction is added up (:meth:`zpp.zero.unit.Unit._fold`), with its
squared norm kept in memory, so the step's norm and non-finite check read nothing; the
unscaling and clipping factor is kept too and applied when the gradient is read back. A
later micro-step reads it back to add to it; the step reads each unit's gradient one unit
ahead of its update and drops it after. Every byte is the in-memory run's: the same fp32
additions in the same order, one multiplication by the same factor.

Memory: the shards of the units in use and up to ``buffer_count`` buffers of one unit's
shard (or gradient; one more while a gradient is read ahead of the step), instead of ``4 Psi / W`` (fp32) or ``6 Psi / W`` (bf16 with masters) of
parameters and ``4 Psi / W`` of gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zpp.zero import param_attrs
from zpp.zero.nvme import BufferPool, Region, SwapFile, Transfer

if TYPE_CHECKING:
    from zpp.zero.unit import Unit

#: a trace longer than this many uses per unit is not recorded (a loop that never steps)
_TRACE_CAP_PER_UNIT = 64


@dataclasses.dataclass(slots=True)
class ParamSwapStats:
    """What the parameter tier did since the engine was built."""

    reads: int = 0
    """Shards read from the file."""
    read_ahead: int = 0
    """Of those, reads issued ahead of use (from the trace)."""
    sync_reads: int = 0
    """Reads made at the point of use (no read ahead: the first step, a mismatch, a unit read
    ahead too late)."""
    writes: int = 0
    """Shards written back (after the optimizer step, a load, a modified gather)."""
    mismatches: int = 0
    """Steps whose order of uses differed from the trace."""
    recorded: int = 0
    """Traces recorded."""
    grad_writes: int = 0
    """Reduced gradient shards written (after each micro-step's reduction)."""
    grad_reads: int = 0
    """Reduced gradient shards read back (for the step, or to accumulate the next micro-step)."""
    grad_read_ahead: int = 0
    """Of those, reads issued ahead of the unit's step."""


class ParamSwap:
    """The parameter shards of a rank's sharded units in one swap file; see [Note: parameters on NVMe]."""

    def __init__(self, swap: SwapFile, buffer_count: int) -> None:
        self.swap = swap
        self.buffers = BufferPool(buffer_count)
        self.ahead = max(1, buffer_count - 1)
        self.stats = ParamSwapStats()
        self._tensors: dict[int, tuple[torch.Tensor, ...]] = {}  # unit index -> tensors of distinct storage
        self._params: dict[int, tuple[torch.nn.Parameter, ...]] = {}  # (their ds_tensor: see param_attrs)
        self._regions: dict[int, Region] = {}
        self._resident: set[int] = set()
        self._reads: dict[int, Transfer] = {}  # read ahead, not yet used
        self._writes: dict[int, Transfer] = {}  # the last write of each unit, until seen done
        self._kept: set[int] = set()  # left in memory at an eviction: the trace uses them again soon
        self._trace: list[int] | None = None
        self._seq: list[int] = []
        self._matching = False
        # the reduced gradients (see [Note: gradients on NVMe])
        self._gregions: dict[int, Region] = {}
        self._gdisk: dict[int, list] = {}  # unit -> [its squared norm (float64), a scale not yet applied]
        self._greads: dict[int, Transfer] = {}
        self._gwrites: dict[int, Transfer] = {}

    # ------------------------------------------------------------------ construction
    def adopt(self, unit: Unit) -> None:
        """Take ``unit``'s shard (and separate master) to the file: written now, then freed."""
        f, k = unit.flat, unit.index
        tensors = [f.shard.detach()]
        if f.master is not None and not f.master_aliases_shard:
            tensors.append(f.master.detach())
        for t in tensors:
            if not (t.is_contiguous() and t.storage_offset() == 0
                    and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
                raise RuntimeError(f"ParamSwap.adopt: unit {k}'s shard is not a whole storage")
        entries, nbytes = Region.layout({f"t{i}": t for i, t in enumerate(tensors)})
        self._tensors[k] = tuple(tensors)
        self._params[k] = unit.params
        self._regions[k] = Region(self.swap.allocate(nbytes), nbytes, entries)
        if f.master is not None:  # its reduced gradient: fp32, the shard's size
            g = torch.empty(f.master.shape, dtype=torch.float32, device="meta")
            entries, nbytes = Region.layout({"grad": g})
            self._gregions[k] = Region(self.swap.allocate(nbytes), nbytes, entries)
        self._resident.add(k)
        self.evict(unit, dirty=True)
        self.buffers.finish_writes()  # construction holds one unit's buffer at a time

    def manages(self, unit: Unit) -> bool:
        return unit.index in self._regions

    def on_disk(self, unit: Unit) -> bool:
        """``unit``'s shard is in the file only (its storage is empty)."""
        return unit.index in self._regions and unit.index not in self._resident

    # ------------------------------------------------------------------ uses
    def ensure(self, unit: Unit) -> None:
        """Give ``unit``'s shard its bytes (from a read issued ahead, or read now), and read
        ahead along the trace."""
        k = unit.index
        if k not in self._regions:
            return
        self._kept.discard(k)
        self._record(k)
        if k not in self._resident:
            self._settle_write(k)
            region = self._regions[k]
            t = self._reads.pop(k, None)
            if t is None:
                self.stats.sync_reads += 1
                t = self._read(k, self.buffers.get(region.nbytes))
            buf = self.buffers.wait(t)
            try:
                for e, ten in zip(region.entries, self._tensors[k], strict=True):
                    ten.untyped_storage().resize_(e.nbytes)
                    ten.view(-1).copy_(buf.view(e).view(-1))
            finally:
                self.buffers.put(buf)
            self._resident.add(k)
            param_attrs.set_on_disk(self._params[k], False)
        self._read_ahead()

    def evict(self, unit: Unit, *, dirty: bool = False) -> None:
        """Free ``unit``'s shard; ``dirty``: it changed since it was read, write it first."""
        k = unit.index
        if k not in self._regions or k not in self._resident:
            return
        tensors = self._tensors[k]
        if dirty:
            region = self._regions[k]
            buf = self.buffers.get(region.nbytes)
            for e, t in zip(region.entries, tensors, strict=True):
                buf.view(e).view(-1).copy_(t.view(-1))
            t = self.swap.write(region, buf)
            self.buffers.written(t)
            self._writes[k] = t
            self.stats.writes += 1
        if self._wanted_soon(k):  # as good as a read ahead, and no read
            self._kept.add(k)
            return
        self._free(k)

    def _free(self, k: int) -> None:
        for t in self._tensors[k]:
            t.untyped_storage().resize_(0)
        self._resident.discard(k)
        param_attrs.set_on_disk(self._params[k], True)

    @contextlib.contextmanager
    def resident(self, unit: Unit, *, modified: bool) -> Iterator[None]:
        """``unit``'s shard in memory inside the block (``modified``: written back after)."""
        was = not self.on_disk(unit)
        self.ensure(unit)
        try:
            yield
        finally:
            if not was or modified:
                self.evict(unit, dirty=modified)

    def values(self, unit: Unit) -> torch.Tensor | None:
        """``unit``'s fp32 values (its master, else its shard) as read-only views of the file
        (CRC32 checked; no copy in memory), or None when the shard is in memory."""
        if not self.on_disk(unit):
            return None
        self.buffers.finish_writes()
        self._writes.clear()
        views = self.swap.mapped(self._regions[unit.index])
        return views["t1" if "t1" in views else "t0"].float()

    # ------------------------------------------------------------------ gradients
    def grad_on_disk(self, unit: Unit) -> bool:
        return unit.index in self._gdisk

    def stash_grad(self, unit: Unit) -> None:
        """Write ``unit``'s reduced gradient (``flat.grad``) to the file and free it, keeping its
        squared norm (the step's check needs no read)."""
        k, f = unit.index, unit.flat
        region = self._gregions.get(k)
        if region is None or f.grad is None:
            return
        g = f.grad
        norm = g.double().pow(2).sum()
        buf = self.buffers.get(region.nbytes)
        buf.view(region.entries[0]).copy_(g.view(region.entries[0].shape))
        t = self.swap.write(region, buf)
        self.buffers.written(t)
        self._gwrites[k] = t
        f.grad = None
        self._gdisk[k] = [norm, 1.0]
        self.stats.grad_writes += 1

    def grad_norm_sq(self, unit: Unit) -> torch.Tensor:
        norm, scale = self._gdisk[unit.index]
        return norm * (scale * scale)

    def scale_grad(self, unit: Unit, factor: float) -> None:
        """Multiply the gradient on disk by ``factor`` when it is read back (unscaling, clipping)."""
        self._gdisk[unit.index][1] *= factor

    def read_grad_ahead(self, unit: Unit) -> None:
        """Start reading ``unit``'s gradient into a free buffer, if one is free now."""
        k = unit.index
        if k not in self._gdisk or k in self._greads:
            return
        w = self._gwrites.get(k)
        if w is not None and not w.done():
            return
        region = self._gregions[k]
        buf = self.buffers.get(region.nbytes, wait=False)
        if buf is not None:
            self._greads[k] = self.swap.read(region, buf)
            self.stats.grad_read_ahead += 1

    def take_grad(self, unit: Unit) -> torch.Tensor:
        """``unit``'s gradient, back from the file (its scale applied); no longer on disk."""
        k = unit.index
        _, scale = self._gdisk.pop(k)
        region = self._gregions[k]
        t = self._greads.pop(k, None)
        if t is None:
            w = self._gwrites.pop(k, None)
            if w is not None and not w.done():
                self.buffers.finish_writes()
            t = self.swap.read(region, self.buffers.get(region.nbytes))
        self.stats.grad_reads += 1
        buf = self.buffers.wait(t)
        try:
            g = buf.view(region.entries[0]).clone()
        finally:
            self.buffers.put(buf)
        if scale != 1.0:
            g.mul_(scale)
        return g

    def drop_grad(self, unit: Unit) -> None:
        """Forget ``unit``'s gradient on disk (``zero_grad``, a skipped step)."""
        k = unit.index
        self._gdisk.pop(k, None)
        t = self._greads.pop(k, None)
        if t is not None:
            try:
                self.buffers.put(self.buffers.wait(t))
            except OSError:
                pass  # the gradient is dropped anyway

    def end_step(self) -> None:
        """The optimizer step is over: this step's order of uses becomes the trace if it
        differs (see [Note: parameters on NVMe])."""
        seq, self._seq = self._seq, []
        if seq and seq != self._trace and len(seq) < _TRACE_CAP_PER_UNIT * max(1, len(self._regions)):
            self._trace = seq
            self.stats.recorded += 1
        self._matching = bool(self._trace)

    # ------------------------------------------------------------------ the rest
    def _record(self, k: int) -> None:
        pos = len(self._seq)
        if pos < _TRACE_CAP_PER_UNIT * len(self._regions):
            self._seq.append(k)
        if self._matching and (pos >= len(self._trace) or self._trace[pos] != k):
            self._matching = False
            self.stats.mismatches += 1
            self._drop_kept()

    def _window(self) -> list[int]:
        """The units of the trace's next ``ahead`` uses (none while the step departs from it)."""
        if not self._matching:
            return []
        pos, n = len(self._seq), len(self._trace)
        return [self._trace[j % n] for j in range(pos, pos + self.ahead)]

    def _wanted_soon(self, k: int) -> bool:
        return k in self._window()

    def _drop_kept(self) -> None:
        """Free the units kept for uses the trace no longer predicts (their files are current)."""
        for k in sorted(self._kept):
            self._free(k)
        self._kept.clear()

    def _read_ahead(self) -> None:
        """Issue the reads of the units of the next uses that are on disk, into free buffers
        (at most ``ahead`` units are resident or on their way for the uses to come)."""
        for k in self._window():
            if k in self._resident or k in self._reads:
                continue
            w = self._writes.get(k)
            if w is not None and not w.done():
                return  # its new bytes are still on their way to the file: read it at its use
            buf = self.buffers.get(self._regions[k].nbytes, wait=False)
            if buf is None:
                return
            self._reads[k] = self._read(k, buf)
            self.stats.read_ahead += 1

    def _read(self, k: int, buf) -> Transfer:
        self.stats.reads += 1
        return self.swap.read(self._regions[k], buf)

    def _settle_write(self, k: int) -> None:
        w = self._writes.pop(k, None)
        if w is not None and not w.done():
            self.buffers.finish_writes()  # the file must hold the unit's last bytes before a read

    def close(self) -> None:
        try:
            for t in [*self._reads.values(), *self._greads.values()]:
                with contextlib.suppress(OSError):
                    self.buffers.wait(t)
            self._reads.clear()
            self._greads.clear()
            self.buffers.finish_writes()
        finally:
            self.swap.close()

    def state_bytes(self) -> int:
        return self.buffers.nbytes

    def stats_dict(self) -> dict[str, object]:
        return {**self.swap.stats(), **dataclasses.asdict(self.stats), "buffers": len(self.buffers.all),
                "wait_s": self.buffers.wait_s}
