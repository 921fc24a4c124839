"""1-bit optimizers (zpp.optim) against their uncompressed counterparts on a small GPT.

    python perf/onebit_bench.py                          # alone: spawns 4 gloo ranks, 2 nodes x 2
    python perf/onebit_bench.py --world 2 --ranks-per-node 1 --steps 20 --json out.json
    mpiexec -n 4 python perf/onebit_bench.py --backend mpi
    torchrun --nproc-per-node 4 perf/onebit_bench.py

Each variant trains the GPT of tests/gpt.py on the stdlib character corpus (every rank its
own batches): ``--warmup`` full-precision steps (the optimizers' warm-up: ``freeze_step`` /
``var_freeze_step``), then ``--steps`` measured steps in the compression stage. Rank 0
prints one line per variant:

    variant  step_s  wire_B/step  inter_B/step  ratio  loss

``wire_B/step`` and ``inter_B/step`` are this rank's sent bytes per measured step from the
transport's wire counters (direct-exchange model, [Note: what is counted] in
zpp/comm/counters.py); ``ratio`` is the baseline's wire bytes over the variant's. The
baselines ("adamw", "lamb") average the gradients with one fp32 all-reduce per step; "lamb"
is OneBitLamb that never leaves its warm-up. ``loss`` is the mean training loss of the
measured steps, on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

VARIANTS = ("adamw", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb")
BASELINE = {"adamw": "adamw", "onebit_adam": "adamw", "zero_one_adam": "adamw", "lamb": "lamb", "onebit_lamb": "lamb"}


def _optimizer(name, params, t, args):
    import zpp.optim as zo

    lr = args.lr
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if name == "onebit_adam":
        return zo.OneBitAdam(params, lr=lr, freeze_step=args.warmup, transport=t)
    if name == "zero_one_adam":
        return zo.ZeroOneAdam(params, lr=lr, var_freeze_step=args.warmup, transport=t)
    freeze = args.warmup if name == "onebit_lamb" else args.warmup + args.steps + 1
    return zo.OneBitLamb(params, lr=lr, freeze_step=freeze, transport=t)


def _run_variant(t, name, args, data):
    from tests.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block))
    params = list(model.parameters())
    opt = _optimizer(name, params, t, args)
    plain = name == "adamw"
    flat = torch.empty(sum(p.numel() for p in params)) if plain else None
    gen = torch.Generator().manual_seed(1 + t.rank)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t.barrier()
            t.counters.reset()
        start = time.perf_counter()
        x, y = data.batch(args.batch, args.block, gen)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if plain:  # fp32 mean of the gradients, as DDP would
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            t.all_reduce(flat, op="mean")
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
    total = t.counters.total()
    return {
        "variant": name,
        "params": len(flat) if plain else opt.flat.numel,
        "step_s": statistics.median(times),
        "wire_bytes": total.wire_bytes / args.steps,
        "inter_bytes": total.inter_bytes / args.steps,
        "loss": statistics.fmean(losses),
    }


def bench(t, args):
    from tests.gpt import CharCorpus

    t.check_metadata = False
    data = CharCorpus(max_bytes=2_000_000)
    rows = [_run_variant(t, name, args, data) for name in args.variants]
    by_name = {r["variant"]: r for r in rows}
    for r in rows:
        base = by_name.get(BASELINE[r["variant"]])
        r["ratio"] = base["wire_bytes"] / r["wire_bytes"] if base and r["wire_bytes"] else None
    return rows


def _print(rows, args, t):
    print(f"# onebit_bench: world={t.world_size} backend={t.name} GPT n_layer={args.n_layer} "
          f"n_embd={args.n_embd} ({rows[0]['params']} params) warmup={args.warmup} steps={args.steps} "
          f"batch={args.batch}x{args.block}")
    print(f"{'variant':<15}{'step_s':>9}{'wire_B/step':>13}{'inter_B/step':>14}{'ratio':>8}{'loss':>8}")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}"
        print(f"{r['variant']:<15}{r['step_s']:>9.4f}{r['wire_bytes']:>13.0f}{r['inter_bytes']:>14.0f}"
              f"{ratio:>8}{r['loss']:>8.3f}")


def _rank_main(backend, args):
    from zpp.comm.registry import get_transport

    t = get_transport(backend)
    rows = bench(t, args)
    if t.rank == 0:
        _print(rows, args, t)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="ranks to spawn when started alone")
    p.add_argument("--ranks-per-node", type=int, default=2, help="emulated nodes when started alone")
    p.add_argument("--backend", choices=("torch", "mpi"), default=None,
                   help="transport (Default: mpi under mpiexec, else torch)")
    p.add_argument("--warmup", type=int, default=10, help="full-precision steps before compression")
    p.add_argument("--steps", type=int, default=20, help="measured steps in the compression stage")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if args.warmup < 1 or args.steps < 1:
        p.error(f"--warmup={args.warmup} and --steps={args.steps} must be >= 1")

    from zpp.bench import launch

    where = launch.detect()
    if where.kind == "alone":
        if args.world % args.ranks_per_node:
            p.error(f"--world={args.world} is not a multiple of --ranks-per-node={args.ranks_per_node}")
        return launch.spawn(_rank_main, (args.backend or "torch", args), nprocs=args.world,
                            ranks_per_node=args.ranks_per_node, timeout=args.timeout)
    backend = args.backend or ("mpi" if where.kind == "mpi" else "torch")
    if where.kind == "mpi" and backend == "torch":
        launch.torch_env_from_mpi(where)
    return _rank_main(backend, args)


if __name__ == "__main__":
    sys.exit(main())
