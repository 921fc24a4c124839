"""DeepSpeed's ``deepspeed.comm`` functions on zpp (:mod:`zpp.comm.dist`) against computed
expectations, on 3 gloo ranks; ``zpp.init_distributed`` from an MPI launch is in
tests/test_faults.py (``test_init_distributed_under_mpiexec``)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as td

from tests.dist import run_world
from zpp.comm import dist


def _eq(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()} want {want.tolist()}")


def _api_world(t) -> dict:
    dist.init_distributed(verbose=False)  # the transport made the world: a no-op
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, n) == (t.rank, t.world_size) and dist.is_initialized()
    assert dist.get_local_rank() == r  # one node: LOCAL_RANK
    ranks = torch.arange(n, dtype=torch.float32)
    # all_reduce with DeepSpeed's and torch's op names, blocking and async
    x = torch.full((3,), float(r + 1))
    assert dist.all_reduce(x) is None
    _eq(x, torch.full((3,), float(n * (n + 1) // 2)), "all_reduce SUM")
    x = torch.full((3,), float(r))
    dist.all_reduce(x, op=td.ReduceOp.MAX)
    _eq(x, torch.full((3,), float(n - 1)), "all_reduce torch MAX")
    x = torch.full((4,), float(r + 1))
    work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)  # gloo has no AVG: sum, then / n in wait()
    work.wait()
    _eq(x, torch.full((4,), (n + 1) / 2), "all_reduce AVG async")
    x = torch.full((2,), float(r + 1))
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    _eq(x, torch.full((2,), (n + 1) / 2), "all_reduce AVG")
    with pytest.raises(TypeError, match="AVG of dtype torch.int64"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="op='sum'"):
        dist.all_reduce(torch.ones(2), op="sum")
    # broadcast, all_gather (list and into one tensor), reduce_scatter_tensor, reduce
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=n - 1)
    _eq(b, torch.full((2,), float(n - 1)), "broadcast")
    parts = [torch.empty(2) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(r)))
    _eq(torch.stack(parts), ranks[:, None].expand(n, 2), "all_gather")
    out = torch.empty(2 * n)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r)), async_op=True).wait()
    _eq(out, ranks.repeat_interleave(2), "all_gather_into_tensor")
    inp = torch.arange(2 * n, dtype=torch.float32) + r
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, inp)
    _eq(shard, n * torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + ranks.sum(), "reduce_scatter_tensor")
    dist.reduce_scatter_fn(shard, inp, op=dist.ReduceOp.AVG)
    _eq(shard, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + ranks.mean(), "reduce_scatter_fn AVG")
    y = torch.full((2,), float(r + 1))
    dist.reduce(y, dst=0)
    if r == 0:
        _eq(y, torch.full((2,), float(n * (n + 1) // 2)), "reduce")
    # groups: every rank enters new_group; ranks and global ranks of the members
    g = dist.new_group([0, n - 1])
    members = dist.get_all_ranks_from_group(g) if r in (0, n - 1) else None
    if r in (0, n - 1):
        assert members == [0, n - 1] and dist.get_global_rank(g, 1) == n - 1
        assert dist.get_world_size(g) == 2 and dist.get_rank(g) == (0 if r == 0 else 1)
        z = torch.ones(1)
        dist.all_reduce(z, group=g)
        _eq(z, torch.full((1,), 2.0), "all_reduce on a group")
    assert dist.get_global_rank(None, 2) == 2 and dist.get_world_group() is td.group.WORLD
    dist.barrier()
    # point to point, non-blocking
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(1)
    reqs = [dist.isend(torch.full((1,), float(r)), nxt), dist.irecv(got, prv)]
    for q in reqs:
        q.wait()
    _eq(got, torch.full((1,), float(prv)), "isend/irecv ring")
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    assert objs == [{"rank": k} for k in range(n)]
    return {"rank": r}


@pytest.mark.timeout(150)
def test_deepspeed_comm_functions():
    assert run_world(_api_world, 3, backend="torch", timeout=120) == [{"rank": k} for k in range(3)]
