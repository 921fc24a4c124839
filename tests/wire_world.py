"""Inside ``zpp cluster run``: every collective and one ZeRO++ training step, each in its own
window, with zpp's wire counters and the kernel's link counters read around it.

    zpp cluster run --nodes 2 --ranks-per-node 2 --backend torch -- python -m tests.wire_world OUT.json

Per window, on every rank: barrier, read the node link's counters, barrier, the case,
barrier, read again. zpp's inter-node bytes of the window come from the transport's
counters; the link bytes from :func:`zpp.cluster.linkstats.read_link` (the ranks of a node
share its namespace, so the node's first rank reports for it). The metadata check is off (its
few bytes per call are not booked by design); barriers are not booked either, which is why
``idle`` windows (barriers only) are measured too. Rank 0 writes one JSON document:
``{"backend", "nodes", "ranks_per_node", "windows": {case: {"counted": [per rank],
"link": [per node: tx_bytes, tx_packets, rx_bytes, rx_packets, retrans_segs]}}}``.
"""
from __future__ import annotations

import json
import sys

import torch

from zpp.cluster.linkstats import read_link
from zpp.comm.collectives import hierarchical_reduce_scatter, quantized_all_gather, quantized_reduce_scatter
from zpp.comm.onebit import OneBitAllReduce
from zpp.comm.registry import get_transport
from zpp.comm.topology import topology_of

N = 1 << 19  # fp32 elements per rank and call: 2 MiB
IDLE_WINDOWS = 3


def _cases(t, topo):
    W = t.world_size
    g = torch.Generator().manual_seed(t.rank)
    x = torch.randn(N, generator=g)
    gathered = torch.empty(W * N)
    slice_ = torch.empty(N // W)
    a2a = torch.empty(N)
    onebit = OneBitAllReduce(N, t)
    onebit(x.clone())  # first call sizes its buffers; the window times a steady one
    return {
        "all_gather": lambda: t.all_gather(gathered, x),
        "reduce_scatter": lambda: t.reduce_scatter(slice_, x, op="mean"),
        "all_reduce": lambda: t.all_reduce(x.clone(), op="mean"),
        "all_to_all": lambda: t.all_to_all(a2a, x),
        "qwZ_int8_all_gather": lambda: quantized_all_gather(gathered, x, transport=t, bits=8),
        "qwZ_int4_all_gather": lambda: quantized_all_gather(gathered, x, transport=t, bits=4),
        "qgZ_int4_reduce_scatter": lambda: quantized_reduce_scatter(slice_, x, topology=topo, bits=4),
        "two_hop_reduce_scatter": lambda: hierarchical_reduce_scatter(slice_, x, topology=topo),
        "onebit_all_reduce": lambda: onebit(x.clone()),
    }


def _engine(t):
    """Stage 3 with qwZ, hpZ and qgZ on a small GPT, after one untimed step."""
    import zpp
    from tests.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                              "zero_hpz_partition_size": topology_of(t).ranks_per_node,
                              "zero_quantized_gradients": True},
        "zpp": {"check_metadata": False, "unit_min_numel": 20_000},
    }
    engine, *_ = zpp.initialize(model=model, config=cfg, transport=t)
    g = torch.Generator().manual_seed(100 + t.rank)

    def step():
        x = torch.randint(0, 128, (4, 32), generator=g)
        engine.backward(engine(x, x))
        engine.step()

    step()
    return step


def _window(t, fn) -> tuple[float, list[int]]:
    t.counters.reset()
    t.barrier()
    before = read_link()
    t.barrier()
    fn()
    t.barrier()
    after = read_link()
    if before is None or after is None:
        raise SystemExit("tests.wire_world: no zpp-eth here; run it under `zpp cluster run`")
    return float(t.counters.total().inter_bytes), (after - before).as_list()


def main(out_path: str) -> int:
    torch.set_num_threads(1)
    t = get_transport()
    t.check_metadata = False
    topo = topology_of(t)
    cases = {f"idle{i}": (lambda: None) for i in range(IDLE_WINDOWS)}
    cases.update(_cases(t, topo))
    cases["zeropp_training_step"] = _engine(t)
    first_of_node = [r for r in range(t.world_size) if r == 0 or t.nodes[r] != t.nodes[r - 1]]
    windows = {}
    for name, fn in cases.items():
        counted, link = _window(t, fn)
        mine = torch.tensor([counted, *link], dtype=torch.float64)
        every = torch.empty(t.world_size * mine.numel(), dtype=torch.float64)
        t.all_gather(every, mine)
        rows = every.view(t.world_size, -1).tolist()
        windows[name] = {"counted": [r[0] for r in rows], "link": [[int(v) for v in rows[r][1:]] for r in first_of_node]}
    if t.rank == 0:
        doc = {"backend": t.name, "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
               "elements_per_rank": N, "windows": windows}
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
    t.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
