"""Compressed collectives against their plain counterparts, on real transports.

Each world runs every check at once (spawning ranks is the expensive part). Ranks raise
AssertionError on a failed check; tests/dist.py re-raises it here with the rank's traceback.
"""

import pytest
import torch

import zpp.quant as zq
from tests.dist import run_world
from tests.onebit_sim import OneBitSim
from zpp.comm.collectives import (
    effective_group_size,
    hierarchical_all_gather_async,
    hierarchical_reduce_scatter,
    quantized_all_gather,
    quantized_all_gather_async,
    quantized_reduce_scatter,
    two_hop,
)
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.topology import topology_of

# (world_size, ranks_per_node): 1 rank; 2 ranks on 1 and on 2 nodes; 2 nodes x 2 ranks;
# 4 nodes x 1; 1 node x 4; 3 nodes x 1 (odd node count)
WORLDS = [(1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (4, 4), (3, 1)]
MPI_WORLDS = [(1, 1), (2, 1), (4, 2)]


def _rand(numel, rank, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def _gather(t, x):
    out = torch.empty(t.world_size * x.numel(), dtype=x.dtype)
    t.all_gather(out, x.contiguous())
    return out.view(t.world_size, -1)


def _check_quantized_all_gather(t):
    for numel, bits, dtype, gs in [(1, 8, torch.float32, 2), (7, 4, torch.float32, 4),
                                   (3, 8, torch.float32, 2048), (100, 4, torch.bfloat16, 2048),
                                   (1000, 8, torch.bfloat16, 64), (4096, 4, torch.float32, 256),
                                   (5000, 8, torch.float16, 512), (0, 8, torch.float32, 64)]:
        shard = _rand(numel, t.rank, numel, dtype)
        out = torch.full((t.world_size * numel,), float("nan"), dtype=dtype)
        quantized_all_gather(out, shard, transport=t, bits=bits, group_size=gs)
        # exactly the all-gather of every rank's dequantize(quantize(shard))
        mine = zq.dequantize(zq.quantize(shard, bits=bits, group_size=effective_group_size(gs, numel)))
        assert torch.equal(out.view(t.world_size, -1), _gather(t, mine)), (numel, bits, dtype)
    # wire bytes: 1/4 (int8) and 1/8 (int4) of the plain fp32 all-gather, plus scales
    n = 1 << 16
    shard = _rand(n, t.rank, 7)
    out = torch.empty(t.world_size * n)
    for bits in (8, 4):
        t.counters.reset()
        quantized_all_gather(out, shard, transport=t, bits=bits, group_size=2048)
        q = t.counters.snapshot()["quantized_all_gather"]
        t.all_gather(out, shard)
        p = t.counters.snapshot()["all_gather"]
        assert q.logical_bytes == p.logical_bytes == t.world_size * n * 4
        peers = t.world_size - 1
        assert q.wire_bytes == peers * zq.quantized_nbytes(n, bits, 2048)
        assert p.wire_bytes == peers * n * 4
        if peers:
            want = 32 // bits
            assert p.wire_bytes / q.wire_bytes == pytest.approx(want / (1 + want * 4 / 2048 / 4), rel=1e-9)
    return True


def _check_hierarchical_all_gather(t):
    """The two-hop all-gather gives the world all-gather's bytes exactly (plain, and under
    qwZ the flat qwZ's), and books what its hops send: with N nodes of R ranks, (N - 1) n
    inter-node and (R - 1) N n intra-node bytes per rank, one call; a world without two
    levels is the plain all-gather."""
    topo = topology_of(t)
    N, R = topo.nodes, topo.ranks_per_node
    for numel, dtype in ((1, torch.float32), (1000, torch.bfloat16), (4099, torch.float32), (0, torch.float32)):
        x = _rand(numel, t.rank, 3, dtype)
        out = torch.full((t.world_size * numel,), float("nan"), dtype=dtype)
        t.counters.reset()
        hierarchical_all_gather_async(out, x, topology=topo).wait()
        assert torch.equal(out.view(t.world_size, -1), _gather(t, x)), (numel, dtype)
        snap = t.counters.snapshot()
        if two_hop(topo):
            h = snap["hierarchical_all_gather"]
            b = numel * x.element_size()
            assert (h.calls, h.inter_bytes, h.intra_bytes) == (1, (N - 1) * b, (R - 1) * N * b), (numel, h)
            assert h.logical_bytes == t.world_size * b
        else:
            assert "hierarchical_all_gather" not in snap, snap
    n = 1 << 14
    shard = _rand(n, t.rank, 9)
    flat, hier = torch.empty(t.world_size * n), torch.empty(t.world_size * n)
    for bits in (8, 4):
        quantized_all_gather(flat, shard, transport=t, bits=bits, group_size=512)
        t.counters.reset()
        quantized_all_gather_async(hier, shard, transport=t, bits=bits, group_size=512, topology=topo).wait()
        assert torch.equal(hier, flat), bits
        q = t.counters.snapshot()["quantized_all_gather"]
        per_rank = zq.quantized_nbytes(n, bits, 512)
        want = ((N - 1) * per_rank, (R - 1) * N * per_rank) if two_hop(topo) else (
            (t.world_size - R) * per_rank, (R - 1) * per_rank)
        assert (q.calls, q.inter_bytes, q.intra_bytes) == (1, *want), (bits, q)
    return True


def _simulate_qgz(inputs, topo, bits, gs):
    """Plain-torch simulation of qgZ for rank topo.rank, from every rank's input."""
    W, R, N = topo.world.world_size, topo.ranks_per_node, topo.nodes
    n = inputs.shape[1]
    s = -(-n // W)
    gs = effective_group_size(gs, s)
    chunk = zq.reduce_scatter_chunk(n, W, gs)
    padded = torch.zeros(W, W * s)
    padded[:, :n] = inputs
    slices = torch.zeros(W, W, chunk)  # [source rank, destination rank, chunk]
    slices[:, :, :s] = padded.view(W, W, s)
    deq = lambda x: zq.dequantize(zq.quantize(x, bits=bits, group_size=gs))  # noqa: E731
    me, node, local = topo.world.rank, topo.node, topo.local_rank
    partials = []
    for m in range(N):  # every node's partial sum of my chunk, after hop 1
        acc = None
        for l in range(R):
            v = deq(slices[m * R + l, me].clone())
            acc = v if acc is None else acc + v
        partials.append(deq(acc) if (R > 1 and N > 1) else acc)
    total = partials[0].clone()
    for p in partials[1:]:
        total = total + p
    return (total / float(W))[:s]


def _check_quantized_reduce_scatter(t):
    topo = topology_of(t)
    W = t.world_size
    for numel, bits, gs in [(1, 4, 2), (3, 4, 8), (1000, 4, 64), (4096, 8, 128), (12345, 4, 256),
                            (50, 8, 2048)]:
        inp = _rand(numel, t.rank, numel)
        s = -(-numel // W)
        out = torch.full((s,), float("nan"))
        quantized_reduce_scatter(out, inp, topology=topo, bits=bits, group_size=gs)
        everyone = _gather(t, inp)
        exact = torch.zeros(W * s)
        exact[:numel] = everyone.mean(0)
        mine = exact[t.rank * s:(t.rank + 1) * s]
        # within the two quantization stages' bound (absmax over my slice >= group absmax)
        lo, hi = t.rank * s, min(numel, (t.rank + 1) * s)
        amax = everyone[:, lo:hi].abs().amax(1) if hi > lo else torch.zeros(W)
        step = 2 ** bits - 2
        nodes_amax = amax.view(topo.nodes, topo.ranks_per_node).sum(1) * (1 + 1 / step)
        bound = (amax.sum() + (nodes_amax.sum() if topo.ranks_per_node > 1 else 0)) / step / W
        assert float((out - mine).abs().max()) <= float(bound) + 1e-6, (numel, bits)
        # and it is exactly the plain-torch simulation of the algorithm
        sim = _simulate_qgz(everyone, topo, bits, gs)
        torch.testing.assert_close(out, sim, rtol=1e-6, atol=1e-7)
        # hierarchical plain reduce-scatter equals the exact mean
        plain = torch.empty(s)
        hierarchical_reduce_scatter(plain, inp, topology=topo)
        torch.testing.assert_close(plain, mine, rtol=1e-5, atol=1e-6)
    # wire bytes: qgZ int4 sends ~1/8 of the plain two-hop inter-node bytes
    n = W * 8192
    inp = _rand(n, t.rank, 3)
    out = torch.empty(n // W)
    t.counters.reset()
    quantized_reduce_scatter(out, inp, topology=topo, bits=4, group_size=2048)
    hierarchical_reduce_scatter(out, inp, topology=topo)
    t.reduce_scatter(out, inp, op="mean")
    snap = t.counters.snapshot()
    q, h, flat = (snap["quantized_reduce_scatter"], snap["hierarchical_reduce_scatter"],
                  snap["reduce_scatter"])
    assert q.logical_bytes == h.logical_bytes == flat.logical_bytes == n * 4
    if topo.nodes > 1:
        assert h.inter_bytes / q.inter_bytes == pytest.approx(8 / (1 + 8 / 2048), rel=1e-9)
        assert flat.inter_bytes / q.inter_bytes >= 8 * topo.ranks_per_node * 0.99
    else:
        assert q.inter_bytes == h.inter_bytes == flat.inter_bytes == 0
    if topo.ranks_per_node > 1:
        assert 0 < q.intra_bytes * 7 < h.intra_bytes
    return True


def _check_onebit(t):
    W = t.world_size
    for n in (1, 5, 1000, 4099):
        ob = OneBitAllReduce(n, t)
        sim = OneBitSim(n, W)
        run_out = torch.zeros(n)
        run_exact = torch.zeros(n)
        drift, recorded = [], []
        for step in range(40):
            x = _rand(n, t.rank, 100 * n + step)
            everyone = _gather(t, x)
            want = sim(everyone)
            got = ob(x.clone())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            run_out += got
            run_exact += everyone.mean(0)
            drift.append(float((run_out - run_exact).norm()))
            if step == 19:
                saved = ob.state_dict()
            if 20 <= step < 25:
                recorded.append(got.clone())
        # error feedback: the running sums stay close, the gap does not grow with steps
        scale = float(everyone.mean(0).norm()) + float(everyone.norm(dim=1).max())
        assert max(drift[20:]) <= 4 * scale, (n, drift[-5:], scale)
        # checkpoint: a fresh object loaded with step 19's state replays steps 20-24 with
        # exactly the outputs the original gave (fresh error buffers would not)
        ob2 = OneBitAllReduce(n, t)
        ob2.load_state_dict(saved)
        for step, want in zip(range(20, 25), recorded):
            x = _rand(n, t.rank, 100 * n + step)
            assert torch.equal(ob2(x.clone()), want), (n, step)
    # replicas identical on every rank
    got = OneBitAllReduce(777, t)(_rand(777, t.rank, 5))
    assert torch.equal(_gather(t, got), got.expand(W, -1))
    # wire bytes: ~1/32 of a plain fp32 all-reduce
    n = 1 << 16
    x = _rand(n, t.rank, 9)
    ob = OneBitAllReduce(n, t)
    t.counters.reset()
    ob(x.clone())
    t.all_reduce(x.clone(), op="mean")
    snap = t.counters.snapshot()
    if W > 1:
        ratio = snap["all_reduce"].wire_bytes / snap["onebit_all_reduce"].wire_bytes
        assert 28 <= ratio <= 32, ratio
    # phase 2 in two hops (automatic on several nodes of several ranks): the same bits as the
    # flat all-gather; per rank, phase 1 sends (N-1)R frames across nodes, phase 2 (N-1)R flat
    # but N-1 in two hops
    nodes = len(set(t.nodes))
    R = W // nodes
    runs = {}
    for hier in (False, None):
        o = OneBitAllReduce(n, t, hierarchical=hier)
        assert o.hierarchical == (hier is None and 1 < nodes < W)
        t.counters.reset()
        outs = [o(_rand(n, t.rank, 50 + s)) for s in range(3)]
        stat = t.counters.snapshot().get("onebit_all_reduce")
        runs[hier] = (outs, stat.inter_bytes if stat else 0)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[None][0]))
    if 1 < nodes < W:
        assert runs[None][1] * 2 * R == runs[False][1] * (R + 1), runs
    with pytest.raises(ValueError, match="numel=777"):
        OneBitAllReduce(777, t)(torch.zeros(5))
    bad = OneBitAllReduce(10, t).state_dict()
    with pytest.raises(ValueError, match="numel"):
        OneBitAllReduce(11, t).load_state_dict(bad)
    return True


def _all_checks(t):
    return (_check_quantized_all_gather(t) and _check_hierarchical_all_gather(t), _check_quantized_reduce_scatter(t),
            _check_onebit(t))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,rpn", WORLDS, ids=[f"w{w}-rpn{r}" for w, r in WORLDS])
def test_collectives_torch(world, rpn):
    results = run_world(_all_checks, world, backend="torch", ranks_per_node=rpn, timeout=300)
    assert results == [(True, True, True)] * world


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,rpn", MPI_WORLDS, ids=[f"w{w}-rpn{r}" for w, r in MPI_WORLDS])
def test_collectives_mpi(world, rpn):
    results = run_world(_all_checks, world, backend="mpi", ranks_per_node=rpn, timeout=300)
    assert results == [(True, True, True)] * world


def _check_bad_sizes(t):
    """A rank whose shard differs from the others' makes every rank raise ValueError."""
    n = 10 + (t.rank == t.world_size - 1)
    out = torch.empty(t.world_size * n)
    with pytest.raises(ValueError, match="disagree"):
        quantized_all_gather(out, torch.randn(n), transport=t, bits=8, group_size=4)
    return True


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["torch", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_mismatched_sizes_raise_everywhere(backend):
    assert run_world(_check_bad_sizes, 2, backend=backend, timeout=120) == [True, True]


def test_local_argument_errors():
    from zpp.comm.counters import WireCounters  # noqa: F401  (import check only)

    class _One:
        world_size = 2
    with pytest.raises(ValueError, match="expected world_size"):
        quantized_all_gather(torch.empty(5), torch.empty(3), transport=_One())
    with pytest.raises(ValueError, match="positive integer"):
        OneBitAllReduce(0, _One())
    assert effective_group_size(2048, 3) == 4 and effective_group_size(2048, 10**6) == 2048
    assert effective_group_size(64, 0) == 2
    with pytest.raises(ValueError, match="group_size=3"):
        effective_group_size(3, 100)


def _agreed_round_trips(t):
    """Metadata round trips of qwZ's gather, flat and in two hops, and what a rank that
    disagrees on the bits gets (see [Note: agreed calls] in zpp/comm/transport.py)."""
    from zpp.comm.torch_backend import TorchTransport

    topo = topology_of(t)
    calls = [0]
    plain = TorchTransport._meta_all_gather

    def counted(self, out, inp):
        calls[0] += 1
        return plain(self, out, inp)

    n = 40
    shard = torch.randn(n, generator=torch.Generator().manual_seed(t.rank))
    out = {}
    TorchTransport._meta_all_gather = counted
    try:
        for name, kw in (("flat", {}), ("two hops", {"topology": topo})):
            got = torch.empty(t.world_size * n)
            calls[0] = 0
            quantized_all_gather_async(got, shard, transport=t, bits=8, group_size=8, **kw).wait()
            out[name] = (calls[0], got)
    finally:
        TorchTransport._meta_all_gather = plain
    with pytest.raises(ValueError, match=r"disagree.*bits=4") as e:
        got = torch.empty(t.world_size * n)
        quantized_all_gather_async(got, shard, transport=t, bits=4 if t.rank == 1 else 8, group_size=8,
                                   topology=topo).wait()
    out["message"] = str(e.value)
    return out


@pytest.mark.timeout(150)
def test_quantized_gather_checks_its_calls_in_one_round_trip():
    """The size check over the world agrees on everything the gather's calls depend on, so
    the calls started with it make no round trip of their own: one in all, flat; two in two
    hops (the second hop, made at wait(), checks itself). Same bits either way; a rank with
    other bits makes every rank raise, naming them."""
    for r in run_world(_agreed_round_trips, 4, ranks_per_node=2, timeout=120):
        assert r["flat"][0] == 1 and r["two hops"][0] == 2, (r["flat"][0], r["two hops"][0])
        assert torch.equal(r["flat"][1], r["two hops"][1])
        assert "rank 1:" in r["message"] and "bits=8" in r["message"], r["message"]
