"""The ZeRO stage 0-3 engine with the ZeRO++ switches, and :func:`initialize`.

    engine, optimizer, _, lr_scheduler = zpp.initialize(model=model, config=ds_config)
    for batch in data:
        loss = loss_fn(engine(batch))
        engine.backward(loss)
        engine.step()

Launch one process per rank (``torchrun --nproc-per-node 4 train.py``); the transport is
``zpp.comm.get_transport(config.zpp.transport)`` unless one is passed.

[Note: stage 3 units]
A unit is made at a module when the parameters of its subtree not yet in a unit reach
``zpp.unit_min_numel`` (Default 0: every module that holds parameters is a unit), and at the
root for whatever is left, in post-order; a tied parameter belongs to the first module that
names it. A module's hooks gather the units it created plus the units of its direct
parameters; gathers are reference-counted, so a child inside its ancestor's unit costs
nothing.

[Note: stage 3 hooks]
* forward pre-hook of every module that directly holds parameters: gather the units holding
  them (tied parameters may live in another module's unit) and count a forward user;
  forward hook: drop the user, release at zero users, and (with grad enabled) register a
  hook on each output that requires grad. That hook runs when the output's gradient is
  ready, i.e. right before the module's own backward, and gathers its units again.
  Gathers go through the engine's :class:`~zpp.zero.prefetch.Prefetcher`, which serves them
  from gathers it started ahead when the order follows the recorded trace (see
  [Note: stage 3 prefetch]); the root module's forward pre-hook opens a pass, the end of
  ``engine.backward`` (or of a forward without grad) closes it.
* ``register_post_accumulate_grad_hook`` on every trainable parameter counts down its
  unit's missing gradients; at zero the unit reduce-scatters its flat gradient into its
  fp32 shard accumulator and releases the full buffer. A leaf's hook runs once per backward
  however often the parameter was used, so tied parameters are reduced once.
* ``engine.backward`` then flushes, in unit order, every unit whose gradients did not all
  arrive (unused parameters count as zeros) and releases whatever is still gathered.
Every rank must run the same graph, as with DDP: collectives are issued in hook order.
Stage 2 uses the same post-accumulate hooks on its buckets (parameters stay gathered).

[Note: 1-bit optimizers]
``optimizer.type`` OneBitAdam, ZeroOneAdam or OneBitLamb (ZeRO stage 0 only; TrainConfig
says why) builds :mod:`zpp.optim`'s optimizer on the engine's transport. It averages the
gradients itself (full precision in warm-up, 1-bit compressed afterwards), so:

* the engine never all-reduces gradients: at the accumulation boundary each unit's locally
  accumulated gradient (the micro-steps' ``loss / gas`` gradients summed in ``.grad``)
  moves to its fp32 ``flat.grad`` as it is, and the optimizer communicates once per step;
* the optimizer is built over one fp32 view of the unit masters per model parameter, in
  model order, so it sees what it would see on a plain model: 1-bit LAMB's trust ratios
  stay per parameter tensor and no bucket padding enters the 1-bit buffer;
* gradient clipping: the averaged gradient's norm would need a full-precision all-reduce of
  the gradients, the very traffic the compression stage removes. The engine all-reduces one
  scalar instead and clips every rank's local gradient by the same ``min(1, clip / rms)``,
  ``rms = sqrt(mean over ranks of ||local gradient||^2)``. As ``||mean g|| <= rms``, the
  mean of the clipped gradients has norm ``<= clip``, as with DDP's rule; but it clips more
  often (rms exceeds the averaged norm by the spread of the ranks' gradients), equals DDP's
  rule on one rank, and costs a scalar all-reduce every step (0/1 Adam's local steps
  included). ``get_global_grad_norm`` is that rms, or None when clipping is off (nothing
  is communicated then);
* checkpoints: before the collective checkpoint each rank writes ``onebit_optim_rankR.pt``,
  its optimizer ``state_dict`` (error-feedback buffers, phase and counters, and its own
  weights, which differ between ranks between 0/1 Adam's syncs), so ``latest`` never names
  a checkpoint without them. At the same world size every rank restores its own file and
  weights; at another world size every rank loads rank 0's (the replicated state; error
  feedback restarts, and the optimizer warns).
"""
from __future__ import annotations

import collections
import json
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zpp.comm.transport import Transport
from zpp.optim._common import FusedOneBitOptimizer
from zpp.zero.config import ONEBIT_OPTIMIZERS, OptimizerConfig, TrainConfig, as_config
from zpp.zero.group import CommContext, Unit
from zpp.zero.prefetch import Prefetcher, PrefetchStats
from zpp.zero.schedulers import build_scheduler
from zpp.zero.shard import Slot

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_ONEBIT_STATE = "onebit_optim_rank{:05d}.pt"  # per-rank 1-bit optimizer state in a checkpoint


class ZeroEngine:
    """Wraps a module for ZeRO data-parallel training. Build it with :func:`initialize`.

    Attributes:
        module: the wrapped model.
        config: the :class:`TrainConfig` in force.
        world: the transport over every rank.
        units: the communication units, in flat order.
        optimizer: the torch optimizer over the fp32 master shards.
        lr_scheduler: the schedule, or None.
        global_steps: optimizer steps taken; micro_steps: ``step()`` calls.
    """

    def __init__(self, module: torch.nn.Module, *, config: TrainConfig, world: Transport,
                 optimizer: Any = None, lr_scheduler: Any = None,
                 trainable: set[int] | None = None) -> None:
        self.module = module
        self.config = config
        self.world = world
        zero = config.zero
        config.check_world(world.world_size)
        if config.zpp.check_metadata is not None:
            world.check_metadata = config.zpp.check_metadata
        if config.precision == "bf16":
            module.to(torch.bfloat16)
        for name, p in module.named_parameters():
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(f"zpp.initialize: parameter {name} has dtype {p.dtype}; "
                                f"expected one of {_PARAM_DTYPES}")
        self._broadcast_buffers()
        if config.zpp.check_parameters:
            check_same_parameters(world, list(module.named_parameters()))
        topology = None
        if zero.stage == 3 and (zero.hpz_partition_size > 1 or zero.quantized_gradients):
            from zpp.comm.topology import topology_of

            topology = topology_of(world)
            h = zero.hpz_partition_size
            if h > 1 and (world.world_size % h or h != topology.ranks_per_node):
                raise ValueError(
                    f"zero_hpz_partition_size={h} must divide world_size={world.world_size} and "
                    f"equal the ranks per node ({topology.ranks_per_node})")
        self.ctx = CommContext(world=world, topology=topology, zero=zero, zpp=config.zpp)
        self.units, self._needs = self._plan_units(trainable)
        self._prefetch = Prefetcher(self.units, bucket_numel=zero.prefetch_bucket_size,
                                    enabled=zero.stage == 3 and config.zpp.prefetch, world=world)
        self._handles: list[Any] = []
        self._install_hooks()
        #: 1-bit optimizer: (unit, slot, fp32 view of the unit master) per trained parameter
        self._onebit: list[tuple[Unit, Slot, torch.nn.Parameter]] | None = None
        if config.optimizer is not None and config.optimizer.onebit:
            if optimizer is not None:
                raise ValueError("zpp.initialize: an optimizer is given both in the config and as optimizer=")
            self.optimizer = self._build_onebit(config.optimizer)
        else:
            masters = [u.flat.master for u in self.units if u.trainable]
            if isinstance(optimizer, FusedOneBitOptimizer):
                built = optimizer
            else:
                built = _build_optimizer(config.optimizer, optimizer, masters)
            if isinstance(built, FusedOneBitOptimizer):  # given, or made by a factory
                raise ValueError(
                    f"zpp.initialize: a {type(built).__name__} given through optimizer= would run over the "
                    "engine's flat buckets next to the engine's own gradient all-reduce; set it in the config "
                    "instead: {'optimizer': {'type': ..., 'params': {...}}}")
            self.optimizer = built
        if config.scheduler is not None:
            if lr_scheduler is not None:
                raise ValueError("zpp.initialize: a scheduler is given both in the config and as lr_scheduler")
            self.lr_scheduler = build_scheduler(config.scheduler, self.optimizer)
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            self.lr_scheduler = lr_scheduler(self.optimizer)
        else:
            self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.micro_steps = 0
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ construction
    def _build_onebit(self, cfg: OptimizerConfig) -> FusedOneBitOptimizer:
        """The 1-bit optimizer over one fp32 view of the unit masters per trained parameter;
        see [Note: 1-bit optimizers]."""
        import zpp.optim as zo

        name = ONEBIT_OPTIMIZERS[cfg.type]
        backend = cfg.params.get("comm_backend_name")
        if isinstance(backend, str):
            wants = zo.COMM_BACKENDS.get(backend.lower())
            if wants is not None and self.world.name in zo.COMM_BACKENDS.values() and wants != self.world.name:
                raise ValueError(
                    f"zpp.initialize: optimizer.params.comm_backend_name={backend!r} asks for the {wants!r} "
                    f"transport but the engine runs on {self.world.name!r} (zpp.transport or transport=), "
                    "which the optimizer shares")
        views = []
        for u in self.units:
            if not u.trainable:
                continue
            master = u.flat.master.detach()
            for slot in u.layout.slots:
                v = torch.nn.Parameter(master[slot.offset:slot.offset + slot.numel].view(slot.shape))
                views.append((u, slot, v))
        self._onebit = views
        return zo.build(name, [v for _, _, v in views], transport=self.world, **cfg.params)

    def _broadcast_buffers(self) -> None:
        for _name, b in self.module.named_buffers():
            if b.numel():
                t = b.data if b.is_contiguous() else b.data.contiguous()
                self.world.broadcast(t, 0)
                if t is not b.data:
                    b.data.copy_(t)

    def _plan_units(self, trainable: set[int] | None):
        """The units, and for every module the units it must have gathered while it runs
        (stage 3; see [Note: stage 3 units])."""
        stage, zero = self.config.zero.stage, self.config.zero
        cap = min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        owner: dict[int, Unit] = {}
        units: list[Unit] = []
        created: dict[int, list[Unit]] = collections.defaultdict(list)
        seen: set[int] = set()
        order: list[tuple[str, torch.nn.Parameter]] = []
        owned: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for mname, m in self.module.named_modules():
            own = []
            for pname, p in m._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                own.append((f"{mname}.{pname}" if mname else pname, p))
            order.extend(own)
            owned[id(m)] = own

        def key(p):
            return (p.requires_grad and (trainable is None or id(p) in trainable), p.dtype)

        def add(named, train, module=None):
            u = Unit(len(units), [n for n, _ in named], [p for _, p in named], trainable=train, ctx=self.ctx)
            units.append(u)
            for _, p in named:
                owner[id(p)] = u
            if module is not None:
                created[id(module)].append(u)

        if stage == 3:
            min_numel = self.config.zpp.unit_min_numel
            visited: set[int] = set()

            def visit(m: torch.nn.Module, is_root: bool) -> list:
                visited.add(id(m))
                acc = list(owned.get(id(m), []))
                for c in m.children():
                    if id(c) not in visited:
                        acc.extend(visit(c, False))
                if acc and (is_root or sum(p.numel() for _, p in acc) >= min_numel):
                    groups: dict[tuple, list] = collections.defaultdict(list)
                    for n, p in acc:
                        groups[key(p)].append((n, p))
                    for (train, _dt), named in groups.items():
                        add(named, train, m)
                    return []
                return acc

            visit(self.module, True)
        else:
            open_: dict[tuple, list] = {}
            sizes: dict[tuple, int] = {}
            for n, p in order:
                k = key(p)
                if open_.get(k) and sizes[k] + p.numel() > cap:
                    add(open_.pop(k), k[0])
                if k not in open_:
                    open_[k], sizes[k] = [], 0
                open_[k].append((n, p))
                sizes[k] += p.numel()
            for k, named in open_.items():
                add(named, k[0])
        needs = []
        for m in self.module.modules():
            us = list(created.get(id(m), []))
            for p in m._parameters.values():
                if p is not None and owner[id(p)] not in us:
                    us.append(owner[id(p)])
            if us:
                needs.append((m, us))
        return units, needs

    def _install_hooks(self) -> None:
        stage = self.config.zero.stage
        if stage == 3:
            # the pass hooks run before / after the root's own: see [Note: stage 3 prefetch]
            self._handles.append(self.module.register_forward_pre_hook(
                lambda _m, _a: self._prefetch.begin_pass(torch.is_grad_enabled())))
            for m, units in self._needs:
                self._handles.append(m.register_forward_pre_hook(self._make_pre_forward(units)))
                self._handles.append(m.register_forward_hook(self._make_post_forward(units)))

            def end_forward(_m, _a, _out):
                if not torch.is_grad_enabled():
                    self._prefetch.end_pass()

            self._handles.append(self.module.register_forward_hook(end_forward))
        if stage >= 2:
            for u in self.units:
                if not u.trainable:
                    continue
                for p in u.params:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_ready(u)))

    def _make_pre_forward(self, units: list[Unit]):
        def hook(_module, _args):
            for u in units:
                u.forward_users += 1
                self._prefetch.gather(u, "forward")
        return hook

    def _make_post_forward(self, units: list[Unit]):
        def pre_backward(_grad):
            for u in units:
                self._prefetch.gather(u, "backward")

        def hook(_module, _args, output):
            for u in units:
                u.forward_users -= 1
                if u.forward_users == 0:
                    u.release()
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(pre_backward)
        return hook

    def _make_grad_ready(self, unit: Unit):
        def hook(_param):
            unit.pending -= 1
            if unit.pending == 0 and not unit.reduced:
                unit.reduce_grads()
                unit.release()
        return hook

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps``, then the stage's gradient
        reduction (see [Note: stage 3 units]
A unit is made at a module when the parameters of its subtree not yet in a unit reach
``zpp.unit_min_numel`` (Default 0: every module that holds parameters is a unit), and at the
root for whatever is left, in post-order; a tied parameter belongs to the first module that
names it. A module's hooks gather the units it created plus the units of its direct
parameters; gathers are reference-counted, so a child inside its ancestor's unit costs
nothing.

[Note: stage 3 hooks])."""
        gas = self.gradient_accumulation_steps
        (loss / gas if gas > 1 else loss).backward()
        if self.config.zero.stage >= 2:
            for u in self.units:
                if u.trainable and not u.reduced:
                    u.reduce_grads()
        self._prefetch.end_pass()
        for u in self.units:
            u.reduced = False
            u.pending = u.expected_grads
            u.release()
            if not u.trainable:  # left out of model_parameters but requires_grad
                for p in u.params:
                    p.grad = None
        return loss

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary reduce (stages 0-1), clip, run
        the optimizer on the master shards, publish the new weights, advance the schedule."""
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps:
            return
        trained = [u for u in self.units if u.trainable]
        if self._onebit is not None:  # the optimizer averages: see [Note: 1-bit optimizers]
            for u in trained:
                self._take_local_grad(u)
        elif self.config.zero.stage < 2:
            for u in trained:
                u.reduce_grads()
                u.reduced = False
        self._clip(trained)
        if self._onebit is not None:
            for u, slot, v in self._onebit:
                v.grad = u.flat.grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
        else:
            for u in trained:
                u.stage_grad()
        self.optimizer.step()
        for _, _, v in self._onebit or ():
            v.grad = None
        for u in trained:
            u.publish()
        for u in self.units:
            u.flat.invalidate_secondary()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        spp = self.config.steps_per_print
        if spp and self.global_steps % spp == 0 and self.world.rank == 0:
            print(f"[zpp] step={self.global_steps} lr={self.get_lr()} grad_norm={self.last_grad_norm}", flush=True)

    @staticmethod
    def _take_local_grad(u: Unit) -> None:
        """Move the unit's accumulated ``.grad`` into its fp32 ``flat.grad`` without any
        communication (1-bit optimizers)."""
        f = u.flat
        flat = u.layout.flatten([p.grad for p in u.params], torch.float32, f.shard.device)
        for p in u.params:
            p.grad = None
        f.grad = flat if f.grad is None else f.grad.add_(flat)

    def _clip(self, trained: list[Unit]) -> None:
        clip = self.config.gradient_clipping
        if self._onebit is not None and not clip:
            self.last_grad_norm = None  # the averaged gradient exists only inside the optimizer
            return
        sq = torch.zeros((), dtype=torch.float64)
        for u in trained:
            sq += u.grad_norm_sq()
        if self._onebit is not None:  # rms of the local norms: see [Note: 1-bit optimizers]
            t = sq.reshape(1).clone()
            if self.world.world_size > 1:
                self.world.all_reduce(t, "sum")
            sq = t[0] / self.world.world_size
        elif self.ctx.degree > 1:
            t = sq.reshape(1).clone()
            self.world.all_reduce(t, "sum")
            sq = t[0]
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for u in trained:
                    if u.flat.grad is not None:
                        u.flat.grad.mul_(coef)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (both ``.grad`` and the reduced shards)."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.flat.grad = None
            u.pending = u.expected_grads
            u.reduced = False
        for _, _, v in self._onebit or ():
            v.grad = None

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """What stage 3 prefetch did (counts of prefetched, used, dropped gathers and of
        passes that fell back); see [Note: stage 3 prefetch] in :mod:`zpp.zero.prefetch`."""
        return self._prefetch.stats

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model ``state_dict`` (every key, tied names included), on every rank.
        Collective in stage 3 (gathers one unit at a time)."""
        keys = list(self.module.state_dict(keep_vars=True).keys())
        names: dict[int, list[str]] = collections.defaultdict(list)
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names[id(p)].append(n)
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            was = u.gathered
            u.gather("exact")  # full precision, from the primary shards
            for p in u.params:
                for n in names[id(p)]:
                    out[n] = p.detach().clone()
            if not was:
                u.release()
        for n, b in self.module.named_buffers(remove_duplicate=False):
            out[n] = b.detach().clone()
        return {k: out[k] for k in keys if k in out}

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now, each storage counted once: parameter
        storage (full buffers in stages 0-2, shards and hpZ secondaries in stage 3), gradients
        (``.grad`` tensors and reduced fp32 shards), fp32 masters that do not alias the
        parameters, and optimizer state tensors (scalars such as ``step`` excluded; for a
        1-bit optimizer its fused fp32 parameter and gradient copies, moments and
        error-feedback buffers)."""
        seen: set[int] = set()

        def nbytes(t: torch.Tensor | None) -> int:
            if t is None or t.numel() == 0:
                return 0
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return 0
            seen.add(ptr)
            return t.untyped_storage().nbytes()

        out = dict(params=0, grads=0, master=0, optimizer=0)
        for u in self.units:
            f = u.flat
            out["params"] += nbytes(f.full) + nbytes(f.shard) + nbytes(f.secondary)
        for u in self.units:
            f = u.flat
            if f.master is not None:
                out["master"] += nbytes(f.master)
            out["grads"] += nbytes(f.grad) + sum(nbytes(p.grad) for p in u.params)
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    out["optimizer"] += nbytes(v)
        if isinstance(self.optimizer, FusedOneBitOptimizer):
            o = self.optimizer
            owned = [o.flat.master, o.flat.grad, *o.buffers.values()]
            if o.compressor is not None:
                owned += [o.compressor.worker_error, o.compressor.server_error]
            out["optimizer"] += sum(nbytes(t) for t in owned)
        return out

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None) -> str:
        from zpp.zero.checkpoint import _atomic_save, save_checkpoint

        tag = tag or f"global_step{self.global_steps}"
        if self._onebit is not None and "/" not in tag and tag not in ("", ".", ".."):  # else save_checkpoint raises
            # per-rank state first: save_checkpoint's barrier then precedes meta and latest
            path = Path(save_dir) / tag
            path.mkdir(parents=True, exist_ok=True)
            _atomic_save({"rank": self.world.rank, "world_size": self.world.world_size,
                          "optimizer": self.optimizer.state_dict()}, path / _ONEBIT_STATE.format(self.world.rank))
        return save_checkpoint(self, save_dir, tag)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None) -> str:
        from zpp.zero.checkpoint import load_checkpoint

        onebit = self._onebit_state_file(Path(load_dir), tag) if self._onebit is not None else None
        path = load_checkpoint(self, load_dir, tag)
        if onebit is not None:  # see [Note: 1-bit optimizers]
            self.optimizer.load_state_dict(torch.load(onebit, map_location="cpu", weights_only=False)["optimizer"])
            self.optimizer.flat.write_params()  # this rank's own weights (0/1 Adam's local steps)
            for u in self.units:
                if u.trainable:
                    u.publish()
        return path

    def _onebit_state_file(self, root: Path, tag: str | None) -> Path | None:
        """The 1-bit optimizer state this rank loads (its own, or rank 0's at another world
        size); checked before anything is loaded. None where load_checkpoint will raise."""
        latest = root / "latest"
        if tag is None and not latest.exists():
            return None
        path = root / (tag or latest.read_text().strip())
        if not (path / "meta.json").exists():
            return None
        saved_world = json.loads((path / "meta.json").read_text())["world_size"]
        f = path / _ONEBIT_STATE.format(self.world.rank if saved_world == self.world.world_size else 0)
        if not f.exists():
            raise FileNotFoundError(
                f"load_checkpoint: {f} missing: the checkpoint holds no {type(self.optimizer).__name__} state "
                "(saved with another optimizer?); load the module's weights and start the optimizer afresh instead")
        return f

    def close(self) -> None:
        """Remove every hook the engine installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------- helpers
def check_same_parameters(world: Transport, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Raise the same ValueError on every rank if any rank's parameters differ from rank 0's
    (a CRC32 per parameter, one all-gather)."""
    W = world.world_size
    if W == 1:
        return
    count = torch.tensor([len(named)], dtype=torch.int64)
    counts = torch.empty(W, dtype=torch.int64)
    world.all_gather(counts, count)
    if len(set(counts.tolist())) > 1:
        raise ValueError(f"zpp.initialize: ranks hold different numbers of parameters: {counts.tolist()}")
    mine = torch.empty(2 * len(named), dtype=torch.int64)
    for i, (_n, p) in enumerate(named):
        flat = p.detach().cpu().contiguous().reshape(-1)
        mine[2 * i] = p.numel()
        mine[2 * i + 1] = zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0
    everyone = torch.empty(W * mine.numel(), dtype=torch.int64)
    world.all_gather(everyone, mine)
    rows = everyone.view(W, -1)
    bad = (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()
    if bad:
        i = bad[0] // 2
        name, p = named[i]
        ranks = [r for r in range(W) if bool((rows[r, 2 * i:2 * i + 2] != rows[0, 2 * i:2 * i + 2]).any())]
        others = len({b // 2 for b in bad}) - 1
        raise ValueError(
            f"zpp.initialize: parameter {name!r} ({tuple(p.shape)}, {p.dtype}) differs from rank 0's on "
            f"ranks {ranks}" + (f" (and {others} more parameters differ)" if others else "")
            + "; seed the model identically on every rank or load the same weights")


def _build_optimizer(cfg: OptimizerConfig | None, given: Any, masters: list[torch.nn.Parameter]):
    if cfg is not None and given is not None:
        raise ValueError("zpp.initialize: an optimizer is given both in the config and as optimizer=")
    if cfg is not None:
        return _OPTIMIZERS[cfg.type](masters, **cfg.params)
    if given is None:
        raise ValueError("zpp.initialize: no optimizer: pass optimizer= or set config['optimizer']")
    if isinstance(given, torch.optim.Optimizer):
        if len(given.param_groups) > 1:
            raise NotImplementedError(
                f"zpp.initialize: an optimizer with {len(given.param_groups)} parameter groups; zpp "
                "builds one group over its flat master shards")
        return type(given)(masters, **given.defaults)
    if callable(given):
        return given(masters)
    raise TypeError(f"zpp.initialize: optimizer={given!r} must be a torch optimizer or a factory "
                    "taking a list of parameters")


def _trainable_ids(model_parameters: Iterable | None) -> set[int] | None:
    if model_parameters is None:
        return None
    ids: set[int] = set()
    for item in model_parameters:
        if isinstance(item, dict):
            extra = sorted(set(item) - {"params", "name"})
            if extra:
                raise NotImplementedError(
                    f"zpp.initialize: parameter groups with their own options ({extra}) are not supported")
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else ps
            ids.update(id(p) for p in ps)
        else:
            ids.add(id(item))
    return ids


def initialize(model: torch.nn.Module, model_parameters: Iterable | None = None, optimizer: Any = None,
               config: Any = None, lr_scheduler: Any = None, *, transport: Transport | None = None,
               training_data: Any = None, config_params: Any = None, **kwargs):
    """DeepSpeed-style entry point.

    Args:
        model: any ``nn.Module`` with fp32 or bf16 parameters, identical on every rank.
        model_parameters: parameters to train (Default: every parameter that requires grad);
            the others stay frozen.
        optimizer: a torch optimizer (rebuilt with its ``defaults`` over the master shards)
            or a factory ``params -> optimizer``, when the config has no "optimizer".
        config: a DeepSpeed dict, a JSON path, or a :class:`TrainConfig`.
        lr_scheduler: a scheduler object or a factory ``optimizer -> scheduler``, when the
            config has no "scheduler".
        transport: the transport to run on (Default: ``zpp.comm.get_transport(config.zpp.transport)``).

    Returns:
        ``(engine, optimizer, None, lr_scheduler)``, like ``deepspeed.initialize``.
    """
    if kwargs:
        raise TypeError(f"zpp.initialize: unexpected arguments {sorted(kwargs)}")
    if training_data is not None:
        raise NotImplementedError("zpp.initialize: training_data= (a DeepSpeed data loader) is not implemented")
    if config is not None and config_params is not None:
        raise ValueError("zpp.initialize: pass config or config_params, not both")
    cfg = as_config(config if config is not None else config_params)
    if transport is None:
        from zpp.comm import registry

        timeout = {} if cfg.zpp.timeout_s is None else {"timeout_s": cfg.zpp.timeout_s}
        transport = registry.get_transport(cfg.zpp.transport, **timeout)
    engine = ZeroEngine(model, config=cfg, world=transport, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        trainable=_trainable_ids(model_parameters))
    return engine, engine.optimizer, None, engine.lr_scheduler
