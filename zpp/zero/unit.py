"""The unit: parameters communicated together, and its life between shards and full weights.

With sharded parameters (stage 3) the planner (:mod:`zpp.zero.planning`) makes one unit per
module it picks; otherwise it makes size-capped buckets. A unit owns a :class:`FlatShard`
and moves it between states with the engine's collectives, which it does not choose: the
gather of each :class:`~zpp.zero.comm_api.Phase` and the gradient reduction come in a
:class:`UnitComms` built once (:mod:`zpp.zero.gather`, :mod:`zpp.zero.reduce`). The engine
and its hooks decide *when*.

[Note: stage 1 bytes]
Stage 1 moves what DDP moves. DDP's all-reduce of ``P`` bytes sends ``2P(W-1)/W`` per rank
(a reduce-scatter plus an all-gather); stage 1 reduce-scatters the summed gradients into
the owned shard at the accumulation boundary (``P(W-1)/W``), steps the optimizer on the
shard, and all-gathers the updated parameters (``P(W-1)/W``). Only the padding of the
shards (to ``SHARD_ALIGN * W`` elements) differs. The gradients stay full and local
between micro-steps (``.grad``), so accumulation reduces once per optimizer step; stage 2
reduce-scatters every micro-step and keeps only the shard.

[Note: one full storage per unit]
With sharded parameters every gather of a unit fills the same full buffer, whose storage is
grown back for the gather and resized to zero bytes at the release (FSDP frees its unsharded
flat parameter the same way). Dropping the reference would not free it: autograd keeps what
the forward saved for the backward, and for a linear layer that is a view of the weight
(``weight.t()``), so every unit's gathered weights would stay in memory from its forward to
its backward: ``4 Psi`` (the whole model, not ``4 Psi / W``) at the end of the forward. With
one storage the saved views see the backward's gather of the same values (every phase's
gather of unchanged shards gives the same values: exact, or quantized from the same shard, or
hpZ's copy of the forward's result). Reading a released parameter's old view reads a storage
of no memory: zpp's parameters hold an empty tensor while released (see [Note: parameter
access] in :mod:`zpp.zero.access`).

[Note: started gathers]
:meth:`Unit.start_gather` starts the phase's gather (asynchronous transport ops) into a new
full buffer and leaves the unit GATHERING; :meth:`Unit.gather` then waits for it, lets the
strategy keep what it keeps (hpZ's secondary slice) and attaches the parameters. The
source (secondary or world, quantized or not) is chosen when the gather starts, so the
result is bit-identical to a gather done at the point of use as long as the shards do not
change in between (they change only at the optimizer step, and the engine waits for or
drops every started gather before it). A started gather of another phase than the one
asked for is waited for and dropped, then the right one is run.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from zpp.comm.transport import Transport, Work
from zpp.zero import access, param_attrs
from zpp.zero import init as zinit
from zpp.zero.comm_api import GradReduce, Phase, WeightGather
from zpp.zero.offload import Offload
from zpp.zero.param_groups import FROZEN
from zpp.zero.param_swap import ParamSwap
from zpp.zero.policy import ShardingPolicy
from zpp.zero.reduce.overlap import LinkWaits, ReductionThread, ThreadReduction
from zpp.zero.shard import FlatLayout, FlatShard, ShardState

if TYPE_CHECKING:
    from zpp.zero.gather.hpz import Secondaries


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitComms:
    """What every unit of an engine shares: the world, the policy and the chosen collectives."""

    world: Transport
    """The flat transport over every data-parallel rank."""
    policy: ShardingPolicy
    """What is sharded."""
    gathers: dict[Phase, WeightGather]
    """The weight gather of each phase (without sharded parameters: only ``Phase.EXACT``'s,
    which publishes the updated shards, at stages 1-2)."""
    reduce: GradReduce
    """The gradient reduction."""
    offload: Offload = Offload()
    """What lives in host memory (see [Note: offload] in :mod:`zpp.zero.offload`)."""
    reducer: ReductionThread | None = None
    """Runs ``reduce`` on a communication thread (``overlap_comm``); None: at once. See [Note:
    overlapped reductions] in :mod:`zpp.zero.reduce.overlap`."""
    waits: LinkWaits = dataclasses.field(default_factory=LinkWaits)
    """Seconds the training thread waited on communication, per phase."""
    params_swap: ParamSwap | None = None
    """The sharded units' parameter shards on NVMe between uses (``offload_param.device:
    "nvme"``); see [Note: parameters on NVMe] in :mod:`zpp.zero.param_swap`."""

    @property
    def degree(self) -> int:
        return self.policy.degree(self.world.world_size)

    def weights_changed(self, flat: FlatShard | None = None, *, replaced: bool = False) -> None:
        """Tell every gather that ``flat``'s shards changed (None: every unit's), so that
        what a gather keeps (hpZ's secondary shard) is dropped or marked out of date
        (``replaced``: set from outside the training, see :meth:`WeightGather.weights_changed`)."""
        for g in {id(g): g for g in self.gathers.values()}.values():
            g.weights_changed(flat, replaced=replaced)

    def resumable(self) -> Secondaries | None:
        """The gathers' state a checkpoint holds (:meth:`WeightGather.resumable`: the forward's
        and the backward's share one), or None."""
        stores = {id(s): s for s in (g.resumable() for g in self.gathers.values()) if s is not None}
        if len(stores) > 1:
            raise RuntimeError(f"UnitComms: the gathers keep {len(stores)} states across steps; a checkpoint "
                               "holds one")
        return next(iter(stores.values()), None)


class Started(NamedTuple):
    """A gather in flight (the unit is GATHERING)."""

    phase: Phase
    work: Work
    gather: WeightGather


class Unit:
    """A set of parameters with one flat layout and one shard.

    Args:
        index: position in the engine's unit list (the order of every flush and checkpoint).
        names, params: qualified names and the parameters, in flat order.
        group: the optimizer group of the parameters (:mod:`zpp.zero.param_groups`), or
            ``FROZEN``: frozen units have no master, no gradients, no optimizer state.
        comms: the engine's :class:`UnitComms`.
        persistent: with sharded parameters, keep this unit's parameters whole on every
            rank anyway (small parameters; DeepSpeed's persistence threshold).
    """

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                 *, group: int, comms: UnitComms, persistent: bool = False) -> None:
        self.index = index
        #: the parameters are sharded between uses (stage 3, unless the unit is persistent:
        #: ``stage3_param_persistence_threshold``, see [Note: persistent parameters] in
        #: :mod:`zpp.zero.planning`)
        self.shards_params = comms.policy.shard_parameters and not persistent
        self.names = tuple(names)
        self.params = tuple(params)
        self.group = group
        self.trainable = trainable = group != FROZEN
        self.comms = comms
        dtype = self.params[0].dtype
        degree = comms.degree
        self.layout = FlatLayout(self.names, [zinit.shape_of(p) for p in self.params], degree)
        self.flat = FlatShard(self.layout, comms.world.rank if degree > 1 else 0, dtype, self.params[0].device)
        #: reduced gradients on their way to host memory (offloaded optimizer), folded at the step
        self.host_grads: list[torch.Tensor] = []
        #: parameters whose gradient the backward delivers (post-accumulate hooks)
        self.expected_grads = sum(1 for p in self.params if p.requires_grad) if trainable else 0
        #: ids of the parameters whose gradient arrived in this micro-step (see [Note: stage 3 hooks])
        self.arrived: set[int] = set()
        self.reduced = False
        #: reductions running on the engine's reduction thread, oldest first (overlap_comm)
        self.pending: list[ThreadReduction] = []
        #: forward users currently inside a module that needs this unit (stage 3)
        self.forward_users = 0
        #: open GatheredParameters blocks holding this unit gathered (never released meanwhile)
        self.pinned = 0
        #: the gather in flight while GATHERING
        self.inflight: Started | None = None
        #: with sharded parameters, the full buffer every gather fills (its storage freed at release)
        self._full: torch.Tensor | None = None
        self._materialize()

    # ------------------------------------------------------------------ storage
    def _materialize(self) -> None:
        f, lay = self.flat, self.layout
        device = self.params[0].device
        own = lay.owned(f.rank)
        if any(zinit.is_loose(p) for p in self.params):
            self._materialize_loose(own)
        elif self.shards_params:
            f.shard = lay.flatten([p.detach() for p in self.params], f.dtype, device)[own].clone()
            f.full = None
            self._detach()
        else:
            f.full = lay.flatten([p.detach() for p in self.params], f.dtype, device)
            f.shard = f.full[own]
            f.attach(self.params)
        offload = self.comms.offload
        if offload.params and self.shards_params:
            f.shard = offload.host(f.shard)
        if self.trainable:
            if offload.optimizer and f.shard.device.type != "cpu":
                f.master = torch.nn.Parameter(offload.host(f.shard, torch.float32), requires_grad=True)
            elif f.dtype == torch.float32:
                f.master = torch.nn.Parameter(f.shard, requires_grad=True)
            else:
                f.master = torch.nn.Parameter(offload.host(f.shard, torch.float32) if offload.optimizer
                                              else f.shard.float(), requires_grad=True)
        if self.comms.policy.shard_parameters:
            self._describe(own)
        if self.comms.params_swap is not None and self.shards_params:
            self.comms.params_swap.adopt(self)

    def _describe(self, own: slice) -> None:
        """DeepSpeed's ZeRO-3 attributes on the parameters (see [Note: ZeRO-3 parameter
        attributes] in :mod:`zpp.zero.param_attrs`): each one's part of this rank's shard."""
        f = self.flat
        status = param_attrs.ZeroParamStatus.NOT_AVAILABLE if self.shards_params else \
            param_attrs.ZeroParamStatus.AVAILABLE
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            lo = min(max(slot.offset, own.start), own.stop)
            hi = max(min(slot.offset + slot.numel, own.stop), lo)
            part = f.shard[lo - own.start:hi - own.start]
            param_attrs.describe(p, numel=slot.numel, shape=slot.shape, partition=part, persist=not self.shards_params,
                                 status=status)

    def _materialize_loose(self, own: slice) -> None:
        """Build the unit from parameters partitioned by :class:`zpp.zero.Init`, one
        parameter at a time (see [Note: partitioned construction])."""
        f, lay = self.flat, self.layout
        sharded = self.shards_params
        device = self.params[0].device
        buf = torch.zeros(lay.shard_numel if sharded else lay.padded_numel, dtype=f.dtype, device=device)
        base = own.start if sharded else 0
        for slot, p in zip(lay.slots, self.params, strict=True):
            if zinit.is_loose(p):
                values = zinit.full_value(p).reshape(-1)  # collective: every rank, every loose parameter
                zinit.take(p)
            else:
                values = p.detach().reshape(-1)
            lo = max(slot.offset, base)
            hi = min(slot.offset + slot.numel, base + buf.numel())
            if hi > lo:
                buf[lo - base:hi - base] = values[lo - slot.offset:hi - slot.offset]
        if sharded:
            f.shard, f.full = buf, None
            self._detach()
        else:
            f.full = buf
            f.shard = buf[own]
            f.attach(self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def gathered(self) -> bool:
        return self.flat.state is ShardState.GATHERED

    # ------------------------------------------------------------------ gather (sharded parameters)
    def gather(self, phase: Phase) -> None:
        """Materialize the full buffer with the phase's gather. Idempotent. Completes a
        started gather of the same phase (see [Note: started gathers])."""
        f = self.flat
        if f.state is ShardState.GATHERED:
            return
        if f.state is ShardState.GATHERING:
            if self.inflight.phase is phase:
                self._complete()
                return
            self.drop_started()
        self.start_gather(phase)
        self._complete()

    def start_gather(self, phase: Phase) -> Work:
        """Start the gather ``gather(phase)`` would run, without waiting (the unit must be
        SHARDED); the unit is GATHERING until :meth:`gather` or :meth:`drop_started`."""
        f = self.flat
        if f.state is not ShardState.SHARDED:
            raise RuntimeError(f"Unit.start_gather: unit {self.index} is {f.state.name}, not SHARDED")
        strategy = self.comms.gathers[phase]
        if self.comms.params_swap is not None:
            self.comms.params_swap.ensure(self)  # freed again once the gather is complete
        full = self._full_storage()
        work = strategy.start(f, full)
        f.full = full
        f.state = ShardState.GATHERING
        self.inflight = Started(phase, work, strategy)
        param_attrs.set_status(self.params, param_attrs.ZeroParamStatus.INFLIGHT)
        return work

    def _complete(self) -> None:
        started, self.inflight = self.inflight, None
        with self.comms.waits.waiting(f"{started.phase.value}_gather", f"unit {self.index}"):
            started.work.wait()
        started.gather.finish(self.flat, self.flat.full)
        if self.comms.params_swap is not None:
            self.comms.params_swap.evict(self)
        self.flat.attach(self.params)
        access.mark_gathered(self.params)

    def drop_started(self) -> None:
        """Wait for a started gather and throw its result away (back to SHARDED)."""
        if self.flat.state is not ShardState.GATHERING:
            return
        started, self.inflight = self.inflight, None
        with self.comms.waits.waiting(f"{started.phase.value}_gather", f"unit {self.index} (dropped)"):
            started.work.wait()
        if self.comms.params_swap is not None:
            self.comms.params_swap.evict(self)
        self.flat.full = None
        self._free_full()
        self.flat.state = ShardState.SHARDED
        param_attrs.set_status(self.params, param_attrs.ZeroParamStatus.NOT_AVAILABLE)

    def release(self) -> None:
        """Drop the full buffer (sharded parameters only; otherwise it is the parameters)."""
        if self.shards_params and self.flat.state is ShardState.GATHERED and not self.pinned:
            self._detach()

    def _detach(self) -> None:
        self.flat.detach(self.params)
        self._free_full()
        access.mark_sharded(self.params)  # reads now go through [Note: parameter access]

    def _full_storage(self) -> torch.Tensor:
        """The full buffer a gather fills: the same tensor and storage at every gather, its
        memory allocated again (see [Note: one full storage per unit])."""
        f = self.flat
        full = self._full
        if full is None or full.dtype != f.dtype or full.device != f.device:
            full = self._full = torch.empty(self.layout.padded_numel, dtype=f.dtype, device=f.device)
        elif full.untyped_storage().nbytes() == 0:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        return full

    def _free_full(self) -> None:
        """Free the full buffer's memory, whoever still views it (see [Note: one full storage per unit])."""
        if self._full is not None and self.shards_params:
            self._full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> None:
        """Average the gradients accumulated in the parameters' ``.grad`` over the ranks with
        the engine's :class:`~zpp.zero.comm_api.GradReduce` into ``flat.grad`` (owned range,
        fp32) and free the ``.grad``. Called once per optimizer step without sharded
        gradients (the micro-steps' gradients summed in ``.grad``), once per micro-step
        with them; see [Note: stage 1 bytes]. With the engine's reduction thread
        (``overlap_comm``) the reduction is only started: :meth:`finish_reductions` completes it."""
        f, lay, comms = self.flat, self.layout, self.comms
        flat = lay.flatten([p.grad for p in self.params], torch.float32, f.device)
        for p in self.params:
            p.grad = None
        self.reduced = True
        if comms.reducer is not None:
            self.pending.append(comms.reducer.start(flat, lay, f"unit {self.index}"))
            return
        with comms.waits.waiting("reduce", f"unit {self.index}"):
            reduced = comms.reduce.start(flat, lay).wait()  # see [Note: reductions return work]
        self._fold(reduced)

    def finish_reductions(self) -> None:
        """Wait for this unit's reductions on the reduction thread, oldest first, and add them
        to ``flat.grad`` (the order of the synchronous path, so the sums are its bits)."""
        while self.pending:
            self._fold(self.pending.pop(0).wait())

    def drop_reductions(self) -> None:
        """Wait for this unit's reductions on the reduction thread (a collective cannot be
        cancelled) and throw their results away: a failed backward, ``zero_grad``. A failed
        reduction is not raised here: the pass is discarded, and a broken world says so at
        its next call."""
        for r in self.pending:
            try:
                r.wait()
            except BaseException:  # noqa: BLE001, S110 - see the docstring
                pass
        self.pending.clear()

    def _fold(self, reduced: torch.Tensor) -> None:
        f, swap = self.flat, self.comms.params_swap
        if f.master is not None and f.master.device != reduced.device:  # offloaded: to the host, overlapped
            self.host_grads.append(self.comms.offload.to_host(reduced))
        elif swap is not None and swap.manages(self):  # see [Note: gradients on NVMe]
            if swap.grad_on_disk(self):
                f.grad = swap.take_grad(self)
            f.add_grad(reduced, owned=True)
            swap.stash_grad(self)
        else:
            f.add_grad(reduced, owned=True)

    @property
    def has_unreduced_grads(self) -> bool:
        """Some ``.grad`` holds gradient not yet reduced into ``flat.grad``."""
        return any(p.grad is not None for p in self.params)

    def reset_micro_step(self) -> None:
        """Forget which gradients arrived (the end of a backward)."""
        self.arrived.clear()
        self.reduced = False

    @property
    def grad_on_disk(self) -> bool:
        """The reduced gradient is in the NVMe swap file (see [Note: gradients on NVMe])."""
        return self.comms.params_swap is not None and self.comms.params_swap.grad_on_disk(self)

    def scale_grad(self, factor: float) -> None:
        """Multiply the reduced gradient by ``factor`` (on disk: when it is read back)."""
        if self.grad_on_disk:
            self.comms.params_swap.scale_grad(self, factor)
        elif self.flat.grad is not None:
            self.flat.grad.mul_(factor)

    def drop_grad(self) -> None:
        """Forget the reduced gradient, in memory or on disk."""
        self.flat.grad = None
        if self.comms.params_swap is not None:
            self.comms.params_swap.drop_grad(self)

    def grad_norm_sq(self) -> torch.Tensor:
        if self.grad_on_disk:
            return self.comms.params_swap.grad_norm_sq(self)
        g = self.flat.grad
        return torch.zeros((), dtype=torch.float64) if g is None else g.double().pow(2).sum()

    def fold_host_grads(self) -> None:
        """Add the gradients copied to the host since the last step into ``flat.grad`` (after
        :func:`zpp.zero.offload.settle`)."""
        for g in self.host_grads:
            self.flat.add_grad(g)
        self.host_grads.clear()

    def stage_grad(self) -> None:
        """Hand the accumulated gradient to the optimizer as ``master.grad``."""
        f = self.flat
        if f.grad is None and not self.grad_on_disk:  # (on disk: the step reads it back, see modes/nvme.py)
            f.grad = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=f.master.device)
        f.master.grad = f.grad

    # ------------------------------------------------------------------ after the step
    def publish(self) -> None:
        """Make the updated master weights the parameters: cast into the shard, all-gather
        into the full buffer (sharded optimizer state and persistent parameters: stages 1-2,
        and persistent units at stage 3); the gathers drop what they keep of the old weights."""
        f, comms = self.flat, self.comms
        f.master.grad = None
        f.grad = None
        self.release()  # a full buffer gathered before the step would hold the old weights
        if not f.master_aliases_shard and not self.on_disk:  # (on disk: cast before it was written)
            f.shard.copy_(f.master.detach())
        if comms.policy.shard_optimizer_state and not self.shards_params and comms.world.world_size > 1:
            with comms.waits.waiting("publish", f"unit {self.index}"):
                comms.gathers[Phase.EXACT].publish(f).wait()
        comms.weights_changed(f)

    @property
    def on_disk(self) -> bool:
        """The shard is in the NVMe swap file only (see [Note: parameters on NVMe])."""
        return self.comms.params_swap is not None and self.comms.params_swap.on_disk(self)

    def resident(self, *, modified: bool = False):
        """A context in which the shard is in memory (``modified``: written back to the NVMe
        swap file after); a no-op without parameters on NVMe."""
        if self.comms.params_swap is None or not self.comms.params_swap.manages(self):
            return contextlib.nullcontext()
        return self.comms.params_swap.resident(self, modified=modified)

    def load_flat(self, values: torch.Tensor, master: torch.Tensor | None = None) -> None:
        """Set the unit from a full flat fp32 vector of ``layout.numel`` elements (checkpoint
        loading): the owned range of the master weights and the parameters."""
        with self.resident(modified=True):
            self._load_flat(values, master)

    def _load_flat(self, values: torch.Tensor, master: torch.Tensor | None) -> None:
        f, lay = self.flat, self.layout
        padded = torch.zeros(lay.padded_numel, dtype=torch.float32, device=f.device)
        padded[:lay.numel] = values
        own = padded[lay.owned(f.rank)]
        if f.master is not None:
            f.master.data.copy_(own if master is None else master)
        if f.full is not None and not self.shards_params:
            f.full.copy_(padded)
        elif not f.master_aliases_shard:
            f.shard.copy_(own)
        self.comms.weights_changed(f, replaced=True)

    def __repr__(self) -> str:
        return f"Unit({self.index}, params={len(self.params)}, trainable={self.trainable}, {self.flat!r})"
