"""``zpp tune --job``: choose the mode of a training job by running it: one profiling run,
the cost model's prediction for every candidate, the best few confirmed by runs, and the
job's config written with the winner's sections.

    zpp tune --job --config ds.json -- python train.py --deepspeed_config ds.json       # 4 local ranks
    zpp tune --job --cluster --ranks-per-node 2 --config ds.json -- python train.py ...  # emulated cluster
    python train.py --deepspeed_config zpp_tuned.json                                   # then the job

[Note: tuning a job]
1. *Profile*: the job runs under ZeRO-3 (:mod:`zpp.zero.trial`: the job's own script, data
   and micro-batch; its mode's switches replaced) from ``start_profile_step`` to
   ``end_profile_step`` (DeepSpeed's ``autotuning`` keys; defaults 2 and 5). It reports the
   step time, the engine's units and gather trace, the bytes, the peak RSS, and the time of
   a 1 MiB-per-rank all-gather over the world and inside the node.
2. *Links*: from the probes, with the cost model's node-link rule: the link between nodes
   carries ``(W - 1) x 1 MiB`` per node in the world probe, a node's link inside ``(R - 1) x
   1 MiB`` per rank; bandwidth = bytes / time (latency taken as 50 us).
3. *Compute*: the profiled step solved for the compute under the model's time rule
   (:func:`zpp.tune.cost.compute_from_step`: the forward's gathers under a third of it, the
   rest in line); the same compute for every candidate (its quantization and the optimizer's share
   are left to the confirming runs). Memory beside the model states: the profile's peak
   RSS less the model's ZeRO-3 state peak.
4. *Predict* every candidate (ZeRO stages 1-3 and the ZeRO++ switches; 1-bit Adam and the
   hierarchical mode change what a step learns and are left to the user, see the README)
   and drop those over ``--memory-gb``.
5. *Confirm* the ``tuner_num_trials`` (default 3) fastest predicted by running each as in 1;
   the winner is the fastest *measured*. The report (``--report``) lists every candidate,
   predicted and measured, and why the winner won; ``--out`` is the job's config (``--config``
   or empty) with the winner's sections, ready to run unchanged. Each run's output goes to
   the report (``logs``), not to the terminal; a failed run's last lines are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zpp.bench.launch import free_port

# torch-free at import (``zpp --help``): the cost model and the trial are imported where used

__all__ = ["CANDIDATES", "add_arguments", "links_from_probe", "run"]

CANDIDATES = ("zero1", "zero2", "zero3", "zero3-qwz", "zero3-hpz", "zero3-qgz", "zero3-zeropp")
PROFILE_MODE = "zero3"
"""The profiling run's mode: ZeRO-3 (its gather trace gives every stage 3 candidate's gathers)."""
DEFAULT_OUT = "zpp_tuned.json"
DEFAULT_REPORT = "zpp_tune_report.json"
LATENCY_S = 50e-6


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--job: tune a training job by running it (after --: the job's command)")
    g.add_argument("--job", action="store_true", help="profile the job, predict every mode, confirm the best")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="the job's DeepSpeed config: its autotuning keys are read and the tuned config is it "
                        "plus the winner's sections")
    g.add_argument("--candidates", default=",".join(CANDIDATES), help=f"(default: {','.join(CANDIDATES)})")
    g.add_argument("--report", default=DEFAULT_REPORT, metavar="FILE",
                   help=f"(default: {DEFAULT_REPORT}, in the config's autotuning.results_dir when it has one)")
    g.add_argument("--job-timeout", type=float, default=900.0, help="seconds per run of the job (default: 900)")


def links_from_probe(m: dict[str, Any]) -> tuple[cost.Link, cost.Link]:
    """(intra, inter) links from a trial's probes (see [Note: tuning a job])."""
    from zpp.tune import cost

    W, R, N, nb = m["world"], m["ranks_per_node"], m["nodes"], m["probe_bytes"]
    intra = cost.LINKS["loopback"]
    if R > 1 and m["probe_intra_s"] > 0:
        intra = cost.Link("measured-intra", (R - 1) * nb / m["probe_intra_s"], LATENCY_S, False)
    inter = cost.LINKS["loopback"]
    if N > 1 and m["probe_world_s"] > 0:
        inter = cost.Link("measured-inter", (W - 1) * nb * cost.WIRE_OVERHEAD / m["probe_world_s"], LATENCY_S, True)
    return intra, inter


def _units(m: dict[str, Any]) -> list[cost.UnitShape]:
    from zpp.tune import cost

    return cost.units_from_trace([n for n, _ in m["units"]], [bool(p) for _, p in m["units"]],
                                 [tuple(e) for e in m["gather_trace"]])


class _Runner:
    def __init__(self, args: argparse.Namespace, command: list[str], tmp: Path, start: int, end: int) -> None:
        self.args, self.command, self.tmp, self.start, self.end = args, command, tmp, start, end
        self.rpn = args.ranks_per_node or (1 if args.cluster else 2)
        self.nprocs = args.nprocs or 4
        self.logs: dict[str, str] = {}

    def __call__(self, mode: cost.Mode) -> dict[str, Any]:
        from zpp.zero.trial import TRIAL_ENV

        trial = self.tmp / f"{mode.name}.trial.json"
        out = self.tmp / f"{mode.name}.metrics.json"
        trial.write_text(json.dumps({"overrides": mode.config(self.rpn), "start": self.start, "end": self.end,
                                     "out": str(out)}))
        env = {TRIAL_ENV: str(trial)}
        log = self.tmp / f"{mode.name}.log"
        print(f"zpp tune --job: running {mode.name} ...", file=sys.stderr, flush=True)
        with open(log, "w") as f:
            rc = self._launch(env, f)
        self.logs[mode.name] = log.read_text()[-20000:]
        if rc != 0 or not out.exists():
            tail = "\n".join(self.logs[mode.name].splitlines()[-15:])
            print(f"zpp tune --job: {mode.name} failed (status {rc}); its last lines:\n{tail}", file=sys.stderr)
            return {"error": f"the job exited with status {rc}" + ("" if out.exists() else
                                                                      f" before its step {self.end}")}
        return json.loads(out.read_text())

    def _launch(self, env: dict[str, str], f) -> int:
        if self.args.cluster:
            from zpp import cluster

            return cluster.run(self.command, ranks_per_node=self.rpn, env=env, timeout=self.args.job_timeout,
                               stdout=f, stderr=f)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nprocs}",
               f"--master-port={free_port()}"]
        if os.path.basename(self.command[0]).startswith("python"):
            cmd += self.command[1:]
        else:
            cmd += ["--no-python", *self.command]
        return subprocess.run(cmd, env={**os.environ, **env, "ZPP_RANKS_PER_NODE": str(self.rpn)},
                              stdout=f, stderr=subprocess.STDOUT, timeout=self.args.job_timeout).returncode


def run(args: argparse.Namespace, command: list[str]) -> int:
    from zpp.tune import cost
    from zpp.zero.trial import apply

    parser: argparse.ArgumentParser = args.parser
    if not command:
        parser.error("--job needs the job's command after --, e.g. zpp tune --job -- python train.py")
    base: dict[str, Any] = {}
    if args.config is not None:
        base = json.loads(Path(args.config).read_text())
    at = base.get("autotuning") or {}
    start, end = int(at.get("start_profile_step", 2)), int(at.get("end_profile_step", 5))
    if end <= start:
        parser.error(f"autotuning.end_profile_step={end} must be above start_profile_step={start}")
    confirm = int(at.get("tuner_num_trials", 3))
    report_path = Path(args.report)
    if args.report == DEFAULT_REPORT and at.get("results_dir"):  # DeepSpeed's autotuning.results_dir
        report_path = Path(at["results_dir"]) / DEFAULT_REPORT
        report_path.parent.mkdir(parents=True, exist_ok=True)
    names = args.candidates.split(",")
    for n in names:
        if n not in cost.MODES or not cost.MODES[n].same_optimizer:
            parser.error(f"--candidates: {n!r} is not one of {', '.join(CANDIDATES)}")
    with tempfile.TemporaryDirectory(prefix="zpp-tune-job-") as tmp:
        runner = _Runner(args, command, Path(tmp), start, end)
        prof = runner(cost.MODES[PROFILE_MODE])
        if "error" in prof:
            print(f"zpp tune --job: the profiling run failed: {prof['error']}", file=sys.stderr)
            return 1
        report = choose(prof, names, runner, confirm=confirm, memory_gb=args.memory_gb)
        report["logs"] = runner.logs
    winner = cost.MODES[report["winner"]]
    tuned = apply(base, {"overrides": winner.config(prof["ranks_per_node"])})
    tuned.pop("autotuning", None)
    Path(args.out).write_text(json.dumps(tuned, indent=2) + "\n")
    report.update(command=" ".join(shlex.quote(c) for c in command), config=args.config, out=args.out)
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(format_report(report))
    print(f"# wrote {args.out} (the job's config with {winner.name}'s sections) and {report_path}")
    return 0


def choose(prof: dict[str, Any], names: list[str], runner, *, confirm: int, memory_gb: float | None) -> dict:
    """Predict every candidate from the profile, run the ``confirm`` best, pick the fastest
    measured (see [Note: tuning a job])."""
    from zpp.tune import cost

    intra, inter = links_from_probe(prof)
    cluster = cost.Cluster(prof["nodes"], prof["ranks_per_node"], intra, inter)
    units = _units(prof)
    z3 = cost.MODES[PROFILE_MODE]
    compute = cost.compute_from_step(prof["step_s"], cost.traffic(z3, units, cluster), cluster)
    other = int(prof["peak_rss_bytes"] - cost.memory(z3, units, cluster)["peak"])
    profile = cost.Profile(compute, other)
    rows = {}
    for n in names:
        p = cost.predict([cost.MODES[n]], units=units, cluster=cluster, profile=profile)[0]
        rows[n] = {"mode": n, "pred_step_s": p.step_s, "pred_inter_bytes": p.inter_bytes,
                   "pred_intra_bytes": p.intra_bytes, "pred_peak_bytes": p.peak_bytes,
                   "fits": memory_gb is None or p.peak_bytes <= memory_gb * 1e9}
    if PROFILE_MODE in rows:
        rows[PROFILE_MODE].update(measured_step_s=prof["step_s"], measured_inter_bytes=prof["inter_bytes"],
                                  measured_peak_bytes=prof["peak_rss_bytes"])
    ranked = sorted((r for r in rows.values() if r.get("fits", True) and "pred_step_s" in r),
                    key=lambda r: r["pred_step_s"])
    for r in ranked[:confirm]:
        if "measured_step_s" in r:
            continue
        m = runner(cost.MODES[r["mode"]])
        if "error" in m:
            r["error"] = m["error"]
            continue
        r.update(measured_step_s=m["step_s"], measured_inter_bytes=m["inter_bytes"],
                 measured_peak_bytes=m["peak_rss_bytes"])
    measured = [r for r in rows.values() if "measured_step_s" in r and r.get("fits", True)]
    if not measured:
        raise RuntimeError("zpp tune --job: no candidate ran")
    best = min(measured, key=lambda r: r["measured_step_s"])
    pred_best = ranked[0]["mode"] if ranked else best["mode"]
    why = (f"{best['mode']} is the fastest measured ({best['measured_step_s']:.3f} s/step) of "
           f"{', '.join(r['mode'] for r in measured)}; the cost model ranked {pred_best} first")
    return {"winner": best["mode"], "why": why, "links": {"intra_Bps": intra.bandwidth, "inter_Bps": inter.bandwidth},
            "compute_s": compute, "other_bytes": other, "nodes": prof["nodes"],
            "ranks_per_node": prof["ranks_per_node"], "profile": prof, "candidates": list(rows.values())}


def format_report(rep: dict[str, Any]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    lines = [f"# zpp tune --job: {rep['nodes']} nodes x {rep['ranks_per_node']} ranks; measured links: inside "
             f"{rep['links']['intra_Bps'] / 1e6:.1f} MB/s, between nodes {rep['links']['inter_Bps'] / 1e6:.2f} MB/s "
             f"per node; compute {rep['compute_s']:.3f} s/step",
             f"{'mode':<14}{'pred_s':>9}{'measured_s':>11}{'pred_inter_MB':>14}{'meas_inter_MB':>14}"
             f"{'pred_peak_MB':>13}"]
    for r in sorted(rep["candidates"], key=lambda r: r.get("pred_step_s", 0)):
        mark = "  <- winner" if r["mode"] == rep["winner"] else ("  (over --memory-gb)" if not r.get("fits", True)
                                                                  else "")
        pi, mi = r.get("pred_inter_bytes"), r.get("measured_inter_bytes")
        lines.append(f"{r['mode']:<14}{f(r.get('pred_step_s'), '.3f'):>9}{f(r.get('measured_step_s'), '.3f'):>11}"
                     f"{f(pi and pi / 1e6, '.2f'):>14}{f(mi and mi / 1e6, '.2f'):>14}"
                     f"{f(r.get('pred_peak_bytes') and r['pred_peak_bytes'] / 2**20, '.0f'):>13}{mark}"
                     + (f"  error: {r['error']}" if "error" in r else ""))
    lines.append(f"# {rep['why']}")
    return "\n".join(lines)
