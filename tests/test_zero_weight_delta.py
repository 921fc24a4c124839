"""hpZ refreshed by quantized weight deltas (``zpp.weight_delta_bits``, zpp/zero/gather/delta.py)
on 2 nodes x 2 spawned gloo ranks.

* The weights every forward computes with equal, bit for bit, a plain-torch simulation of
  the scheme (zpp.quant.reference's quantizer: the first gather int8 codes of each shard,
  then per step ``copy += deq(Q4(shard - copy))``), on every rank, and stay closer to the
  exact weights than qwZ's int8 codes of the weights.
* The link carries the deltas' int4 codes: the forward's inter-node gather bytes per step
  are, to the byte, the int4 payload's share of qwZ's int8 payload, and the backward's
  gathers stay inside the node.
* Step by step the loss follows plain stage 3 as closely as qwZ does.
* Weights replaced from outside training (GatheredParameters) are gathered again over the
  world, not patched by a delta.
* Configs it cannot serve raise a ValueError naming the value.
* Checkpoints hold the copies: a resumed run continues bit for bit (gloo and MPI); a
  checkpoint without them restarts them from a world gather, logged.
"""
import pytest
import torch

import zpp.zero as zz
from tests.dist import needs_mpi, run_world
from tests.gpt import GPT, CharCorpus, GPTConfig
from tests.test_zero_engine import train_steps
from zpp.comm.collectives import effective_group_size
from zpp.quant import reference as ref
from zpp.zero.deepspeed_config import from_deepspeed
from zpp.zero.gather.delta import DeltaSecondaryGather

GPT_CFG = dict(n_layer=2, n_embd=96, n_head=4, block_size=32)
BATCH = 4
STEPS = 6
GROUP = 256  # small groups so that the test GPT's shards hold several


def _config(delta_bits=4, precision=None, **zero):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": True,
            "zero_hpz_partition_size": 2, **zero}
    zpp = {"check_metadata": False, "unit_min_numel": 50_000, "weight_group_size": GROUP}
    if delta_bits is not None:
        zpp["weight_delta_bits"] = delta_bits
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "zero_optimization": zero, "zpp": zpp}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(t, cfg, seed=0):
    torch.manual_seed(seed)
    engine, *_ = zz.initialize(model=GPT(GPTConfig(**GPT_CFG)), config=cfg, transport=t)
    return engine


def _capture(engine):
    """Record, per unit, the full flat buffer each forward computes with (the first forward
    gather of the unit in each step)."""
    seen = {}

    def hook(module, args):
        for u in engine.units:
            if u.gathered and u.index not in seen:  # (a prefetched unit's buffer is still being filled)
                seen[u.index] = u.flat.full.detach().clone()
    for m in engine.module.modules():
        m.register_forward_pre_hook(hook)
    return seen


def _delta_gathers(engine):
    """The engine's weight-delta gathers (forward and backward), each once."""
    return [g for g in {id(g): g for g in engine.comms.gathers.values()}.values() if isinstance(g, DeltaSecondaryGather)]


def _exact(t, engine):
    """Every unit's exact full flat weights (the fp32 masters, gathered)."""
    out = {}
    for u in engine.units:
        full = torch.empty(u.layout.padded_numel)
        t.all_gather(full, u.flat.master.detach().contiguous())
        out[u.index] = full
    return out


def _q(x, bits):
    """deq(Q(x)) of one rank's shard as the collective quantizes it (plain torch)."""
    gs = effective_group_size(GROUP, x.numel())
    data, scales = ref.quantize(x, bits, gs, True)
    return ref.dequantize(data, scales, x.numel(), bits, gs, True, torch.float32)


def _per_shard(full, degree, fn):
    return torch.cat([fn(s) for s in full.view(degree, -1)])


def _refresh_run(t, precision):
    data = CharCorpus(max_bytes=200_000)
    engine = _engine(t, _config(precision=precision))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(17 + t.rank)
    degree = t.world_size
    copy, mismatches, err_delta, err_int8, inter = None, [], [], [], []
    seen = _capture(engine)
    for step in range(STEPS):
        exact = _exact(t, engine)
        shards = {k: w.to(dtype) for k, w in exact.items()}  # what each rank gathers from
        if copy is None:  # the first gather: qwZ's int8 codes of each shard
            copy = {k: _per_shard(w, degree, lambda s: _q(s, 8)).to(dtype) for k, w in shards.items()}
        else:  # then the int4 codes of the differences, added in fp32 and cast back
            copy = {k: (copy[k].float() + _per_shard(shards[k].float() - copy[k].float(), degree,
                                                      lambda s: _q(s, 4))).to(dtype) for k in exact}
        seen.clear()
        t.counters.reset()
        x, y = data.batch(BATCH, GPT_CFG["block_size"], g)
        loss = engine(x, y)
        engine.backward(loss)
        snap = t.counters.snapshot()
        engine.step()
        inter.append({k: (v.inter_bytes, v.intra_bytes) for k, v in snap.items()})
        mismatches.append(sorted(k for k in exact if not torch.equal(seen[k], copy[k])))
        if step >= 2:
            w = torch.cat(list(exact.values()))
            err_delta.append(((torch.cat([copy[k].float() for k in exact]) - w).norm() / w.norm()).item())
            q8 = torch.cat([_per_shard(shards[k], degree, lambda s: _q(s, 8)) for k in exact])
            err_int8.append(((q8 - w).norm() / w.norm()).item())
    gathers = _delta_gathers(engine)
    counts = (sum(gg.world_gathers for gg in gathers), sum(gg.refreshes for gg in gathers))
    units = [(u.layout.shard_numel, u.index) for u in engine.units]
    engine.close()
    return {"mismatches": mismatches, "err_delta": err_delta, "err_int8": err_int8, "inter": inter,
            "counts": counts, "units": units}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.timeout(150)
def test_forward_weights_are_the_simulated_copies_and_bytes_are_int4(precision):
    results = run_world(_refresh_run, 4, ranks_per_node=2, args=(precision,), timeout=120)
    r = results[0]
    for res in results:
        assert all(m == [] for m in res["mismatches"]), res["mismatches"]
    n_units = len(r["units"])
    # the first step gathers each unit over the world once, every later step refreshes it
    assert r["counts"] == (n_units, n_units * (STEPS - 1)), r["counts"]
    # the copies are closer to the exact weights than int8 codes of the weights would be
    # (measured, relative L2 error at steps 2-5, lr 3e-3: fp32 0.57x, 0.59x, 0.49x, 0.47x int8's;
    # in bf16 both are bounded by bf16's own rounding as well)
    for d, q8 in zip(r["err_delta"], r["err_int8"], strict=True):
        assert d < (0.75 if precision == "fp32" else 1.0) * q8, (r["err_delta"], r["err_int8"])

    # bytes: the first step's forward gather is int8 codes, the later ones int4 codes of the
    # same groups, both with one fp32 scale per group; the backward stays in the node
    def payload(bits):
        total = 0
        for shard_numel, _ in r["units"]:
            gs = effective_group_size(min(GROUP, shard_numel), shard_numel)
            groups = -(-shard_numel // gs)
            total += groups * gs * bits // 8 + 4 * groups
        return total
    first = r["inter"][0]["quantized_all_gather"][0]
    later = [s["quantized_all_gather"][0] for s in r["inter"][1:]]
    assert first > 0 and all(b == later[0] for b in later), (first, later)
    assert later[0] / first == pytest.approx(payload(4) / payload(8), rel=1e-12), (later[0], first)
    for s in r["inter"]:
        assert s.get("all_gather", (0, 0))[0] == 0, s  # the backward's gathers cross no node link
        assert s.get("all_gather", (0, 0))[1] > 0, s
    # a refresh sends no codes inside the node: only the inter-node hop carries differences,
    # and the node's gathers carry the updated copies (the forward's refresh and the backward's
    # gather: each rank's secondary, 1/2 of a unit, to its one local peer)
    size = 2 if precision == "bf16" else 4
    copies = sum(shard_numel * 4 // 2 * size for shard_numel, _ in r["units"])
    for s in r["inter"][1:]:
        assert s["quantized_all_gather"][1] == 0, s
        assert s["all_gather"][1] == 2 * copies, (s, copies)


def _short_losses(t, delta_bits, switches):
    data = CharCorpus(max_bytes=200_000)
    cfg = _config(delta_bits, **switches)
    if not switches.get("zero_quantized_weights", True):
        cfg["zero_optimization"].pop("zero_hpz_partition_size")
    engine = _engine(t, cfg)
    g = torch.Generator().manual_seed(17 + t.rank)
    losses = []
    for _ in range(8):
        x, y = data.batch(BATCH, GPT_CFG["block_size"], g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def _three_runs(t):
    return {"plain": _short_losses(t, None, {"zero_quantized_weights": False}),
            "qwz": _short_losses(t, None, {}),
            "delta": _short_losses(t, 4, {})}


@pytest.mark.timeout(150)
def test_losses_follow_plain_stage3_as_qwz_does():
    for r in run_world(_three_runs, 4, ranks_per_node=2, timeout=120):
        worst = {k: max(abs(a - b) / b for a, b in zip(r[k], r["plain"], strict=True)) for k in ("qwz", "delta")}
        # qwZ's bound from tests/test_zero_zeropp.py (its measured 7.9e-4); the deltas' copy is closer
        assert worst["qwz"] < 2e-3 and worst["delta"] < 2e-3, worst
        assert r["delta"] != r["plain"], "the delta path changed nothing: is it running?"


def _replaced_run(t):
    data = CharCorpus(max_bytes=200_000)
    engine = _engine(t, _config())
    g = torch.Generator().manual_seed(17 + t.rank)
    for _ in range(2):
        x, y = data.batch(BATCH, GPT_CFG["block_size"], g)
        engine.backward(engine(x, y))
        engine.step()
    wte = engine.module.wte.weight
    with zz.GatheredParameters(wte, modifier_rank=0):
        if t.rank == 0:
            wte.data[3].zero_()
    seen = []
    handle = engine.module.register_forward_hook(lambda m, a, out: seen.append(None))
    gathers = _delta_gathers(engine)
    before = sum(gg.world_gathers for gg in gathers)
    row = []
    hook = engine.module.wte.register_forward_pre_hook(lambda m, a: row.append(m.weight.detach()[3].clone()))
    x, y = data.batch(BATCH, GPT_CFG["block_size"], g)
    engine(x, y)
    handle.remove()
    hook.remove()
    after = sum(gg.world_gathers for gg in gathers)
    engine.close()
    return {"row": row[0], "world_gathers": after - before, "forwards": len(seen)}


@pytest.mark.timeout(150)
def test_replaced_weights_are_gathered_over_the_world_again():
    for r in run_world(_replaced_run, 4, ranks_per_node=2, timeout=120):
        assert r["forwards"] == 1
        # int8 codes of the replaced weights hold the zeroed row exactly; a delta from the old copy would not
        assert torch.equal(r["row"], torch.zeros_like(r["row"])), r["row"]
        assert r["world_gathers"] >= 1, r


@pytest.mark.parametrize(("zero", "bits", "match"), [
    ({"stage": 2}, 4, "stage=2"),
    ({"stage": 3}, 4, "zero_hpz_partition_size=1"),
    ({"stage": 3, "zero_hpz_partition_size": 2}, 3, "weight_delta_bits"),
    ({"stage": 3, "zero_hpz_partition_size": 2}, "4", "weight_delta_bits"),
])
def test_configs_it_cannot_serve_are_refused(zero, bits, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed({"zero_optimization": zero, "zpp": {"weight_delta_bits": bits}})


def _late_run(t):
    from zpp.comm.collectives import quantized_all_gather
    from zpp.zero.comm_api import Phase
    data = CharCorpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(17 + t.rank)
    states = {}
    for name, delta_bits in (("delta", 4), ("hpz", None)):
        engine = _engine(t, _config(delta_bits))
        if delta_bits is not None:  # a step: the copies exist, out of date (the next gather refreshes them)
            x, y = data.batch(BATCH, GPT_CFG["block_size"], g)
            engine.backward(engine(x, y))
            engine.step()
        u = engine.units[0]
        store = engine.comms.gathers[Phase.FORWARD].secondaries
        before = store.state(u.flat).value
        u.start_gather(Phase.FORWARD)
        engine.comms.weights_changed()  # the weights change while the gather is on its way
        u.gather(Phase.FORWARD)
        states[name] = (before, store.state(u.flat).value)
        u.release()
        engine.close()
        states[name + "-closed"] = store.state(u.flat).value
    out = torch.empty(0)
    quantized_all_gather(out, torch.empty(0), transport=t, bits=4)  # an empty shard gathers to nothing
    return states


@pytest.mark.timeout(150)
def test_a_gather_that_outlives_a_weight_change_leaves_the_copy_out_of_date():
    for r in run_world(_late_run, 4, ranks_per_node=2, timeout=120):
        # the refresh delivered the old weights: the copy stays stale, the next gather refreshes it
        assert r["delta"] == ("stale", "stale"), r
        # plain hpZ's world gather: its slice is not kept as valid
        assert r["hpz"] == ("absent", "absent"), r
        assert r["delta-closed"] == r["hpz-closed"] == "absent", r  # close() lets the copies go


def _resume_run(t, root):
    import logging
    from pathlib import Path
    data = CharCorpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(17 + t.rank)
    batches = [data.batch(BATCH, GPT_CFG["block_size"], g) for _ in range(STEPS)]
    half = STEPS // 2
    out = {}
    a = _engine(t, _config())
    train_steps(a, batches[:half])
    a.save_checkpoint(root, "mid")
    out["uninterrupted"] = train_steps(a, batches[half:])
    out["weights"] = _exact(t, a)
    a.close()
    mine = Path(root, "mid", f"hpz_copies_rank{t.rank % 2:05d}.pt")  # its counterpart's on the first node
    out["file_bytes"] = mine.stat().st_size
    out["files"] = sorted(p.name for p in Path(root, "mid").glob("hpz_copies_*"))
    out["copy_numel"] = sum(u.layout.padded_numel // 2 for u in a.units)
    for name, drop in (("resumed", False), ("copies dropped", True)):
        b = _engine(t, _config(), seed=1)  # other initial weights: everything comes from the checkpoint
        b.load_checkpoint(root, "mid")
        if drop:  # what a load did before the copies were saved: every unit starts from a world gather
            b.comms.weights_changed(replaced=True)
        gathers = _delta_gathers(b)
        before = sum(gg.world_gathers for gg in gathers)
        out[name] = train_steps(b, batches[half:])
        out[name + " world gathers"] = sum(gg.world_gathers for gg in gathers) - before
        if not drop:
            out["resumed weights"] = _exact(t, b)
        b.close()
    # a checkpoint saved without the deltas: the copies start again from a world gather, and rank 0 says why
    c = _engine(t, _config(None))
    train_steps(c, batches[:1])
    c.save_checkpoint(root, "plain")
    c.close()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logging.getLogger("zpp.zero").addHandler(handler)
    d = _engine(t, _config(), seed=1)
    d.load_checkpoint(root, "plain")
    logging.getLogger("zpp.zero").removeHandler(handler)
    gathers = _delta_gathers(d)
    out["from plain"] = train_steps(d, batches[1:2])
    out["from plain world gathers"] = sum(gg.world_gathers for gg in gathers)
    out["from plain log"] = [m for m in seen if "weight-delta copies" in m]
    d.close()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["torch", pytest.param("mpi", marks=needs_mpi)])
def test_a_resumed_run_continues_bit_for_bit(tmp_path, backend):
    """The copies are in the checkpoint (once: the first node's): a run resumed from it
    computes the uninterrupted run's losses and weights bit for bit, with no world gather;
    without them (as before they were saved) it does not. A checkpoint without copies starts
    them from a world gather, and rank 0 says why."""
    results = run_world(_resume_run, 4, backend=backend, ranks_per_node=2, args=(str(tmp_path),), timeout=170)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["uninterrupted"], (rank, r["resumed"], r["uninterrupted"])
        for i, w in r["weights"].items():
            assert torch.equal(r["resumed weights"][i], w), (rank, i)
        assert r["resumed world gathers"] == 0, r["resumed world gathers"]
        # the test can fail: restarting the copies from a world gather moves the losses
        assert r["copies dropped world gathers"] > 0
        assert r["copies dropped"] != r["uninterrupted"], r["copies dropped"]
        # the first node's ranks write their fp32 slices (numel / k per unit) and little else; the
        # second node's hold the same and write nothing
        assert r["files"] == ["hpz_copies_rank00000.pt", "hpz_copies_rank00001.pt"], r["files"]
        assert 4 * r["copy_numel"] <= r["file_bytes"] < 4 * r["copy_numel"] + 64_000, r
        assert r["from plain world gathers"] > 0 and all(torch.isfinite(torch.tensor(r["from plain"])))
        if rank == 0:
            assert len(r["from plain log"]) == 1 and "holds no copies" in r["from plain log"][0], r["from plain log"]
        else:
            assert r["from plain log"] == []


def test_ranks_that_would_hold_different_copies_hold_none():
    """If the ranks' plans differ (one would gather a unit inside the node, another over the
    world), no rank holds any copy again: the units start from a world gather everywhere."""
    import types

    from zpp.zero.checkpoint.load import _agree_copies, _copies_plan
    saved = {0: {"stale": True}, 1: {"stale": False}}
    read = types.SimpleNamespace(copies=("store", dict(saved), None))
    same = [{"copies": _copies_plan(read)}, {"copies": [(0, True), (1, False)]}]
    _agree_copies(read, same)
    assert read.copies == ("store", saved, None)
    _agree_copies(read, [*same, {"copies": [(0, True)]}])
    store, use, reason = read.copies
    assert store == "store" and use == {} and "different units" in reason
