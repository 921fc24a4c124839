"""Training-step benchmark: zpp ZeRO stages and ZeRO++ switches vs torch DDP and FSDP2.

    python perf/train_bench.py --world 4 --ranks-per-node 2 --steps 6       # spawns ranks
    torchrun --nnodes 2 --nproc-per-node 2 ... perf/train_bench.py --steps 6 # one per rank
    python perf/train_bench.py --variants zero3,zero3-zeropp --json out.json

For each variant: a GPT from tests/gpt.py on the stdlib character corpus, ``--warmup``
steps, then ``--steps`` measured steps. Rank 0 prints one line per variant:

    variant  step_s  inter_B/step  intra_B/step  model_state_B  peak_rss_MiB  loss

Bytes: zpp variants read the transport's wire counters (direct-exchange model, see
[Note: what is counted] in zpp/comm/counters.py), per rank. DDP and FSDP2 do not go through
a zpp transport; their bytes are the same model applied to what they send (DDP: one
all-reduce of the gradients; FSDP2: forward and backward all-gather plus a reduce-scatter of
every block and the root) and are marked "(model)". Peak RSS is the process maximum so far,
so variants run in the given order and later ones cannot report less than earlier ones:
run one variant per invocation to compare memory.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

VARIANTS = {
    "ddp": None, "fsdp2": None,
    "zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
    "zero3-qwz": {"stage": 3, "zero_quantized_weights": True},
    "zero3-hpz": {"stage": 3, "zero_hpz_partition_size": -1},  # -1: ranks per node
    "zero3-qgz": {"stage": 3, "zero_quantized_gradients": True},
    "zero3-zeropp": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": -1,
                     "zero_quantized_gradients": True},
}


def _model(args):
    from tests.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))


def _modelled_bytes(kind, psi, t):
    """Inter/intra bytes per rank per step under the direct-exchange model."""
    W, me = t.world_size, t.nodes[t.rank]
    inter_peers = sum(1 for n in t.nodes if n != me)
    intra_peers = W - 1 - inter_peers
    m = 4 * psi
    per_peer = 2 * m / W if kind == "ddp" else 3 * m / W  # all-reduce | 2 all-gathers + reduce-scatter
    return inter_peers * per_peer, intra_peers * per_peer


def _run_variant(t, name, args, data):
    from zpp.comm.topology import topology_of
    import zpp.zero as zz

    model = _model(args)
    psi = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(t.rank)
    engine = None
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model) if t.world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        net = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        z = dict(VARIANTS[name])
        if z.get("zero_hpz_partition_size") == -1:
            z["zero_hpz_partition_size"] = topology_of(t).ranks_per_node
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": z,
               "zpp": {"check_metadata": False, "unit_min_numel": args.unit_min_numel}}
        engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
        net = engine

    def step():
        x, y = data.batch(args.batch, args.block, g)
        loss = net(x, y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    for _ in range(args.warmup):
        step()
    t.counters.reset()
    t.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    t.barrier()
    dt = (time.perf_counter() - t0) / args.steps
    row = {"variant": name, "params": psi, "step_s": dt, "loss": loss,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if engine is not None:
        snap = t.counters.snapshot()
        row["inter_bytes"] = sum(s.inter_bytes for s in snap.values()) / args.steps
        row["intra_bytes"] = sum(s.intra_bytes for s in snap.values()) / args.steps
        row["model_state_bytes"] = sum(engine.model_state_bytes().values())
        row["bytes_source"] = "counters"
        engine.close()
    else:
        row["inter_bytes"], row["intra_bytes"] = _modelled_bytes(name, psi, t)
        row["bytes_source"] = "model"
        row["model_state_bytes"] = None
    return row


def bench(t, args):
    from tests.gpt import CharCorpus

    data = CharCorpus(max_bytes=2_000_000)
    rows = []
    for name in args.variants:
        try:
            rows.append(_run_variant(t, name, args, data))
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. FSDP2 on an old torch)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
    return rows


def _print(rows, args, world, per_node):
    print(f"# train_bench: world={world} ranks_per_node={per_node} steps={args.steps} "
          f"GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block} batch={args.batch}")
    print(f"{'variant':<14}{'step_s':>9}{'inter_B/step':>14}{'intra_B/step':>14}"
          f"{'state_B':>12}{'peak_MiB':>10}{'loss':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<14} failed: {r['error']}")
            continue
        mark = "" if r["bytes_source"] == "counters" else " (model)"
        state = "-" if r["model_state_bytes"] is None else f"{r['model_state_bytes']}"
        print(f"{r['variant']:<14}{r['step_s']:>9.3f}{r['inter_bytes']:>14.0f}{r['intra_bytes']:>14.0f}"
              f"{state:>12}{r['peak_rss_mib']:>10.0f}{r['loss']:>8.3f}{mark}")


def _rank_main(t, args):
    rows = bench(t, args)
    if t.rank == 0:
        _print(rows, args, t.world_size, topology_ranks(t))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


def topology_ranks(t):
    from zpp.comm.topology import topology_of

    return topology_of(t).ranks_per_node


def _spawned(rank, world, per_node, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      ZPP_RANKS_PER_NODE=str(per_node))
    torch.set_num_threads(1)
    from zpp.comm.registry import get_transport

    _rank_main(get_transport("torch"), args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="ranks to spawn when not under torchrun")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--unit-min-numel", type=int, default=100_000,
                   help="zpp stage 3 unit size (Default: one unit per block + root)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if "RANK" in os.environ:
        from zpp.comm.registry import get_transport

        _rank_main(get_transport("torch"), args)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, args.ranks_per_node, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
