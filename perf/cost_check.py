"""zpp/tune/cost.py against measurement on the emulated cluster: for each cluster shape, rate
and ZeRO mode, the predicted step time, bytes and memory beside the measured ones.

    sudo python perf/cost_check.py                                   # 2x2,3x2,4x1 x 4 rates
    sudo python perf/cost_check.py --shapes 2x2 --rates 100mbit --modes zero3,zero3-zeropp

Time: the profile is each mode's step on the same cluster shape without shaping (the first
rate, "unshaped": 1000gbit veths, limited by this machine's copies), less the model's
communication time on the unshaped links as perf/link_probe.py measures them (the all-gather
probe of ``zpp tune --job``): that is the mode's compute here, quantization and the
engine's own work included (on a real cluster: one node's run). The shaped rates are
then predicted; the unshaped rows are the profile and are not counted in the errors.
Memory: predicted from one rank with no communication at all, measured once in this process
(the GPT's forward + backward and AdamW over all its parameters: peak RSS less its 16 bytes
per parameter of model states is what a rank holds beside the states), plus each mode's
model-state peak (zpp/tune/cost.py): nothing of the cluster runs goes into it. Each mode
runs in its own ``zpp cluster run`` of perf/train_bench.py (so its peak memory is its own);
the measured row gives the step time, zpp's counters, the kernel's node-link bytes and the
peak RSS.

Errors are ``|predicted - measured| / measured``; the bytes per step must be exact. Output:
a table per shape and rate, the medians, and --out (JSON with date, host, command, revision).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import clusterlib  # noqa: E402
import runinfo  # noqa: E402
import trainlib  # noqa: E402
from zpp import cluster  # noqa: E402
from zpp.tune import cost, job  # noqa: E402

UNSHAPED = "1000gbit"  # the veths are then limited by the machine's copies, not by tc
MODES = ("zero1", "zero2", "zero3", "zero3-qwz", "zero3-hpz", "zero3-qgz", "zero3-zeropp")


def measure_profile(args) -> dict:
    """One rank, no communication: seconds of forward + backward and of the AdamW step, the
    quantizer's seconds per element (int8 and int4, quantize + dequantize), peak RSS."""
    import zpp.quant as zq
    from tests.gpt import CharCorpus

    torch.set_num_threads(1)
    model = trainlib.make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = CharCorpus(max_bytes=2_000_000)
    g = torch.Generator().manual_seed(0)
    fb, st = [], []
    for i in range(args.warmup + args.profile_steps):
        x, y = data.batch(args.batch, args.block, g)
        t0 = time.perf_counter()
        model(x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= args.warmup:
            fb.append(t1 - t0)
            st.append(t2 - t1)
    x = torch.randn(1 << 20)
    quant = {}
    for bits in (8, 4):
        zq.dequantize(zq.quantize(x, bits=bits, group_size=2048))
        t0 = time.perf_counter()
        for _ in range(5):
            zq.dequantize(zq.quantize(x, bits=bits, group_size=2048))
        quant[bits] = (time.perf_counter() - t0) / 5 / x.numel()
    psi = sum(p.numel() for p in model.parameters())
    return {"params": psi, "fwd_bwd_s": statistics.median(fb), "opt_s": statistics.median(st),
            "quant_s_per_elem": quant, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "cores": os.cpu_count()}


def compute_s(mode: cost.Mode, prof: dict, units, world: int) -> float:
    """The mode's compute on this machine (see the module docstring)."""
    opt = prof["opt_s"] / (world if mode.stage >= 1 else 1)
    psi = prof["params"]
    q = 0.0
    if mode.weight_bits is not None:  # every rank quantizes its shard, dequantizes the unit
        q += psi * (1 + 1 / world) * prof["quant_s_per_elem"][mode.weight_bits] / 2
    if mode.gradient_bits is not None:  # two quantizations and dequantizations of the gradient
        q += 2 * psi / max(1, world // 2) * prof["quant_s_per_elem"][mode.gradient_bits]
    share = max(1.0, world / prof["cores"])
    return (prof["fwd_bwd_s"] + opt + q) * share


def run_mode(mode: str, shape: tuple[int, int], args, tmp: Path) -> dict:
    nodes, rpn = shape
    out = tmp / f"{mode}.json"
    cmd = [sys.executable, str(HERE / "train_bench.py"), "--variants", mode, "--json", str(out),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
           "--block", str(args.block), "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--unit-min-numel", str(args.unit_min_numel)]
    rc = cluster.run(cmd, nodes=nodes, ranks_per_node=rpn, backend="torch", timeout=args.timeout)
    if rc != 0 or not out.exists():
        return {"variant": mode, "error": f"exit code {rc}"}
    return json.loads(out.read_text())["rows"][0]


def run_probe(shape: tuple[int, int], args, tmp: Path) -> dict:
    """perf/link_probe.py on the cluster: the unshaped links' bandwidth."""
    out = tmp / "probe.json"
    rc = cluster.run([sys.executable, str(HERE / "link_probe.py"), "--json", str(out)], nodes=shape[0],
                     ranks_per_node=shape[1], backend="torch", timeout=args.timeout)
    if rc != 0 or not out.exists():
        return {"error": f"exit code {rc}"}
    return json.loads(out.read_text())


def compare(row: dict, mode: cost.Mode, shape, rate: str, prof: dict, unshaped: dict | None,
            other_bytes: int | None = None, probe: dict | None = None) -> dict:
    nodes, rpn = shape
    intra, fast = job.links_from_probe(probe) if probe else (cost.LINKS["loopback"], cost.LINKS["loopback"])
    c = cost.Cluster(nodes, rpn, intra, fast if rate == UNSHAPED else cost.LINKS[rate])
    units = cost.units_from_trace([n for n, _ in row["units"]], [bool(p) and mode.stage == 3 for _, p in row["units"]],
                                  [tuple(e) for e in row["gather_trace"]])
    if unshaped is not None:  # the mode's compute here: its unshaped step less its communication
        loop = cost.Cluster(nodes, rpn, intra, fast)
        compute = cost.compute_from_step(unshaped["step_s"], cost.traffic(mode, units, loop), loop)
    else:
        compute = compute_s(mode, prof, units, c.world)
    other = prof["peak_rss_bytes"] - 16 * prof["params"] if other_bytes is None else other_bytes
    profile = cost.Profile(compute, other_bytes=other)
    pred = cost.predict([mode], units=units, cluster=c, profile=profile)[0]
    eth = max(row.get("eth_tx_bytes_per_node") or [0])
    measured_peak = row["peak_rss_mib"] * 2**20

    def err(p, m):
        return abs(p - m) / m if m else None
    return {
        "shape": f"{nodes}x{rpn}", "rate": rate, "mode": mode.name,
        "profile": "unshaped step" if unshaped is not None else "one rank",
        "step_s": row["step_s"], "pred_step_s": pred.step_s, "step_err": err(pred.step_s, row["step_s"]),
        "compute_s": profile.compute_s, "pred_comm_s": pred.comm_s,
        "inter_bytes": row["inter_bytes"], "pred_inter_bytes": pred.inter_bytes,
        "intra_bytes": row["intra_bytes"], "pred_intra_bytes": pred.intra_bytes,
        "bytes_exact": pred.inter_bytes == row["inter_bytes"] and pred.intra_bytes == row["intra_bytes"],
        "eth_tx_bytes": eth, "pred_node_link_bytes": pred.node_link_bytes,
        "link_err": err(pred.node_link_bytes, eth) if eth and nodes > 1 else None,
        "peak_bytes": measured_peak, "pred_peak_bytes": pred.peak_bytes, "mem_err": err(pred.peak_bytes, measured_peak),
        "state_bytes": row["model_state_bytes"], "pred_state_bytes": pred.state_rest,
    }


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_rows(rows):
    print(f"{'shape':<6}{'rate':<9}{'mode':<14}{'step_s':>8}{'pred':>8}{'err':>7}{'link_err':>9}"
          f"{'bytes':>7}{'peak_MiB':>9}{'pred':>7}{'err':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<6}{r['rate']:<9}{r['mode']:<14} failed: {r['error']}")
            continue
        print(f"{r['shape']:<6}{r['rate']:<9}{r['mode']:<14}{r['step_s']:>8.3f}{r['pred_step_s']:>8.3f}"
              f"{_fmt(r['step_err'], '.1%'):>7}{_fmt(r['link_err'], '.1%'):>9}"
              f"{'exact' if r['bytes_exact'] else 'DIFF':>7}{r['peak_bytes'] / 2**20:>9.0f}"
              f"{r['pred_peak_bytes'] / 2**20:>7.0f}{_fmt(r['mem_err'], '.1%'):>7}")


def summary(rows) -> dict:
    ok = [r for r in rows if "error" not in r]

    def med(key, sel=lambda r: True):
        v = [r[key] for r in ok if r[key] is not None and sel(r) and (key != "step_err" or r["rate"] != UNSHAPED)]
        return statistics.median(v) if v else None
    out = {"step_err_median": med("step_err"), "mem_err_median": med("mem_err"),
           "link_err_median": med("link_err"), "bytes_exact": all(r["bytes_exact"] for r in ok),
           "failed": len(rows) - len(ok)}
    for rate in sorted({r["rate"] for r in ok}):
        out[f"step_err_median_{rate}"] = med("step_err", lambda r, rate=rate: r["rate"] == rate)
    # the choice: the mode with the least predicted step, against the measured fastest
    picks = []
    for key in sorted({(r["shape"], r["rate"]) for r in ok if r["rate"] != UNSHAPED}):
        group = [r for r in ok if (r["shape"], r["rate"]) == key]
        chosen = min(group, key=lambda r: r["pred_step_s"])
        fastest = min(group, key=lambda r: r["step_s"])
        picks.append({"shape": key[0], "rate": key[1], "chosen": chosen["mode"], "fastest": fastest["mode"],
                      "chosen_over_fastest": chosen["step_s"] / fastest["step_s"]})
    out["choices"] = picks
    return out


def derive(raw: list[dict], prof: dict) -> list[dict]:
    """The comparison rows from the measured ones: per shape, each mode's unshaped row is its
    time profile, and the first mode's unshaped peak less its predicted model states is what a
    rank holds beside them (the memory calibration: that row's memory error is not counted)."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in raw):
        nodes, rpn = (int(v) for v in shape.split("x"))
        mine = [r for r in raw if r["shape"] == shape]
        probe = next((r["row"] for r in mine if r["mode"] == "probe" and "error" not in r["row"]), None)
        mine = [r for r in mine if r["mode"] != "probe"]
        base = {r["mode"]: r["row"] for r in mine if r["rate"] == UNSHAPED and "error" not in r["row"]}
        other, calib = None, None
        if base:
            calib, first = next(iter(base.items()))
            c = cost.Cluster(nodes, rpn, cost.LINKS["loopback"], cost.LINKS["loopback"])
            units = cost.units_from_trace([n for n, _ in first["units"]], [False] * len(first["units"]),
                                          [tuple(e) for e in first["gather_trace"]])
            other = int(first["peak_rss_mib"] * 2**20 - cost.memory(cost.MODES[calib], units, c)["peak"])
        for r in mine:
            if "error" in r["row"]:
                rows.append({"shape": shape, "rate": r["rate"], "mode": r["mode"], "error": r["row"]["error"]})
                continue
            out = compare(r["row"], cost.MODES[r["mode"]], (nodes, rpn), r["rate"], prof, base.get(r["mode"]), other,
                          probe)
            if r["mode"] == calib and r["rate"] == UNSHAPED:
                out["mem_err"] = None  # the calibration
            rows.append(out)
    return rows


def markdown(record: dict) -> str:
    """The tables for perf/BENCHMARKS.md: per shape and rate, the step-time errors (median and
    worst), the node-link byte error, bytes exact or not, the memory error, and the choice."""
    ok = [r for r in record["runs"] if "error" not in r]
    choice = {(c["shape"], c["rate"]): c for c in record["summary"]["choices"]}
    lines = ["| shape | rate | modes | step error median (worst) | node-link bytes error median | counters | "
             "peak memory error median | predicted fastest | measured fastest | chosen / fastest |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["shape"], r["rate"]) for r in ok):
        g = [r for r in ok if (r["shape"], r["rate"]) == key]
        steps = [r["step_err"] for r in g if r["rate"] != UNSHAPED]
        links = [r["link_err"] for r in g if r["link_err"] is not None]
        mems = [r["mem_err"] for r in g if r["mem_err"] is not None]
        c = choice.get(key)
        step = "(profile)" if key[1] == UNSHAPED else f"{statistics.median(steps):.1%} ({max(steps):.1%})"
        pick = (f"{c['chosen']} | {c['fastest']} | {c['chosen_over_fastest']:.2f}" if c else "- | - | -")
        lines.append(f"| {key[0]} | {'unshaped' if key[1] == UNSHAPED else key[1]} | {len(g)} | {step} | "
                     f"{statistics.median(links):.1%} | {'exact' if all(r['bytes_exact'] for r in g) else 'DIFF'} | "
                     f"{statistics.median(mems):.1%} | {pick} |")
    s = record["summary"]
    lines.append("")
    lines.append(f"Over every shaped row: step error median {s['step_err_median']:.1%}, node-link bytes "
                 f"{s['link_err_median']:.1%}, peak memory {s['mem_err_median']:.1%}; counters exact: "
                 f"{s['bytes_exact']}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainlib.add_model_args(ap, n_layer=4, n_embd=256, block=128, batch=4, steps=2, warmup=1)
    ap.add_argument("--shapes", default="2x2,3x2,4x1")
    ap.add_argument("--rates", default=f"{UNSHAPED},1gbit,100mbit,10mbit")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--unit-min-numel", type=int, default=100_000)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--probe-only", action="store_true", help="only the unshaped link probe of each shape")
    ap.add_argument("--recompute", default=None, metavar="FILES",
                    help="comma-separated earlier --out files: merge their measured rows, derive again, write --out")
    ap.add_argument("--out", default=str(HERE / "results" / "cost_check.json"))
    args = ap.parse_args(argv)
    if args.recompute:
        records = [json.loads(Path(f).read_text()) for f in args.recompute.split(",")]
        record = {**records[0], **runinfo.provenance(),
                  "merged_from": [{k: r.get(k) for k in ("date", "command", "git_revision")} for r in records],
                  "raw": [x for r in records for x in r["raw"]]}
        record["runs"] = derive(record["raw"], record["profile"])
        record["summary"] = summary(record["runs"])
        clusterlib.save(record, args.out)
        print_rows(record["runs"])
        print(json.dumps(record["summary"], indent=1))
        print(markdown(record))
        return 0
    modes = [cost.MODES[m] for m in args.modes.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    prof = measure_profile(args)
    print(f"# profile (1 rank, no communication): {json.dumps(prof)}", flush=True)
    record = clusterlib.new_record(args.shapes, None, model={k: getattr(args, k) for k in (
        "n_layer", "n_embd", "n_head", "block", "batch", "steps", "warmup", "unit_min_numel")}, profile=prof)
    record["raw"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            def body(rate, _bits, shape=shape):
                if rate == UNSHAPED:
                    record["raw"].append({"shape": f"{shape[0]}x{shape[1]}", "rate": rate, "mode": "probe",
                                          "row": run_probe(shape, args, Path(tmp))})
                    print(f"# {shape[0]}x{shape[1]} link probe: {json.dumps(record['raw'][-1]['row'])}", flush=True)
                    record["runs"] = derive(record["raw"], prof)
                    record["summary"] = summary(record["runs"])
                    clusterlib.save(record, args.out)
                for m in modes if not args.probe_only else ():
                    row = run_mode(m.name, shape, args, Path(tmp))
                    record["raw"].append({"shape": f"{shape[0]}x{shape[1]}", "rate": rate, "mode": m.name, "row": row})
                    record["runs"] = derive(record["raw"], prof)
                    record["summary"] = summary(record["runs"])
                    print_rows(record["runs"][-1:])
                    clusterlib.save(record, args.out)
            clusterlib.at_each_rate(shape[0], args.rates, body)
    print()
    print_rows(record["runs"])
    print(json.dumps(record["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
