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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import runinfo  # noqa: E402
import trainlib  # noqa: E402

# variant -> (optimizer type, its params less lr/freeze); None: torch DDP with torch AdamW
VARIANTS = {
    "ddp-adamw": None,
    "zero0-adamw": ("AdamW", {}),
    "onebitadam": ("OneBitAdam", {}),
    "zerooneadam": ("ZeroOneAdam", {"var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}),
    "onebitlamb": ("OneBitLamb", {}),
}
_FREEZE = {"OneBitAdam": "freeze_step", "OneBitLamb": "freeze_step", "ZeroOneAdam": "var_freeze_step"}


def _run_variant(t, name, args, data):
    import zpp.zero as zz

    model = trainlib.make_model(args)
    psi = sum(p.numel() for p in model.parameters())
    engine = None
    if VARIANTS[name] is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model) if t.world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

        def opt_step():
            opt.step()
            opt.zero_grad()
        backward = lambda loss: loss.backward()  # noqa: E731 - DDP's all-reduce runs in here
    else:
        kind, extra = VARIANTS[name]
        params = {"lr": args.lr, **extra}
        if kind in _FREEZE:
            params[_FREEZE[kind]] = args.warmup
        cfg = {"optimizer": {"type": kind, "params": params}, "zero_optimization": {"stage": 0},
               "zpp": {"check_metadata": False}}
        engine, opt, *_ = zz.initialize(model=model, config=cfg, transport=t)
        net, backward, opt_step = engine, engine.backward, engine.step
    measured, snap = trainlib.timed_steps(t, args, data, net, backward, opt_step)
    row = {"variant": name, "params": psi, **measured}
    if engine is not None:
        row["inter_bytes"], row["intra_bytes"] = trainlib.counted_per_step(snap, args.steps)
        row["bytes_source"] = "counters"
        if kind in _FREEZE:
            assert opt.step_count > args.warmup, "measured steps must be in the compression stage"
        engine.close()
    else:
        row["inter_bytes"], row["intra_bytes"] = trainlib.modelled_bytes("ddp", psi, t)
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
        eth = trainlib.fmt_eth(r, "eth_tx_bytes_per_node")
        rt = trainlib.fmt_eth(r, "tcp_retrans_per_node")
        print(f"{r['variant']:<14}{r['step_s']:>9.3f}{r['fwd_bwd_s']:>10.3f}{r['opt_s']:>8.3f}"
              f"{r['inter_bytes']:>14.0f}{eth:>30}{rt:>20}{r['loss']:>8.3f}{mark}")


def _rank_main(t, args):
    from zpp.comm.topology import topology_of

    per_node = topology_of(t).ranks_per_node
    rows = bench(t, args)
    if t.rank == 0:
        _print(rows, args, t.world_size, per_node)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**runinfo.provenance(), "rows": rows}, f, indent=1)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=4, n_embd=256, block=128, batch=4, steps=5, warmup=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="ddp-adamw,zero0-adamw,onebitadam",
                   help="comma-separated, from " + ", ".join(VARIANTS) + " (--warmup is also the freeze step)")
    args = p.parse_args(argv)
    trainlib.parse_variants(p, args, VARIANTS)
    trainlib.launch(_rank_main, args)


if __name__ == "__main__":
    main()
