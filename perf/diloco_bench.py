"""Wall time to a target loss: torch DDP + AdamW, zpp ZeRO-3 + ZeRO++, zpp 1-bit Adam and the
hierarchical mode (ZeRO inside the node, streaming compressed DiLoCo across nodes, ``zpp.outer``),
on the same GPT, data and token count (issue 14).

    python perf/diloco_bench.py --world 4 --ranks-per-node 2 --steps 20        # local ranks, no shaping
    zpp cluster run --nodes 2 --ranks-per-node 2 -- python perf/diloco_bench.py --label 10mbit \\
        --json perf/results/diloco_bench-10mbit.json          # inside a shaped cluster (take its lock)
    python perf/diloco_bench.py --plot perf/results/diloco_bench-100mbit.json \\
        perf/results/diloco_bench-10mbit.json --png perf/results/diloco_bench.png   # side by side

Every variant trains ``--steps`` steps from the same initial weights on the same per-rank
batches (tests/gpt.py's GPT on the stdlib character corpus), for each ``--seeds`` seed (model
initialisation and data). Each rank records its training loss and its elapsed time after every
step (from a common barrier); the curve is, per step, the loss averaged over the ranks against
the slowest rank's time. A variant reaches the target when its loss, averaged over the last
``--window`` steps, first falls to DDP's at its last step (the target is per seed).
``--target-from`` takes DDP's rows from an earlier run instead (for instance to give the
variants that did not reach the target more steps without running DDP again).

Rank 0 prints one line per variant and seed:

    variant  seed  step_s  inter_B/step  eth_tx_B/step  final_loss  final/ddp  time_to_target_s  ddp/this

* ``inter_B/step``: bytes per rank per step sent to other nodes, from zpp's wire counters
  (DDP: the counters' model of one fp32 all-reduce, marked "(model)"); the hierarchical
  mode's are its outer all-reduces spread over the steps.
* ``eth_tx_B/step``: bytes that left each node's link per step, by the kernel's counters, over
  the same span as the time curve (the busiest node; "-" outside ``zpp cluster``). A sync
  still in flight after the last step is not in it.
* ``final/ddp``: the windowed loss after the last step over DDP's (equal tokens).
* ``ddp/this``: DDP's time to the target over this variant's (> 1: sooner than DDP).

``--json`` writes the rows with their curves; ``--png`` plots loss against wall time (and
against steps) for every variant and seed. ``--plot JSON...`` only plots earlier runs, one
panel per run (for instance one per link rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import runinfo  # noqa: E402
import trainlib  # noqa: E402

VARIANTS = ("ddp", "zero3-zeropp", "onebitadam", "diloco")
#: more variants for ``--variants`` (not run by default): the loss cost of what the link
#: carries, against DDP and each other (issue 25: int4 forward weights)
EXTRA_VARIANTS = ("zero3", "zero3-qwz", "zero3-qgz", "zero3-qgz-gg128", "zero3-qgz-gg512", "zero3-qgz-gg2048",
                  "zero3-zeropp-gg128", "zero3-zeropp-gg512", "zero3-zeropp-gg2048",
                  "zero3-zeropp-w4", "zero3-zeropp-w4-g128", "zero3-zeropp-delta4")
LR = 1e-3


def _outer(args) -> dict:
    """The ``zpp.outer`` section: ``args.outer_config`` when set (perf/diloco_study.py), else
    from the command line's options."""
    if getattr(args, "outer_config", None) is not None:
        return dict(args.outer_config)
    return {"method": args.outer_method, "sync_every": args.sync_every, "fragments": args.fragments,
            "delay": args.delay, "compression": args.outer_compression, "lr": args.outer_lr,
            "momentum": args.outer_momentum}


def scheduler_config(args) -> dict | None:
    """``--lr-schedule cosine``: DeepSpeed's WarmupCosineLR, a linear warm-up over
    ``--lr-warmup`` steps, then cosine decay to ``--lr-min-ratio`` of the lr at
    ``args.lr_total_steps`` (the reference's step count: runs longer than it stay at the floor);
    None: constant lr."""
    if getattr(args, "lr_schedule", "constant") == "constant":
        return None
    total = getattr(args, "lr_total_steps", None) or args.steps
    return {"type": "WarmupCosineLR", "params": {
        "total_num_steps": total, "warmup_num_steps": args.lr_warmup, "warmup_type": "linear",
        "warmup_min_ratio": 0.0, "cos_min_ratio": args.lr_min_ratio}}


def engine_config(name: str, args, ranks_per_node: int) -> dict:
    """The DeepSpeed-style config of a zpp variant (every name but ``ddp``)."""
    if name not in VARIANTS + EXTRA_VARIANTS or name == "ddp":
        raise ValueError(f"variant {name!r} is not a zpp variant of {list(VARIANTS + EXTRA_VARIANTS)}")
    schedule = scheduler_config(args)
    adamw = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    zpp_section: dict = {"check_metadata": False}
    if name == "zero3" or name.startswith(("zero3-qwz", "zero3-qgz")):  # uncompressed, or one of ZeRO++'s quantizers
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
                "zero_quantized_weights": name.startswith("zero3-qwz"),
                "zero_quantized_gradients": name.startswith("zero3-qgz")}
        optimizer = adamw
    elif name.startswith("zero3-zeropp"):
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": True,
                "zero_quantized_gradients": True, "zero_hpz_partition_size": ranks_per_node}
        optimizer = adamw
        if name.startswith("zero3-zeropp-w4"):
            zpp_section["weight_bits"] = 4
        if name.endswith("-g128"):  # a scale per 128 weights instead of 2048: 4.25 bits per weight
            zpp_section["weight_group_size"] = 128
        if name.startswith("zero3-zeropp-delta"):  # hpZ's copy refreshed by quantized weight deltas
            zpp_section["weight_delta_bits"] = int(name.rsplit("delta", 1)[1])
    elif name == "onebitadam":  # 1-bit Adam needs plain data parallel (stage 0)
        zero = {"stage": 0}
        optimizer = {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": args.freeze_step}}
    else:  # diloco: ZeRO inside the node, the outer sync across
        zero = {"stage": args.inner_stage, "stage3_param_persistence_threshold": 0}
        optimizer = adamw
        zpp_section["outer"] = _outer(args)
    if "-gg" in name:  # qgZ with a scale per N gradient entries
        zpp_section["gradient_group_size"] = int(name.rsplit("-gg", 1)[1])
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "optimizer": optimizer, "zero_optimization": zero,
           "zpp": zpp_section}
    if schedule:
        cfg["scheduler"] = schedule
    return cfg


def _build(name, model, t, args):
    """(net, backward(loss), step(), engine or None) for one variant."""
    schedule = scheduler_config(args)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from zpp.zero.schedulers import WarmupCosineLR

        net = DDP(model) if t.world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        # the same scheduler class the engine builds from the config below
        sched = WarmupCosineLR(opt, **schedule["params"]) if schedule else None

        def opt_step():
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        return net, lambda loss: loss.backward(), opt_step, None
    import zpp.zero as zz
    from zpp.comm.topology import topology_of

    cfg = engine_config(name, args, topology_of(t).ranks_per_node)
    engine, *_ = zz.initialize(model=model, config=cfg, transport=t)
    return engine, engine.backward, engine.step, engine


def _model(args, seed):
    from tests.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block))


#: apart from any ``1000 * seed + rank`` of the seeds and ranks used here
DATA_ORDER_STRIDE = 1_000_003


def data_seed(seed: int, rank: int, order: int = 0) -> int:
    """The seed of one rank's batch stream: the same for every variant of a seed; ``order``
    > 0 draws other batches from the same corpus (``--data-order``: how far two runs that
    differ only in their batches end apart, the measure's own spread). Distinct for every
    seed and rank below 1000."""
    if order < 0:
        raise ValueError(f"--data-order {order}: expected an integer >= 0")
    return 1000 * seed + rank + DATA_ORDER_STRIDE * order


#: the corpus the batches are drawn from (the first bytes of the stdlib walk, tests/gpt.py)
TRAIN_BYTES = 2_000_000
#: the held-out bytes after them (other files): the evaluation's batches
HELD_OUT_BYTES = 250_000
#: the evaluation batches' generator (the same batches for every variant, seed and order)
EVAL_SEED = 424_242


def corpora():
    """(training corpus, held-out corpus): the held-out one is the ``HELD_OUT_BYTES`` that
    follow the training bytes in the same walk, never drawn for training."""
    from tests.gpt import CharCorpus

    held = CharCorpus(max_bytes=TRAIN_BYTES + HELD_OUT_BYTES)
    held.data = held.data[TRAIN_BYTES:]
    return CharCorpus(max_bytes=TRAIN_BYTES), held


def evaluate(net, held, args) -> float:
    """The mean loss over ``args.eval_batches`` fixed batches of the held-out corpus (no
    grad), the same batches on every rank; each rank evaluates its own weights (a node's
    replica in the hierarchical mode)."""
    g = torch.Generator().manual_seed(EVAL_SEED)
    with torch.no_grad():
        return sum(float(net(*held.batch(args.batch, args.block, g))) for _ in range(args.eval_batches)) / max(
            1, args.eval_batches)


def _run(t, name, seed, args, data, held=None) -> dict:
    """One variant's run; with ``held`` and ``args.eval_batches`` also the held-out loss after
    each step of ``args.eval_at`` (its time left out of the time curve)."""
    model = _model(args, seed)
    psi = sum(p.numel() for p in model.parameters())
    net, backward, opt_step, engine = _build(name, model, t, args)
    g = torch.Generator().manual_seed(data_seed(seed, t.rank, getattr(args, "data_order", 0)))
    losses, times, evals = [], [], {}
    eval_at = set(getattr(args, "eval_at", ())) if held is not None and getattr(args, "eval_batches", 0) else set()
    t.counters.reset()
    t.barrier()
    eth0 = trainlib.eth_counters()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.batch(args.batch, args.block, g)
        loss = net(x, y)
        backward(loss)
        opt_step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if step in eval_at:
            paused = time.perf_counter()
            evals[step] = evaluate(net, held, args)
            t0 += time.perf_counter() - paused
    eth1 = trainlib.eth_counters()  # the link's bytes over the same span as the time curve
    if engine is not None and engine.outer is not None:
        # finish the sync in flight before the collectives below: with one rank per node the
        # outer sync's inter-node transport is the job world's own group (zpp.comm.topology)
        engine.outer.wait()
    snap = t.counters.snapshot()  # before the gathers below
    t.barrier()
    eth = trainlib.node_eth_per_step(t, eth0, eth1, args.steps)
    mine = torch.tensor([losses, times], dtype=torch.float64)
    every = torch.empty(t.world_size * mine.numel(), dtype=torch.float64)
    t.all_gather(every, mine.reshape(-1))
    every = every.view(t.world_size, 2, args.steps)
    row = {"variant": name, "seed": seed, "data_order": getattr(args, "data_order", 0), "params": psi,
           "steps": args.steps,
           "loss_curve": every[:, 0].mean(0).tolist(), "time_curve": every[:, 1].amax(0).tolist(), **eth}
    row["step_s"] = row["time_curve"][-1] / args.steps
    if evals:  # the mean over ranks (every rank evaluated the same steps)
        mine = torch.tensor([evals[k] for k in sorted(evals)], dtype=torch.float64)
        t.all_reduce(mine, "mean")
        row["eval_loss"] = {str(k): v for k, v in zip(sorted(evals), mine.tolist())}
    if engine is not None:
        row["inter_bytes"], row["intra_bytes"] = trainlib.counted_per_step(snap, args.steps)
        row["bytes_source"] = "counters"
        if engine.outer is not None:
            s = engine.outer.stats
            c = engine.outer.config  # the settings in force, the mode's defaults filled in
            row["outer"] = {**_outer(args), **dataclasses.asdict(c), "outer_lr": c.outer_lr,
                            "outer_momentum": c.outer_momentum, "started": s.started, "landed": s.landed,
                            "wait_s": s.wait_s, "chosen_delay": s.chosen_delay,
                            "state_bytes": engine.model_state_bytes().get("outer")}
        engine.close()
    else:
        row["inter_bytes"], row["intra_bytes"] = trainlib.modelled_bytes("ddp", psi, t)
        row["bytes_source"] = "model"
    return row


def windowed(curve: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values (fewer at the start) at every step."""
    out, acc = [], 0.0
    for i, v in enumerate(curve):
        acc += v
        if i >= window:
            acc -= curve[i - window]
        out.append(acc / min(i + 1, window))
    return out


def with_targets_from(path: str, seeds: list[int], data_order: int = 0) -> list[dict]:
    """DDP's rows for ``seeds`` (and ``data_order``) from an earlier run's JSON, each marked
    with ``"from": path`` (ValueError naming the seeds it lacks)."""
    with open(path) as f:
        earlier = json.load(f)
    refs = [{**r, "from": path} for r in earlier["rows"] if r.get("variant") == "ddp" and r.get("seed") in seeds
            and r.get("data_order", 0) == data_order]
    missing = sorted(set(seeds) - {r["seed"] for r in refs})
    if missing:
        raise ValueError(f"--target-from {path}: no DDP row for seed(s) {missing}")
    return refs


def summarize(rows: list[dict], window: int) -> None:
    """Add to every row the target (DDP's windowed loss at its last step, same seed), its time
    to reach it (None: never), the final windowed loss over DDP's, DDP's time over its own and,
    inside ``zpp cluster``, its link bytes per step over DDP's (the busiest node's each)."""
    ddp = {r["seed"]: r for r in rows if r["variant"] == "ddp"}
    smooth = [windowed(r["loss_curve"], window) for r in rows]
    for r, curve in zip(rows, smooth):  # first every final loss: DDP's row may come after the others
        r["final_loss"] = curve[-1]
    for r, curve in zip(rows, smooth):
        ref = ddp.get(r["seed"])
        if ref is None:
            continue
        target = ref["final_loss"]  # DDP's windowed loss at its last step
        hit = next((i for i, v in enumerate(curve) if v <= target), None)
        r["target_loss"] = target
        r["time_to_target_s"] = None if hit is None else r["time_curve"][hit]
        r["steps_to_target"] = None if hit is None else hit + 1
        r["final_over_ddp"] = r["final_loss"] / ref["final_loss"]
        if trainlib.busiest_eth(r) and trainlib.busiest_eth(ref):
            r["eth_over_ddp"] = trainlib.busiest_eth(r) / trainlib.busiest_eth(ref)
    for r in rows:
        ref = ddp.get(r["seed"])
        if ref is not None and ref.get("time_to_target_s") and r.get("time_to_target_s"):
            r["ddp_over_this"] = ref["time_to_target_s"] / r["time_to_target_s"]


def print_rows(rows: list[dict]) -> None:
    print(f"{'variant':<14}{'seed':>5}{'step_s':>9}{'inter_B/step':>14}{'eth_tx_B/step':>14}{'final_loss':>11}"
          f"{'final/ddp':>10}{'time_to_target_s':>17}{'ddp/this':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<14}{r.get('seed', '-'):>5} failed: {r['error']}")
            continue

        def f(k, fmt):
            v = r.get(k)
            return "-" if v is None else format(v, fmt)
        mark = "" if r["bytes_source"] == "counters" else " (model)"
        eth = trainlib.busiest_eth(r)
        print(f"{r['variant']:<14}{r['seed']:>5}{r['step_s']:>9.3f}{r['inter_bytes']:>14.0f}"
              f"{'-' if eth is None else format(eth, '.0f'):>14}{r['final_loss']:>11.4f}"
              f"{f('final_over_ddp', '.4f'):>10}{f('time_to_target_s', '.1f'):>17}{f('ddp_over_this', '.2f'):>9}{mark}")


def plot(runs: list[dict], png: str) -> None:
    """Loss against wall time (top) and against steps (bottom), one column per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 8), squeeze=False)
    colors = {v: f"C{i % 10}" for i, v in enumerate(VARIANTS + EXTRA_VARIANTS)}
    for col, run in enumerate(runs):
        window = run["args"]["window"]
        for r in run["rows"]:
            if "error" in r:
                continue
            style = "-" if r["seed"] == min(x["seed"] for x in run["rows"] if "seed" in x) else "--"
            smooth = windowed(r["loss_curve"], window)
            label = f"{r['variant']} seed {r['seed']}"
            axes[0][col].plot(r["time_curve"], smooth, style, color=colors.get(r["variant"]), label=label)
            axes[1][col].plot(range(1, len(smooth) + 1), smooth, style, color=colors.get(r["variant"]), label=label)
            if r["variant"] == "ddp":
                for ax in axes[:, col]:
                    ax.axhline(r["final_loss"], color="grey", linewidth=0.5)
        axes[0][col].set_title(f"{run['args'].get('label') or 'unshaped'}: loss (mean of last {window} steps)")
        axes[0][col].set_xlabel("wall time (s)")
        axes[0][col].set_xscale("log")
        axes[1][col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.set_ylabel("training loss")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _rank_main(t, args):
    data, _ = corpora()
    rows = []
    for seed in args.seeds:
        for name in args.variants:
            rows.append(_run(t, name, seed, args, data))
    if t.rank != 0:
        return
    if args.target_from:
        rows = with_targets_from(args.target_from, args.seeds, args.data_order) + rows
    summarize(rows, args.window)
    print(f"# diloco_bench: world={t.world_size} label={args.label or 'unshaped'} steps={args.steps} GPT "
          f"n_layer={args.n_layer} n_embd={args.n_embd} block={args.block} batch={args.batch} "
          f"params={rows[0]['params']} outer={_outer(args)} inner_stage={args.inner_stage}")
    print_rows(rows)
    run = {**runinfo.provenance(), "args": {k: v for k, v in vars(args).items() if k != "plot"}, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if args.png:
        plot([run], args.png)


def add_schedule_args(p) -> None:
    """The inner lr's schedule and the batches' order (:func:`scheduler_config`,
    :func:`data_seed`), shared with perf/diloco_study.py."""
    p.add_argument("--data-order", type=int, default=0,
                   help="0: each seed's own batches; K > 0: other batches of the same corpus, the same model init")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="the inner lr: constant, or a linear warm-up then cosine decay over --steps")
    p.add_argument("--lr-warmup", type=int, default=20, help="--lr-schedule cosine: warm-up steps")
    p.add_argument("--lr-min-ratio", type=float, default=0.1,
                   help="--lr-schedule cosine: the floor, a fraction of the lr")


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=4, n_embd=256, block=128, batch=4, steps=500, warmup=0)  # no warm-up:
    # every step counts towards the wall time
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS + EXTRA_VARIANTS)}")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (model initialisation and data)")
    p.add_argument("--window", type=int, default=20, help="steps the loss is averaged over")
    p.add_argument("--label", default="", help="what the run was (a link rate); shown in the plot")
    p.add_argument("--png", default=None, help="write the plot here (rank 0)")
    p.add_argument("--freeze-step", type=int, default=50, help="1-bit Adam's warm-up steps")
    p.add_argument("--inner-stage", type=int, default=2, help="the hierarchical mode's ZeRO stage inside the node")
    p.add_argument("--sync-every", type=int, default=50, help="zpp.outer.sync_every (H)")
    p.add_argument("--fragments", type=int, default=4, help="zpp.outer.fragments")
    p.add_argument("--delay", type=lambda v: v if v == "auto" else int(v), default=1,
                   help="zpp.outer.delay (tau), or auto")
    p.add_argument("--outer-compression", default="int4", help="zpp.outer.compression")
    p.add_argument("--outer-method", default="diloco", choices=("diloco", "sgd", "average"), help="zpp.outer.method")
    p.add_argument("--outer-lr", type=float, default=None, help="zpp.outer.lr (default: the method's, 0.7 for diloco)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="zpp.outer.momentum (default: the method's, 0.9 for diloco)")
    add_schedule_args(p)
    p.add_argument("--target-from", default=None, metavar="JSON",
                   help="take DDP's rows (the targets) from this earlier run of the same seeds and link, "
                        "to run other variants for longer without DDP")
    p.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                   help="only plot these earlier runs side by side into --png")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.plot:
        if not args.png:
            p.error("--plot needs --png")
        runs = []
        for path in args.plot:
            with open(path) as f:
                runs.append(json.load(f))
        plot(runs, args.png)
        return
    trainlib.parse_variants(p, args, VARIANTS + EXTRA_VARIANTS)
    if args.target_from and "ddp" in args.variants:
        p.error("--target-from takes DDP's rows from that file: leave ddp out of --variants")
    if args.model != "gpt":
        p.error(f"--model={args.model!r}: this benchmark trains tests/gpt.py's GPT only")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds={args.seeds!r}: comma-separated integers")
    if args.steps < 1 or args.window < 1 or not args.seeds:
        p.error(f"--steps={args.steps} and --window={args.window} must be >= 1, --seeds non-empty")
    if args.delay != "auto" and not 0 <= args.delay < args.sync_every:
        p.error(f"--delay={args.delay} must be in [0, --sync-every={args.sync_every})")
    trainlib.launch(_rank_main, args)


if __name__ == "__main__":
    main()
