"""perf/train_bench.py on the emulated cluster: every variant in fresh processes, at each rate,
one table, the engine issue's targets checked, everything in perf/results/train_cluster.json.

    sudo python perf/train_cluster.py                                # 2 nodes x 2, 100mbit and 1gbit
    sudo python perf/train_cluster.py --rates 100mbit --variants zero3,zero3-zeropp
    sudo python perf/train_cluster.py --ds-python .dsenv/bin/python  # adds DeepSpeed ZeRO-3 rows
    sudo python perf/train_cluster.py --rates 1000gbit,1gbit,100mbit   # utilization: unshaped first

Each variant runs as its own ``zpp cluster run`` (so peak memory is the variant's own and a
variant that fails cannot disturb the next), with the same model, data and step counts.
Targets (issue 5, at the slow rate): zpp stage 3's step within 10% of FSDP2's; stage 3 with
all of ZeRO++ >= 3x faster per step than stage 3, with <= 0.15 of its inter-node bytes
(counted by zpp's wire counters and measured on the node links). With an unshaped rate
(``1000gbit``: the veths' own speed) run first, each variant's compute utilization at the
slower rates (its unshaped step over its step there) and issue 25's targets: ZeRO++ >= 0.8 at
100 Mbit (the weight-delta variant's against its own unshaped step and ZeRO++'s), zpp ZeRO-3
>= 0.5 at 1 Gbit, ZeRO++ >= 8x DeepSpeed ZeRO-3 at 100 Mbit and faster than FSDP2 at every
rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import clusterlib  # noqa: E402
import train_bench  # noqa: E402
import trainlib  # noqa: E402
from zpp import cluster  # noqa: E402

MODEL_ARGS = ("model", "n_layer", "n_embd", "n_head", "block", "batch", "steps", "warmup", "unit_min_numel",
              "persistence_threshold")


def _variant(name: str, rate: str, args, tmp: Path) -> dict:
    out = tmp / f"{name}-{rate}.json"
    python = args.ds_python if name.startswith("deepspeed") else sys.executable
    cmd = [python, str(HERE / "train_bench.py"), "--variants", name, "--json", str(out)]
    for k in MODEL_ARGS:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    rc = cluster.run(cmd, nodes=args.nodes, ranks_per_node=args.ranks_per_node, backend="torch",
                     timeout=args.timeout)
    if rc != 0 or not out.exists():
        return {"variant": name, "error": f"exit code {rc}"}
    return json.loads(out.read_text())["rows"][0]



UNSHAPED_BITS = 1e11  # a rate at or above this is the unshaped profile


def utilization(rows: dict[str, dict], unshaped: dict[str, dict]) -> dict[str, float]:
    """Per variant: its unshaped step over its step in ``rows``."""
    return {k: unshaped[k]["step_s"] / r["step_s"] for k, r in rows.items()
            if "error" not in r and "error" not in unshaped.get(k, {"error": 1})}


def check(rows: dict[str, dict], slow: bool, util: dict[str, float] | None = None,
          rate_bits: float = 0.0, unshaped: dict[str, dict] | None = None) -> list[str]:
    ok = {k: r for k, r in rows.items() if "error" not in r}
    lines = []

    def say(what, value, cmp, want):
        good = value >= want if cmp == ">=" else value <= want
        lines.append(f"{what}: {value:.2f} (target {cmp} {want}) {'ok' if good else 'MISS'}")

    if "zero3" in ok and "fsdp2" in ok:
        say("zpp stage 3 step / FSDP2 step", ok["zero3"]["step_s"] / ok["fsdp2"]["step_s"], "<=", 1.10)
    if "zero3" in ok and "zero3-zeropp" in ok:
        z3, pp = ok["zero3"], ok["zero3-zeropp"]
        if slow:
            say("ZeRO++ step speedup over stage 3", z3["step_s"] / pp["step_s"], ">=", 3.0)
        say("ZeRO++ / stage 3 inter-node bytes (counters)", pp["inter_bytes"] / z3["inter_bytes"], "<=", 0.15)
        if trainlib.busiest_eth(z3) and trainlib.busiest_eth(pp):
            say("ZeRO++ / stage 3 node-link bytes (measured)", trainlib.busiest_eth(pp) / trainlib.busiest_eth(z3),
                "<=", 0.15)
    if util:  # issue 25
        if "zero3-zeropp" in util and rate_bits <= 2e8:
            say("ZeRO++ compute utilization", util["zero3-zeropp"], ">=", 0.8)
        delta = "zero3-zeropp-delta4"
        if delta in util and rate_bits <= 2e8:
            say("ZeRO++ with weight deltas compute utilization", util[delta], ">=", 0.8)
            plain = (unshaped or {}).get("zero3-zeropp", {"error": 1})
            if "error" not in plain:  # the stricter measure: the faster unshaped step of the two
                say("ZeRO++ with weight deltas: ZeRO++'s unshaped step / its step",
                    plain["step_s"] / ok[delta]["step_s"], ">=", 0.8)
        if "zero3" in util and 5e8 <= rate_bits <= 2e9:
            say("zpp ZeRO-3 compute utilization", util["zero3"], ">=", 0.5)
    if "zero3-zeropp" in ok and "deepspeed3" in ok and slow:
        say("ZeRO++ step speedup over DeepSpeed ZeRO-3", ok["deepspeed3"]["step_s"] / ok["zero3-zeropp"]["step_s"],
            ">=", 8.0)
    if "zero3-zeropp" in ok and "fsdp2" in ok:
        say("ZeRO++ step speedup over FSDP2", ok["fsdp2"]["step_s"] / ok["zero3-zeropp"]["step_s"], ">=", 1.0)
    return lines


def main(argv=None) -> int:
    bp = train_bench.parser()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--variants", default="ddp,fsdp2,deepspeed3,zero1,zero2,zero3,zero3-qwz,zero3-hpz,"
                    "zero3-qgz,zero3-zeropp,deepspeed3-zeropp")
    ap.add_argument("--ds-python", default=None,
                    help="a Python that can import deepspeed (and zpp); without it DeepSpeed rows are skipped")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--unit-min-numel", type=int, default=bp.get_default("unit_min_numel"))
    ap.add_argument("--persistence-threshold", type=int, default=bp.get_default("persistence_threshold"))
    ap.add_argument("--model", choices=("gpt", "hf-gpt2"), default="gpt")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(HERE / "results" / "train_cluster.json"))
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in train_bench.VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {list(train_bench.VARIANTS)}")
    if args.ds_python is None:
        variants = [v for v in variants if not v.startswith("deepspeed")]
    record = clusterlib.new_record(args.nodes, args.ranks_per_node,
                                   model={k: getattr(args, k) for k in MODEL_ARGS})
    with tempfile.TemporaryDirectory() as tmp:
        unshaped: dict[str, dict] = {}

        def one_rate(rate: str, rate_bits: int) -> None:
            rows = {}
            for v in variants:
                rows[v] = _variant(v, rate, args, Path(tmp))
                print(f"[{rate}] {v}: " + (rows[v].get("error") or f"{rows[v]['step_s']:.2f} s/step"),
                      file=sys.stderr, flush=True)
            if rate_bits >= UNSHAPED_BITS:
                unshaped.update(rows)
            util = utilization(rows, unshaped) if unshaped and rate_bits < UNSHAPED_BITS else {}
            lines = check(rows, slow=rate_bits <= 2e8, util=util, rate_bits=rate_bits, unshaped=unshaped)
            if util:
                lines.insert(0, "compute utilization (unshaped step / step): "
                             + ", ".join(f"{k} {v:.2f}" for k, v in util.items()))
            record["runs"].append({"rate": rate, "rows": list(rows.values()), "checks": lines,
                                   "utilization": util})
            params = next((r["params"] for r in rows.values() if "params" in r), "?")
            print(f"\n## {rate}, {args.nodes} nodes x {args.ranks_per_node} ranks, {args.model} {args.n_layer} x "
                  f"{args.n_embd}, {params} parameters, batch {args.batch} x {args.block} per rank")
            train_bench.print_rows(list(rows.values()))
            for line in lines:
                print("  " + line)

        clusterlib.at_each_rate(args.nodes, args.rates, one_rate)
    clusterlib.save(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
