"""Peak memory per rank at ZeRO stage 3 on a large GPT, against the ZeRO formula.

    python perf/memory_bench.py                      # 4 local ranks, GPT 16 x 720 (~100M parameters)
    python perf/memory_bench.py --n-layer 8 --n-embd 512 --json perf/results/memory_bench.json

The model is built under ``zpp.zero.Init`` (no rank ever holds it whole), then trained for a
few stage-3 AdamW steps (fp32, every parameter sharded). Each rank reports the peak of its
resident memory over construction and training, above what it held before (Linux VmHWM,
reset through /proc/self/clear_refs; glibc is told to map large allocations on their own so
freed tensors leave the resident set), against:

* the ZeRO formula for fp32 Adam: ``16 Psi / N`` bytes (parameter shard 4, gradient shard 4,
  Adam moments 8; the fp32 master is the parameter shard itself);
* the live units: what the stage-3 hooks and prefetch hold gathered at once, bounded by the
  prefetch peak (``engine.prefetch_stats.peak_inflight_numel``) plus two units (the one
  computing and the one being released), 4 bytes an element;
* and the rest: activations of one micro-batch, temporaries, the allocator.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import runinfo  # noqa: E402
import trainlib  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _rank(t, args):  # (t, args): trainlib.run_rank calls it so
    import torch

    import zpp.zero as zz
    from tests.gpt import GPT, CharCorpus, GPTConfig

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: freed tensors leave RSS
    data = CharCorpus(max_bytes=2_000_000)
    t.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    torch.manual_seed(0)
    with zz.Init(transport=t):
        model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))
    built = _status("VmHWM") - base
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zpp": {"check_metadata": False}}
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    psi = sum(u.layout.numel for u in engine.units)
    g = torch.Generator().manual_seed(t.rank)
    for _ in range(args.steps):
        x, y = data.batch(args.batch, args.block, g)
        engine.backward(engine(x, y))
        engine.step()
    peak = _status("VmHWM") - base
    biggest = max(u.layout.padded_numel for u in engine.units)
    live = (engine.prefetch_stats.peak_inflight_numel + 2 * biggest) * 4
    held = engine.model_state_bytes()
    engine.close()
    row = {"rank": t.rank, "params": psi, "peak_bytes": peak, "construction_peak_bytes": built,
            "formula_bytes": 16 * psi // t.world_size, "live_units_bytes": live, "held_bytes": held,
            "units": len(engine.units), "biggest_unit_numel": biggest}
    with open(os.path.join(args.out_dir, f"rank{t.rank}.json"), "w") as f:
        json.dump(row, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=16, n_embd=720, block=128, batch=1, steps=3, warmup=0)
    args = p.parse_args(argv)
    args.n_head = 8 if args.n_embd % 8 == 0 else args.n_head
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args.out_dir = tmp
        trainlib.launch(_rank, args)
        rows = [json.loads(open(os.path.join(tmp, f"rank{r}.json")).read()) for r in range(args.world)]
    mib = 1 << 20
    print(f"# memory_bench: world={len(rows)} GPT {args.n_layer} x {args.n_embd}, {rows[0]['params']} parameters, "
          f"batch {args.batch} x {args.block}")
    print(f"{'rank':>4} {'peak_MiB':>9} {'formula_MiB':>12} {'live_units_MiB':>15} {'rest_MiB':>9} "
          f"{'construction_MiB':>17} {'model_MiB':>10}")
    for r in rows:
        rest = r["peak_bytes"] - r["formula_bytes"] - r["live_units_bytes"]
        print(f"{r['rank']:>4} {r['peak_bytes'] / mib:>9.0f} {r['formula_bytes'] / mib:>12.0f} "
              f"{r['live_units_bytes'] / mib:>15.0f} {rest / mib:>9.0f} {r['construction_peak_bytes'] / mib:>17.0f} "
              f"{4 * r['params'] / mib:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runinfo.provenance(), "model": {"n_layer": args.n_layer, "n_embd": args.n_embd,
                                                         "block": args.block, "batch": args.batch},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
