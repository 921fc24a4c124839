"""The cost model (zpp/tune/cost.py): its formulas against cases computed by hand, and its
bytes per step against the engine's wire counters on 2 nodes x 2 gloo ranks, exactly, for
every ZeRO mode."""
from __future__ import annotations

import math

import pytest
import torch

import zpp.zero as zz
from tests.dist import run_world
from tests.gpt import GPT, GPTConfig
from zpp.tune import cost
from zpp.tune.cost import LINKS, MODES, Cluster, Profile, UnitShape

C22 = Cluster(nodes=2, ranks_per_node=2, intra=LINKS["loopback"], inter=LINKS["100mbit"])


def _bytes(mode, units, cluster=C22):
    t = cost.traffic(MODES[mode], units, cluster)
    return t.inter_bytes, t.intra_bytes, t.node_link_bytes / cost.WIRE_OVERHEAD


def test_stage3_by_hand():
    # one unit of 8192 fp32 elements on 4 ranks: shard 2048 (8192 bytes); each rank sends its
    # shard to 1 local and 2 remote peers per gather (forward, backward), 1/4 of the 32 KiB
    # gradient to each peer, and 8 bytes of norm as an all-reduce: 2*8/4 = 4 to each peer
    inter, intra, link = _bytes("zero3", [UnitShape(8192)])
    assert (inter, intra) == (3 * 2 * 8192 + 2 * 4, 3 * 8192 + 4)
    # the ring: each node sends W - 1 = 3 chunks per pass (not R (W - R) = 4)
    assert link == 3 * (3 * 8192) + 2 * 3 * 2


def test_stages_1_2_by_hand():
    for mode in ("zero1", "zero2"):
        inter, intra, _ = _bytes(mode, [UnitShape(8192)])
        assert (inter, intra) == (2 * 2 * 8192 + 8, 2 * 8192 + 4)


def test_gradient_accumulation_by_hand():
    # two backward passes per optimizer step: stage 3 gathers twice and reduce-scatters twice,
    # stage 2 reduce-scatters twice and publishes once, stage 1 reduces the accumulated
    # gradient once; the norm is once per step
    def with_micro(mode):
        t = cost.traffic(MODES[mode], [UnitShape(8192)], C22, micro_steps=2)
        return t.inter_bytes, t.intra_bytes
    assert with_micro("zero3") == (6 * 2 * 8192 + 2 * 4, 6 * 8192 + 4)
    assert with_micro("zero2") == (3 * 2 * 8192 + 8, 3 * 8192 + 4)
    assert with_micro("zero1") == (2 * 2 * 8192 + 8, 2 * 8192 + 4)
    # hpZ: only the step's first gather crosses nodes (two hops: 8192 B to the remote peer, the
    # node's 16384 B to the local one); the second forward and both backwards read the
    # secondary shards (16384 B to the local peer each); two reduce-scatters of 8192 B per peer
    assert with_micro("zero3-hpz") == (8192 + 2 * 2 * 8192 + 8, 16384 + 3 * 16384 + 2 * 8192 + 4)
    with pytest.raises(ValueError, match="micro_steps"):
        cost.traffic(MODES["zero2"], [UnitShape(8192)], C22, micro_steps=0)


def test_zeropp_by_hand():
    inter, intra, _ = _bytes("zero3-zeropp", [UnitShape(8192)])
    # qwZ: 2048 int8 codes + one fp32 scale (group 2048) per rank, in two hops (hpZ and qgZ
    # have the engine build the topology): to the remote peer of equal local rank, then the
    # node's two shards to the local peer
    q = 2048 + 4
    # hpZ: the backward gathers the node's secondary shards, 8192 / 2 elements, to the local peer
    hpz = 4096 * 4
    # qgZ (groups of G = 128): hop 1 sends half of W * chunk = 8192 int4 codes (4096 B) and
    # their 8192 / G fp32 scales to the local peer; hop 2 half of N * chunk = 4096 codes
    # (2048 B) and 4096 / G scales to the remote peer
    G = 128
    assert cost.MODES["zero3-zeropp"].gradient_group_size == G
    qgz_intra, qgz_inter = 4096 // 2 + 4 * (8192 // G) // 2, 2048 // 2 + 4 * (4096 // G) // 2
    assert inter == q + qgz_inter + 8
    assert intra == 2 * q + hpz + qgz_intra + 4


def test_one_rank_per_node_and_one_node():
    c41 = Cluster(4, 1, LINKS["loopback"], LINKS["1gbit"])
    inter, intra, link = _bytes("zero3", [UnitShape(8192)], c41)
    assert intra == 0 and inter == 3 * 3 * 8192 + 3 * 4 and link == inter  # ring == direct with R = 1
    c14 = Cluster(1, 4, LINKS["loopback"], LINKS["1gbit"])
    inter, intra, link = _bytes("zero3-zeropp", [UnitShape(8192)], c14)
    assert inter == 0 and link == 0 and intra > 0


def test_onebit_by_hand():
    # 8192 elements on 4 ranks: chunks of 2048 -> frames of 256 sign bytes + a 4-byte scale; phase
    # 1 sends a frame to every peer; phase 2 (2 nodes x 2) one to the remote peer of the same
    # local rank and the node's 2 frames to the local peer; plus the 4-byte finiteness flag
    inter, intra, _ = _bytes("onebit-adam", [UnitShape(8192)])
    f = 256 + 4
    assert inter == 2 * f + f + 2 * 2
    assert intra == f + 2 * f + 2


def test_outer_by_hand():
    # 2 nodes x 2, H = 5 (the mode's default), 4 fragments, int4: inner steps stay inside the
    # node; a fragment of this rank's 1/R shard is 8192 / 2 / 4 = 1024 elements, reduced in int4
    # across the 2 nodes (hop 2 only: one rank per node in the nodes' group) and gathered back
    # in int4
    psi = 8192
    t = cost.traffic(MODES["outer-int4"], [UnitShape(psi)], C22)
    frag = psi // 2 // 4
    g = cost._group(2048, frag // 2)
    per_sync = (frag * 4 // 8) // 2 + (frag // g * 4) // 2  # hop-2 all-to-all: codes + scales
    per_sync += (frag // 2) * 4 // 8 + 4 * math.ceil((frag // 2) / g)  # all-gather of my half
    assert MODES["outer-int4"].outer.sync_every == 5
    assert t.inter_bytes == pytest.approx(4 * per_sync / 5)
    inner = cost.traffic(MODES["zero2"], [UnitShape(psi)], Cluster(1, 2, LINKS["loopback"], LINKS["100mbit"]))
    assert t.intra_bytes == pytest.approx(inner.intra_bytes)


def test_time_by_hand():
    one = cost.Call("x", intra=1000, inter=2_000_000, node_link=3_000_000, steps=3)
    want = max(3 * LINKS["100mbit"].latency_s + 3_000_000 * cost.WIRE_OVERHEAD / 12.5e6,
               3 * LINKS["loopback"].latency_s + 1000 / 2e9)
    assert cost.call_time(one, C22) == pytest.approx(want)
    step, comm = cost.step_time(cost.Traffic((one,)), C22, Profile(compute_s=2.0))
    assert comm == pytest.approx(want) and step == pytest.approx(2.0 + want)
    half, _ = cost.step_time(cost.Traffic((one,)), C22, Profile(compute_s=2.0, overlap=0.5))
    assert half == pytest.approx(2.0 + want / 2)
    # a prefetched forward gather (stage 3) runs under the forward's compute (a third of it): it
    # shows only where the forward's gathers together outlast that
    g = cost.Call("forward gather", intra=0, inter=1, node_link=1_250_000, steps=0, prefetched=True)
    tg = 1_250_000 * cost.WIRE_OVERHEAD / 12.5e6
    assert cost.step_time(cost.Traffic((g, one)), C22, Profile(compute_s=2.0))[0] == pytest.approx(2.0 + want)
    assert cost.step_time(cost.Traffic((g,) * 40 + (one,)), C22, Profile(compute_s=2.0))[0] == pytest.approx(
        40 * tg + 2.0 * 2 / 3 + want)
    # and compute_from_step inverts it, on either side of the forward's share
    for k in (1, 40):
        t = cost.Traffic((g,) * k + (one,))
        step = cost.step_time(t, C22, Profile(compute_s=2.0))[0]
        assert cost.compute_from_step(step, t, C22) == pytest.approx(2.0)
    p = Profile.from_flops(7_000_000_000, 1_000_000, peak_flops=1e15, mfu=0.5)
    assert p.compute_s == pytest.approx(6 * 7e9 * 1e6 / 5e14)


def test_overlapped_backward_by_hand():
    """Backward gathers started ahead and reductions on the reduction thread run under the
    backward's compute (2/3 of it): they show only where together they outlast it."""
    b = cost.Call("reduce", intra=0, inter=1, node_link=1_250_000, steps=0, beside_backward=True)
    tb = 1_250_000 * cost.WIRE_OVERHEAD / 12.5e6  # 0.1035 s
    g = cost.Call("forward gather", intra=0, inter=1, node_link=1_250_000, steps=0, prefetched=True)
    for k, want in ((1, 2.0), (12, 2.0), (13, 2.0 / 3 + 13 * tb), (40, 2.0 / 3 + 40 * tb)):
        step, comm = cost.step_time(cost.Traffic((b,) * k), C22, Profile(compute_s=2.0))
        assert step == pytest.approx(want) and comm == pytest.approx(k * tb)
    # the two phases are separate: a forward that waits on its gathers does not lend the
    # backward its slack, and the reverse
    t = cost.Traffic((g,) * 10 + (b,) * 20)
    assert cost.step_time(t, C22, Profile(compute_s=2.0))[0] == pytest.approx(10 * tb + 20 * tb)
    t = cost.Traffic((g,) * 2 + (b,) * 20)
    assert cost.step_time(t, C22, Profile(compute_s=2.0))[0] == pytest.approx(2.0 / 3 + 20 * tb)
    # compute_from_step inverts it in every regime (bisection)
    for traffic in ((b,), (b,) * 40, (g,) * 10 + (b,) * 20, (g,) * 2 + (b,) * 3):
        t = cost.Traffic(traffic)
        for c in (0.5, 2.0, 7.0):
            step = cost.step_time(t, C22, Profile(compute_s=c))[0]
            if step > cost.step_time(t, C22, Profile(compute_s=0.0))[0]:  # else the link alone explains it
                assert cost.compute_from_step(step, t, C22) == pytest.approx(c, rel=1e-9)


def test_which_calls_run_beside_the_backward():
    """Stage 3 with overlap_comm (its default): the backward gathers (started ahead) and every
    unit's reduction but the first unit's (reduced last) run beside the backward; the norm
    and the forward's gathers (under the forward) do not. Without overlap_comm, or at stage 1, nothing does."""
    units = [UnitShape(8192), UnitShape(8192), UnitShape(8192)]

    def beside(mode):
        t = cost.traffic(mode, units, C22)
        return [(c.what, c.beside_backward) for c in t.calls]
    calls = beside(MODES["zero3"])
    assert calls == [("forward gather", False), ("backward gather", True), ("gradient reduce-scatter", False),
                     ("forward gather", False), ("backward gather", True), ("gradient reduce-scatter", True),
                     ("forward gather", False), ("backward gather", True), ("gradient reduce-scatter", True),
                     ("gradient norm", False)]
    import dataclasses

    inline = dataclasses.replace(MODES["zero3"], overlap_comm=False)
    assert not any(b for _, b in beside(inline)) and inline.config(2)["zero_optimization"]["overlap_comm"] is False
    assert not any(b for _, b in beside(MODES["zero1"]))
    two = dataclasses.replace(MODES["zero2"], overlap_comm=True)
    assert [b for w, b in beside(two) if w == "gradient reduce-scatter"] == [False, True, True]
    assert not any(b for w, b in beside(two) if w == "weight all-gather")
    # the same bytes either way: only the time moves
    a, b_ = cost.traffic(MODES["zero3"], units, C22), cost.traffic(inline, units, C22)
    assert (a.inter_bytes, a.intra_bytes) == (b_.inter_bytes, b_.intra_bytes)


def test_zeropp_with_weight_deltas_by_hand():
    inter, intra, _ = _bytes("zero3-zeropp-delta4", [UnitShape(8192)])
    pp_inter, pp_intra, _ = _bytes("zero3-zeropp", [UnitShape(8192)])
    # the forward's first gather: int4 codes of the differences (1024 B + one scale per rank)
    # to the other node's counterpart, instead of qwZ's int8 codes (2048 B + one scale) over
    # two hops; inside the node no codes, but the updated copy, 8192 / 2 fp32 elements, to the
    # local peer
    q8, q4 = 2048 + 4, 1024 + 4
    assert inter == pp_inter - q8 + q4
    assert intra == pp_intra - 2 * q8 + 4096 * 4
    assert MODES["zero3-zeropp-delta4"].config(2)["zpp"] == {"weight_delta_bits": 4}
    assert "zpp" not in MODES["zero3-zeropp-delta4"].config(1)  # one rank per node: no node copy, ZeRO++
    m = cost.memory(MODES["zero3-zeropp-delta4"], [UnitShape(8192)], C22)
    pp = cost.memory(MODES["zero3-zeropp"], [UnitShape(8192)], C22)
    # at rest the secondary (1/R of the unit) stays
    assert m["rest"] - pp["rest"] == 4 * 8192 // 2
    # in a step the refreshes' fp32 differences of their secondaries (1/R of a unit) for the
    # units in flight on top (the unit and one prefetched: memory()'s default)
    assert m["peak"] - pp["peak"] == 4 * 2 * 8192 // 2


def test_memory_by_hand():
    units = [UnitShape(8192)]
    m3 = cost.memory(MODES["zero3"], units, C22)
    assert m3["rest"] == 4 * 2048 + 8 * 2048          # shard + Adam moments of the shard
    m1 = cost.memory(MODES["zero1"], units, C22)
    assert m1["rest"] == 4 * 8192 + 8 * 2048
    hpz = cost.memory(MODES["zero3-hpz"], units, C22)
    assert hpz["peak"] - m3["peak"] == 4 * 8192 // 2  # the secondary: 1/R of the unit


def test_resident_peak_by_hand():
    """[Note: the resident peak]: three units of 8192 and 4096 elements on 4 ranks (shards
    2048, 2048, 1024), moments in memory or on NVMe through 3 buffers."""
    units = [UnitShape(8192), UnitShape(8192), UnitShape(4096)]
    shard = 2048 + 2048 + 1024
    for buffers, moments in ((0, 8 * shard), (3, 3 * 8 * 2048)):
        m = cost.memory(MODES["zero3"], units, C22, nvme_buffers=buffers, live_numel=3 * 8192)
        assert m["rest"] == 4 * shard + moments and m["grads"] == 4 * shard
        assert m["peak"] == m["rest"] + 4 * 3 * 8192 + 4 * shard + 4 * 8192  # live units, grad shards, a unit's grad
        r = cost.resident_peak(MODES["zero3"], units, C22, activations=1_000_000, step_temporaries=2.0,
                               nvme_buffers=buffers, live_numel=3 * 8192, runtime=5000)
        # the backward's start: no reduced shard yet (the last step dropped them)
        assert r["backward"] == m["peak"] - 4 * shard + 1_000_000 + 5000
        assert r["step"] == 4 * shard + moments + 4 * shard + 2.0 * 4 * 2048 + 5000  # two copies of the biggest shard
        assert r["peak"] == max(r["backward"], r["step"]) == r["backward"]
        # from the second micro-step of an accumulation on, the shards are there at its start
        acc = cost.resident_peak(MODES["zero3"], units, C22, activations=1_000_000, step_temporaries=2.0,
                                 nvme_buffers=buffers, live_numel=3 * 8192, runtime=5000, accumulating=True)
        assert acc["backward"] == r["backward"] + 4 * shard and acc["step"] == r["step"]
    # the optimizer step sets the peak when its temporaries outweigh the activations
    r = cost.resident_peak(MODES["zero3"], units, C22, activations=0, step_temporaries=40.0)
    assert r["peak"] == r["step"] > r["backward"]


def test_resident_peak_with_parameters_on_nvme_by_hand():
    """[Note: parameters on NVMe]: the same three units with both tiers on NVMe (2 buffers of a
    shard, 3 of a unit's moments) and 3 units gathered at once."""
    units = [UnitShape(8192), UnitShape(8192), UnitShape(4096)]
    u = 2048  # the largest shard
    m = cost.memory(MODES["zero3"], units, C22, nvme_buffers=3, param_nvme_buffers=2, live_numel=3 * 8192)
    assert m["rest"] == 2 * 4 * u + 3 * 8 * u            # the two pools: no shard, no moment between uses
    assert m["grads"] == 4 * u                            # one reduced gradient shard
    live = 4 * 3 * 8192 + 4 * (3 * 8192 // 4)             # the gathered units and their shards read in
    assert m["peak"] == m["rest"] + live + 4 * u + 4 * 8192  # and a unit's full gradient
    r = cost.resident_peak(MODES["zero3"], units, C22, activations=1_000_000, step_temporaries=2.0,
                           nvme_buffers=3, param_nvme_buffers=2, live_numel=3 * 8192)
    assert r["backward"] == m["peak"] + 1_000_000  # the one reduced shard in memory is counted
    # the pools, the stepping unit's gradient and shard, AdamW's two copies of it
    assert r["step"] == m["rest"] + 4 * u + 4 * u + 2.0 * 4 * u
    with pytest.raises(ValueError, match="param_nvme_buffers=2 needs stage 3"):
        cost.memory(MODES["zero2"], units, C22, param_nvme_buffers=2)


def test_modes_write_deepspeed_configs():
    assert MODES["zero3-zeropp"].config(2) == {"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}
    assert MODES["outer-int4"].config(2)["zpp"]["outer"]["compression"] == "int4"


def test_bad_cluster_names_the_value():
    with pytest.raises(ValueError, match="nodes"):
        Cluster(0, 2, LINKS["loopback"], LINKS["1gbit"])


# ------------------------------------------------------------------ against the counters
STEPS = 2


def _model():
    """A GPT whose units (zpp.unit_min_numel 2000) include the blocks' leftovers (attention
    projections and norms, 2,368 elements) as one unit of the ModuleList: gathered once per
    block that uses it, so its gathers per step come from the trace, not from a rule."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8))


def _measure(t, modes, threshold, gas):
    out = {}
    for name in modes:
        mode = MODES[name]
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
               "gradient_accumulation_steps": gas, **mode.config(2)}
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        cfg["zpp"] = {**cfg.get("zpp", {}), "unit_min_numel": 2000}
        if mode.onebit:
            cfg["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1}}
        engine, *_ = zz.initialize(model=_model(), config=cfg, transport=t)
        g = torch.Generator().manual_seed(t.rank)

        def step():  # one optimizer step: gas backward passes
            for _ in range(gas):
                x = torch.randint(0, 128, (2, 8), generator=g)
                engine.backward(engine(x, x))
                engine.step()
        step()
        step()  # past a 1-bit optimizer's freeze step
        t.counters.reset()
        for _ in range(STEPS):
            step()
        total = t.counters.total()
        units = [(u.layout.numel, not u.shards_params) for u in engine.units]
        trace = [(i, phase.value) for i, phase in engine._prefetch.trace() or ()]
        out[name] = (total.inter_bytes / STEPS, total.intra_bytes / STEPS, units, trace)
        engine.close()
    return out


ZERO_MODES = ("zero1", "zero2", "zero3", "zero3-qwz", "zero3-hpz", "zero3-qgz", "zero3-zeropp", "zero3-zeropp-delta4",
              "onebit-adam")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("threshold, gas", [(0, 1), pytest.param(1000, 1, marks=pytest.mark.slow),
                                             pytest.param(1000, 2, marks=pytest.mark.slow)])
def test_bytes_equal_the_counters(threshold, gas):
    """Every mode's bytes per optimizer step, predicted from the engine's units alone, equal
    what the transport counted: exact, inter- and intra-node, with and without persistent
    units, with and without gradient accumulation."""
    res = run_world(_measure, 4, ranks_per_node=2, args=(ZERO_MODES, threshold, gas), timeout=200)[0]
    assert set(res) == set(ZERO_MODES)
    for name, (inter, intra, units, trace) in res.items():
        assert inter > 0 and intra > 0, (name, inter, intra)
        if MODES[name].stage == 3:
            assert len(units) >= 3, units
            assert max(sum(1 for i, _ in trace if i == k) for k in range(len(units))) > 2, trace
        if threshold and MODES[name].stage == 3:
            assert any(p for _, p in units) and not all(p for _, p in units), units
        stage3 = MODES[name].stage == 3
        shapes = cost.units_from_trace([n for n, _ in units], [p and stage3 for _, p in units], trace)
        want = cost.traffic(MODES[name], shapes, C22, micro_steps=gas)
        assert (want.inter_bytes, want.intra_bytes) == (inter, intra), (name, units)
