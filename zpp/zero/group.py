"""The unit: parameters communicated together, and every collective the engine runs on them.

Stage 3 makes one unit per module (its directly owned parameters, split by trainable/frozen
and dtype); stages 0-2 make size-capped buckets. A unit owns a :class:`FlatShard` and knows
how to gather, release, reduce gradients and publish an optimizer update, choosing the
plain or the ZeRO++ collective from the configuration. The engine decides *when*.

[Note: stage 1 bytes]
Stage 1 moves what DDP moves. DDP's all-reduce of ``P`` bytes sends ``2P(W-1)/W`` per rank
(a reduce-scatter plus an all-gather); stage 1 reduce-scatters the summed gradients into
the owned shard at the accumulation boundary (``P(W-1)/W``), steps the optimizer on the
shard, and all-gathers the updated parameters (``P(W-1)/W``). Only the padding of the
shards (to ``SHARD_ALIGN * W`` elements) differs. The gradients stay full and local
between micro-steps (``.grad``), so accumulation reduces once per optimizer step; stage 2
reduce-scatters every micro-step and keeps only the shard.

[Note: which gather]
Stage 3 gathers a unit before each forward and each backward use:

1. hpZ secondary valid: all-gather the secondary shards over ``topology.intra`` (no
   inter-node bytes).
2. otherwise, forward with qwZ: :func:`quantized_all_gather` over the world.
3. otherwise: the plain all-gather over the world (backward without hpZ is full precision).

With hpZ on, a world gather (2 or 3) also keeps this rank's ``1/k`` slice of the result as
the secondary shard. It holds exactly the weights the forward used (quantized ones under
qwZ), so forward and backward of a micro-step see the same weights; the optimizer step
invalidates it, see :meth:`Unit.publish`.

[Note: started gathers]
:meth:`Unit.start_gather` issues the gather chosen above (asynchronous transport ops:
``all_gather_async``, ``quantized_all_gather_async``) into a new full buffer and leaves the
unit GATHERING; :meth:`Unit.gather` then waits for it, keeps the hpZ secondary slice and
attaches the parameters. The source (secondary or world, quantized or not) is chosen when
the gather starts, so the result is bit-identical to a gather done at the point of use as
long as the shards do not change in between (they change only at the optimizer step, and
the engine waits for or drops every started gather before it). A started gather of another
phase than the one asked for is waited for and dropped, then the right one is run.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from zpp.comm.collectives import quantized_all_gather_async, quantized_reduce_scatter
from zpp.comm.transport import Transport, Work
from zpp.zero.config import ZeroConfig, ZppConfig
from zpp.zero.shard import FlatLayout, FlatShard, SecondaryState, ShardState


@dataclasses.dataclass(kw_only=True, slots=True)
class CommContext:
    """What every unit of an engine shares: transports and switches."""

    world: Transport
    """The flat transport over every data-parallel rank."""
    topology: object | None
    """:class:`zpp.comm.topology.Topology` of ``world`` when hpZ or qgZ needs it, else None."""
    zero: ZeroConfig
    zpp: ZppConfig

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def degree(self) -> int:
        return 1 if self.zero.stage == 0 else self.world.world_size

    @property
    def hpz(self) -> bool:
        return self.zero.stage == 3 and self.zero.hpz_partition_size > 1 and self.topology is not None


class Unit:
    """A set of parameters with one flat layout and one shard.

    Args:
        index: position in the engine's unit list (the order of every flush and checkpoint).
        names, params: qualified names and the parameters, in flat order.
        trainable: whether the parameters are trained (frozen units have no master, no
            gradients, no optimizer state).
        ctx: the engine's :class:`CommContext`.
    """

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                 *, trainable: bool, ctx: CommContext) -> None:
        self.index = index
        self.names = tuple(names)
        self.params = tuple(params)
        self.trainable = trainable
        self.ctx = ctx
        dtype = self.params[0].dtype
        self.layout = FlatLayout(self.names, [p.shape for p in self.params], ctx.degree)
        rank = ctx.world.rank if ctx.degree > 1 else 0
        self.flat = FlatShard(self.layout, rank, dtype)
        #: gradients still to arrive in this micro-step (post-accumulate hooks count down)
        self.expected_grads = sum(1 for p in self.params if p.requires_grad) if trainable else 0
        self.pending = self.expected_grads
        self.reduced = False
        #: forward users currently inside a module that needs this unit (stage 3)
        self.forward_users = 0
        #: the started gather while GATHERING: (phase, work, keep the hpZ secondary)
        self.inflight: tuple[str, Work, bool] | None = None
        self._materialize()

    # ------------------------------------------------------------------ storage
    def _materialize(self) -> None:
        f, lay = self.flat, self.layout
        device = self.params[0].device
        full = lay.flatten([p.detach() for p in self.params], f.dtype, device)
        own = lay.owned(f.rank)
        if self.ctx.stage < 3:
            f.full = full
            f.shard = full[own]
            f.attach(self.params)
        else:
            f.shard = full[own].clone()
            f.full = None
            f.detach(self.params)
        if self.trainable:
            if f.dtype == torch.float32:
                f.master = torch.nn.Parameter(f.shard, requires_grad=True)
            else:
                f.master = torch.nn.Parameter(f.shard.float(), requires_grad=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def gathered(self) -> bool:
        return self.flat.state is ShardState.GATHERED

    # ------------------------------------------------------------------ stage 3 gather
    def gather(self, phase: str) -> None:
        """Materialize the full buffer (stage 3; see [Note: which gather]). Idempotent.
        ``phase`` is "forward", "backward", or "exact" (the full-precision primary shards,
        never the secondary: consolidation). Completes a started gather of the same phase
        (see [Note: started gathers])."""
        f = self.flat
        if f.state is ShardState.GATHERED:
            return
        if f.state is ShardState.GATHERING:
            if self.inflight[0] == phase:
                self._complete()
                return
            self.drop_started()
        self.start_gather(phase)
        self._complete()

    def start_gather(self, phase: str) -> Work:
        """Start the gather ``gather(phase)`` would run, without waiting (the unit must be
        SHARDED); the unit is GATHERING until :meth:`gather` or :meth:`drop_started`."""
        f, ctx = self.flat, self.ctx
        if f.state is not ShardState.SHARDED:
            raise RuntimeError(f"Unit.start_gather: unit {self.index} is {f.state.name}, not SHARDED")
        full = torch.empty(self.layout.padded_numel, dtype=f.dtype, device=f.shard.device)
        keep_secondary = False
        if f.secondary_state is SecondaryState.VALID and phase != "exact":
            work = ctx.topology.intra.all_gather_async(full, f.secondary)
        else:
            if phase == "forward" and ctx.zero.quantized_weights:
                gs = min(ctx.zpp.weight_group_size, self.layout.shard_numel)
                work = quantized_all_gather_async(full, f.shard, transport=ctx.world, bits=ctx.zpp.weight_bits,
                                                  group_size=gs)
            else:
                work = ctx.world.all_gather_async(full, f.shard)
            keep_secondary = ctx.hpz and phase != "exact"
        f.full = full
        f.state = ShardState.GATHERING
        self.inflight = (phase, work, keep_secondary)
        return work

    def _complete(self) -> None:
        f, ctx = self.flat, self.ctx
        _phase, work, keep_secondary = self.inflight
        self.inflight = None
        work.wait()
        if keep_secondary:
            k = ctx.topology.ranks_per_node
            n = self.layout.padded_numel // k
            lr = ctx.topology.local_rank
            f.secondary = f.full[lr * n:(lr + 1) * n].clone()
            f.secondary_state = SecondaryState.VALID
        f.attach(self.params)

    def drop_started(self) -> None:
        """Wait for a started gather and throw its result away (back to SHARDED)."""
        if self.flat.state is not ShardState.GATHERING:
            return
        _phase, work, _keep = self.inflight
        self.inflight = None
        work.wait()
        self.flat.full = None
        self.flat.state = ShardState.SHARDED

    def release(self) -> None:
        """Drop the full buffer (stage 3 only; stages 0-2 keep it)."""
        if self.ctx.stage == 3 and self.flat.state is ShardState.GATHERED:
            self.flat.detach(self.params)

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> None:
        """Average the gradients accumulated in the parameters' ``.grad`` over the world into
        ``flat.grad`` (owned range, fp32) and free the ``.grad``. Stage 0: all-reduce (every
        rank owns everything); stages 1-3: reduce-scatter into the owned shard, qgZ's
        quantized two-hop one when switched on (stage 3). Stages 0-1 call it once per
        optimizer step (the micro-steps' gradients summed in ``.grad``), stages 2-3 once per
        micro-step; see [Note: stage 1 bytes]."""
        ctx, f, lay = self.ctx, self.flat, self.layout
        grads = [p.grad for p in self.params]
        flat = lay.flatten(grads, torch.float32, f.shard.device)
        for p in self.params:
            p.grad = None
        if ctx.stage == 0:
            ctx.world.all_reduce(flat, "mean")
            f.add_grad(flat)
        else:
            out = torch.empty(lay.shard_numel, dtype=torch.float32, device=flat.device)
            if ctx.zero.quantized_gradients and ctx.world.world_size > 1:
                gs = min(ctx.zpp.gradient_group_size, lay.shard_numel)
                quantized_reduce_scatter(out, flat, topology=ctx.topology, bits=ctx.zpp.gradient_bits,
                                         group_size=gs)
            else:
                ctx.world.reduce_scatter(out, flat, "mean")
            f.add_grad(out)
        self.reduced = True
        self.pending = self.expected_grads

    def grad_norm_sq(self) -> torch.Tensor:
        g = self.flat.grad
        return torch.zeros((), dtype=torch.float64) if g is None else g.double().pow(2).sum()

    def stage_grad(self) -> None:
        """Hand the accumulated gradient to the optimizer as ``master.grad``."""
        f = self.flat
        if f.grad is None:
            f.grad = torch.zeros(self.layout.shard_numel if self.ctx.degree > 1 else self.layout.padded_numel,
                                 dtype=torch.float32, device=f.shard.device)
        f.master.grad = f.grad

    # ------------------------------------------------------------------ after the step
    def publish(self) -> None:
        """Make the updated master weights the parameters: cast into the shard, all-gather
        into the full buffer (stages 1-2), invalidate hpZ's secondary shard (stage 3)."""
        f, ctx = self.flat, self.ctx
        f.master.grad = None
        f.grad = None
        if not f.master_aliases_shard:
            f.shard.copy_(f.master.detach())
        if ctx.stage in (1, 2) and ctx.world.world_size > 1:
            ctx.world.all_gather(f.full, f.shard.clone())
        f.invalidate_secondary()

    def load_flat(self, values: torch.Tensor, master: torch.Tensor | None = None) -> None:
        """Set the unit from a full flat fp32 vector of ``layout.numel`` elements (checkpoint
        loading): the owned range of the master weights and the parameters."""
        f, lay = self.flat, self.layout
        padded = torch.zeros(lay.padded_numel, dtype=torch.float32, device=f.shard.device)
        padded[:lay.numel] = values
        own = padded[lay.owned(f.rank)]
        if f.master is not None:
            f.master.data.copy_(own if master is None else master)
        if f.full is not None and self.ctx.stage < 3:
            f.full.copy_(padded)
        elif not f.master_aliases_shard:
            f.shard.copy_(own)
        f.invalidate_secondary()

    def __repr__(self) -> str:
        return f"Unit({self.index}, params={len(self.params)}, trainable={self.trainable}, {self.flat!r})"
