"""1-bit optimizer training-step benchmark: zpp.initialize with OneBitAdam (and the other
1-bit optimizers) in their compression stage vs plain data parallel with AdamW.

    zpp cluster up --nodes 2 --rate 100mbit
    zpp cluster run --nodes 2 --ranks-per-node 2 --backend torch -- python perf/onebit_train_bench.py
    zpp cluster down
    python perf/onebit_train_bench.py --world 4 --ranks-per-node 2     # spawns ranks on one host

For each variant: a GPT from tests/gpt.py on the stdlib character corpus, ``--warmup``
steps, then ``--steps`` measured steps. The 1-bit optimizers get ``freeze_step`` (0/1 Adam:
``var_freeze_step``) equal to ``--warmup``, so every measured step is in the compression
stage. Rank 0 prints one line per variant:

    variant  step_s  fwd_bwd_s  opt_s  inter_B/step  eth_tx_B/step  tcp_retrans/step  loss

``step_s`` is rank 0's wall time per step; ``fwd_bwd_s`` and ``opt_s`` split it into forward
plus backward (DDP's gradient all-reduce included) and ``engine.step`` / ``optimizer.step``
(the 1-bit optimizers' compression and communication included).

* ``inter_B/step``: bytes this rank sends to other nodes per step, from the transport's
  wire counters (direct-exchange model, see zpp/comm/counters.py). ``ddp-adamw`` does not
  go through a zpp transport: its figure is that model applied to one fp32 all-reduce of
  the gradients, marked "(model)".
* ``eth_tx_B/step``: bytes actually sent on the node's ``zpp-eth`` interface (from the
  node namespace's /proc/net/dev, so frame headers included, and both ranks of the node
  together), node 0 and node 1; "-" outside ``zpp cluster``.
* ``tcp_retrans/step``: TCP segments the node retransmitted per step (/proc/net/snmp):
  packets dropped at the shaped link are sent again and counted in eth_tx again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

# variant -> (optimizer type, its params less lr/freeze); None: torch DDP with torch AdamW
VARIANTS = {
    "ddp-adamw": None,
    "zero0-adamw": ("AdamW", {}),
    "onebitadam": ("OneBitAdam", {}),
    "zerooneadam": ("ZeroOneAdam", {"var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}),
    "onebitlamb": ("OneBitLamb", {}),
}
_FREEZE = {"OneBitAdam": "freeze_step", "OneBitLamb": "freeze_step", "ZeroOneAdam": "var_freeze_step"}


def _eth_bytes(dev: str = "zpp-eth") -> tuple[int, int, int] | None:
    """(tx bytes, tx packets, TCP segments retransmitted) of ``dev`` and of TCP in this
    process's network namespace, or None outside one that has ``dev``."""
    try:
        with open("/proc/net/dev") as f:
            rows = [rest.split() for name, _, rest in (line.partition(":") for line in f) if name.strip() == dev]
        with open("/proc/net/snmp") as f:
            tcp = [line.split()[1:] for line in f if line.startswith("Tcp:")]
    except OSError:
        return None
    if not rows or len(tcp) < 2:
        return None
    retrans = int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
    return int(rows[0][8]), int(rows[0][9]), retrans


def _run_variant(t, name, args, data):
    from perf.train_bench import _modelled_bytes
    from tests.gpt import GPT, GPTConfig
    import zpp.zero as zz

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))
    psi = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(t.rank)
    engine = None
    if VARIANTS[name] is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model) if t.world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        kind, extra = VARIANTS[name]
        params = {"lr": args.lr, **extra}
        if kind in _FREEZE:
            params[_FREEZE[kind]] = args.warmup
        cfg = {"optimizer": {"type": kind, "params": params}, "zero_optimization": {"stage": 0},
               "zpp": {"check_metadata": False}}
        engine, opt, *_ = zz.initialize(model=model, config=cfg, transport=t)
        net = engine

    split = [0.0, 0.0]  # seconds in forward+backward, in the optimizer step

    def step():
        x, y = data.batch(args.batch, args.block, g)
        t0 = time.perf_counter()
        loss = net(x, y)
        if engine is not None:
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
        else:
            loss.backward()  # DDP: the gradient all-reduce runs in here
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
        split[0] += t1 - t0
        split[1] += time.perf_counter() - t1
        return loss.item()

    for _ in range(args.warmup):
        step()
    t.counters.reset()
    t.barrier()
    split[:] = [0.0, 0.0]
    eth0 = _eth_bytes()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    t.barrier()
    dt = (time.perf_counter() - t0) / args.steps
    eth1 = _eth_bytes()
    snap = t.counters.snapshot()  # before the exchange of the interface counters below
    # every rank's namespace counters (a node's ranks share one): rank 0 reports them per node
    eth = torch.full((3,), -1.0, dtype=torch.float64)
    if eth0 is not None and eth1 is not None:
        eth = torch.tensor([b - a for a, b in zip(eth0, eth1)], dtype=torch.float64) / args.steps
    every = torch.empty(3 * t.world_size, dtype=torch.float64)
    t.all_gather(every, eth)
    every = every.view(t.world_size, 3)
    first_of_node = {}
    for r, n in enumerate(t.nodes):
        first_of_node.setdefault(n, r)
    nodes = [every[r].tolist() for _, r in sorted(first_of_node.items())]
    row = {"variant": name, "params": psi, "step_s": dt, "fwd_bwd_s": split[0] / args.steps,
           "opt_step_s": split[1] / args.steps, "loss": loss}
    if min(min(n) for n in nodes) >= 0:
        row["eth_tx_bytes_per_node"] = [n[0] for n in nodes]
        row["eth_tx_packets_per_node"] = [n[1] for n in nodes]
        row["tcp_retrans_per_node"] = [n[2] for n in nodes]
    if engine is not None:
        row["inter_bytes"] = sum(s.inter_bytes for s in snap.values()) / args.steps
        row["intra_bytes"] = sum(s.intra_bytes for s in snap.values()) / args.steps
        row["bytes_source"] = "counters"
        if kind in _FREEZE:
            assert opt.step_count > args.warmup, "measured steps must be in the compression stage"
        engine.close()
    else:
        row["inter_bytes"], row["intra_bytes"] = _modelled_bytes("ddp", psi, t)
        row["bytes_source"] = "model"
    return row


def bench(t, args):
    from tests.gpt import CharCorpus

    data = CharCorpus(max_bytes=2_000_000)
    return [_run_variant(t, name, args, data) for name in args.variants]


def _print(rows, args, world, per_node):
    print(f"# onebit_train_bench: world={world} ranks_per_node={per_node} warmup={args.warmup} "
          f"steps={args.steps} GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block} "
          f"batch={args.batch} params={rows[0]['params'] if rows else '?'}")
    print(f"{'variant':<14}{'step_s':>9}{'fwd_bwd_s':>10}{'opt_s':>8}{'inter_B/step':>14}"
          f"{'eth_tx_B/step (node 0, 1)':>30}{'tcp_retrans/step':>20}{'loss':>8}")
    for r in rows:
        mark = "" if r["bytes_source"] == "counters" else " (model)"
        eth = ", ".join(f"{b:.0f}" for b in r["eth_tx_bytes_per_node"]) if "eth_tx_bytes_per_node" in r else "-"
        rt = ", ".join(f"{b:.0f}" for b in r["tcp_retrans_per_node"]) if "tcp_retrans_per_node" in r else "-"
        print(f"{r['variant']:<14}{r['step_s']:>9.3f}{r['fwd_bwd_s']:>10.3f}{r['opt_step_s']:>8.3f}"
              f"{r['inter_bytes']:>14.0f}{eth:>30}{rt:>20}{r['loss']:>8.3f}{mark}")


def _rank_main(t, args):
    from zpp.comm.topology import topology_of

    per_node = topology_of(t).ranks_per_node
    rows = bench(t, args)
    if t.rank == 0:
        _print(rows, args, t.world_size, per_node)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


def _spawned(rank, world, per_node, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      ZPP_RANKS_PER_NODE=str(per_node))
    torch.set_num_threads(1)
    from zpp.comm.registry import get_transport

    _rank_main(get_transport("torch"), args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="ranks to spawn when not under a launcher")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="also the 1-bit optimizers' freeze step")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="ddp-adamw,zero0-adamw,onebitadam")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if "RANK" in os.environ:
        torch.set_num_threads(1)
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
