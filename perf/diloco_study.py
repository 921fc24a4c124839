"""Equal-token loss of the hierarchical mode against DDP over model sizes, seeds and outer
settings (issue 23), on perf/diloco_bench.py's runs: the same GPT family, data and per-rank
batches; one world for the whole study, DDP once per size and seed.

    python perf/diloco_study.py --world 2 --ranks-per-node 1 --batch 8 --steps 400 \\
        --sizes 4x64,4x128,8x128 --seeds 1,2 --settings defaults,bench \\
        --json perf/results/diloco_study.json

A size is ``LAYERSxWIDTH`` (4 heads, ``--block`` characters). A setting is a name from
:data:`SETTINGS` or ``name:key=value,key=value`` with the keys of ``zpp.outer``
(``lr``, ``momentum``, ``sync_every``, ``fragments``, ``delay``, ``mix``, ``compression``,
``method``, ``nesterov``, ...); ``defaults`` is ``{}``, the mode's own defaults (H = 5, 4
fragments, delay 1, int4; ``--sync-every`` sets H for every setting that does not name it).

Besides the training loss (the windowed mean of the batches just trained on, which moves
with what those batches hold), every run's loss on ``--eval-batches`` fixed batches of
held-out text (the stdlib files after the training bytes, perf/diloco_bench.py's
:func:`corpora`) is taken at DDP's last step: ``eval_over_ddp`` compares the models, not
the batches.

The losses do not depend on the link (the outer updates land at fixed steps), so the study
runs unshaped. Rank 0 prints one line per run and rewrites ``--json`` after each, so an
interrupted study keeps what it finished; ``--table JSON... --png PNG`` prints and plots
earlier runs. ``step_s`` is this machine's unshaped step; the time to DDP's loss at a link
rate is estimated from it (see :func:`time_at_link`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diloco_bench  # noqa: E402
import runinfo  # noqa: E402
import trainlib  # noqa: E402

#: named outer settings (the keys of ``zpp.outer``)
SETTINGS: dict[str, dict] = {
    "defaults": {},
    # the cluster runs' setting of perf/BENCHMARKS.md (issue 23's "current settings")
    "bench": {"sync_every": 10, "fragments": 4, "delay": 1, "compression": "int4", "lr": 0.5},
}


def parse_setting(text: str) -> tuple[str, dict]:
    """``name`` (from :data:`SETTINGS`) or ``name:key=value,...`` -> (name, outer section)."""
    name, _, rest = text.partition(":")
    if not rest:
        if name not in SETTINGS:
            raise ValueError(f"setting {name!r} is not one of {sorted(SETTINGS)} and has no ':key=value'")
        return name, dict(SETTINGS[name])
    out = {}
    for kv in rest.split(","):
        k, _, v = kv.partition("=")
        if not _:
            raise ValueError(f"setting {text!r}: {kv!r} is not key=value")
        try:
            out[k] = json.loads(v)
        except ValueError:  # a name: "int4", "topk", "average", ...
            out[k] = v
    return name, out


def parse_size(text: str) -> tuple[int, int]:
    layers, _, width = text.partition("x")
    return int(layers), int(width)


def time_at_link(row: dict, ddp: dict, mbit: float) -> dict:
    """Estimated seconds to DDP's final loss at ``mbit`` Mbit/s per node link.

    A step costs its measured unshaped compute time plus, for DDP (whose all-reduce blocks
    the step), its bytes per node per step over the link; the hierarchical mode's syncs run
    behind ``delay`` steps, so its step costs the larger of its compute and its bytes per
    step over the link (0 delay: the sum). Bytes per node = zpp's counters per rank times the
    ranks per node (DDP's: the counters' all-reduce model)."""
    rate = mbit * 1e6 / 8
    per_node = row["ranks_per_node"]

    def step_s(r: dict, overlapped: bool) -> float:
        link = r["inter_bytes"] * per_node / rate
        return max(r["step_s"], link) if overlapped else r["step_s"] + link
    ddp_step = step_s(ddp, False)
    this_step = step_s(row, bool(row.get("outer", {}).get("delay")))
    out = {"ddp_step_s": ddp_step, "step_s": this_step}
    if ddp.get("steps_to_target") and row.get("steps_to_target"):
        out["ddp_s"] = ddp["steps_to_target"] * ddp_step
        out["this_s"] = row["steps_to_target"] * this_step
        out["ddp_over_this"] = out["ddp_s"] / out["this_s"]
    return out


def _rank_main(t, args):
    data, held = diloco_bench.corpora()
    rows: list[dict] = []
    for size in args.sizes:
        for seed in args.seeds:
            ddp = None
            for name, outer in [("ddp", None), *args.settings]:  # DDP first: the target
                a = argparse.Namespace(**vars(args))
                a.n_layer, a.n_embd = size
                if outer is not None:
                    h = {} if args.sync_every is None else {"sync_every": args.sync_every}
                    a.outer_config = {**h, **outer}
                variant = "ddp" if outer is None else "diloco"
                a.lr_total_steps = args.steps  # a decaying lr ends at DDP's last step for every run
                a.eval_at = (args.steps,)  # the held-out loss at equal tokens
                if outer is not None:  # longer, to see when it reaches DDP's final loss
                    a.steps = args.steps + args.extra_steps
                row = diloco_bench._run(t, variant, seed, a, data, held)
                if t.rank != 0:
                    continue
                row.update(size=f"{size[0]}x{size[1]}", setting=name, ranks_per_node=args.ranks_per_node)
                if outer is not None:
                    row["outer"] = {**row.get("outer", {}), **a.outer_config}
                pair = [ddp, row] if ddp is not None else [row]
                diloco_bench.summarize(pair, args.window)
                # equal tokens: the windowed loss at DDP's last step
                row["equal_token_loss"] = diloco_bench.windowed(row["loss_curve"], args.window)[args.steps - 1]
                if ddp is None:
                    ddp = row
                else:
                    row["final_over_ddp"] = row["equal_token_loss"] / ddp["final_loss"]
                    if "eval_loss" in row and "eval_loss" in ddp:  # held out, at equal tokens
                        key = str(args.steps)
                        row["eval_over_ddp"] = row["eval_loss"][key] / ddp["eval_loss"][key]
                    row["at_10mbit"] = time_at_link(row, ddp, 10.0)
                rows.append(row)
                r10 = row.get("at_10mbit", {})
                print(f"{row['size']:>6} seed {seed} {name:<24} params {row['params']:>8} step {row['step_s']:.3f} s "
                      f"inter {row['inter_bytes']:>10.0f} B/step  final {row['final_loss']:.4f}  "
                      f"/ddp {row.get('final_over_ddp', 1.0):.4f}  held-out /ddp {row.get('eval_over_ddp', 1.0):.4f}  "
                      f"steps to DDP's {row.get('steps_to_target')}  "
                      f"10Mbit ddp/this {r10.get('ddp_over_this', float('nan')):.1f}", flush=True)
                if args.json:
                    run = {**runinfo.provenance(), "args": {k: v for k, v in vars(args).items()}, "rows": rows}
                    with open(args.json, "w") as f:
                        json.dump(run, f, indent=1)


def table(paths: list[str]) -> str:
    """A markdown table of the study JSONs at ``paths``: per size, seed and setting the
    equal-token loss over DDP's (training window, and held-out where taken), the steps to
    DDP's final loss, the link bytes over DDP's and the estimated 10 Mbit speed-up
    (:func:`time_at_link`)."""
    lines = ["| size (params) | seed | setting | DDP's loss (training window) | loss / DDP's | held-out / DDP's | "
             "steps to DDP's loss | link bytes / DDP's | 10 Mbit: DDP's time / this (est.) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        ddp = {(r["size"], r["seed"]): r for r in rows if r["variant"] == "ddp"}
        for r in rows:
            if r["variant"] == "ddp":
                continue
            d = ddp[(r["size"], r["seed"])]
            est = r.get("at_10mbit", {}).get("ddp_over_this")
            held = r.get("eval_over_ddp")
            lines.append(f"| {r['size']} ({r['params']:,}) | {r['seed']} | {r['setting']} | {d['final_loss']:.4f} | "
                         f"{r['final_over_ddp']:.4f} | {'-' if held is None else format(held, '.4f')} | "
                         f"{r.get('steps_to_target') or '> %d' % r['steps']} | "
                         f"1/{d['inter_bytes'] / r['inter_bytes']:.0f} | {'-' if est is None else format(est, '.0f')} |")
    return "\n".join(lines)


def plot(paths: list[str], png: str) -> None:
    """The study JSONs at ``paths`` as a picture: per run, the held-out loss over DDP's (the
    training window's where no held-out loss was taken) against the model's parameters, one
    colour per setting and world, with DDP's loss and the issue's 2% marked; and the estimated
    10 Mbit speed-up against DDP where the run reached DDP's loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours: dict[str, str] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        world = f"{run['args']['world'] // run['args']['ranks_per_node']}x{run['args']['ranks_per_node']}"
        for r in run["rows"]:
            if r["variant"] == "ddp":
                continue
            h = r.get("outer", {}).get("sync_every")
            key = f"{r['setting']}{'' if h is None else f' H={h}'} ({world}, batch {run['args']['batch']})"
            colour = colours.setdefault(key, f"C{len(colours) % 10}")
            ratio = r.get("eval_over_ddp", r["final_over_ddp"])
            loss_ax.scatter(r["params"], ratio, color=colour, label=key, s=18)
            speed = r.get("at_10mbit", {}).get("ddp_over_this")
            if speed is not None:
                time_ax.scatter(r["params"], speed, color=colour, label=key, s=18)
    for ax in (loss_ax, time_ax):
        ax.set_xscale("log")
        ax.set_xlabel("model parameters")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one legend entry per setting
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    loss_ax.axhline(1.0, color="grey", linewidth=0.8)
    loss_ax.axhline(1.02, color="grey", linewidth=0.8, linestyle="--")
    loss_ax.set_ylabel("loss / DDP's at equal tokens (held-out where taken)")
    time_ax.axhline(10.0, color="grey", linewidth=0.8, linestyle="--")
    time_ax.set_yscale("log")
    time_ax.set_ylabel("10 Mbit: DDP's time to its loss / this (est.)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(p, n_layer=4, n_embd=64, block=64, batch=8, steps=400, warmup=0)
    p.add_argument("--sizes", default="4x64,4x128", help="comma-separated LAYERSxWIDTH")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--settings", default="defaults;bench", help="semicolon-separated settings (see the docstring)")
    p.add_argument("--sync-every", type=int, default=None,
                   help="H, unless a setting names sync_every (default: the mode's, 5)")
    p.add_argument("--inner-stage", type=int, default=2)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=16,
                   help="held-out batches (of --batch sequences) whose mean loss at DDP's last step is "
                        "compared too; 0: none")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="only print a markdown table of earlier runs")
    p.add_argument("--png", default=None, help="with --table: also plot those runs into this PNG")
    p.add_argument("--extra-steps", type=int, default=200,
                   help="steps the hierarchical runs train beyond DDP's (to reach DDP's final loss)")
    diloco_bench.add_schedule_args(p)  # a decaying schedule ends at --steps for every run
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.png and not args.table:
        p.error("--png plots the JSONs given with --table")
    if args.table:
        print(table(args.table))
        if args.png:
            plot(args.table, args.png)
        return
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
        args.settings = [parse_setting(s) for s in args.settings.split(";") if s]
    except ValueError as e:
        p.error(str(e))
    trainlib.launch(_rank_main, args)


if __name__ == "__main__":
    main()
