"""The engine's pluggable pieces on their own: the sharding policy, each weight gather
(:mod:`zpp.zero.gather`) and each gradient reduction (:mod:`zpp.zero.reduce`) against a
plain reference, on a real 2 nodes x 2 gloo world; and ``zpp.reshard_after_forward``.

References: the plain gather must give the full buffer every rank built from one seed; qwZ
every rank's ``dequantize(quantize(shard))`` computed here with zpp.quant; hpZ the world
gather's result, then the same result again from inside the node with no inter-node byte;
the reductions the fp64 mean of every rank's gradient (each rank rebuilds the others' from
their seeds) or, for qgZ, the plain-torch simulation of the algorithm in test_collectives.
"""
import pytest
import torch

import zpp.quant as zq
import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from tests.test_collectives import _simulate_qgz
from tests.test_zero_engine import _batches, _build, train_steps
from zpp.comm.collectives import effective_group_size
from zpp.comm.topology import topology_of
from zpp.zero.comm_api import Comms, Phase
from zpp.zero.deepspeed_config import from_deepspeed
from zpp.zero.gather import GATHERS, PlainGather, QuantizedGather, SecondaryGather, build_gathers
from zpp.zero.gather.hpz import SecondaryState
from zpp.zero.policy import ShardingPolicy
from zpp.zero.reduce import REDUCES, build_reduce
from zpp.zero.shard import FlatLayout, FlatShard
from zpp.zero.strategies import build_comms

NUMELS = (5, 1000, 12345)  # odd, one group, many groups


def _flat(t, numel, dtype=torch.float32):
    """A FlatShard holding this rank's range of one full buffer (the same on every rank)."""
    layout = FlatLayout(["w"], [torch.Size([numel])], t.world_size)
    full = torch.zeros(layout.padded_numel, dtype=dtype)
    full[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    f = FlatShard(layout, t.rank, dtype)
    f.shard = full[layout.owned(t.rank)].clone()
    return f, full


def _gather(strategy, f):
    out = torch.full((f.layout.padded_numel,), float("nan"), dtype=f.dtype)
    strategy.start(f, out).wait()
    strategy.finish(f, out)
    return out


def _comms(t, topo, ds):
    return Comms(world=t, topology=topo, config=from_deepspeed(ds))


def _check_gathers(t):
    topo = topology_of(t)
    comms = _comms(t, topo, {"zero_optimization": {"stage": 3}, "zpp": {"weight_bits": 4, "weight_group_size": 64}})
    plain, qwz = PlainGather(comms), QuantizedGather(comms)
    for numel in NUMELS:
        f, full = _flat(t, numel)
        assert torch.equal(_gather(plain, f), full), numel
        # qwZ: every rank's shard through the pure-torch quantizer, in rank order
        lay = f.layout
        gs = effective_group_size(min(64, lay.shard_numel), lay.shard_numel)
        want = torch.cat([zq.dequantize(zq.quantize(full[lay.owned(r)], bits=4, group_size=gs))
                          for r in range(t.world_size)])
        got = _gather(qwz, f)
        assert torch.equal(got, want), numel
        assert not torch.equal(got, full), numel  # int4 does change the weights
        # hpZ over either: the world gather, then the same from the node's secondary shards
        for inner, expect in ((plain, full), (qwz, want)):
            hpz = SecondaryGather(comms, inner)
            assert hpz.secondaries.state(f) is SecondaryState.ABSENT and hpz.kept(f) == []
            t.counters.reset()
            first = _gather(hpz, f)
            assert torch.equal(first, expect), numel
            assert hpz.secondaries.state(f) is SecondaryState.VALID
            n = lay.padded_numel // topo.ranks_per_node
            assert torch.equal(hpz.secondaries.get(f), expect[topo.local_rank * n:(topo.local_rank + 1) * n])
            assert [t.data_ptr() for t in hpz.kept(f)] == [hpz.secondaries.get(f).data_ptr()]
            assert t.counters.total().inter_bytes > 0
            t.counters.reset()
            topo.intra.counters.reset()
            second = _gather(hpz, f)
            assert torch.equal(second, expect), numel
            assert t.counters.total().inter_bytes == 0 and topo.intra.counters.total().inter_bytes == 0
            assert topo.intra.counters.total().intra_bytes + t.counters.total().intra_bytes > 0
            hpz.weights_changed(f)  # the weights changed: the next gather goes over the world again
            assert hpz.secondaries.state(f) is SecondaryState.ABSENT
    return True


def _check_reduces(t):
    topo = topology_of(t)
    W = t.world_size
    for numel in NUMELS:
        layout = FlatLayout(["g"], [torch.Size([numel])], W)
        everyone = torch.zeros(W, layout.padded_numel)
        for r in range(W):
            everyone[r, :numel] = torch.randn(numel, generator=torch.Generator().manual_seed(10 * numel + r)) * (1 + r)
        mean = everyone.double().mean(0).float()
        own = layout.owned(t.rank)
        for name in ("all_reduce", "reduce_scatter", "qgz", "local"):
            comms = _comms(t, topo, {"zero_optimization": {"stage": 3},
                                     "zpp": {"gradient_bits": 4, "gradient_group_size": 64}})
            mine = everyone[t.rank].clone()
            got = REDUCES[name](comms)(mine, layout if name != "all_reduce" else
                                       FlatLayout(["g"], [torch.Size([numel])], 1))
            if name == "all_reduce":
                torch.testing.assert_close(got, mean, rtol=1e-6, atol=1e-6)
            elif name == "reduce_scatter":
                torch.testing.assert_close(got, mean[own], rtol=1e-6, atol=1e-6)
            elif name == "qgz":
                sim = _simulate_qgz(everyone, topo, 4, min(64, layout.shard_numel))
                torch.testing.assert_close(got, sim, rtol=1e-6, atol=1e-7)
                if numel == NUMELS[-1]:  # every rank's range holds data: quantization shows
                    assert float((got - mean[own]).abs().max()) > 0
            else:
                assert torch.equal(got, everyone[t.rank])  # nothing communicated
    return True


def _all(t):
    return _check_gathers(t) and _check_reduces(t)


def test_strategies_against_references():
    assert run_world(_all, 4, ranks_per_node=2, timeout=150) == [True] * 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_policy_of_each_stage(stage):
    p = ShardingPolicy.from_config(from_deepspeed({"zero_optimization": {"stage": stage}}))
    assert (p.shard_optimizer_state, p.shard_gradients, p.shard_parameters) == (stage >= 1, stage >= 2, stage == 3)
    assert p.reduce_each_micro_step == (stage >= 2)
    assert p.gather_after_step == (stage in (1, 2))
    assert p.degree(4) == (4 if stage else 1)
    with pytest.raises(AttributeError):
        p.shard_parameters = not p.shard_parameters  # frozen


def test_policy_rejects_impossible_combinations():
    with pytest.raises(ValueError, match="shard_gradients=True needs shard_optimizer_state"):
        ShardingPolicy(shard_gradients=True)
    with pytest.raises(ValueError, match="shard_parameters=True needs shard_gradients"):
        ShardingPolicy(shard_optimizer_state=True, shard_parameters=True)
    with pytest.raises(ValueError, match="secondary_degree=2 needs shard_parameters"):
        ShardingPolicy(secondary_degree=2)
    with pytest.raises(ValueError, match="secondary_degree=0"):
        ShardingPolicy(secondary_degree=0)


class _OneRank:
    """What the registries read of a world before anything is communicated (the refusals
    below raise while resolving names, before any resource is built)."""

    world_size, rank, ranks_per_node = 4, 0, 2


def _pick(ds):
    cfg = from_deepspeed(ds)
    comms = Comms(world=_OneRank(), topology=None, config=cfg)
    policy = ShardingPolicy.from_config(cfg)
    gathers = build_gathers(comms, policy)
    return {ph: repr(g) for ph, g in gathers.items()}, type(build_reduce(comms, policy)).name


PICKS = {
    "stage0": {"zero_optimization": {"stage": 0}},
    "stage2": {"zero_optimization": {"stage": 2}},
    "stage3": {"zero_optimization": {"stage": 3}},
    "zeropp": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                     "zero_hpz_partition_size": 2}},
    "onebit": {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
    "qwz-by-name": {"zero_optimization": {"stage": 3}, "zpp": {"weight_gather": "qwz"}},
    "qgz-by-name": {"zero_optimization": {"stage": 3}, "zpp": {"gradient_reduce": "qgz"}},
    "qgz-by-name-stage2": {"zero_optimization": {"stage": 2}, "zpp": {"gradient_reduce": "qgz"}},
}


def _picks(t):
    """Each config's strategies as the engine builds them, with the resources they need
    (the real topology of a 2 nodes x 2 world, built only where a strategy needs it)."""
    out = {}
    for key, ds in PICKS.items():
        cfg = from_deepspeed(ds)
        policy = ShardingPolicy.from_config(cfg)
        comms = build_comms(t, cfg, policy)
        gathers = build_gathers(comms, policy)
        reduce = build_reduce(comms, policy)
        out[key] = ({ph: repr(g) for ph, g in gathers.items()}, reduce.name,
                    None if comms.topology is None else comms.topology.ranks_per_node)
    t.barrier()  # every rank has built its groups before rank 0's store goes away
    return out


def test_registries_pick_from_the_config():
    got = run_world(_picks, 4, ranks_per_node=2, timeout=90)
    assert all(r == got[0] for r in got)
    p = {k: (g, r) for k, (g, r, _) in got[0].items()}
    topo = {k: v for k, (_, _, v) in got[0].items()}
    assert p["stage0"] == ({}, "all_reduce")
    assert p["stage2"] == ({Phase.EXACT: "PlainGather()"}, "reduce_scatter")  # publishes the updated shards
    g, r = p["stage3"]
    assert g == {Phase.FORWARD: "PlainGather()", Phase.BACKWARD: "PlainGather()", Phase.EXACT: "PlainGather()"}
    assert r == "reduce_scatter"
    g, r = p["zeropp"]
    assert g[Phase.FORWARD].startswith("SecondaryGather(QuantizedGather(bits=8")
    assert g[Phase.BACKWARD].startswith("SecondaryGather(PlainGather()")
    assert g[Phase.EXACT] == "PlainGather()" and r == "qgz"
    assert p["onebit"][1] == "local"
    # by name
    assert p["qwz-by-name"][0][Phase.FORWARD].startswith("QuantizedGather")
    assert p["qgz-by-name"][1] == "qgz" and p["qgz-by-name-stage2"][1] == "qgz"
    # the topology is built from what the chosen strategies need, not from the switches
    assert topo == {"stage0": None, "stage2": None, "stage3": None, "zeropp": 2, "onebit": None,
                    "qwz-by-name": None, "qgz-by-name": 2, "qgz-by-name-stage2": 2}
    assert set(GATHERS) == {"plain", "qwz"} and set(REDUCES) == {"all_reduce", "reduce_scatter", "qgz", "local"}
    assert REDUCES["qgz"].needs == SecondaryGather.needs == frozenset({"topology"})


@pytest.mark.parametrize("ds, match", [
    ({"zero_optimization": {"stage": 3}, "zpp": {"weight_gather": "int3"}}, r"weight_gather='int3'.*choices"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}, "zpp": {"weight_gather": "plain"}},
     "contradicts zero_quantized_weights"),
    ({"zero_optimization": {"stage": 2}, "zpp": {"gradient_reduce": "nope"}}, r"gradient_reduce='nope'.*choices"),
    ({"zero_optimization": {"stage": 0}, "zpp": {"gradient_reduce": "reduce_scatter"}}, "does not fit ZeRO stage 0"),
    ({"zero_optimization": {"stage": 0}, "zpp": {"gradient_reduce": "local"}}, "'local' goes with the 1-bit"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}, "zpp": {"gradient_reduce": "reduce_scatter"}},
     "contradicts zero_quantized_gradients"),
])
def test_registries_refuse_bad_names(ds, match):
    with pytest.raises(ValueError, match=match):
        _pick(ds)


def _reshard(t):
    """Stage 3 with and without resharding after forward: the same losses; without it no
    backward gather (all-gather bytes about halved)."""
    out = {}
    batches = _batches("gpt", t.rank, 6)
    for reshard in (True, False):
        torch.manual_seed(1234)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "zpp": {"reshard_after_forward": reshard, "prefetch": False}}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        t.counters.reset()
        losses = train_steps(engine, batches)
        gathered = t.counters.snapshot()["all_gather"].logical_bytes
        with torch.no_grad():  # evaluation releases what it gathered either way
            engine(*batches[0])
        assert not any(u.gathered for u in engine.units)
        out[reshard] = (losses, gathered)
        engine.close()
    return out


def test_reshard_after_forward_false_skips_the_backward_gather():
    for r in run_world(_reshard, 2, timeout=150):
        (l1, g1), (l0, g0) = r[True], r[False]
        assert l1 == l0  # bit-identical losses: the same weights, gathered once instead of twice
        assert g0 < 0.6 * g1, (g0, g1)


def _qgz_by_name(t):
    """qgZ chosen by name (``zpp.gradient_reduce``, without ``zero_quantized_gradients``):
    at stage 3 the same training as the switch; at stage 2 too (the engine builds the
    topology because qgZ needs it)."""
    out = {}
    batches = _batches("gpt", t.rank, 4)
    for key, zero, zpp in (("switch", {"stage": 3, "zero_quantized_gradients": True}, {}),
                           ("name", {"stage": 3}, {"gradient_reduce": "qgz"}),
                           ("name-stage2", {"stage": 2}, {"gradient_reduce": "qgz"}),
                           ("plain-stage2", {"stage": 2}, {})):
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
               "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 700},
               "zpp": {"check_metadata": False, **zpp}}
        engine, *_ = zz.initialize(model=_build("gpt", 0), config=cfg, transport=t)
        t.counters.reset()
        losses = train_steps(engine, batches)
        out[key] = (losses, {k: (v.calls, v.intra_bytes, v.inter_bytes) for k, v in t.counters.snapshot().items()},
                    engine.comms.reduce.name)
        engine.close()
    return out


def test_qgz_by_name_trains():
    for rank, r in enumerate(run_world(_qgz_by_name, 4, ranks_per_node=2, timeout=120)):
        assert r["name"] == r["switch"], rank
        losses, ops, name = r["name-stage2"]
        plain, plain_ops, _ = r["plain-stage2"]
        assert name == "qgz" and "quantized_reduce_scatter" in ops and "reduce_scatter" not in ops, (rank, ops)
        assert ops["quantized_reduce_scatter"][2] < plain_ops["reduce_scatter"][2], (rank, ops, plain_ops)
        gap = max(abs(a - b) / b for a, b in zip(losses, plain, strict=True))
        assert gap <= 0.08, (rank, losses, plain)  # test_zero_zeropp's bound for qgZ's first steps


def _hpz_wrong_degree(t):
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}, "zpp": {"check_metadata": False}}
    try:
        zz.initialize(model=_build("gpt", 0), config=cfg, transport=t)
    except ValueError as e:
        t.barrier()  # every rank has built its groups before rank 0's store goes away
        return str(e)
    return None


def test_hpz_degree_must_be_the_ranks_per_node():
    """hpZ's check of its degree against the topology it needs, raised on every rank."""
    for msg in run_world(_hpz_wrong_degree, 4, ranks_per_node=2, timeout=90):
        assert msg is not None and "zero_hpz_partition_size=4" in msg and "ranks per node (2)" in msg, msg


def _two_hop_gathers(t):
    """Each variant with its world gathers in two hops and in one (and ZeRO++ with the
    default): losses, masters, and the counted calls and bytes per op."""
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    out = {}
    for name, zero, settings in (("stage3", {"stage": 3}, (False, True)), ("stage2", {"stage": 2}, (False, True)),
                                 ("zeropp", {"stage": 3, **zeropp}, (False, True, None))):
        for hier in settings:
            cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                   "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0},
                   "zpp": {"check_metadata": False, "hierarchical_gather": hier}}
            engine, _, _, _ = zz.initialize(model=_build("gpt", t.rank), config=cfg, transport=t)
            t.counters.reset()
            losses = train_steps(engine, _batches("gpt", t.rank, 3))
            ops = {k: (v.calls, v.inter_bytes, v.intra_bytes) for k, v in t.counters.snapshot().items()}
            masters = [u.flat.master.detach().clone() for u in engine.units]
            out[name, hier] = (losses, masters, ops)
            engine.close()
    return out


def test_two_hop_gathers_are_exact_with_fewer_inter_node_bytes():
    """zpp.hierarchical_gather: the same training to the bit (an all-gather moves bytes, it
    does not round them); each world gather's inter-node bytes go from (W - R) to (N - 1)
    shards per rank (half, on 2 nodes x 2) and its calls stay one each; the rest is
    unchanged. ZeRO++ (hpZ, qgZ: the topology is built anyway) gathers in two hops by
    default."""
    none = (0, 0, 0)
    for rank, r in enumerate(run_world(_two_hop_gathers, 4, ranks_per_node=2, timeout=150)):
        for name, flat_op, hier_op in (("stage3", "all_gather", "hierarchical_all_gather"),
                                       ("stage2", "all_gather", "hierarchical_all_gather"),
                                       ("zeropp", "quantized_all_gather", "quantized_all_gather")):
            (l1, m1, ops1), (l2, m2, ops2) = r[name, False], r[name, True]
            assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(m1, m2, strict=True)), (rank, name)
            if flat_op == hier_op:  # the qwZ gathers keep their name
                assert ops2[hier_op][0] == ops1[flat_op][0] and 2 * ops2[hier_op][1] == ops1[flat_op][1], (
                    rank, name, ops1, ops2)
            else:  # every world gather moved from all_gather (what stays there is not a weight gather)
                moved = ops1[flat_op][0] - ops2.get(flat_op, none)[0]
                assert moved > 0 and ops2[hier_op][0] == moved, (rank, name, ops1, ops2)
                assert 2 * ops2[hier_op][1] == ops1[flat_op][1] - ops2.get(flat_op, none)[1], (rank, name, ops1, ops2)
            others = {k for k in ops1 if k not in (flat_op, hier_op)}
            assert all(ops1[k] == ops2[k] for k in others), (rank, name, ops1, ops2)
        default, on = r["zeropp", None], r["zeropp", True]
        assert default[0] == on[0] and default[2] == on[2], (rank, default[2], on[2])
