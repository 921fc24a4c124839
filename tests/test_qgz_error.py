"""perf/qgz_error.py simulates qgZ's numerics with zpp.quant: its reduced gradient is the
plain-torch simulation that tests/test_collectives.py holds the real collective to, and its
error shrinks with the group size."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.perf_module import perf_module
from tests.test_collectives import _simulate_qgz


@pytest.fixture(scope="module")
def qe():
    with perf_module("qgz_error") as mod:
        yield mod


def _topo(rank, nodes, per_node):
    world = SimpleNamespace(world_size=nodes * per_node, rank=rank)
    return SimpleNamespace(world=world, ranks_per_node=per_node, nodes=nodes, node=rank // per_node,
                           local_rank=rank % per_node)


@pytest.mark.parametrize("bits, group", [(4, 128), (4, 2048), (8, 256)])
def test_simulation_is_the_collectives_reference(qe, bits, group):
    nodes, per_node = 2, 2
    W = nodes * per_node
    g = torch.Generator().manual_seed(bits + group)
    grads = torch.randn(W, W * 2 * group, generator=g) * torch.linspace(0.01, 3.0, W * 2 * group)
    mine = qe.simulate_qgz(grads, per_node, bits, group)
    s = grads.shape[1] // W
    for rank in range(W):  # the reference gives one rank's slice of the mean
        want = _simulate_qgz(grads, _topo(rank, nodes, per_node), bits, group)
        torch.testing.assert_close(mine[rank * s:(rank + 1) * s], want, rtol=0, atol=0)


def test_smaller_groups_err_less_on_uneven_scales(qe):
    g = torch.Generator().manual_seed(0)
    # rows of very different scales, as a model's gradients have
    grads = torch.randn(4, 64, 256, generator=g) * torch.logspace(-3, 0, 64).view(1, 64, 1)
    grads = grads.reshape(4, -1)
    exact = grads.mean(0)
    err = {G: float((qe.simulate_qgz(grads, 2, 4, G) - exact).norm() / exact.norm()) for G in (128, 2048)}
    assert err[128] < 0.75 * err[2048], err
