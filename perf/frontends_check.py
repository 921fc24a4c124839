"""The Hugging Face Trainer, accelerate and Lightning on zpp against real DeepSpeed 0.19.8.

    python perf/frontends_check.py --ds-python /work/dsenv/bin/python --json perf/results/frontends_check.json

Runs each user script of tests/frontends/ (a tiny GPT-2, 2 ranks, 20 optimizer steps,
gradient accumulation 2, the user's schedule, evaluation, a checkpoint at step 10 and a
resume from it) three ways: under ``zpp run`` (``import deepspeed`` is zpp), with real
DeepSpeed (``--ds-python``: a Python where ``import deepspeed`` is DeepSpeed 0.19.8; CPU, so
``DS_ACCELERATOR=cpu``), and on the front-end's own DDP path. Variants: ZeRO-2, ZeRO-3, and
for the Trainer ZeRO-3 with DeepSpeed's optimizer and WarmupLR from the config. Writes every
run's losses and learning rates and, per variant, the largest relative difference of zpp
from DeepSpeed (losses, lrs, evaluation, resumed losses) and of both from DDP. ZeRO++ is
not compared: DeepSpeed's ZeRO++ kernels need CUDA (tests/test_frontends.py checks it
against DDP within its quantization error). Exits 1 when zpp differs from DeepSpeed by more
than ``--rtol`` (Default: 1e-4, the issue's bound).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import runinfo  # noqa: E402

from tests.frontends import harness  # noqa: E402

STEPS, SAVE_AT = 20, 10
VARIANTS = {
    "trainer": {"zero2": ["--stage", "2"], "zero3": ["--stage", "3"],
                "zero3_ds_optim_warmuplr": ["--stage", "3", "--ds-optim"]},
    "accelerate": {"zero2": ["--stage", "2"], "zero3": ["--stage", "3"]},
    "lightning": {"zero2": ["--stage", "2"], "zero3": ["--stage", "3"]},
}


def rel(a, b) -> float | None:
    if a is None or b is None:
        return None
    a, b = ([a], [b]) if isinstance(a, (int, float)) else (a, b)
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def resume_from(frontend: str, folder: Path) -> str:
    if frontend == "trainer":
        return str(folder / f"checkpoint-{SAVE_AT}")
    if frontend == "accelerate":
        return str(folder)
    return str(next(folder.glob(f"*step={SAVE_AT}.ckpt")))


def one(frontend: str, engine: str, flags: list[str], work: Path, python: str, resume: bool) -> dict:
    folder = work / "ckpt"
    base = ["--steps", str(STEPS), "--dir", str(folder), "--save-at", str(SAVE_AT)]
    t0 = time.monotonic()
    run = harness.run(frontend, work, engine=engine, python=python, args=[*base, *flags], timeout=900)
    run["wall_s"] = round(time.monotonic() - t0, 1)
    if resume:
        again = harness.run(frontend, work, engine=engine, python=python, timeout=900, out="resumed.json",
                            args=[*base, *flags, "--resume", resume_from(frontend, folder)])
        run["resumed_losses"] = again["losses"]
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-python", required=True, help="a Python that imports DeepSpeed 0.19.8")
    p.add_argument("--json", default="perf/results/frontends_check.json")
    p.add_argument("--frontends", default="trainer,accelerate,lightning")
    p.add_argument("--rtol", type=float, default=1e-4)
    args = p.parse_args()
    record = {**runinfo.provenance(), "steps": STEPS, "save_at": SAVE_AT, "world": harness.WORLD, "variants": {}}
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="zpp-frontends-") as tmp:
        for frontend in args.frontends.split(","):
            ddp = None
            for name, flags in VARIANTS[frontend].items():
                runs = {}
                for engine, python in (("zpp", sys.executable), ("deepspeed", args.ds_python)):
                    runs[engine] = one(frontend, engine, flags, Path(tmp) / frontend / name / engine, python,
                                       resume=name == "zero3")
                    print(f"{frontend} {name} {engine}: {runs[engine]['wall_s']} s", file=sys.stderr, flush=True)
                if "--ds-optim" not in flags:  # DDP has no DeepSpeed schedule; one DDP run per front-end
                    ddp = ddp or one(frontend, "ddp", [], Path(tmp) / frontend / "ddp", sys.executable, resume=False)
                z, d = runs["zpp"], runs["deepspeed"]
                cmp = {"zpp_vs_deepspeed": {"losses": rel(z["losses"], d["losses"]), "lrs": rel(z["lrs"], d["lrs"]),
                                            "eval": rel(z["eval"], d["eval"]),
                                            "resumed_losses": rel(z.get("resumed_losses"), d.get("resumed_losses"))}}
                if "--ds-optim" not in flags:
                    cmp["zpp_vs_ddp"] = {"losses": rel(z["losses"], ddp["losses"])}
                    cmp["deepspeed_vs_ddp"] = {"losses": rel(d["losses"], ddp["losses"])}
                worst = max([worst, *(v for v in cmp["zpp_vs_deepspeed"].values() if v is not None)])
                record["variants"][f"{frontend}/{name}"] = {"flags": flags, "compare": cmp, "runs": runs}
                print(f"{frontend} {name}: {json.dumps(cmp)}", file=sys.stderr, flush=True)
            if ddp is not None:
                record["variants"][f"{frontend}/ddp"] = {"runs": {"ddp": ddp}}
    record["max_rel_zpp_vs_deepspeed"] = worst
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"max relative difference, zpp against DeepSpeed: {worst:.3g} (bound {args.rtol:g})")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
