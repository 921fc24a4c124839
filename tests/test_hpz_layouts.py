"""hpZ's secondary shards in both layouts (zpp/zero/gather/hpz.py, [Note: which entries a
secondary shard holds]) on worlds where the node count and the ranks per node differ (3 x 2
and 2 x 3 spawned gloo ranks): a slice kept from a full buffer gathers back to that buffer
over the node, the counterparts slice holds exactly the primary shards of the ranks with this
local rank (node order) and the rank's own shard is the view ``own`` gives, and the node's
gather of counterpart slices is one call per node."""
import pytest
import torch

from tests.dist import run_world
from zpp.comm.topology import topology_of
from zpp.zero.gather.hpz import Secondaries

SHARD = 5  # entries of one rank's primary shard


class _Flat:  # the store keys its slices by the object only
    pass


def _layouts(t):
    topo = topology_of(t)
    k, nodes = topo.ranks_per_node, topo.nodes
    full = torch.arange(t.world_size * SHARD, dtype=torch.float32) * 10 + 1  # rank r's shard: [r * SHARD, ...)
    out = {}
    for counterparts in (False, True):
        store = Secondaries(topo, counterparts=counterparts)
        flat = _Flat()
        store.keep(flat, full)
        held = store.held(flat)
        t.counters.reset()
        back = torch.zeros_like(full)
        store.gather_async(back, held).wait()
        calls = t.counters.snapshot()["all_gather"].calls
        own = store.own(held).clone() if counterparts else None
        out[counterparts] = dict(held=held.clone(), back=back, calls=calls, own=own)
    return dict(full=full, k=k, nodes=nodes, node=topo.node, local=topo.local_rank, rank=t.rank, layouts=out)


@pytest.mark.parametrize("ranks_per_node", [2, 3])
@pytest.mark.timeout(90)
def test_both_layouts_gather_back_and_hold_what_they_say(ranks_per_node):
    for r in run_world(_layouts, 6, ranks_per_node=ranks_per_node, timeout=75):
        full, k, nodes, local, rank = r["full"], r["k"], r["nodes"], r["local"], r["rank"]
        shards = full.view(-1, SHARD)
        plain, mine = r["layouts"][False], r["layouts"][True]
        for lay in (plain, mine):
            assert torch.equal(lay["back"], full), (rank, lay)
            assert lay["held"].numel() == full.numel() // k
        # contiguous: the local rank's k-th of the buffer, gathered in one call
        assert torch.equal(plain["held"], full.view(k, -1)[local]) and plain["calls"] == 1
        # counterparts: the shards of ranks m * k + local, node order, one call per node
        assert torch.equal(mine["held"], torch.cat([shards[m * k + local] for m in range(nodes)]))
        assert mine["calls"] == nodes
        assert torch.equal(mine["own"], shards[rank])
