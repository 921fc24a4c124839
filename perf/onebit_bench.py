"""1-bit optimizers (zpp.optim) against their uncompressed counterparts on a small GPT.

    python perf/onebit_bench.py                          # alone: spawns 4 gloo ranks, 2 nodes x 2
    python perf/onebit_bench.py --world 2 --ranks-per-node 1 --steps 20 --json out.json
    mpiexec -n 4 python perf/onebit_bench.py --backend mpi
    torchrun --nproc-per-node 4 perf/onebit_bench.py
    python perf/onebit_bench.py --allreduce 16M,64M                   # OneBitAllReduce calls, 4 ranks
    python perf/onebit_bench.py --allreduce 16M --world 1 --ranks-per-node 1 --threads 1

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

``--allreduce SIZES`` times :class:`~zpp.comm.onebit.OneBitAllReduce` itself instead (sizes in
fp32 elements, K/M = Ki/Mi): ``--warmup-calls`` calls, then ``--iters`` timed calls, and the
same number of plain fp32 ``all_reduce(mean)`` calls and ``copy_`` of the tensor (memcpy) in
the same run. ``call_ms`` is the max over ranks of each rank's median; a second, profiled set
of calls splits rank 0's time over the kernels, the transport calls and the rest (framing
copies, Python), with each kernel's modelled memory traffic and the bandwidth it reached
(traffic / time) next to memcpy's (read + write bytes / time):

    part  ms  share  traffic_MB  GB/s
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


_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _elements(text: str) -> int:
    text = text.strip().upper()
    mult = _SUFFIX.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def _traffic(ob, es: int) -> dict[str, float]:
    """Modelled bytes each kernel reads plus writes for one call ([Note: 1-bit all-reduce]):
    the lazy compress reads x (the server: the average) and the buffer, writes the buffer
    and the signs; the weighted sum reads W chunks of signs and writes the average; the
    decode reads all signs and writes x."""
    n, P, c = ob.numel, ob.padded, ob.chunk
    return {
        "compress(worker)": es * n + 8 * P + P / 8,
        "weighted_sum": P / 8 + 4 * c,
        "compress(server)": 12 * c + c / 8,
        "unpack": P / 8 + es * n,
    }


def _median_ms(times):
    return 1e3 * statistics.median(times)


def _allreduce_bench(t, args):
    """Per-call times of OneBitAllReduce, plain all_reduce and memcpy, and rank 0's profile."""
    from zpp.comm.onebit import OneBitAllReduce
    from zpp.quant import cpu

    t.check_metadata = False  # as a running job would: see [Note: metadata check]
    rows = []
    for n in args.allreduce:
        gen = torch.Generator().manual_seed(t.rank)
        x0 = torch.randn(n, generator=gen)
        x = x0.clone()
        ob = OneBitAllReduce(n, t)

        def timed(fn, reps):
            out = []
            for _ in range(reps):
                t.barrier()
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
            return out

        for _ in range(args.warmup_calls):
            ob(x.copy_(x0))
        one = timed(lambda: ob(x), args.iters)
        plain = timed(lambda: t.all_reduce(x, op="mean"), args.iters)
        y = torch.empty_like(x)
        copy = timed(lambda: y.copy_(x0), args.iters)
        # profile: wrap the kernels and the transport calls, then call again
        parts: dict[str, float] = {}
        seen: dict[str, int] = {}

        def wrap(name, fn):
            def inner(*a, **k):
                count = seen[name] = seen.get(name, 0) + 1
                label = name if name != "onebit_compress" else ("compress(worker)" if count == 1 else "compress(server)")
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts[label] = parts.get(label, 0.0) + time.perf_counter() - start
            return inner

        K = cpu.kernels()
        names = ("onebit_compress", "signs_weighted_sum", "unpack_scaled")
        for name in names:
            setattr(K, name, wrap(name, getattr(K, name)))
        for name in ("all_to_all", "all_gather", "check_agree"):
            setattr(t, name, wrap(name, getattr(t, name)))
        total = 0.0
        try:
            for _ in range(args.iters):
                t.barrier()
                seen.clear()
                start = time.perf_counter()
                ob(x)
                total += time.perf_counter() - start
        finally:
            for name in names:
                delattr(K, name)
            for name in ("all_to_all", "all_gather", "check_agree"):
                delattr(t, name)
        mine = torch.tensor([_median_ms(one), _median_ms(plain), _median_ms(copy), 1e3 * min(one)],
                            dtype=torch.float64)
        everyone = torch.empty(t.world_size * 4, dtype=torch.float64)
        t.all_gather(everyone, mine)
        worst = everyone.view(t.world_size, 4).amax(0).tolist()
        per = {k.replace("signs_weighted_sum", "weighted_sum").replace("unpack_scaled", "unpack"):
               1e3 * v / args.iters for k, v in parts.items()}
        per["other"] = 1e3 * total / args.iters - sum(per.values())
        rows.append({"numel": n, "onebit_ms": worst[0], "plain_ms": worst[1], "memcpy_ms": worst[2], "onebit_min_ms": worst[3],
                     "memcpy_GBps": 8 * n / worst[2] / 1e6, "profile_ms": per,
                     "traffic_B": _traffic(ob, 4), "wire_B": ob.padded // 8})
        del ob, x, y, x0
    return rows


def _print_allreduce(rows, args, t):
    import zpp

    print(f"# onebit_bench --allreduce: world={t.world_size} backend={t.name} "
          f"threads/rank={torch.get_num_threads()} iters={args.iters} (max over ranks of medians; "
          f"min: of each rank's fastest call) zpp={os.path.dirname(zpp.__file__)}")
    for r in rows:
        n = r["numel"]
        print(f"numel {n} ({n >> 20} Mi fp32): onebit {r['onebit_ms']:.2f} ms (min "
              f"{r['onebit_min_ms']:.2f})  plain all_reduce "
              f"{r['plain_ms']:.2f} ms  memcpy {r['memcpy_ms']:.2f} ms ({r['memcpy_GBps']:.1f} GB/s r+w)")
        total = sum(r["profile_ms"].values())
        print(f"  {'part':<18}{'ms':>9}{'share':>7}{'traffic_MB':>12}{'GB/s':>7}")
        for name, ms in sorted(r["profile_ms"].items(), key=lambda kv: -kv[1]):
            tb = r["traffic_B"].get(name)
            extra = f"{tb / 1e6:>12.1f}{tb / ms / 1e6:>7.1f}" if tb and ms > 0 else ""
            print(f"  {name:<18}{ms:>9.2f}{ms / total:>7.1%}{extra}")


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
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = _allreduce_bench(t, args) if args.allreduce else bench(t, args)
    if t.rank == 0:
        (_print_allreduce if args.allreduce else _print)(rows, args, t)
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
    p.add_argument("--allreduce", default=None,
                   help="time OneBitAllReduce on these sizes instead (fp32 elements, e.g. 16M,64M)")
    p.add_argument("--iters", type=int, default=5, help="--allreduce: timed calls per size")
    p.add_argument("--warmup-calls", type=int, default=2, help="--allreduce: untimed calls first")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (Default: as launched)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if args.allreduce is not None:
        try:
            args.allreduce = [_elements(v) for v in args.allreduce.split(",") if v.strip()]
        except ValueError:
            p.error(f"--allreduce={args.allreduce!r}: expected sizes like 16M,64M")
        if not args.allreduce or min(args.allreduce) < 1 or args.iters < 1:
            p.error(f"--allreduce sizes and --iters={args.iters} must be positive")
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
