"""What a verified checkpoint costs: save and load time of the benchmark GPT with and without
the CRC32 checksums and the fsyncs (zpp/zero/checkpoint/files.py).

    python perf/checkpoint_bench.py --world 1 --json perf/results/checkpoint_bench_w1.json
    python perf/checkpoint_bench.py --world 4 --json perf/results/checkpoint_bench_w4.json

A GPT (tests/gpt.py; Default 8 layers x 512, 25.35M fp32 parameters), ZeRO stage 3 and Adam
after one training step, so the checkpoint holds the weights and both Adam moments (about
304 MB over all shards); ``--config zeropp-delta4 --world 4 --ranks-per-node 2``: ZeRO++ with
int4 weight deltas, whose checkpoint holds hpZ's node copy too (``zeropp``: without them). Each variant saves the same tag ``--repeats`` times (the first save
publishes a new tag, the others re-save it: the atomic exchange) and loads it back into the
same engine (every rank reads and checks every shard, see [Note: resharding]); the time of a
save or load is the slowest rank's wall time; a row gives the minimum over the repeats (the
least disturbed by other load on the machine) and the median, and the minimum CPU time of
the process (``time.process_time``: what the checksums cost shows there even when other jobs
slow the wall clock); the variants are interleaved. Variants switch the checksums off in
this process only (a stand-in CRC32 that returns 0) or the fsyncs (``ZPP_CHECKPOINT_FSYNC=0``),
so the difference is their cost:

* ``crc+fsync``: what zpp does; ``nocrc+fsync``; ``crc+nofsync``; ``nocrc+nofsync``.
* ``torch.save``: the baseline: each rank ``torch.save``-s the object its shard file holds to a
  file and ``torch.load``-s the shard files a load reads, nothing else.

The files go to ``--dir`` (Default: a temporary directory under /tmp), removed at the end;
reads come from the page cache (the files were just written).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import trainlib  # noqa: E402

VARIANTS = ("crc+fsync", "nocrc+fsync", "crc+nofsync", "nocrc+nofsync", "torch.save")


def _switch(variant: str):
    """Switch the checksums (patched in zpp.zero.checkpoint.files) or the fsyncs
    (``ZPP_CHECKPOINT_FSYNC=0``) off for ``variant``; returns the undo."""
    from zpp.zero.checkpoint import files

    real_zlib = files.zlib
    if variant.startswith("nocrc"):
        files.zlib = types.SimpleNamespace(crc32=lambda data, value=0: 0)
    if variant.endswith("nofsync"):
        os.environ["ZPP_CHECKPOINT_FSYNC"] = "0"

    def undo():
        files.zlib = real_zlib
        os.environ.pop("ZPP_CHECKPOINT_FSYNC", None)
    return undo


def _slowest(t, seconds: float) -> float:
    x = torch.tensor([seconds], dtype=torch.float64)
    t.all_reduce(x, op="max")
    return float(x)


def _timed(t, call) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``call()``, each the slowest rank's."""
    t.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    call()
    return _slowest(t, time.perf_counter() - w0), _slowest(t, time.process_time() - c0)


def _baseline(t, engine, root: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """torch.save of this rank's shard object, torch.load of every shard file."""
    from zpp.zero.checkpoint.save import _unit_entries, shard_name

    obj = {"units": _unit_entries(engine, False)}
    save = _timed(t, lambda: torch.save(obj, os.path.join(root, shard_name(t.rank))))
    load = _timed(t, lambda: [torch.load(os.path.join(root, shard_name(r)), map_location="cpu", weights_only=False)
                              for r in range(t.world_size)])
    return save, load


def main(t, args):
    import zpp

    model = trainlib.make_model(args)
    params = sum(p.numel() for p in model.parameters())
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
    if args.config != "zero3":  # ZeRO++ (hpZ over the node), with int4 weight deltas: their copies are saved too
        cfg["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True,
                                        zero_hpz_partition_size=args.ranks_per_node)
        cfg["zpp"] = {"weight_delta_bits": 4} if args.config == "zeropp-delta4" else {}
    engine, *_ = zpp.initialize(model=model, config=cfg, transport=t)
    g = torch.Generator().manual_seed(t.rank)
    x = torch.randint(0, 128, (args.batch, args.block), generator=g)
    engine.backward(engine(x, x))
    engine.step()
    base = args.dir
    if t.rank == 0:
        os.makedirs(base, exist_ok=True)
    t.barrier()
    runs = {v: ([], []) for v in args.variants}
    for _ in range(args.repeats):  # variants interleaved, so load on the machine hits all alike
        for variant in args.variants:
            root = os.path.join(base, variant)
            if t.rank == 0:
                os.makedirs(root, exist_ok=True)
            t.barrier()
            if variant == "torch.save":
                s, lo = _baseline(t, engine, root)
            else:
                undo = _switch(variant)
                try:
                    s = _timed(t, lambda: engine.save_checkpoint(root, tag="bench"))  # noqa: B023
                    lo = _timed(t, lambda: engine.load_checkpoint(root, tag="bench"))  # noqa: B023
                finally:
                    undo()
            runs[variant][0].append(s)
            runs[variant][1].append(lo)
    rows = []
    for variant, (saves, loads) in runs.items():
        root = os.path.join(base, variant)
        files = os.path.join(root, "bench") if variant != "torch.save" else root
        rows.append({"variant": variant, "save_s": min(w for w, _ in saves), "load_s": min(w for w, _ in loads),
                     "save_median_s": statistics.median(w for w, _ in saves),
                     "load_median_s": statistics.median(w for w, _ in loads),
                     "save_cpu_s": min(c for _, c in saves), "load_cpu_s": min(c for _, c in loads),
                     "save_runs_s": saves, "load_runs_s": loads,
                     "checkpoint_bytes": sum(e.stat().st_size for e in os.scandir(files))})
    t.barrier()
    if t.rank:
        return
    shutil.rmtree(base, ignore_errors=True)
    full = {r["variant"]: r for r in rows}
    print(f"# checkpoint_bench world={t.world_size} config={args.config} GPT {args.n_layer}x{args.n_embd} params={params} "
          f"stage 3 + Adam, min (median) of {args.repeats}")
    print(f"{'variant':>14} {'save_s':>16} {'save_cpu_s':>10} {'load_s':>16} {'load_cpu_s':>10} {'MB':>8}")
    for r in rows:
        print(f"{r['variant']:>14} {r['save_s']:7.3f} ({r['save_median_s']:6.3f}) {r['save_cpu_s']:10.3f} "
              f"{r['load_s']:7.3f} ({r['load_median_s']:6.3f}) {r['load_cpu_s']:10.3f} "
              f"{r['checkpoint_bytes'] / 1e6:8.1f}")
    ratios = {}
    if "crc+fsync" in full and "nocrc+fsync" in full:
        ratios["crc_save"] = full["crc+fsync"]["save_s"] / full["nocrc+fsync"]["save_s"]
        ratios["crc_load"] = full["crc+fsync"]["load_s"] / full["nocrc+fsync"]["load_s"]
        ratios["crc_save_cpu"] = full["crc+fsync"]["save_cpu_s"] / full["nocrc+fsync"]["save_cpu_s"]
        ratios["crc_load_cpu"] = full["crc+fsync"]["load_cpu_s"] / full["nocrc+fsync"]["load_cpu_s"]
    if "crc+fsync" in full and "crc+nofsync" in full:
        ratios["fsync_save"] = full["crc+fsync"]["save_s"] / full["crc+nofsync"]["save_s"]
    if "crc+fsync" in full and "torch.save" in full:
        ratios["zpp_vs_torch_save"] = full["crc+fsync"]["save_s"] / full["torch.save"]["save_s"]
        ratios["zpp_vs_torch_load"] = full["crc+fsync"]["load_s"] / full["torch.save"]["load_s"]
    print("ratios: " + ", ".join(f"{k}={v:.3f}" for k, v in ratios.items()))
    if args.json:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=trainlib.ROOT).stdout.strip()
        out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "host": socket.gethostname(), "command": " ".join(["python"] + sys.argv), "git_revision": rev,
               "world": t.world_size, "ranks_per_node": args.ranks_per_node, "config": args.config, "params": params,
               "model": {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "block")},
               "repeats": args.repeats, "rows": rows, "ratios": ratios}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trainlib.add_model_args(p, n_layer=8, n_embd=512, block=128, batch=1, steps=1, warmup=0)
    p.set_defaults(n_head=8, ranks_per_node=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--config", choices=("zero3", "zeropp", "zeropp-delta4"), default="zero3",
                   help="stage 3 (Default), ZeRO++ with hpZ over --ranks-per-node, or that with int4 weight deltas")
    p.add_argument("--dir", default=None, help="where the checkpoints go (Default: a new directory under /tmp)")
    a = p.parse_args()
    trainlib.parse_variants(p, a, VARIANTS)
    a.dir = a.dir or tempfile.mkdtemp(prefix="zpp-ckpt-bench-")
    a.ranks_per_node = a.ranks_per_node or a.world  # one node
    trainlib.launch(main, a)
