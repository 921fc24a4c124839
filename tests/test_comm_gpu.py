"""The collectives on CUDA tensors over NCCL. Skipped (not faked) without CUDA.

One GPU: a one-rank NCCL world runs every compressed collective on device tensors (the CUDA
quantization kernels and the NCCL code paths). Two or more GPUs: a world of one rank per GPU
checks values against the exact collectives, as tests/test_collectives.py does on CPU.
"""
import pytest
import torch

import zpp.quant as zq
from tests.dist import run_world
from zpp.comm.collectives import quantized_all_gather, quantized_reduce_scatter
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.topology import topology_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")


def _gpu_checks(t):
    dev = torch.device("cuda", torch.cuda.current_device())
    W = t.world_size
    g = torch.Generator(device=dev).manual_seed(t.rank)
    shard = torch.randn(5001, device=dev, generator=g)
    out = torch.full((W * 5001,), float("nan"), device=dev)
    quantized_all_gather(out, shard, transport=t, bits=8, group_size=256)
    mine = zq.dequantize(zq.quantize(shard, bits=8, group_size=256))
    ref = torch.empty(W * 5001, device=dev)
    t.all_gather(ref, mine)
    assert torch.equal(out, ref)
    inp = torch.randn(W * 4096, device=dev, generator=g)
    rs = torch.empty(4096, device=dev)
    quantized_reduce_scatter(rs, inp, topology=topology_of(t), bits=4, group_size=512)
    exact = inp.clone()
    t.all_reduce(exact, op="mean")
    mine = exact.view(W, -1)[t.rank]
    assert float((rs - mine).abs().max()) <= float(inp.abs().max()) * 2 / 14 + 1e-5
    ob = OneBitAllReduce(3000, t, device=dev)
    y = ob(torch.randn(3000, device=dev, generator=g))
    gathered = torch.empty(W * 3000, device=dev)
    t.all_gather(gathered, y)
    assert torch.equal(gathered.view(W, -1), y.expand(W, -1))
    return True


@pytest.mark.timeout(300)
def test_nccl_collectives():
    world = max(1, torch.cuda.device_count())
    results = run_world(_gpu_checks, world, backend="torch", timeout=240,
                        transport_kwargs={"backend": "nccl"})
    assert results == [True] * world
