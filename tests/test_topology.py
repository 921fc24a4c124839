"""Layout, Topology and the transport registry.

The layout rules and the group bookkeeping are checked in-process against a fake transport
(no traffic); the real sub-groups of both backends are checked in worlds of 2 nodes x 2 ranks
and of one node.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import BACKENDS, run_world
from zpp.comm import registry
from zpp.comm.registry import get_transport, register_transport
from zpp.comm.single import SingleRankTransport
from zpp.comm.topology import Layout, Topology, agree_on_layout, topology_of
from zpp.comm.transport import Transport


class _FakeTransport(Transport):
    """No traffic: records the sub-groups asked for; the metadata all-gather returns
    ``table`` (one row of int64 words per rank)."""

    name = "fake"

    def __init__(self, rank, nodes, table=None, ranks=None):
        super().__init__(rank, len(nodes), ranks if ranks is not None else range(len(nodes)), nodes)
        self.table = table
        self.asked: list[tuple[int, ...]] = []

    def _subgroup(self, members):
        self.asked.append(members)
        if self.rank not in members:
            return None
        return _FakeTransport(members.index(self.rank), [self.nodes[m] for m in members], ranks=[self.ranks[m] for m in members])

    def _meta_all_gather(self, out, inp):
        out.copy_(torch.tensor(self.table, dtype=torch.int64).reshape(-1))

    def _all_gather(self, out, inp): raise AssertionError("no traffic expected")
    def _reduce_scatter(self, out, inp, op): raise AssertionError("no traffic expected")
    def _all_reduce(self, t, op): raise AssertionError("no traffic expected")
    def _all_to_all(self, out, inp): raise AssertionError("no traffic expected")
    def _broadcast(self, t, src): raise AssertionError("no traffic expected")
    def barrier(self): pass


# ---------------------------------------------------------------------- Layout
def test_layout_numbers():
    lay = Layout(rank=5, world_size=8, ranks_per_node=4)
    assert (lay.nodes, lay.node, lay.local_rank) == (2, 1, 1)
    assert [lay.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.node_list() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(AttributeError):
        lay.rank = 0  # frozen
    with pytest.raises(TypeError):
        Layout(5, 8, 4)  # keyword-only


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"rank": 0, "world_size": 4, "ranks_per_node": 3}, ["3", "4"]),
        ({"rank": 0, "world_size": 4, "ranks_per_node": 0}, ["0", "4"]),
        ({"rank": 4, "world_size": 4, "ranks_per_node": 2}, ["rank=4", "4"]),
        ({"rank": 0, "world_size": 0, "ranks_per_node": 1}, ["world_size=0"]),
    ],
)
def test_layout_rejects(kwargs, words):
    with pytest.raises(ValueError) as info:
        Layout(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_layout_from_env_sources():
    # ZPP_RANKS_PER_NODE overrides torchrun's LOCAL_WORLD_SIZE; that beats "one node"
    env = {"ZPP_RANKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "4"}
    assert Layout.from_env(3, 4, env).ranks_per_node == 2
    assert Layout.from_env(3, 4, {"LOCAL_WORLD_SIZE": "4"}).ranks_per_node == 4
    assert Layout.from_env(3, 4, {}).ranks_per_node == 4
    with pytest.raises(ValueError, match="3.*4"):
        Layout.from_env(0, 4, {"ZPP_RANKS_PER_NODE": "3"})
    with pytest.raises(ValueError, match="ZPP_RANKS_PER_NODE='two'"):
        Layout.from_env(0, 4, {"ZPP_RANKS_PER_NODE": "two"})


def test_layout_from_node_keys():
    assert Layout.from_node_keys(2, ["a", "a", "b", "b"]) == Layout(rank=2, world_size=4, ranks_per_node=2)
    assert Layout.from_node_keys(0, [7, 7, 7]).nodes == 1
    with pytest.raises(ValueError, match=r"unequal.*\[3, 1\]"):
        Layout.from_node_keys(0, [0, 0, 0, 3])
    with pytest.raises(ValueError, match=r"node-major.*\[0, 2\]"):
        Layout.from_node_keys(0, [0, 1, 0, 1])


def test_agree_on_layout_is_collective():
    """Every rank reads its own environment; one odd rank makes every rank raise."""
    ok = [[2, 0], [2, 1], [2, 0], [2, 1]]
    assert agree_on_layout(_FakeTransport(1, [0] * 4, ok), {"ZPP_RANKS_PER_NODE": "2"}).ranks_per_node == 2
    odd = [[2, 0], [2, 1], [4, 2], [2, 1]]  # rank 2 saw another LOCAL_WORLD_SIZE
    with pytest.raises(ValueError, match=r"disagree.*\[2, 2, 4, 2\]"):
        agree_on_layout(_FakeTransport(0, [0] * 4, odd), {"ZPP_RANKS_PER_NODE": "2"})
    failed = [[2, 0], [0, -1], [2, 0], [2, 1]]  # rank 1 could not read a layout at all
    with pytest.raises(ValueError, match="disagree"):
        agree_on_layout(_FakeTransport(0, [0] * 4, failed), {"ZPP_RANKS_PER_NODE": "2"})
    # torchrun numbering that is not node-major: LOCAL_RANK 0,0,1,1 with 2 per node
    shuffled = [[2, 0], [2, 0], [2, 1], [2, 1]]
    env = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(ValueError, match=r"node-major.*\[0, 0, 1, 1\]"):
        agree_on_layout(_FakeTransport(0, [0] * 4, shuffled), env)


# ---------------------------------------------------------------------- Topology (no traffic)
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3), (1, 4), (4, 1)])
def test_topology_groups(nodes, per_node):
    world_size = nodes * per_node
    for rank in range(world_size):
        world = _FakeTransport(rank, [r // per_node for r in range(world_size)])
        topo = Topology.build(world)
        # every rank asks for every group, in the same order: all intra, then all inter;
        # a group of one rank is a SingleRankTransport, asked of nobody
        want_intra = [tuple(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
        want_inter = [tuple(range(l, world_size, per_node)) for l in range(per_node)]
        assert world.asked == [g for g in want_intra + want_inter if len(g) > 1]
        for sub in (topo.intra, topo.inter):
            assert isinstance(sub, SingleRankTransport) == (sub.world_size == 1 and world_size > 1)
            if isinstance(sub, SingleRankTransport):
                assert sub.counters is world.counters and sub.ranks == (rank,)
        assert (topo.nodes, topo.ranks_per_node, topo.node, topo.local_rank) == (nodes, per_node, rank // per_node, rank % per_node)
        assert topo.intra.ranks == want_intra[rank // per_node]
        assert topo.inter.ranks == want_inter[rank % per_node]
        assert set(topo.intra.nodes) == {rank // per_node}
        assert topo.inter.nodes == tuple(range(nodes))
        assert topo.world is world and (topo.rank, topo.world_size) == (rank, world_size)


@pytest.mark.parametrize("nodes,match", [([0, 1, 0, 1], "node-major"), ([0, 0, 0, 1], "unequal"), ([0, 0, 1], "unequal")])
def test_topology_rejects_bad_nodes(nodes, match):
    world = _FakeTransport(0, nodes)
    with pytest.raises(ValueError, match=match):
        Topology.build(world)
    assert world.asked == []  # decided before any (collective) group creation


def test_topology_of_caches():
    world = _FakeTransport(0, [0, 0, 1, 1])
    topo = topology_of(world)
    asked = len(world.asked)
    assert topology_of(world) is topo and len(world.asked) == asked


def test_topology_of_a_sub_transport():
    """Node ids need not start at 0: the intra transport of node 1 is one node; its
    inter-node group (this rank alone) asks the backend for nothing. The inter transport of
    local rank 0 is two nodes of one rank each."""
    world = _FakeTransport(2, [0, 0, 1, 1])
    sub = topology_of(world).intra
    topo = topology_of(sub)
    assert (topo.nodes, topo.ranks_per_node, topo.intra.ranks) == (1, 2, (2, 3))
    assert isinstance(topo.inter, SingleRankTransport) and topo.inter.ranks == (2,) and sub.asked == [(0, 1)]
    across = topology_of(topology_of(world).inter)
    assert (across.nodes, across.ranks_per_node, across.inter.ranks) == (2, 1, (0, 2))
    assert isinstance(across.intra, SingleRankTransport) and across.intra.ranks == (2,)
    x = torch.arange(3.0)
    out = torch.empty(3)
    across.intra.all_gather(out, x)  # one rank: a copy, nothing booked across nodes
    assert torch.equal(out, x) and world.counters.total().wire_bytes == 0


def test_check_metadata_reaches_the_groups_made_from_a_transport():
    """The metadata check switched on a world whose topology was built before (a script that
    read the topology first, a second engine) reaches the topology's groups and their own
    topologies, both ways."""
    for rank, nodes in ((0, [0, 0, 1, 1]), (2, [0, 0, 1, 1]), (1, [0, 1])):
        world = _FakeTransport(rank, nodes)
        topo = topology_of(world)
        below = topology_of(topo.inter)
        groups = (topo.intra, topo.inter, below.intra, below.inter)
        assert all(g.check_metadata for g in groups)
        world.check_metadata = False
        assert not any(g.check_metadata for g in groups), [g.check_metadata for g in groups]
        world.check_metadata = True
        assert all(g.check_metadata for g in groups)
        # a group made now takes the world's setting
        world.check_metadata = False
        assert not world.subgroup(range(len(nodes))).check_metadata


# ---------------------------------------------------------------------- registry
def test_get_transport_unknown_name_lists_choices():
    with pytest.raises(ValueError) as info:
        get_transport("nccl2")
    assert "'mpi'" in str(info.value) and "'torch'" in str(info.value)


def test_get_transport_name_from_env(monkeypatch):
    made = []
    monkeypatch.setitem(registry._REGISTRY, "torch", lambda **kw: made.append(("torch", kw)) or "T")
    register_transport("fake", lambda **kw: made.append(("fake", kw)) or "F")
    try:
        monkeypatch.delenv("ZPP_COMM_BACKEND", raising=False)
        assert get_transport(timeout_s=3) == "T"  # default: torch
        monkeypatch.setenv("ZPP_COMM_BACKEND", "fake")
        assert get_transport() == "F"
        assert get_transport("torch") == "T"  # the argument beats the environment
        monkeypatch.setenv("ZPP_COMM_BACKEND", "nope")
        with pytest.raises(ValueError, match=r"ZPP_COMM_BACKEND.*'mpi'.*'torch'"):
            get_transport()
    finally:
        registry._REGISTRY.pop("fake", None)
    assert made == [("torch", {"timeout_s": 3}), ("fake", {}), ("torch", {})]
    with pytest.raises(TypeError):
        register_transport("bad", 42)


# ---------------------------------------------------------------------- real groups
def _topology_world(t: Transport, per_node: int) -> dict:
    topo = topology_of(t)
    if topology_of(t) is not topo:
        raise AssertionError("topology_of did not cache")
    n, r = t.world_size, t.rank
    report = {
        "numbers": (topo.rank, topo.world_size, topo.nodes, topo.ranks_per_node, topo.node, topo.local_rank),
        "intra": (topo.intra.ranks, topo.intra.nodes, topo.intra.rank),
        "inter": (topo.inter.ranks, topo.inter.nodes, topo.inter.rank),
    }
    # the groups carry traffic among their members only, and book it at the right level
    for name, sub in (("intra", topo.intra), ("inter", topo.inter)):
        t.counters.reset()
        x = torch.tensor([float(r)] * 3)
        out = torch.empty(3 * sub.world_size)
        sub.all_gather(out, x)
        want = torch.tensor(sub.ranks, dtype=torch.float32).repeat_interleave(3)
        if not torch.equal(out, want):
            raise AssertionError(f"{name} all_gather: {out.tolist()} want {want.tolist()}")
        y = torch.tensor([float(r)])
        sub.all_reduce(y)
        if y.item() != float(sum(sub.ranks)):
            raise AssertionError(f"{name} all_reduce: {y.item()} want {sum(sub.ranks)}")
        s = t.counters.snapshot()  # sub-transports share the world's counters
        report[name + "_wire"] = (s["all_gather"].intra_bytes, s["all_gather"].inter_bytes) if s else (0, 0)
    # the world still works after the sub-groups were made
    z = torch.ones(2)
    t.all_reduce(z)
    if z.tolist() != [float(n)] * 2:
        raise AssertionError(f"world all_reduce after subgroups: {z.tolist()}")
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend,world_size,per_node",
    [
        pytest.param(*BACKENDS[0].values, 4, 2, id="torch-2x2"),
        pytest.param(*BACKENDS[1].values, 4, 2, marks=BACKENDS[1].marks, id="mpi-2x2"),
        # one node (intra = world, one-rank inter groups); torch only: an MPI world costs
        # seconds of start-up, and the bookkeeping is the same (see test_topology_groups)
        pytest.param(*BACKENDS[0].values, 2, None, id="torch-1x2"),
    ],
)
def test_topology_real_groups(backend, world_size, per_node):
    per = per_node or world_size
    reports = run_world(_topology_world, world_size, backend=backend, ranks_per_node=per_node, args=(per,), timeout=90)
    nodes = world_size // per
    for rank, rep in enumerate(reports):
        node, local = rank // per, rank % per
        assert rep["numbers"] == (rank, world_size, nodes, per, node, local)
        assert rep["intra"] == (tuple(range(node * per, node * per + per)), (node,) * per, local)
        assert rep["inter"] == (tuple(range(local, world_size, per)), tuple(range(nodes)), node)
        # 12 bytes to each peer: all intra peers are on this node, all inter peers are not
        assert rep["intra_wire"] == (12 * (per - 1), 0)
        assert rep["inter_wire"] == (0, 12 * (nodes - 1))


def _never_called(t: Transport) -> None:
    raise AssertionError("the transport should not have been made")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ranks_per_node_fails_on_every_rank(backend):
    results = run_world(_never_called, 4, backend=backend, ranks_per_node=3, timeout=90, return_exceptions=True)
    for rank, exc in enumerate(results):
        assert isinstance(exc, ValueError), (rank, exc)
        assert "ranks_per_node=3" in str(exc) and "world_size=4" in str(exc), str(exc)
