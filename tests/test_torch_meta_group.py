"""The metadata check runs on a process group of its own on gloo ([Note: metadata checks on
gloo] in zpp/comm/torch_backend.py), on a real 2-rank gloo world.

* A check does not wait for the collectives started before it on the same transport: rank 0
  starts an all-gather and then checks, while rank 1 checks before it joins the all-gather
  (so the all-gather cannot finish before both checks have). With the companion group both
  return; on the transport's own group (companion dropped) rank 0's check sits behind the
  unfinished all-gather and the world times out.
* Which transports hold one: the world, its sub-groups and duplicates while the check is on;
  none made while it is off; each is freed with the transport's groups.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_world
from zpp.comm.topology import topology_of


def _check_beside_a_started_gather(t, drop: bool):
    if drop:
        t._companions.meta = None
    out = torch.empty(2 * 1000)
    mine = torch.full((1000,), float(t.rank))
    # neither all-gather checks (the ranks' checks and gathers come in different orders)
    if t.rank == 0:
        t.check_metadata = False
        work = t.all_gather_async(out, mine)
        t.check_metadata = True
        t.check_agree("beside", [1])
    else:
        t.check_agree("beside", [1])
        t.check_metadata = False
        work = t.all_gather_async(out, mine)
    work.wait()
    return out.view(2, -1)[:, 0].tolist()


@pytest.mark.timeout(90)
def test_a_check_does_not_wait_for_a_started_gather():
    assert run_world(_check_beside_a_started_gather, 2, args=(False,), timeout=60,
                     transport_kwargs={"timeout_s": 20}) == [[0.0, 1.0]] * 2
    out = run_world(_check_beside_a_started_gather, 2, args=(True,), timeout=60,
                    transport_kwargs={"timeout_s": 4}, return_exceptions=True)
    assert isinstance(out[0], (TimeoutError, ConnectionError)), out


def _holders(t):
    topo = topology_of(t)
    dup = t.duplicate()
    on = [x._companions.meta is not None for x in (t, topo.intra, topo.inter, dup)]
    groups = len(dup.process_groups())
    t.check_metadata = False
    off = t.duplicate()
    off_meta = off._companions.meta is not None
    dup.free()
    off.free()
    return {"on": on, "dup_groups": groups, "off": off_meta, "freed": dup._companions.meta is None}


@pytest.mark.timeout(90)
def test_which_transports_hold_a_metadata_group():
    for r in run_world(_holders, 4, ranks_per_node=2, timeout=60):
        assert r["on"] == [True, True, True, True] and r["dup_groups"] == 3, r  # group, reverse, meta
        assert not r["off"] and r["freed"], r
