"""Training-step benchmark: zpp ZeRO stages and ZeRO++ switches vs torch DDP, torch FSDP2
and DeepSpeed ZeRO-3, on the same GPT, data and optimizer.

    python perf/train_bench.py --world 4 --ranks-per-node 2 --steps 3      # spawns local ranks
    zpp cluster run --nodes 2 --ranks-per-node 2 -- python perf/train_bench.py --variants zero3
    sudo python perf/train_cluster.py                  # each variant in fresh processes, 2 rates

For each variant: a GPT from tests/gpt.py on the stdlib character corpus, AdamW (lr 1e-3, no
weight decay), ``--warmup`` steps, then ``--steps`` measured steps. Rank 0 prints one line per
variant:

    variant  step_s  fwd_bwd_s  opt_s  inter_B/step  eth_tx_B/step (node 0, 1)  state_B  peak_MiB  loss

* ``step_s``: wall time per step (after a barrier); ``fwd_bwd_s`` and ``opt_s`` split it into
  forward plus backward and the optimizer step (DDP's all-reduce and FSDP2's reduce-scatter run
  in backward; zpp stages 1-2 gather the updated parameters in the step).
* ``inter_B/step``: bytes this rank sends to other nodes per step. zpp variants read the
  transport's wire counters (direct-exchange model, [Note: what is counted] in
  zpp/comm/counters.py); DDP, FSDP2 and DeepSpeed do not go through a zpp transport, so theirs
  is that model applied to what they are designed to send, marked "(model)".
* ``eth_tx_B/step``: bytes that really left each node on its link, measured by the kernel
  (perf/trainlib.py); only inside ``zpp cluster``. This is the figure to compare across
  libraries.
* ``state_B``: zpp's model-state bytes on rank 0 (parameters, gradients, optimizer state).
* ``peak_MiB``: the process's peak RSS. It only grows, so run one variant per process to
  compare memory (perf/train_cluster.py does).

DeepSpeed variants need ``deepspeed`` importable (``pip install deepspeed`` into a separate
environment that sees this one's torch and zpp: see perf/BENCHMARKS.md); without it, and for
whatever DeepSpeed cannot run on CPU, the row reports the error instead.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import runinfo  # noqa: E402
import trainlib  # noqa: E402

_ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": -1, "zero_quantized_gradients": True}
VARIANTS = {
    "ddp": None, "fsdp2": None,
    "deepspeed3": {"stage": 3}, "deepspeed3-zeropp": {"stage": 3, **_ZEROPP},
    "zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
    "zero3-qwz": {"stage": 3, "zero_quantized_weights": True},
    "zero3-hpz": {"stage": 3, "zero_hpz_partition_size": -1},  # -1: ranks per node
    "zero3-qgz": {"stage": 3, "zero_quantized_gradients": True},
    "zero3-zeropp": {"stage": 3, **_ZEROPP},
    # the reductions in line (overlap_comm is on by default at stage 3): the side-by-side rows
    "zero3-inline": {"stage": 3, "overlap_comm": False},
    "zero3-zeropp-inline": {"stage": 3, **_ZEROPP, "overlap_comm": False},
    # qwZ with int4 codes instead of int8 (half the forward gathers' bytes)
    "zero3-zeropp-w4": {"stage": 3, **_ZEROPP, "zpp": {"weight_bits": 4}},
    # the same with a scale per 128 weights instead of 2048 (4.25 bits per weight on the wire)
    "zero3-zeropp-w4-g128": {"stage": 3, **_ZEROPP, "zpp": {"weight_bits": 4, "weight_group_size": 128}},
    # qgZ with a scale per 2048 gradient entries (the default before 2026-12-07: 128)
    "zero3-zeropp-gg2048": {"stage": 3, **_ZEROPP, "zpp": {"gradient_group_size": 2048}},
    # hpZ's node copy kept across steps and refreshed by int4 weight deltas (zpp.weight_delta_bits)
    "zero3-zeropp-delta4": {"stage": 3, **_ZEROPP, "zpp": {"weight_delta_bits": 4}},
    # the per-call metadata check on, as a job starts (the bench's other rows switch it off)
    "zero3-zeropp-checked": {"stage": 3, **_ZEROPP, "zpp": {"check_metadata": True}},
    "zero3-zeropp-delta4-checked": {"stage": 3, **_ZEROPP, "zpp": {"weight_delta_bits": 4, "check_metadata": True}},
    # the prefetch window measured on a timed pass ("auto") or fixed at DeepSpeed's 5e7 elements,
    # zpp's default (the measured window was the default for a few hours of 2026-12-07: the plain
    # zero3 / zero3-zeropp rows of perf/results/prefetch_window-*.json)
    "zero3-auto": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
    "zero3-zeropp-auto": {"stage": 3, **_ZEROPP, "stage3_prefetch_bucket_size": "auto"},
    "zero3-b5e7": {"stage": 3, "stage3_prefetch_bucket_size": 50_000_000},
    "zero3-zeropp-b5e7": {"stage": 3, **_ZEROPP, "stage3_prefetch_bucket_size": 50_000_000},
    # qgZ's two hops on one reduction thread instead of pipelined over two
    "zero3-zeropp-1worker": {"stage": 3, **_ZEROPP, "zpp": {"pipeline_reductions": False}},
    # the weight gathers in two hops (zpp.hierarchical_gather: ZeRO++'s default) or in one
    "zero3-2hop": {"stage": 3, "zpp": {"hierarchical_gather": True}},
    "zero3-zeropp-1hop": {"stage": 3, **_ZEROPP, "zpp": {"hierarchical_gather": False}},
    "zero3-zeropp-1hop-inline": {"stage": 3, **_ZEROPP, "overlap_comm": False, "zpp": {"hierarchical_gather": False}},
    # the optimizer state on NVMe (zpp.zero.nvme) under --nvme-path; not in the defaults
    "zero2-nvme": {"stage": 2, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 1_000_000},
    "zero3-nvme": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
    # the parameter shards on NVMe (zpp.zero.param_swap), and both tiers (ZeRO-Infinity)
    "zero3-nvme-param": {"stage": 3, "offload_param": {"device": "nvme"}},
    "zero3-infinity": {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
    # the same for a job under a memory cap: two buffers per tier, no gathers started ahead
    "zero3-infinity-lean": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                            "offload_param": {"device": "nvme", "buffer_count": 2},
                            "offload_optimizer": {"device": "nvme", "buffer_count": 2}},
    # DeepSpeed's ZeRO-Infinity optimizer tier (its async_io op: libaio-dev; stage 3 only there)
    "deepspeed3-nvme": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
}
DEFAULT_VARIANTS = [v for v in VARIANTS if not v.startswith("deepspeed") and "nvme" not in v]
LR = 1e-3


def _zero_section(name, t, nvme_path=None):
    from zpp.comm.topology import topology_of

    z = dict(VARIANTS[name])
    z.pop("zpp", None)  # zpp's own keys: _build puts them in the "zpp" section
    if z.get("zero_hpz_partition_size") == -1:
        z["zero_hpz_partition_size"] = topology_of(t).ranks_per_node
    for sec in ("offload_optimizer", "offload_param"):
        if z.get(sec, {}).get("device") == "nvme":
            z[sec] = {**z[sec], "nvme_path": nvme_path}
    return z


def _build(name, model, t, args):
    """(callable net, backward(loss), step(), engine or None) for one variant."""
    if name in ("ddp", "fsdp2"):
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model) if t.world_size > 1 else model
        else:
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b)
            net = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

        def opt_step():
            opt.step()
            opt.zero_grad()
        return net, lambda loss: loss.backward(), opt_step, None
    if name.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the default group zpp made
        cfg = {"train_micro_batch_size_per_gpu": args.batch,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
               "zero_optimization": _zero_section(name, t, args.nvme_path)}
        if "nvme" in name:  # DeepSpeed steps offloaded state with its CPU Adam only; the aio section as zpp's
            cfg["optimizer"]["params"].pop("torch_adam")
            cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1}  # both defaults
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return eng, eng.backward, eng.step, None
    import zpp.zero as zz

    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "zero_optimization": {**_zero_section(name, t, args.nvme_path),
                                 "stage3_param_persistence_threshold": args.persistence_threshold},
           # the Hugging Face model keeps zpp's default units (its GPT2Block, from _no_split_modules)
           "zpp": {"check_metadata": False, "unit_min_numel": args.unit_min_numel if args.model == "gpt" else None,
                   **VARIANTS[name].get("zpp", {})}}
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    return engine, engine.backward, engine.step, engine


def _run_variant(t, name, args, data):
    if args.init and not name.startswith(("ddp", "fsdp", "deepspeed")):
        import zpp.zero as zz

        with zz.Init(transport=t):
            model = trainlib.make_model(args)
    else:
        model = trainlib.make_model(args)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    net, backward, opt_step, engine = _build(name, model, t, args)
    nvme_at = {}  # the NVMe swap's counters when the timed steps start

    def on_timed():  # drops the warm-up's waits and swap traffic
        engine.link_waits()
        if engine.mode("nvme") is not None:
            nvme_at.update(engine.mode("nvme").stats())
    on_timed = on_timed if engine is not None else None
    measured, snap = trainlib.timed_steps(t, args, data, net, backward, opt_step, on_timed=on_timed)
    row = {"variant": name, "params": psi, **measured}
    if engine is not None:
        # rank 0's seconds per step blocked on communication, per phase (zpp.zero LinkWaits)
        row["link_wait_s"] = {k: v / args.steps for k, v in sorted(engine.link_waits().items())}
        row["inter_bytes"], row["intra_bytes"] = trainlib.counted_per_step(snap, args.steps)
        row["model_state_bytes"] = sum(engine.model_state_bytes().values())
        nvme = engine.mode("nvme")
        if nvme is not None:  # the swaps' traffic and waits per timed step (both tiers together)
            now = nvme.stats()
            row["nvme"] = {**now, **{f"{k}_per_step": (_swapped(now, k) - _swapped(nvme_at, k)) / args.steps
                                     for k in ("read_bytes", "written_bytes", "wait_s", "busy_s")}}
        # each unit's elements and whether it stays whole at stage 3 (for zpp/tune/cost.py)
        row["units"] = [[u.layout.numel, not u.shards_params] for u in engine.units]
        row["gather_trace"] = [[i, phase.value] for i, phase in engine._prefetch.trace() or ()]
        ps = engine.prefetch_stats  # the window (measured or set) and the most elements gathered ahead at once
        row["prefetch"] = {"window_numel": ps.window_numel, "peak_inflight_numel": ps.peak_inflight_numel,
                           "largest_unit_numel": max(u.layout.padded_numel for u in engine.units)}
        row["bytes_source"] = "counters"
        if args.trace:
            row["trace"] = _trace_step(t, args, data, engine)
        # parameters on NVMe: the model may not fit in memory whole, so it is not gathered back
        engine.close(gather_weights=engine.comms.params_swap is None)
    else:
        kind = "ddp" if name == "ddp" else "fsdp"
        row["inter_bytes"], row["intra_bytes"] = trainlib.modelled_bytes(kind, psi, t)
        row["bytes_source"] = "model"
        row["model_state_bytes"] = None
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def _swapped(stats: dict, key: str) -> float:
    """``key`` of the NVMe mode's stats summed over its two files (optimizer state, ``params``)."""
    return stats.get(key, 0) + stats.get("params", {}).get(key, 0)


def _trace_step(t, args, data, engine) -> dict:
    """One more step, under ``torch.profiler`` on rank 0: its chrome trace, gzipped, to
    ``args.trace`` + ".chrome-trace.gz" (open it in https://ui.perfetto.dev or
    chrome://tracing: the compute ops, and zpp's spans: ``zpp.forward/backward/step``,
    ``zpp.wait.<phase>``, and ``zpp.reduce`` on the reduction thread, which the profiler does
    not see and which is added from the engine's own record, aligned on ``zpp.forward``) and
    zpp's spans as a text timeline to ``args.trace`` + ".txt"; returns where they are."""
    g = torch.Generator().manual_seed(1000 + t.rank)
    x, y = data.batch(args.batch, args.block, g)
    t.barrier()
    if t.rank != 0:
        engine.backward(engine(x, y))
        engine.step()
        t.barrier()
        return {}
    from torch.profiler import ProfilerActivity, profile

    waits = engine.comms.waits
    waits.spans = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.backward(engine(x, y))
        engine.step()
    t.barrier()
    spans, waits.spans = sorted(waits.spans, key=lambda s: s[1]), None
    raw = args.trace + ".profiler.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.remove(raw)
    events = trace["traceEvents"]
    fwd = next(e for e in events if e.get("name") == "zpp.forward" and e.get("ph") == "X")
    offset_us = fwd["ts"] - next(s[1] for s in spans if s[0] == "zpp.forward") * 1e6
    main = fwd["tid"]
    events += [{"ph": "X", "name": name, "cat": "zpp", "pid": fwd["pid"], "tid": "zpp-reduce thread",
                "ts": s * 1e6 + offset_us, "dur": (e - s) * 1e6} for name, s, e, th in spans if th != "MainThread"]
    events.append({"ph": "M", "name": "thread_name", "pid": fwd["pid"], "tid": main, "args": {"name": "training"}})
    chrome = args.trace + ".chrome-trace.gz"
    with gzip.open(chrome, "wt") as f:
        json.dump(trace, f)
    t0 = spans[0][1]
    threads = {th: i for i, th in enumerate(dict.fromkeys(s[3] for s in spans))}
    lines = [f"# one training step on rank 0 ({args.model} {args.n_layer} x {args.n_embd}, {args.variants}); "
             "start and length in seconds; " + ", ".join(f"thread {i}: {th}" for th, i in threads.items())]
    lines += [f"{s - t0:9.3f} {e - s:8.3f}  thread {threads[th]}  {name}" for name, s, e, th in spans]
    with open(args.trace + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return {"chrome": chrome, "text": args.trace + ".txt"}


def bench(t, args):
    from tests.gpt import CharCorpus

    data = CharCorpus(max_bytes=2_000_000)
    rows = []
    for name in args.variants:
        try:
            rows.append(_run_variant(t, name, args, data))
        except Exception as e:  # noqa: BLE001 - report and go on (DeepSpeed's CPU gaps)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            if t.world_size > 1 and name.startswith(("ddp", "fsdp", "deepspeed")):
                break  # a failed foreign collective may leave the ranks out of step: stop here
    return rows


def header(args, world, per_node):
    return (f"# train_bench: world={world} ranks_per_node={per_node} warmup={args.warmup} "
            f"steps={args.steps} GPT n_layer={args.n_layer} n_embd={args.n_embd} block={args.block} "
            f"batch={args.batch}")


def print_rows(rows):
    print(f"{'variant':<20}{'step_s':>8}{'fwd_bwd_s':>10}{'opt_s':>7}{'inter_B/step':>14}"
          f"{'eth_tx_B/step (node 0, 1)':>28}{'state_B':>11}{'peak_MiB':>9}{'loss':>7}  link waits s/step (rank 0)")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<20} failed: {r['error']}")
            continue
        mark = "" if r["bytes_source"] == "counters" else " (model)"
        state = "-" if r["model_state_bytes"] is None else f"{r['model_state_bytes']}"
        waits = " ".join(f"{k} {v:.2f}" for k, v in r.get("link_wait_s", {}).items() if v >= 0.005)
        if "nvme" in r:
            nv = r["nvme"]
            waits += (f" | nvme read {nv['read_bytes_per_step'] / 2**20:.0f} MiB, written "
                      f"{nv['written_bytes_per_step'] / 2**20:.0f} MiB, waited {nv['wait_s_per_step']:.2f} s"
                      f"{'' if nv.get('direct', nv.get('params', {}).get('direct')) else ' (buffered I/O)'}")
        print(f"{r['variant']:<20}{r['step_s']:>8.3f}{r['fwd_bwd_s']:>10.3f}{r['opt_s']:>7.3f}"
              f"{r['inter_bytes']:>14.0f}{trainlib.fmt_eth(r, 'eth_tx_bytes_per_node'):>28}{state:>11}"
              f"{r['peak_rss_mib']:>9.0f}{r['loss']:>7.3f}{mark}  {waits}")


def _rank_main(t, args):
    from zpp.comm.topology import topology_of

    per_node = topology_of(t).ranks_per_node  # a collective the first time: every rank
    rows = bench(t, args)
    if t.rank == 0:
        if rows and "params" in rows[0]:
            print(header(args, t.world_size, per_node) + f" params={rows[0]['params']}")
        print_rows(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**runinfo.provenance(), "rows": rows}, f, indent=1)


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=4, n_embd=256, block=128, batch=4, steps=6, warmup=2)
    p.add_argument("--unit-min-numel", type=int, default=100_000,
                   help="zpp stage 3 unit size (Default: one unit per block + root)")
    p.add_argument("--persistence-threshold", type=int, default=0,
                   help="zpp's stage3_param_persistence_threshold (Default: 0, every parameter sharded; "
                        "DeepSpeed's rows keep DeepSpeed's default)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--nvme-path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "zpp-bench-nvme"),
                   help="the NVMe variants' nvme_path (Default: $TMPDIR/zpp-bench-nvme)")
    p.add_argument("--init", action="store_true",
                   help="zpp variants: build the model under zpp.zero.Init (no rank ever holds it whole)")
    p.add_argument("--trace", default=None, metavar="PREFIX",
                   help="zpp variants: one more step under torch.profiler on rank 0, its chrome trace written "
                        "to PREFIX.chrome-trace.gz and its zpp spans to PREFIX.txt (one variant per run)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    trainlib.parse_variants(p, args, VARIANTS)
    trainlib.launch(_rank_main, args)


if __name__ == "__main__":
    main()
