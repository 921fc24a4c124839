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

With ``--offload nvme`` (``offload_optimizer.device: "nvme"`` under ``--nvme-path``) the
moments leave memory for ``buffer_count`` host buffers of one unit's moments each. Each row
then has a predicted peak from terms measured apart from the ZeRO run (the README's formula
for each setting, zpp.tune.cost.offload_peak_bytes): a calibration in the launching process,
before any rank starts, measures on one plain torch GPT of the same shape the activations of
one micro-batch (the resident rise over a forward and backward, less the gradients) and
torch's AdamW temporaries per element of the largest tensor it steps (the rise over a step of
one tensor of the largest unit shard's size); a ZeRO run of a one-block GPT (1 x 64) in the
same setting measures the runtime a rank holds beside its model once it has stepped (its step
phase less that phase's terms). The peak is the larger of the backward at its start (states
at rest but the reduced gradients, the units prefetch gathered, a unit's full gradient, the
activations) and the step (states, the temporaries of one unit's shard: zpp steps unit by
unit, one tensor each), each plus the runtime.

    python perf/memory_bench.py --world 2 --n-layer 8 --n-embd 512 --offload none
    python perf/memory_bench.py --world 2 --n-layer 8 --n-embd 512 --offload nvme
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


def _reset_hwm() -> None:
    """Reset VmHWM to the current resident set (/proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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
    _reset_hwm()
    base = _status("VmRSS")
    torch.manual_seed(0)
    with zz.Init(transport=t):
        model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))
    built = _status("VmHWM") - base
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zpp": {"check_metadata": False}}
    if args.offload in ("nvme", "infinity"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path,
                                                         "buffer_count": args.buffer_count}
    if args.prefetch_bucket_size is not None:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = args.prefetch_bucket_size
    if args.offload == "infinity":
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path,
                                                     "buffer_count": args.buffer_count}
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    psi = sum(u.layout.numel for u in engine.units)
    g = torch.Generator().manual_seed(t.rank)
    phases = {}
    for i in range(args.steps):
        x, y = data.batch(args.batch, args.block, g)
        last = i == args.steps - 1
        if last:  # each phase's own peak in the last step (VmHWM reset before it)
            peak_so_far = _status("VmHWM")
            for name, run in (("forward", lambda: engine(x, y)), ("backward", None), ("step", engine.step)):
                _reset_hwm()
                if name == "forward":
                    loss = run()
                elif name == "backward":
                    engine.backward(loss)
                else:
                    run()
                phases[name] = _status("VmHWM") - base
                peak_so_far = max(peak_so_far, _status("VmHWM"))
        else:
            engine.backward(engine(x, y))
            engine.step()
    peak = max(_status("VmHWM"), peak_so_far) - base
    checkpoint = _checkpoint_phases(engine, args, base) if args.checkpoint else {}
    biggest = max(u.layout.padded_numel for u in engine.units)
    # the gathered units at the backward's start: what prefetch started ahead, at least the
    # unit computing and the one being released
    live_numel = max(engine.prefetch_stats.peak_inflight_numel, 2 * biggest)
    held = engine.model_state_bytes()
    reducer = engine.comms.reducer
    reducing = reducer.peak_numel if reducer is not None else None
    engine.close(gather_weights=args.offload != "infinity")
    shards = [u.flat.master.numel() for u in engine.units if u.trainable]
    row = {"rank": t.rank, "params": psi, "peak_bytes": peak, "construction_peak_bytes": built,
            "formula_bytes": 16 * psi // t.world_size, "live_units_numel": live_numel,
            "live_units_bytes": 4 * live_numel, "held_bytes": held,
            "units": len(engine.units), "biggest_unit_numel": biggest, "offload": args.offload,
            "shard_numel": sum(shards), "biggest_shard_numel": max(shards), "prefetch_peak_numel":
            engine.prefetch_stats.peak_inflight_numel, "reducing_peak_numel": reducing,
            "unit_numels": [u.layout.numel for u in engine.units],
            "phase_peak_bytes": phases, "checkpoint_phases": checkpoint}
    with open(os.path.join(args.out_dir, f"rank{t.rank}.json"), "w") as f:
        json.dump(row, f)


def _checkpoint_phases(engine, args, base: int) -> dict:
    """A save and a load of the trained engine: each one's VmHWM peak above ``base`` (mapped
    file pages included) and its sampled rise of anonymous memory (RssAnon, every 2 ms: what
    the process itself allocated; the page cache of a mapped file is not in it)."""
    import shutil
    import threading

    out = {}
    root = os.path.join(args.checkpoint, "memory_bench_checkpoints")
    try:
        for name, run in (("save", lambda: engine.save_checkpoint(root, tag="bench")),
                          ("load", lambda: engine.load_checkpoint(root, tag="bench"))):
            engine.job_world.barrier()
            _reset_hwm()
            anon0, peak, done = _status("RssAnon"), [0], threading.Event()

            def sample():
                while not done.wait(0.002):
                    peak[0] = max(peak[0], _status("RssAnon"))
            th = threading.Thread(target=sample, daemon=True)
            th.start()
            run()
            done.set()
            th.join()
            peak[0] = max(peak[0], _status("RssAnon"))
            out[name] = {"hwm_bytes": _status("VmHWM") - base, "anon_rise_bytes": peak[0] - anon0}
        engine.job_world.barrier()
    finally:
        if engine.job_world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def calibrate(args, shard_numel: int) -> dict:
    """One plain torch GPT of the run's shape on this process, no ZeRO: the activations of one
    micro-batch and AdamW's temporaries per element of one tensor (see the docstring)."""
    import torch

    from tests.gpt import GPT, CharCorpus, GPTConfig

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))
    psi = sum(p.numel() for p in model.parameters())
    x, y = CharCorpus(max_bytes=200_000).batch(args.batch, args.block, torch.Generator().manual_seed(0))
    model(x, y).backward()  # the first backward allocates the gradients
    _reset_hwm()
    before = _status("VmRSS")
    model(x, y).backward()  # gradients exist: the rise is the activations (and autograd's own)
    activations = _status("VmHWM") - before
    del model
    p = torch.nn.Parameter(torch.randn(shard_numel))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    opt.step()  # the moments exist
    _reset_hwm()
    before = _status("VmRSS")
    opt.step()
    per_elem = (_status("VmHWM") - before) / (4 * shard_numel)
    return {"params": psi, "activations_bytes": activations, "step_temporaries_per_fp32": per_elem}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=16, n_embd=720, block=128, batch=1, steps=3, warmup=0)
    p.add_argument("--offload", choices=("none", "nvme", "infinity"), default="none",
                   help="offload_optimizer.device nvme (under --nvme-path), and offload_param.device nvme "
                        "too (infinity)")
    p.add_argument("--nvme-path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "zpp-memory-bench"))
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--prefetch-bucket-size", type=lambda v: v if v == "auto" else int(v), default=None,
                   help="stage3_prefetch_bucket_size, or auto (Default: zpp's, 5e7; 0 gathers no unit ahead)")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="after training, save and load a checkpoint under DIR (shared by the ranks) and report "
                        "each one's peak and rise of anonymous memory")
    args = p.parse_args(argv)
    args.n_head = 8 if args.n_embd % 8 == 0 else args.n_head
    import tempfile

    from zpp.tune import cost

    one_node = cost.Cluster(1, args.world, cost.LINKS["loopback"], cost.LINKS["loopback"])

    def run(a) -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            a.out_dir = tmp
            trainlib.launch(_rank, a)
            return [json.loads(open(os.path.join(tmp, f"rank{r}.json")).read()) for r in range(a.world)]

    def predict(r: dict, cal: dict, runtime: float) -> dict:
        return cost.resident_peak(
            cost.MODES["zero3"], [cost.UnitShape(n) for n in r["unit_numels"]], one_node,
            activations=cal["activations_bytes"], step_temporaries=cal["step_temporaries_per_fp32"],
            nvme_buffers=args.buffer_count if args.offload in ("nvme", "infinity") else 0,
            param_nvme_buffers=args.buffer_count if args.offload == "infinity" else 0,
            live_numel=r["live_units_numel"], runtime=runtime)

    # the runtime term: the same setting on a one-block GPT, its step phase less that phase's terms
    small = argparse.Namespace(**{**vars(args), "n_layer": 1, "n_embd": 64, "n_head": 8, "checkpoint": None})
    small_rows = run(small)
    small_cal = calibrate(small, max(r["biggest_shard_numel"] for r in small_rows))
    runtime = sum(r["phase_peak_bytes"]["step"] - predict(r, small_cal, 0.0)["step"]
                  for r in small_rows) / len(small_rows)
    rows = run(args)
    cal = calibrate(args, max(r["biggest_shard_numel"] for r in rows))
    cal["runtime_bytes"] = runtime
    for r in rows:
        r["predicted"] = predict(r, cal, runtime)
        r["predicted_peak_bytes"] = r["predicted"]["peak"]
        r["error"] = abs(r["predicted_peak_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
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
    print(f"# offload {args.offload}: calibration {json.dumps(cal)}")
    for r in rows:
        pr = r["predicted"]
        print(f"rank {r['rank']}: peak {r['peak_bytes'] / mib:.0f} MiB, predicted {pr['peak'] / mib:.0f} MiB "
              f"({r['error']:.1%}; states {pr['states'] / mib:.0f}, backward {pr['backward'] / mib:.0f}, "
              f"step {pr['step'] / mib:.0f}); measured by phase (last step): "
              + ", ".join(f"{k} {v / mib:.0f}" for k, v in r["phase_peak_bytes"].items()))
        for k, c in r["checkpoint_phases"].items():
            print(f"rank {r['rank']}: {k}_checkpoint peak {c['hwm_bytes'] / mib:.0f} MiB, anonymous rise "
                  f"{c['anon_rise_bytes'] / mib:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runinfo.provenance(), "model": {"n_layer": args.n_layer, "n_embd": args.n_embd,
                                                         "block": args.block, "batch": args.batch},
                       "offload": args.offload, "calibration": cal, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
