"""zpp's learning-rate schedules against real DeepSpeed, step for step, through each engine.

    python perf/ds_schedules_check.py --ds-python /work/dsenv/bin/python
    python perf/ds_schedules_check.py --ds-python ... --steps 40 --json perf/results/ds_schedules_check.json

Every case of tests/test_schedulers.py's ``CASES`` (a DeepSpeed "scheduler" section over
AdamW, ``torch_adam``) runs through ``deepspeed.initialize`` (one CPU rank,
``DS_ACCELERATOR=cpu``, in the Python given by ``--ds-python``) and through
``zpp.initialize`` (one rank), training a 4 -> 2 linear layer; before each optimizer step both
record the lr the optimizer holds (``engine.get_lr()[0]``) and, for OneCycle with momentum,
the group's first beta. The JSON holds both sequences, the largest difference per case and
per schedule type, the same against tests/test_schedulers.py's written-out formulas
(``expected``), and where it ran (perf/runinfo.py). Exits 1 when a difference exceeds 1e-12.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-12


def ds_child(cases_path: str, out_path: str) -> None:
    """In the DeepSpeed Python: every case through deepspeed.initialize; writes
    {name: [[lr, beta or None], ...]} and DeepSpeed's version to ``out_path``."""
    import socket

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch

    job = json.loads(Path(cases_path).read_text())
    out = {}
    for name, cfg, momentum in job["cases"]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        g = torch.Generator().manual_seed(0)
        seen = []
        for _ in range(job["steps"]):
            group = engine.optimizer.param_groups[0]
            seen.append([engine.get_lr()[0], group["betas"][0] if momentum else None])
            engine.backward(engine(torch.randn(2, 4, generator=g)).pow(2).mean())
            engine.step()
        out[name] = seen
    Path(out_path).write_text(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                                          "sequences": out}))


def _max_diff(a, b, i):
    """Largest |a - b| of field ``i`` over the steps (inf where only one has a value)."""
    worst = 0.0 if len(a) == len(b) else float("inf")
    for x, y in zip(a, b):
        if (x[i] is None) != (y[i] is None):
            return float("inf")
        if x[i] is not None:
            worst = max(worst, abs(x[i] - y[i]))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ds-python", required=True, help="a Python with deepspeed installed")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=str(ROOT / "perf" / "results" / "ds_schedules_check.json"))
    ap.add_argument("--ds-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ds_child:
        ds_child(*args.ds_child)
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "perf"))
    import runinfo

    from tests.dist import run_world
    from tests.test_schedulers import CASES, cycles_momentum, ds_config, engine_sequences, expected

    record = runinfo.provenance()
    with tempfile.TemporaryDirectory(prefix="zpp-ds-sched-") as tmp:
        job, got = Path(tmp, "cases.json"), Path(tmp, "deepspeed.json")
        job.write_text(json.dumps({"steps": args.steps, "cases": [
            [c[0], ds_config(c), cycles_momentum(c)] for c in CASES]}))
        run = subprocess.run([args.ds_python, __file__, "--ds-python", args.ds_python, "--ds-child", str(job),
                              str(got)], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
            return 2
        ds = json.loads(got.read_text())
    zpp = run_world(engine_sequences, 1, args=(args.steps,), timeout=300)[0]
    cases, per_type = {}, {}
    for case in CASES:
        name, kind = case[0], case[2]["type"]
        d, z, f = ds["sequences"][name], [list(x) for x in zpp[name]], [list(x) for x in expected(case, args.steps)]
        row = {"type": kind, "config": ds_config(case), "deepspeed": d, "zpp": z,
               "max_abs_lr_diff": _max_diff(d, z, 0), "max_abs_beta1_diff": _max_diff(d, z, 1),
               "max_abs_lr_diff_formula": _max_diff(d, f, 0), "max_abs_beta1_diff_formula": _max_diff(d, f, 1)}
        cases[name] = row
        t = per_type.setdefault(kind, {"cases": 0, "max_abs_lr_diff": 0.0, "max_abs_beta1_diff": 0.0})
        t["cases"] += 1
        t["max_abs_lr_diff"] = max(t["max_abs_lr_diff"], row["max_abs_lr_diff"])
        t["max_abs_beta1_diff"] = max(t["max_abs_beta1_diff"], row["max_abs_beta1_diff"])
        print(f"{name:30s} max |lr diff| {row['max_abs_lr_diff']:.3g}  max |beta1 diff| "
              f"{row['max_abs_beta1_diff']:.3g}  (formula: {row['max_abs_lr_diff_formula']:.3g})")
    worst = max(max(r["max_abs_lr_diff"], r["max_abs_beta1_diff"], r["max_abs_lr_diff_formula"],
                    r["max_abs_beta1_diff_formula"]) for r in cases.values())
    record.update({"deepspeed": ds["deepspeed"], "deepspeed_torch": ds["torch"], "ds_python": args.ds_python,
                   "steps": args.steps, "tolerance": TOL, "max_abs_diff": worst, "ok": worst <= TOL,
                   "per_type": per_type, "cases": cases})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"largest difference {worst:.3g} (tolerance {TOL}); wrote {args.json}")
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
