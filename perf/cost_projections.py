"""The cost model's projections at 16, 64, 256 and 1024 ranks (8 per node) for the benchmark
GPT (25M) and Llama-2-shaped 7B and 70B models, and its check against the ZeRO++ paper's
figures; no run, pure arithmetic (zpp/tune/cost.py).

    python perf/cost_projections.py                 # prints the tables, writes the JSON
    python perf/cost_projections.py --inter 100gbit --mfu 0.3

Assumptions (all in the JSON): bf16 parameters on the wire (2 bytes), gradients reduced in
fp32 as zpp does (a DeepSpeed-like 16-bit reduction is shown beside it for the paper check),
NVLink 4 inside a node (450 GB/s a direction), the inter-node rate per node, compute from
FLOPs (6 x params x tokens / (989 TFLOPS x mfu), H100 bf16 dense), 4096 tokens per rank and
step, no overlap of communication with compute (zpp today), Adam's fp32 moments, no
activations in the memory column.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import clusterlib  # noqa: E402
from zpp.tune import cost  # noqa: E402
from zpp.tune.predict import MODELS, model_units  # noqa: E402

RANKS = (16, 64, 256, 1024)
PER_NODE = 8
SHOWN = ("zero2", "zero3", "zero3-zeropp", "onebit-adam", "outer-int4")


def project(model: str, ranks: int, inter: str, args) -> dict:
    units = model_units(model, None, 0)
    psi = sum(u.numel for u in units)
    c = cost.Cluster(ranks // PER_NODE, PER_NODE, cost.LINKS["nvlink"], cost.LINKS[inter])
    prof = cost.Profile.from_flops(psi, args.tokens, peak_flops=args.peak_tflops * 1e12, mfu=args.mfu)
    rows = cost.predict(cost.MODES.values(), units=units, cluster=c, profile=prof, param_bytes=2)
    return {"model": model, "params": psi, "ranks": ranks, "inter": inter, "compute_s": prof.compute_s,
            "rows": [r.to_dict() for r in rows]}


def paper_check(args) -> dict:
    """ZeRO++ (arXiv 2306.10209): 4x less cross-node volume than ZeRO-3, up to 2.16x throughput
    at 384 GPUs on a low-bandwidth network. Bytes here for a 16-bit reduction (the paper's) and
    for zpp's fp32 one; the speed-up at 384 ranks for the 7B and 70B shapes per link."""
    out: dict = {"paper": {"volume_ratio": 4.0, "speedup_384": 2.16}, "rows": []}
    c = cost.Cluster(48, PER_NODE, cost.LINKS["nvlink"], cost.LINKS["100gbit"])
    units = model_units("7b", None, 0)
    for gb in (2, 4):
        z3 = cost.traffic(cost.MODES["zero3"], units, c, param_bytes=2, grad_bytes=gb)
        pp = cost.traffic(cost.MODES["zero3-zeropp"], units, c, param_bytes=2, grad_bytes=gb)
        out[f"volume_ratio_grad{gb * 8}"] = z3.node_link_bytes / pp.node_link_bytes
    for model in ("7b", "70b"):
        units = model_units(model, None, 0)
        psi = sum(u.numel for u in units)
        prof = cost.Profile.from_flops(psi, args.tokens, peak_flops=args.peak_tflops * 1e12, mfu=args.mfu)
        for inter in ("10gbit", "100gbit", "400gbit", "3200gbit"):
            c = cost.Cluster(48, PER_NODE, cost.LINKS["nvlink"], cost.LINKS[inter])
            t = {}
            for name in ("zero3", "zero3-zeropp"):
                t[name], _ = cost.step_time(cost.traffic(cost.MODES[name], units, c, param_bytes=2, grad_bytes=2),
                                            c, prof)
            out["rows"].append({"model": model, "inter": inter, "zero3_s": t["zero3"], "zeropp_s": t["zero3-zeropp"],
                                "speedup": t["zero3"] / t["zero3-zeropp"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inter", default="100gbit,400gbit", help="inter-node rates per node (presets)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step (default: 4096)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--out", default=str(HERE / "results" / "cost_projections.json"))
    args = ap.parse_args(argv)
    record = clusterlib.new_record(None, PER_NODE, assumptions={
        "param_bytes": 2, "grad_bytes": 4, "intra": "nvlink", "tokens_per_rank": args.tokens,
        "peak_tflops": args.peak_tflops, "mfu": args.mfu, "overlap": 0.0})
    for inter in args.inter.split(","):
        for model in MODELS:
            print(f"\n{model} ({sum(u.numel for u in model_units(model, None, 0)) / 1e9:.3g}B), inter {inter}, "
                  f"8 ranks per node: step s (state GB per rank at rest)")
            print(f"{'ranks':>6}" + "".join(f"{m:>22}" for m in SHOWN))
            for n in RANKS:
                p = project(model, n, inter, args)
                record["runs"].append(p)
                by = {r["mode"]: r for r in p["rows"]}
                print(f"{n:>6}" + "".join(f"{by[m]['step_s']:>13.3g} ({by[m]['state_rest'] / 1e9:>5.3g})"
                                          for m in SHOWN))
    record["paper_check"] = paper_check(args)
    pc = record["paper_check"]
    print(f"\nZeRO++ check: cross-node bytes ZeRO-3 / ZeRO++ (7B, 384 ranks): {pc['volume_ratio_grad16']:.2f}x with "
          f"16-bit gradients (paper: 4x), {pc['volume_ratio_grad32']:.2f}x with zpp's fp32 reduction")
    for r in pc["rows"]:
        print(f"  {r['model']:>4} at 384 ranks, {r['inter']:>8}: ZeRO++ {r['speedup']:.2f}x ZeRO-3 "
              f"({r['zero3_s']:.3g} s vs {r['zeropp_s']:.3g} s; paper: up to 2.16x)")
    clusterlib.save(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
