"""Count aborts at exit: N launches of the README's zpp.comm snippet and of a 3-step stage-3
``zpp.initialize`` run, under torchrun and mpiexec (4 ranks each).

    python perf/exit_check.py                      # N=50 of each, torchrun and mpiexec
    python perf/exit_check.py -n 10 --launchers torchrun --zpp-root /work/main   # another tree

The snippet's runs rotate over three endings: plain, after ``destroy_process_group()``, and
with an all-gather started and never waited (``ZPP_EXIT``, see tests/fault_worker.py).
A run counts as bad when its launcher exits non-zero, when any process printed
"terminate called" (the gloo worker-thread abort of [Note: clean exit] in
zpp/comm/teardown.py), or when a rank did not write its result. Prints one line per run
kind and a JSON summary (``--json``). The scenarios are tests/fault_worker.py's ``snippet``
and ``train`` (``ZPP_FAULT_STAGE=3``, 3 steps, prefetch on).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

import runinfo  # noqa: E402

from tests.launched import launch  # noqa: E402


ENDINGS = ("", "destroy", "inflight")


def check(kind: str, scenario: str, n: int, nprocs: int, extra_path: str | None) -> dict:
    base = {"ZPP_FAULT_STAGE": "3", "ZPP_FAULT_STEPS": "3", "ZPP_TIMEOUT_S": "120"}
    if kind.endswith(":torch"):  # mpiexec:torch: the torch transport under mpiexec
        kind, base["ZPP_COMM_BACKEND"] = kind.split(":")[0], "torch"
    if extra_path:
        base["PYTHONPATH"] = os.pathsep.join([extra_path, str(ROOT)])
    nonzero = aborts = missing = 0
    walls = []
    examples: list[str] = []
    for i in range(n):
        env = {**base, "ZPP_EXIT": ENDINGS[i % len(ENDINGS)] if scenario == "snippet" else ""}
        with tempfile.TemporaryDirectory(prefix="zpp-exit-") as tmp:
            run = launch(kind, nprocs, scenario, Path(tmp), env=env, wait_s=300)
        walls.append(run.wall_s)
        bad_code = any(c != 0 for c in run.codes)
        aborted = run.output.count("terminate called")
        absent = [r for r in range(nprocs) if r not in run.results or "error" in run.results[r]]
        nonzero += bad_code
        aborts += aborted > 0
        missing += bool(absent)
        if (bad_code or aborted or absent) and len(examples) < 3:
            examples.append(f"run {i}: codes {run.codes}, 'terminate called' x{aborted}, ranks without result "
                            f"{absent}\n{run.output[-1500:]}")
        print(f"  {kind} {scenario} {i + 1}/{n}: codes {run.codes} aborts {aborted} {run.wall_s:.1f} s",
              file=sys.stderr, flush=True)
    return {"launcher": kind + (":torch" if "ZPP_COMM_BACKEND" in base else ""), "scenario": scenario, "runs": n, "nonzero_exit": nonzero, "terminate_called": aborts,
            "missing_results": missing, "mean_wall_s": round(sum(walls) / max(len(walls), 1), 2),
            "examples": examples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=50, help="runs of each kind (default: 50)")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--launchers", default="torchrun,mpiexec",
                   help="comma list of torchrun, mpiexec, mpiexec:torch (the torch transport under mpiexec)")
    p.add_argument("--scenarios", default="snippet,train")
    p.add_argument("--zpp-root", default=None, help="import zpp from this tree instead (a baseline)")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    info = runinfo.provenance()  # of the tree that ran the command (not --zpp-root's)
    rows = []
    for kind in args.launchers.split(","):
        for scenario in args.scenarios.split(","):
            row = check(kind, scenario, args.n, args.nprocs, args.zpp_root)
            rows.append(row)
            print(f"{kind:9s} {scenario:8s} runs {row['runs']:3d}  non-zero exit {row['nonzero_exit']:3d}  "
                  f"'terminate called' {row['terminate_called']:3d}  missing results {row['missing_results']:3d}  "
                  f"mean {row['mean_wall_s']:.1f} s", flush=True)
            for ex in row["examples"]:
                print(ex, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "started": started, "zpp_root": args.zpp_root or str(ROOT),
                                               "rows": rows}, indent=1))
    return 1 if any(r["nonzero_exit"] or r["terminate_called"] or r["missing_results"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
