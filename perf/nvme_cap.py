"""A job under a memory cap: in memory it is killed, with the optimizer state on NVMe it trains.

    sudo python perf/nvme_cap.py --cap-mib 2300 --json perf/results/nvme_cap.json

Each run is perf/train_bench.py (2 gloo ranks, stage 3, AdamW, the same data) started inside
a fresh cgroup (v1 ``memory`` controller, or v2) whose limit is ``--cap-mib`` for the whole
job: both ranks, their threads and the page cache they cause. The run in memory and the run
with ``offload_optimizer.device: "nvme"`` get the same cap; then both run again without a cap
for the reference losses and the job's peak (the cgroup's ``max_usage_in_bytes`` /
``memory.peak``). Changes the host (a cgroup under /sys/fs/cgroup, removed after): root only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runinfo  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from tests.memcap import Cgroup  # noqa: E402  (the cgroup the opt-in tests use too)


def one(variant: str, cap: int | None, args, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(HERE / "train_bench.py"), "--world", "2", "--variants", variant,
               "--nvme-path", str(args.nvme_path), "--json", str(out), *extra]
        env = dict(os.environ)
        if args.malloc_mmap_threshold:  # glibc: larger blocks are mapped, and unmapped when freed
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        with Cgroup(f"zpp-cap-{os.getpid()}-{variant}-{'cap' if cap else 'free'}", cap) as cg:
            proc = cg.run(cmd, timeout=args.timeout, env=env)
            rec = {"variant": variant, "cap_bytes": cap, "rc": proc.returncode, "peak_bytes": cg.peak(),
                   "limit_hits": cg.failcnt(), "oom_kills": cg.oom_kills()}
        if proc.returncode == 0:
            row = json.loads(out.read_text())["rows"][0]
            rec.update(row=row, losses=row.get("losses"), loss=row["loss"])
        else:
            rec["error"] = proc.stderr[-1500:]
        return rec


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-mib", type=int, required=True)
    p.add_argument("--nvme-path", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "zpp-nvme-cap")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--variants", default="zero3,zero3-infinity",
                   help="train_bench variants, each run capped and free (Default: in memory, and with the "
                        "parameters and the optimizer state on NVMe)")
    p.add_argument("--free", choices=("all", "first", "none"), default="all",
                   help="run every variant without the cap too (all), only the first (the reference), or none")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for every run (0: glibc's default, which keeps freed "
                        "blocks of up to 32 MiB in its arenas) (Default: 128 KiB)")
    args, extra = p.parse_known_args(argv)
    extra = ["--n-layer", "8", "--n-embd", "1024", "--n-head", "16", "--block", "128", "--batch", "2", "--steps",
             "3", "--warmup", "1", "--ranks-per-node", "2", "--init", *extra]
    cap = args.cap_mib << 20
    variants = args.variants.split(",")
    runs = [one(v, c, args, extra) for i, v in enumerate(variants)
            for c in ((cap, None) if args.free == "all" or (i == 0 and args.free == "first") else (cap,))]
    psi = next((r["row"]["params"] for r in runs if "row" in r), None)
    print(f"# cap {args.cap_mib} MiB for the job (2 ranks); GPT params {psi}; 16 Psi = "
          f"{16 * psi / 2**20:.0f} MiB = {16 * psi / cap:.2f}x the cap" if psi else "# no run finished")
    for r in runs:
        what = "ok" if r["rc"] == 0 else f"rc {r['rc']} (killed)" if r["rc"] < 0 or r["rc"] == 137 else f"rc {r['rc']}"
        print(f"{r['variant']:<12}{'capped' if r['cap_bytes'] else 'free':<8}{what:<18}peak "
              f"{r['peak_bytes'] / 2**20:7.0f} MiB  limit hits {r['limit_hits']:>6}"
              + (f"  step {r['row']['step_s']:.2f} s  loss {r['loss']:.4f}" if r["rc"] == 0 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({**runinfo.provenance(), "cap_bytes": cap, "runs": runs,
                                               "malloc_mmap_threshold": args.malloc_mmap_threshold,
                                               "bench_args": extra}, indent=1))


if __name__ == "__main__":
    main()
