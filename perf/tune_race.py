"""``zpp tune --job --loss-steps`` on the emulated cluster, one rate after another: does the
hierarchical mode win the race to a target loss where the link is slow, and lose it where
the link is fast? (issue 21; [Note: the loss race] in zpp/tune/job.py)

    python perf/tune_race.py --rates 1000gbit,10mbit --loss-steps 100 --out perf/results/tune_race.json
    python perf/tune_race.py --rates 100mbit --loss-steps 0 --candidates zero3,zero3-zeropp,zero3-zeropp-delta4 \
        --layers 8 --width 512 --heads 8 --block 128 --batch 1 --trials 3    # by the step alone

Needs root (``zpp cluster up``). The job is a user's script as it would be written: a GPT of
tests/gpt.py on characters of the Python standard library's sources, AdamW, each rank its own
batches (seeded by its rank and ``--seed``), ``zpp.initialize`` with the config given. Per rate
the record keeps the report ``zpp tune`` wrote (every candidate predicted and measured, the
race's loss curves and times to the target; the runs' logs dropped) and the seconds the
whole ``zpp tune`` took.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import clusterlib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import argparse, sys, torch
    sys.path.insert(0, {root!r})
    import zpp
    from tests.gpt import GPT, GPTConfig, CharCorpus

    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    torch.manual_seed({seed})
    model = GPT(GPTConfig(n_layer={layers}, n_embd={width}, n_head={heads}, block_size={block}))
    engine, *_ = zpp.initialize(args=args, model=model, model_parameters=model.parameters())
    data = CharCorpus(max_bytes=2_000_000)
    g = torch.Generator().manual_seed(1000 * {seed} + engine.job_world.rank)
    for _ in range(args.steps):
        x, y = data.batch({batch}, {block}, g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    engine.close()
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rates", default="1000gbit,10mbit")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--loss-steps", type=int, default=100,
                   help="0: no race to a loss, the mode by its measured step alone (zpp tune --job's default)")
    p.add_argument("--candidates", default="zero2,zero3,zero3-zeropp,outer-int4")
    p.add_argument("--trials", type=int, default=2, help="autotuning.tuner_num_trials")
    p.add_argument("--no-check-metadata", action="store_true",
                   help='the job\'s config turns the per-call metadata check off ("zpp": {"check_metadata": false})')
    p.add_argument("--job-timeout", type=float, default=1200.0)
    p.add_argument("--out", default="perf/results/tune_race.json")
    args = p.parse_args()
    record = clusterlib.new_record(args.nodes, args.ranks_per_node, model={
        k: getattr(args, k) for k in ("layers", "width", "heads", "block", "batch", "seed")},
        loss_steps=args.loss_steps, candidates=args.candidates, check_metadata=not args.no_check_metadata)
    with tempfile.TemporaryDirectory(prefix="zpp-tune-race-") as tmp:
        tmp_path = Path(tmp)
        script = tmp_path / "train.py"
        script.write_text(SCRIPT.format(root=str(ROOT), **{k: getattr(args, k) for k in (
            "seed", "layers", "width", "heads", "block", "batch")}))
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": args.batch, "optimizer": {
            "type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
            "autotuning": {"start_profile_step": 2, "end_profile_step": 6, "tuner_num_trials": args.trials},
            **({"zpp": {"check_metadata": False}} if args.no_check_metadata else {})}))

        def body(rate: str, bps: int) -> None:
            rep_path, out_path = tmp_path / f"report-{rate}.json", tmp_path / f"tuned-{rate}.json"
            race = ["--loss-steps", str(args.loss_steps)] if args.loss_steps else []
            cmd = [sys.executable, "-m", "zpp", "tune", "--job", "--cluster", "--ranks-per-node",
                   str(args.ranks_per_node), "--config", str(ds), "--candidates", args.candidates,
                   *race, "--job-timeout", str(args.job_timeout),
                   "--report", str(rep_path), "--out", str(out_path), "--",
                   sys.executable, str(script), "--deepspeed_config", str(ds),
                   "--steps", str(2 * args.loss_steps + 10)]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=tmp, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                               capture_output=True)
            wall = time.perf_counter() - t0
            print(r.stdout)
            if r.returncode != 0:
                print(r.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"zpp tune failed at {rate} (status {r.returncode})")
            rep = json.loads(rep_path.read_text())
            rep.pop("logs", None)
            rep["profile"].pop("step_times", None)
            record["runs"].append({"rate": rate, "bps": bps, "tune_wall_s": wall, "report": rep,
                                   "tuned": json.loads(out_path.read_text())})
            clusterlib.save(record, args.out)

        clusterlib.at_each_rate(args.nodes, args.rates, body)
    for run in record["runs"]:
        print(f"{run['rate']}: {run['report']['why']}  ({run['tune_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
