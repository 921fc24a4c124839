"""The hierarchical mode (``zpp.outer``): ZeRO inside each node, DiLoCo across nodes.

On 2 nodes x 2 gloo ranks (the streaming and resume world under MPI too), against plain-torch references written here:

* H = 1 with plain averaging, no compression, an inner optimizer linear in the gradient (SGD
  with momentum) equals torch DDP over the 4 ranks (the mean of the nodes' updates is the
  update of the mean gradient); with Adam it would not, and the mode does not claim it;
* DiLoCo itself: each node an AdamW replica on its 2 ranks' mean gradient, every H steps
  torch.optim.SGD(Nesterov) on the nodes' averaged pseudo-gradient, the replicas reset to it;
* Streaming: fragments of a flat weight vector on the staggered schedule, applied tau steps
  late with the merge, written out by hand over the flat vector; at stage 3 (many units) the
  outer steps the engine applies cover every trainable element once per period;
* resume mid-interval (pending syncs in flight, 1-bit error feedback) continues bit for bit;
  a checkpoint resharded into another stage continues within fp32 reduction order;
* the compressed outer all-reduce within its quantization bound, with its wire bytes; the
  1-bit error feedback saved and restored; the outer state bytes per rank.
"""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

import zpp.zero as zz
from tests.dist import needs_mpi, run_world
from tests.test_zero_engine import _batches, _build, _rel, train_steps
from zpp.zero.config import OuterConfig, TrainConfig, ZppConfig
from zpp.zero.deepspeed_config import from_deepspeed
from zpp.zero.outer import Schedule, build_outer_reduce, cut
from zpp.zero.outer_config import outer_lr_rule

NODES, PER_NODE = 2, 2
LR = 3e-3


#: the settings the references below are written for (fp32 syncs of the whole shard, applied
#: at once) unless a test names others; the mode's defaults are tested on their own
PLAIN_OUTER = {"compression": "none", "fragments": 1, "delay": 0}


def _cfg(stage=0, outer=None, *, opt="AdamW", lr=LR, bf16=False, **opt_params):
    """A config; AdamW gets DeepSpeed's default weight decay 0 (the references' too); ``outer``
    over :data:`PLAIN_OUTER`."""
    if outer is not None:
        outer = {**PLAIN_OUTER, **outer}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": opt, "params": {"lr": lr, **opt_params}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 10**8},
        "bf16": {"enabled": bf16},
        "zpp": {"outer": outer} if outer is not None else {},
    }


def _engine(t, cfg):
    engine, *_ = zz.initialize(model=_build("gpt", 0), config=cfg, transport=t)
    return engine


def _node_batches(t, steps):
    """Every rank's batches (each process can regenerate any rank's)."""
    return {r: _batches("gpt", r, steps) for r in range(t.world_size)}


# ---------------------------------------------------------------------- plain-torch references
def _replica_step(model, opt, batches, step, node, rank, losses):
    """One inner step of node ``node``'s replica: the mean gradient of its ranks' batches."""
    grads = None
    for r in range(node * PER_NODE, (node + 1) * PER_NODE):
        model.zero_grad()
        loss = model(*batches[r][step])
        loss.backward()
        if r == rank:
            losses.append(loss.item())
        g = [p.grad.clone() for p in model.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g / PER_NODE
    opt.step()


def _diloco_reference(rank, batches, steps, H, inner, outer_kw):
    """DiLoCo in plain torch: per node a replica with its own inner optimizer; every H steps
    torch.optim.SGD on the anchor with the averaged pseudo-gradient, then every replica
    takes the anchor. ``outer_kw`` None: plain averaging. Returns rank's losses and its
    node's final weights."""
    node = rank // PER_NODE
    models = [_build("gpt", 0) for _ in range(NODES)]
    opts = [inner(m.parameters()) for m in models]
    anchor = _build("gpt", 0)
    outer = torch.optim.SGD(anchor.parameters(), **outer_kw) if outer_kw else None
    losses = []
    for step in range(steps):
        for n, m in enumerate(models):
            _replica_step(m, opts[n], batches, step, n, rank, losses)
        if (step + 1) % H == 0:
            with torch.no_grad():
                for a, *ps in zip(anchor.parameters(), *(m.parameters() for m in models), strict=True):
                    delta = sum(a - p for p in ps) / NODES
                    if outer is None:
                        a.sub_(delta)
                    else:
                        a.grad = delta
                if outer is not None:
                    outer.step()
                for m in models:
                    for a, p in zip(anchor.parameters(), m.parameters(), strict=True):
                        p.copy_(a)
    return losses, {k: v.detach().clone() for k, v in models[node].state_dict().items()}


def _streaming_reference(rank, batches, steps, engine, *, H, F, tau, mix, lr, mu):
    """Streaming DiLoCo written out over the flat weight vector of the engine's one unit:
    fragment f = [k T / F, (k+1) T / F) of the flat vector, started after the steps p with
    p mod H == ((f + 1) H // F) mod H, its Nesterov outer step applied after step p + tau with
    the merge mix * local + (1 - mix) * anchor."""
    (unit,) = engine.units
    slots = unit.layout.slots
    T = unit.layout.padded_numel
    node = rank // PER_NODE
    models = [_build("gpt", 0) for _ in range(NODES)]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in models]

    def flat(m):
        named = dict(m.named_parameters())
        v = torch.zeros(T)
        for s in slots:
            v[s.offset:s.offset + s.numel] = named[s.name].detach().reshape(-1)
        return v

    def put(m, v):
        named = dict(m.named_parameters())
        with torch.no_grad():
            for s in slots:
                named[s.name].copy_(v[s.offset:s.offset + s.numel].view(s.shape))

    anchor = flat(models[0])
    mom = torch.zeros(T)
    bounds = [k * T // F for k in range(F + 1)]
    pending: dict[int, tuple[int, torch.Tensor]] = {}
    losses = []
    for step in range(steps):
        p = step + 1
        for n, m in enumerate(models):
            _replica_step(m, opts[n], batches, step, n, rank, losses)
        starts = [f for f in range(F) if p % H == ((f + 1) * H // F) % H]
        lands = [f for f, (p0, _) in pending.items() if p0 + tau == p]
        vs = [flat(m) for m in models]
        for f in starts:
            lo, hi = bounds[f], bounds[f + 1]
            pending[f] = (p, sum(anchor[lo:hi] - v[lo:hi] for v in vs) / NODES)
        for f in sorted(set(lands) | ({f for f in starts} if tau == 0 else set())):
            _, d = pending.pop(f)
            lo, hi = bounds[f], bounds[f + 1]
            mom[lo:hi] = mu * mom[lo:hi] + d
            anchor[lo:hi] -= lr * (d + mu * mom[lo:hi])
            for v in vs:
                v[lo:hi] = anchor[lo:hi] if tau == 0 else mix * v[lo:hi] + (1 - mix) * anchor[lo:hi]
        for m, v in zip(models, vs, strict=True):
            put(m, v)
    return losses, flat(models[node])


def _flat_of(engine):
    (unit,) = engine.units
    return unit.flat.master.detach().clone()


# ---------------------------------------------------------------------- world A: equivalences
def _equivalences(t):
    out = {}
    steps = 6
    batches = _node_batches(t, steps)
    mine = batches[t.rank]
    # (1) H = 1, average, no compression, SGD + momentum == torch DDP over every rank
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _build("gpt", 0)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp_losses = []
    for x, y in mine:
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ddp_losses.append(loss.item())
    ddp_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for stage in (0, 3):
        e = _engine(t, _cfg(stage, {"method": "average", "sync_every": 1}, opt="SGD", lr=0.05, momentum=0.9))
        assert e.world.world_size == PER_NODE and e.job_world.world_size == t.world_size
        losses = train_steps(e, mine)
        state = e.consolidated_state_dict()
        out[f"h1-stage{stage}"] = (_rel(losses, ddp_losses),
                                   max(float((state[k] - ddp_state[k]).abs().max()) for k in state),
                                   e.outer.stats.landed)
        e.close()
    # (2) DiLoCo: AdamW inner, Nesterov outer on the averaged pseudo-gradient, H = 3
    steps, H = 9, 3
    batches = _node_batches(t, steps)
    ref_losses, ref_state = _diloco_reference(
        t.rank, batches, steps, H, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0),
        {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    for stage in (1, 2, 3):
        e = _engine(t, _cfg(stage, {"sync_every": H, "lr": 0.7}))
        losses = train_steps(e, batches[t.rank])
        state = e.consolidated_state_dict()
        mem = e.model_state_bytes()
        shards = sum(u.layout.shard_numel for u in e.units if u.trainable)
        out[f"diloco-stage{stage}"] = (_rel(losses, ref_losses),
                                       max(float((state[k] - ref_state[k]).abs().max()) for k in state),
                                       e.outer.stats.landed)
        out[f"memory-stage{stage}"] = (mem["outer"], 2 * 4 * shards)  # anchor + momentum, fp32
        e.close()
    # (3) bf16 parameters: fp32 anchors; right after a sync every node holds the same weights
    e = _engine(t, _cfg(2, {"sync_every": 2, "compression": "int8"}, bf16=True))
    assert all(a.dtype == torch.float32 for a in e.outer.anchors)
    losses = train_steps(e, batches[t.rank][:4])
    state = e.consolidated_state_dict()
    flat = torch.cat([v.float().reshape(-1) for v in state.values()])
    every = torch.empty(t.world_size * flat.numel())
    t.all_gather(every, flat)
    out["bf16-replicas-equal"] = bool((every.view(t.world_size, -1) == flat).all())
    out["bf16-losses"] = losses
    e.close()
    return out


@pytest.mark.timeout(240)
def test_outer_equivalences():
    res = run_world(_equivalences, NODES * PER_NODE, ranks_per_node=PER_NODE, timeout=220)
    for rank, r in enumerate(res):
        for stage in (0, 3):
            rel, err, landed = r[f"h1-stage{stage}"]
            assert rel <= 1e-5 and err <= 1e-5 and landed == 6, (rank, stage, rel, err, landed)
        for stage in (1, 2, 3):
            rel, err, landed = r[f"diloco-stage{stage}"]
            assert rel <= 1e-5 and err <= 2e-5 and landed == 3, (rank, stage, rel, err, landed)
            got, want = r[f"memory-stage{stage}"]
            assert got == want, (rank, stage, got, want)
        assert r["bf16-replicas-equal"], rank
        assert all(abs(a - b) < 0.5 for a, b in zip(r["bf16-losses"], res[0]["bf16-losses"]))
    print({k: v for k, v in res[0].items() if k != "bf16-losses"})


# ---------------------------------------------------------------------- world B: streaming, resume
def _streaming(t):
    out = {}
    steps, H, F, tau, mix = 10, 4, 2, 1, 0.5
    batches = _node_batches(t, steps)
    outer = {"sync_every": H, "fragments": F, "delay": tau, "mix": mix, "lr": 0.5, "momentum": 0.8}
    e = _engine(t, _cfg(0, outer))
    assert e.outer._worker is not None  # the syncs run in the background
    losses = train_steps(e, batches[t.rank])
    ref_losses, ref_flat = _streaming_reference(t.rank, batches, steps, e, H=H, F=F, tau=tau, mix=mix, lr=0.5,
                                                mu=0.8)
    out["streaming"] = (_rel(losses, ref_losses), float((_flat_of(e) - ref_flat).abs().max()),
                        e.outer.stats.started, e.outer.stats.landed)
    background = _flat_of(e)
    e.close()
    # a transport that cannot run on a second thread (MPI without MPI_THREAD_MULTIPLE): the
    # syncs run inside the step, counted, with the same numbers
    cls = type(t)
    saved = cls.__dict__.get("thread_safe")
    cls.thread_safe = property(lambda self: False)
    try:
        e = _engine(t, _cfg(0, outer))
    finally:
        if saved is None:
            del cls.thread_safe
        else:
            cls.thread_safe = saved
    again = train_steps(e, batches[t.rank])
    out["foreground"] = (e.outer._worker is None, e.outer.stats.foreground, again == losses,
                         bool(torch.equal(_flat_of(e), background)))
    e.close()
    out["coverage"] = _coverage(t, batches[t.rank])
    return out


def _coverage(t, batches):
    """Stage 3 (one unit per block and the root): the outer steps the engine applies, recorded
    as (unit, range) from the anchor views it moves, cover every trainable element of this
    rank's shards exactly once per period, for each period, with and without delay."""
    import zpp.zero.outer.sync as sync

    H, F = 4, 5  # more fragments than steps: some steps start two
    out = {}
    for tau in (0, 2):
        e = _engine(t, _cfg(3, {"sync_every": H, "fragments": F, "delay": tau}))
        bases = {a.data_ptr(): i for i, a in enumerate(e.outer.anchors)}
        applied: list[tuple[int, int, int, int]] = []  # (position, unit, lo, hi)
        real = sync.outer_step

        def record(anchor, delta, buf, **kw):
            base = anchor.data_ptr() - anchor.storage_offset() * anchor.element_size()
            lo = anchor.storage_offset() - e.outer.anchors[bases[base]].storage_offset()
            applied.append((e.outer.position, bases[base], lo, lo + anchor.numel()))
            real(anchor, delta, buf, **kw)

        sync.outer_step = record
        try:
            train_steps(e, batches[:2 * H + tau])
        finally:
            sync.outer_step = real
        shards = [u.layout.shard_numel for u in e.outer.units]
        counts = []
        for period in range(2):  # the syncs started in steps [period H + 1, (period + 1) H]
            seen = [torch.zeros(n, dtype=torch.int64) for n in shards]
            for pos, u, lo, hi in applied:
                if period * H < pos - tau <= (period + 1) * H:
                    seen[u][lo:hi] += 1
            counts.append((min(int(s.min()) for s in seen), max(int(s.max()) for s in seen)))
        trainable = sum(p.numel() for p in _build("gpt", 0).parameters() if p.requires_grad)
        out[tau] = (counts, len(e.outer.units), sum(shards) * PER_NODE >= trainable, e.outer.stats.started)
        e.close()
    return out


def _resume(t, tmp):
    """Save mid-interval (a sync in flight), load into a fresh engine, continue: the same
    losses as without the interruption, bit for bit; then reshard the checkpoint into another
    stage and continue within reduction order."""
    out = {}
    steps, cut_at = 10, 6  # int4-streaming: fragment 0 started after step 6, lands after 7
    batches = _node_batches(t, steps)[t.rank]
    cases = {
        "int4-streaming": (3, {"sync_every": 4, "fragments": 2, "delay": 1, "compression": "int4"}),
        "1bit": (1, {"sync_every": 2, "compression": "1bit"}),
        "plain": (2, {"sync_every": 4}),
    }
    for name, (stage, outer) in cases.items():
        e = _engine(t, _cfg(stage, outer))
        full = train_steps(e, batches)
        e.close()
        e = _engine(t, _cfg(stage, outer))
        first = train_steps(e, batches[:cut_at])
        pending = len(e.outer._pending)
        e.save_checkpoint(tmp, tag=name)
        e.close()
        e = _engine(t, _cfg(stage, outer))
        e.load_checkpoint(tmp, tag=name)
        rest = train_steps(e, batches[cut_at:])
        out[name] = (first + rest == full, pending, e.outer.position)
        e.close()
        if name == "plain":  # the same checkpoint into stage 3: resharded outer state
            e = _engine(t, _cfg(3, outer))
            e.load_checkpoint(tmp, tag=name)
            out["resharded"] = _rel(first + train_steps(e, batches[cut_at:]), full)
            e.close()
    return out


def _outer_tensors(e):
    """This rank's replica as full named tensors: its weights and its outer anchor and
    momentum (each unit's shards all-gathered inside the node)."""
    out = {}
    for u, a, m in zip(e.outer.units, e.outer.anchors, e.outer.momenta, strict=True):
        for kind, shard in (("anchor", a), ("momentum", m)):
            full = shard
            if u.layout.degree > 1:
                full = torch.empty(u.layout.padded_numel)
                e.world.all_gather(full, shard.contiguous())
            for sl in u.layout.slots:
                out[f"{kind}.{sl.name}"] = full[sl.offset:sl.offset + sl.numel].view(sl.shape).clone()
    return {**out, **{f"weight.{k}": v.float() for k, v in e.consolidated_state_dict().items()}}


def _saved_for_reload(t, tmp):
    """2 nodes x 2 ranks at stage 3, 5 steps (momentum set by one sync, the replicas apart
    since): save; the replica and outer state of this rank's node."""
    e = _engine(t, _cfg(3, {"sync_every": 3}))
    train_steps(e, _node_batches(t, 5)[t.rank])
    e.save_checkpoint(tmp, tag="reload")
    out = _outer_tensors(e)
    e.close()
    return out


def _reload(t, tmp):
    """The checkpoint into 2 nodes x 1 rank at stage 0: each node loads its own replica."""
    e = _engine(t, _cfg(0, {"sync_every": 3}))
    e.load_checkpoint(tmp, tag="reload")
    out = _outer_tensors(e)
    position = e.outer.position
    e.close()
    # an engine without the mode, ZeRO over both ranks: node 0's replica, no outer keys left
    # in its optimizer state
    e = _engine(t, _cfg(2))
    e.load_checkpoint(tmp, tag="reload")
    plain = {f"weight.{k}": v.float() for k, v in e.consolidated_state_dict().items()}
    keys = sorted({k for st in e.optimizer.state.values() for k in st})
    e.close()
    return out, position, plain, keys


def _skip_on_one_node(t, tmp):
    """Node 1 skips step 3 (a NaN gradient on its ranks only), node 0 applies it; with syncs in
    the background (delay 1) the nodes still start each sync at the same step, so a
    checkpoint right after the start of one completes (it waited forever before), and the
    schedule positions agree. See [Note: skipped steps and the outer schedule]."""
    e = _engine(t, _cfg(0, {"sync_every": 4, "fragments": 2, "delay": 1}))
    step = 0
    node = t.rank // PER_NODE

    def hook(grad):
        if node == 1 and step == 2:
            grad = grad.clone()
            grad.view(-1)[5] = float("nan")
        return grad

    handle = e.module.blocks[0].fc.weight.register_hook(hook)
    for x, y in _node_batches(t, 4)[t.rank]:
        loss = e(x, y)
        e.backward(loss)
        e.step()
        step += 1
    handle.remove()
    pending = len(e.outer._pending)
    e.save_checkpoint(tmp, tag="skipped")
    out = (e.skipped_steps, e.outer.position, pending, e.outer.stats.started, e.outer.stats.landed)
    e.close()
    return out


def _world_b(t, tmp):
    return {**_streaming(t), **_resume(t, tmp), "saved": _saved_for_reload(t, tmp),
            "skip": _skip_on_one_node(t, tmp)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["torch", pytest.param("mpi", marks=[*needs_mpi, pytest.mark.slow])])
def test_outer_streaming_and_resume(tmp_path, backend):
    """Both transports (gloo, and MPI under mpiexec, the background sync thread included)."""
    res = run_world(_world_b, NODES * PER_NODE, backend=backend, ranks_per_node=PER_NODE, args=(str(tmp_path),),
                    timeout=220)
    for rank, r in enumerate(res):
        rel, err, started, landed = r["streaming"]
        # 10 steps, H 4, 2 fragments: starts after steps 2, 4, 6, 8, 10; lands 1 later
        assert started == 5 and landed == 4, (rank, started, landed)
        assert rel <= 1e-5 and err <= 2e-5, (rank, rel, err)
        assert r["foreground"] == (True, 5, True, True), (rank, r["foreground"])
        for tau, (counts, units, covers, started) in r["coverage"].items():
            assert counts == [(1, 1), (1, 1)] and units > 1 and covers, (rank, tau, r["coverage"])
            want = sum(len(Schedule(4, 5, tau).starting(p)) for p in range(1, 2 * 4 + tau + 1))
            assert started == want, (rank, tau, started, want)
        same, pending, position = r["int4-streaming"]
        assert same and pending == 1 and position == 10, (rank, r["int4-streaming"])
        assert r["1bit"][0] and r["plain"][0], (rank, r["1bit"], r["plain"])
        assert r["resharded"] <= 1e-5, (rank, r["resharded"])
    print({k: v for k, v in res[0].items() if k != "saved"})
    for rank, r in enumerate(res):  # (skipped, position, pending, started, landed) after 4 steps
        assert r["skip"] == (rank // PER_NODE, 4, 1, 2, 1), (rank, r["skip"])
    # the hierarchical checkpoint into 2 nodes x 1 rank: each node its own replica, its own
    # anchor and momentum, the schedule position
    again = run_world(_reload, NODES, backend=backend, ranks_per_node=1, args=(str(tmp_path),), timeout=100)
    for node, (got, position, plain, keys) in enumerate(again):
        want = res[node * PER_NODE]["saved"]
        assert position == 5 and sorted(got) == sorted(want), (node, position, sorted(got), sorted(want))
        for k in want:
            assert torch.equal(got[k], want[k]), (node, k, float((got[k] - want[k]).abs().max()))
        node0 = res[0]["saved"]
        assert keys == ["exp_avg", "exp_avg_sq", "step"], keys
        assert all(torch.equal(v, node0[k]) for k, v in plain.items()), node
    apart = res[0]["saved"], res[PER_NODE]["saved"]
    assert any(not torch.equal(apart[0][k], apart[1][k]) for k in apart[0] if k.startswith("weight."))
    assert all(torch.equal(apart[0][k], apart[1][k]) for k in apart[0] if not k.startswith("weight."))


# ---------------------------------------------------------------------- world C: the outer all-reduce
def _group_bound(x: torch.Tensor, gs: int) -> torch.Tensor:
    n = x.numel()
    g = -(-n // gs)
    pad = torch.zeros(g * gs)
    pad[:n] = x.abs()
    return pad.view(g, gs).amax(1).repeat_interleave(gs)[:n]


def _reduces(t):
    from zpp.comm.topology import topology_of

    topo = topology_of(t)
    inter = topo.inter
    n, gs = 3001, 256
    out = {}

    def x_of(rank, call=0):
        g = torch.Generator().manual_seed(1000 * call + rank)
        return torch.randn(n, generator=g) * (1 + rank)

    peers = list(inter.ranks)
    xs = [x_of(r) for r in peers]
    exact = sum(xs) / len(xs)
    for name, bits in (("none", 0), ("int8", 8), ("int4", 4)):
        red = build_outer_reduce(name, inter, n, gs)
        t.counters.reset()
        y = red(x_of(t.rank).clone())
        stats = t.counters.snapshot()[red.counter]
        err = (y - exact).abs()
        if bits:
            # reduce-scatter: (sum_n absmax_n(g)) / step / N per group of the slice; the mean
            # requantized for the all-gather: absmax(mean group) / step more
            step, N, s = 2**bits - 2, len(peers), -(-n // len(peers))
            e1 = torch.cat([sum(_group_bound(x[j * s:(j + 1) * s], gs) for x in xs) / step / N for j in range(N)])
            e2 = torch.cat([_group_bound(exact[j * s:(j + 1) * s], gs) for j in range(N)])[:n] + e1[:n]
            bound = e1[:n] + e2 / step + 1e-6 * (exact.abs() + 1)
        else:
            bound = 1e-6 * (sum(x.abs() for x in xs) + exact.abs())
        out[name] = (int((err > bound).sum()), float(err.max()), stats.inter_bytes, stats.intra_bytes)
    # 1bit: error feedback repays the residual (the running mean of the results converges to
    # the exact mean, mean absolute error about 1/calls) and its state round-trips
    red = build_outer_reduce("1bit", inter, n, gs)
    mine = x_of(t.rank)
    errs, total = [], torch.zeros(n)
    for k in range(1, 21):
        total += red(mine.clone())
        errs.append(float((total / k - exact).abs().mean()))
        if k == 10:
            saved = red.state_dict()
            twin = build_outer_reduce("1bit", inter, n, gs)
            twin.load_state_dict(saved)
            a, b = red(mine.clone()), twin(mine.clone())
            out["1bit-restored"] = bool(torch.equal(a, b))
            red.load_state_dict(saved)  # rewind: the sequence goes on as without the extra call
    out["1bit-errors"] = (errs[0], errs[-1], float(exact.abs().mean()))
    out["topk"] = _topk_against_reference(t, inter, x_of, n, gs, None)
    out["topk-chunks"] = _topk_against_reference(t, inter, x_of, n, gs, 1024)
    t.counters.reset()
    red(mine.clone())
    out["1bit-bytes"] = t.counters.snapshot()[red.counter].inter_bytes
    # the error-feedback buffers live on the fragment's device (the engine passes its masters'):
    # "meta" stands in for a GPU here
    out["devices"] = {name: sorted({str(b.device) for b in build_outer_reduce(name, inter, n, gs,
                                                                               device="meta").buffers()})
                      for name in ("1bit", "topk")}
    return out


def _topk_reference(x: torch.Tensor, error: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the rank sends, decoded; its new error) by a plain sort, chunk by chunk: the
    ceil(chunk / 64) largest |x + e| of every chunk of ``chunk`` elements (a shorter last
    chunk keeps as many, or all it has), int8 codes over the chunk's max/127."""
    acc = x + error
    sent = torch.zeros_like(acc)
    kept = -(-chunk // 64)
    for lo in range(0, acc.numel(), chunk):
        part = acc[lo:lo + chunk]
        keep = lo + torch.argsort(part.abs(), descending=True)[:kept]
        scale = torch.tensor(float(acc[keep].abs().max()) / 127.0, dtype=torch.float32)
        sent[keep] = torch.round(acc[keep] / scale).clamp(-127, 127) * scale
    return sent, acc - sent


def _topk_against_reference(t, inter, x_of, n, gs, chunk):
    from zpp.zero.outer.reduce import SparseMean, sparse_frame_bytes

    peers = list(inter.ranks)

    def build():
        return build_outer_reduce("topk", inter, n, gs) if chunk is None else SparseMean(inter, n, gs, chunk=chunk)
    red = build()
    size = n if chunk is None else chunk  # the default chunk (4096) holds all n = 3001 elements
    assert isinstance(red, SparseMean) and red.chunk == size and red.k == -(-n // size) * -(-size // 64)
    errors = {r: torch.zeros(n) for r in peers}
    res = {"wrong": [], "bytes": [], "k": red.k, "chunks": red.chunks}
    for call in range(3):
        sends = {}
        for r in peers:
            sends[r], errors[r] = _topk_reference(x_of(r, call), errors[r], size)
        expect = sum(sends.values()) / len(peers)
        t.counters.reset()
        y = red(x_of(t.rank, call).clone())
        st = t.counters.snapshot()[red.counter]
        res["bytes"].append((st.inter_bytes, st.intra_bytes, (len(peers) - 1) * sparse_frame_bytes(n, size)))
        res["wrong"].append((float((y - expect).abs().max()), float((red.error - errors[t.rank]).abs().max()),
                             int((sends[t.rank] != 0).sum()), int((y != 0).sum())))
        if call == 1:
            saved = red.state_dict()
            twin = build()
            twin.load_state_dict(saved)
            # the restored twin sends what the original sends next; then the original is
            # rewound by the same load (a wrong load shows in the next call's reference check)
            x2 = x_of(t.rank, 2)
            a, b = red(x2.clone()), twin(x2.clone())
            res["restored"] = bool(torch.equal(a, b)) and bool(torch.equal(twin.error, red.error))
            red.load_state_dict(saved)
    return res


@pytest.mark.timeout(120)
def test_outer_all_reduce_compressed():
    res = run_world(_reduces, NODES * PER_NODE, ranks_per_node=PER_NODE, timeout=100)
    n = 3001
    for rank, r in enumerate(res):
        for name in ("none", "int8", "int4"):
            wrong, err, inter, intra = r[name]
            assert wrong == 0, (rank, name, err)
            assert intra == 0, (rank, name, intra)  # the outer all-reduce never talks inside the node
        # 2 nodes: fp32 all-reduce sends 4n bytes; int8 about n, int4 about n/2 (+ scales)
        assert r["none"][2] == 4 * n, r["none"]
        assert r["int8"][2] < 0.3 * r["none"][2] and r["int4"][2] < 0.16 * r["none"][2], r
        assert r["int4"][1] > r["int8"][1] > r["none"][1], r  # coarser codes, larger errors
        first, last, scale = r["1bit-errors"]
        assert r["1bit-restored"], rank
        # one call is off by ~0.7 of the mean magnitude; the mean of 20 by ~1/20 of it (the
        # residual is repaid, not lost: about 1/T)
        assert last < first / 4 and last < 0.2 * scale, r["1bit-errors"]
        assert r["1bit-bytes"] < 0.05 * r["none"][2], (r["1bit-bytes"], r["none"][2])
        # topk: the same mean as the plain reference on every call (error feedback carried
        # exactly: the rank's error buffer equals the reference's), k entries per rank, and
        # (N-1) frames of 3k + 4 per chunk bytes on the wire, nothing inside the node; in one
        # chunk (the default 4096 > n) and in three of 1024 (the last one padded)
        for key, chunks, kept in (("topk", 1, -(-n // 64)), ("topk-chunks", 3, 16)):
            got = r[key]
            assert (got["chunks"], got["k"]) == (chunks, chunks * kept), (key, got["chunks"], got["k"])
            for call, (err, eerr, sent, nonzero) in enumerate(got["wrong"]):
                assert err < 1e-6 and eerr < 1e-6, (rank, key, call, err, eerr)
                assert sent == got["k"] and got["k"] <= nonzero <= NODES * got["k"], (rank, key, call, sent, nonzero)
            for inter, intra, expect in got["bytes"]:
                assert (inter, intra) == (expect, 0), (key, got["bytes"])
                assert expect == (NODES - 1) * chunks * (3 * kept + 4), (key, expect)
            assert got["restored"], (rank, key)
        assert r["devices"] == {"1bit": ["meta"], "topk": ["meta"]}, r["devices"]
        assert r["topk"]["bytes"][0][0] < 0.1 * r["int4"][2]  # 3N/64 of int4's at N = 2 nodes (+ its scales)


# ---------------------------------------------------------------------- no world
def test_fragments_cover_every_element_once_per_period():
    for shards, F in (([16], 1), ([16, 48, 32], 4), ([16, 48, 32], 5), ([1000, 16], 7), ([64], 64)):
        frags = cut(shards, F)
        assert len(frags) == F
        seen = [torch.zeros(n, dtype=torch.int64) for n in shards]
        for f in frags:
            for pc in f.pieces:
                seen[pc.unit][pc.lo:pc.hi] += 1
        assert all(bool((s == 1).all()) for s in seen), (shards, F)
        sizes = [f.numel for f in frags]
        assert max(sizes) - min(sizes) <= 1, sizes
    with pytest.raises(ValueError, match="fragments=9"):
        cut([8], 9)
    for H, F, tau in ((1, 1, 0), (4, 1, 0), (4, 2, 1), (10, 3, 9), (3, 7, 2), (100, 8, 5)):
        s = Schedule(H, F, tau)
        for first in range(1, 3 * H):  # any window of H consecutive steps: each fragment starts once
            started = [f for p in range(first, first + H) for f in s.starting(p)]
            assert sorted(started) == list(range(F)), (H, F, tau, first, started)
        assert all(s.landing(p + tau) == s.starting(p) for p in range(1, 3 * H))
        assert s.starting(H) == [f for f in range(F) if s.phase(f) == 0] and F - 1 in s.starting(H)


def test_outer_config_errors_name_the_key():
    def ds(outer):
        return from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zpp": {"outer": outer}})

    cfg = ds({"sync_every": 50, "compression": "int4", "fragments": 4, "delay": 2})
    assert cfg.zpp.outer == OuterConfig(sync_every=50, compression="int4", fragments=4, delay=2)
    assert (cfg.zpp.outer.outer_lr, cfg.zpp.outer.outer_momentum) == (pytest.approx(outer_lr_rule(50)), 0.9)
    assert OuterConfig(method="average").outer_lr == 1.0 and OuterConfig(method="sgd").outer_momentum == 0.0
    for bad, match in (({"sync_every": 0}, r"zpp\.outer\.sync_every=0"),
                       ({"sync_every": 4, "delay": 4}, r"zpp\.outer\.delay=4"),
                       ({"compression": "fp8"}, r"zpp\.outer\.compression='fp8'"),
                       ({"method": "average", "lr": 0.5}, r"zpp\.outer\.lr=0\.5 with method=.average."),
                       ({"method": "sgd", "momentum": 0.9}, r"zpp\.outer\.momentum=0\.9"),
                       ({"group_size": 3}, r"zpp\.outer\.group_size=3"),
                       ({"mix": 1.5}, r"zpp\.outer\.mix=1\.5"),
                       ({"sync_evry": 5}, r"unknown keys in 'outer': \['sync_evry'\]"),
                       ("often", r"zpp\.outer='often'")):
        with pytest.raises(ValueError, match=match):
            ds(bad)
    with pytest.raises(NotImplementedError, match="OneBitAdam with zpp.outer"):
        TrainConfig(optimizer=zz.OptimizerConfig(type="onebitadam"), zpp=ZppConfig(outer=OuterConfig()))
    assert dataclasses.replace(ZppConfig(outer={"sync_every": 3}), transport="mpi").outer.sync_every == 3


def test_outer_lr_rule():
    """The default "diloco" outer lr against [Note: the outer lr rule]: 0.2 up to H = 10,
    DiLoCo's 0.7 from H = 100, geometric in between; an explicit lr and the other methods
    are left alone."""
    for H in (1, 5, 10):
        assert outer_lr_rule(H) == 0.2 and OuterConfig(sync_every=H).outer_lr == 0.2
    for H in (100, 500):
        assert outer_lr_rule(H) == 0.7 and OuterConfig(sync_every=H).outer_lr == 0.7
    for H in (11, 20, 31, 50, 99):
        assert outer_lr_rule(H) == pytest.approx(0.2 * 3.5 ** math.log10(H / 10), rel=1e-12), H
    assert outer_lr_rule(50) == pytest.approx(0.4801, abs=1e-4)
    lrs = [outer_lr_rule(H) for H in range(1, 150)]
    assert lrs == sorted(lrs)  # never decreasing in H, continuous at both ends
    assert abs(outer_lr_rule(11) - 0.2) < 0.02 and abs(outer_lr_rule(99) - 0.7) < 0.02
    assert OuterConfig(sync_every=5, lr=0.5).outer_lr == 0.5
    assert OuterConfig(sync_every=5, method="sgd").outer_lr == 1.0
    assert OuterConfig(sync_every=5, method="average").outer_lr == 1.0


def test_outer_step_is_torch_sgd():
    """The outer step on plain tensors is torch.optim.SGD's (Nesterov and heavy-ball) bit for
    bit, and the one-node outer all-reduce returns its input (a one-rank transport)."""
    from zpp.comm.single import SingleRankTransport
    from zpp.zero.outer import merge, outer_step

    g = torch.Generator().manual_seed(0)
    for nesterov in (True, False):
        ref = torch.nn.Parameter(torch.randn(257, generator=g))
        mine, buf = ref.detach().clone(), torch.zeros(257)
        opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
        for _ in range(4):
            delta = torch.randn(257, generator=g)
            ref.grad = delta.clone()
            opt.step()
            outer_step(mine, delta, buf, lr=0.7, momentum=0.9, nesterov=nesterov)
            assert torch.equal(mine, ref.detach()), nesterov
    a, w = torch.randn(9, generator=g), torch.randn(9, generator=g)
    merged = w.clone()
    merge(merged, a, 0.25)
    assert torch.allclose(merged, 0.25 * w + 0.75 * a)
    x = torch.randn(10, generator=g)
    assert torch.equal(build_outer_reduce("int4", SingleRankTransport(0, 0), 10, 2)(x.clone()), x)


def _user_collectives(t):
    """One rank per node and a background sync (delay 1): the script's own collectives on the
    job's world (an averaged loss, a barrier) between steps, while a sync is in flight."""
    outer = {"sync_every": 2, "fragments": 2, "delay": 1, "compression": "none"}
    batches = _batches("gpt", t.rank, 8)
    out = {}
    for talk in (False, True):
        engine = _engine(t, _cfg(0, outer))
        losses = []
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if talk:
                mean = loss.detach().reshape(1).clone()
                t.all_reduce(mean)
                t.barrier()
            losses.append(loss.item())
        stats = engine.outer.stats
        out[talk] = (losses, stats.started - stats.foreground)
        engine.close()
    return out


@pytest.mark.parametrize("backend", ["torch", pytest.param("mpi", marks=needs_mpi)])
def test_background_sync_beside_the_scripts_own_collectives(backend):
    for r in run_world(_user_collectives, NODES, backend=backend, ranks_per_node=1, timeout=100):
        (quiet, bg_quiet), (talking, bg_talking) = r[False], r[True]
        assert bg_quiet > 0 and bg_talking == bg_quiet  # the syncs ran in the background both times
        assert talking == quiet  # the script's collectives change nothing


def _auto_delay(t, tmp, slow_s):
    """delay 'auto' on 2 nodes x 2: each sync held ``slow_s`` (a slow link), the inner step fast."""
    from zpp.zero.outer import sync as sync_mod

    real = sync_mod.OuterSync._timed

    def slow(self, reducer, delta):
        # the wait sits inside the timed call: nothing syncs the two nodes before their first outer
        # sync, so a wait outside it could cancel against their skew (it did once, under load) and
        # leave every rank measuring ~0; the ranks measure differently and must agree
        def held(d):
            time.sleep(slow_s * (1 + self.world.rank))
            return reducer(d)
        return real(self, held, delta)
    sync_mod.OuterSync._timed = slow
    outer = {"sync_every": 4, "fragments": 2, "delay": "auto", "compression": "none"}
    batches = _batches("gpt", t.rank, 10)
    engine = _engine(t, _cfg(1, outer))
    chosen = []
    for x, y in batches[:6]:
        engine.backward(engine(x, y))
        engine.step()
        chosen.append(engine.outer.stats.chosen_delay)
    engine.save_checkpoint(tmp, tag="t6")
    losses = train_steps(engine, batches[6:])
    engine.close()
    sync_mod.OuterSync._timed = real  # the resumed engine measures nothing: the delay comes with the checkpoint
    again = _engine(t, _cfg(1, outer))
    again.load_checkpoint(tmp, tag="t6")
    out = {"chosen": chosen, "resumed": again.outer.stats.chosen_delay, "sched": again.outer.schedule.delay,
           "exact": train_steps(again, batches[6:]) == losses}
    again.close()
    return out


@pytest.mark.slow  # 9 s
@pytest.mark.timeout(200)
def test_delay_auto_covers_the_slowest_sync_and_every_rank_agrees(tmp_path):
    import json

    res = run_world(_auto_delay, 4, ranks_per_node=2, args=(str(tmp_path), 0.2), timeout=170)
    for r in res:
        # 1 until the first update lands (H=4, F=2: the sync started after step 2 lands after step 3),
        # then the slowest rank's 0.8 s sync over sub-second steps: more than 1, capped at H - 1 = 3
        assert r["chosen"][:2] == [None, None] and r["chosen"][2] is not None, r["chosen"]
        assert len(set(r["chosen"][2:])) == 1 and 1 < r["chosen"][2] <= 3, r["chosen"]
        assert r["resumed"] == r["sched"] == r["chosen"][-1] and r["exact"], r
    assert len({json.dumps(r["chosen"]) for r in res}) == 1  # the same on every rank


def _defaults(t):
    """``"outer": {}`` on 2 nodes x 1 at stage 0: the settings in force and what crossed."""
    cfg = _cfg(0)
    cfg["zpp"] = {"outer": {}}
    engine = _engine(t, cfg)
    t.counters.reset()
    train_steps(engine, _batches("gpt", t.rank, 10))
    stats = t.counters.snapshot()
    c, s = engine.outer.config, engine.outer.stats
    out = {"config": (c.sync_every, c.fragments, c.delay, c.compression, c.outer_lr, c.outer_momentum),
           "background": engine.outer._worker is not None, "started": s.started, "landed": s.landed,
           "quantized": stats["quantized_all_reduce"].inter_bytes if "quantized_all_reduce" in stats else 0,
           "fp32": stats["all_reduce"].inter_bytes if "all_reduce" in stats else 0,
           "trainable": sum(u.layout.shard_numel for u in engine.outer.units)}
    engine.close()
    return out


@pytest.mark.timeout(120)
def test_outer_defaults_are_the_measured_setting():
    """[Note: the mode's defaults]: H = 5, 4 fragments, delay 1 in the background, int4, lr 0.2
    with momentum 0.9. Over 10 steps each fragment starts after the steps of its phase
    (fragment f of 4 at H = 5: residues 1, 2, 3, 0, i.e. steps 1 6 / 2 7 / 3 8 / 5 10): 8 syncs,
    of which the one after step 10 lands after step 11; only int4 frames cross the nodes."""
    for r in run_world(_defaults, NODES, ranks_per_node=1, timeout=100):
        assert r["config"] == (5, 4, 1, "int4", 0.2, 0.9), r
        assert r["background"] and (r["started"], r["landed"]) == (8, 7), r
        assert r["fp32"] == 0 < r["quantized"], r
        # each of the 8 syncs sends half its fragment's T / 4 elements as int4 codes in the
        # reduce-scatter and half in the all-gather: T bytes of codes in all (T trainable
        # elements); the groups of 2048 pad these small halves, so up to 2T; fp32 syncs send 8T
        assert r["trainable"] <= r["quantized"] <= 2 * r["trainable"], r
    for sync_every, delay in ((1, 0), (2, 1), (100, 1)):  # None: 1 below H, 0 at H = 1
        assert OuterConfig(sync_every=sync_every).delay == delay
    assert OuterConfig(sync_every=1, method="average").fragments == 4
    with pytest.raises(ValueError, match=r"delay=1"):
        OuterConfig(sync_every=1, delay=1)
    from zpp.tune import job
    from zpp.zero.outer_config import DEFAULT_SYNC_EVERY
    assert job.MIN_SYNC_EVERY == DEFAULT_SYNC_EVERY == OuterConfig().sync_every


def test_delay_auto_config():
    assert OuterConfig(sync_every=4, delay="auto").delay == "auto"
    with pytest.raises(ValueError, match="delay='auto' needs sync_every >= 2"):
        OuterConfig(sync_every=1, delay="auto")
    with pytest.raises(ValueError, match="delay"):
        OuterConfig(sync_every=4, delay="soon")
    cfg = from_deepspeed({"zpp": {"outer": {"sync_every": 8, "delay": "auto"}}})
    assert cfg.zpp.outer.delay == "auto"
