"""``zpp tune --job``: choose the mode of a training job by running it: one profiling run,
the cost model's prediction for every candidate, the best few confirmed by runs, and the
job's config written with the winner's sections.

    zpp tune --job --config ds.json -- python train.py --deepspeed_config ds.json       # 4 local ranks
    zpp tune --job --cluster --ranks-per-node 2 --config ds.json -- python train.py ...  # emulated cluster
    python train.py --deepspeed_config zpp_tuned.json                                   # then the job

[Note: tuning a job]
1. *Profile*: the job runs under ZeRO-3 (:mod:`zpp.zero.trial`: the job's own script, data
   and micro-batch; its mode's switches replaced) from ``start_profile_step`` to
   ``end_profile_step`` (DeepSpeed's ``autotuning`` keys; defaults 2 and 5; optimizer steps,
   so a step of gradient accumulation is all its micro-batches). It reports the step time,
   the backward passes per step, the engine's units and gather trace, the bytes, the peak
   RSS, and the time of a 1 MiB-per-rank all-gather over the world and inside the node.
2. *Links*: from the probes, with the cost model's node-link rule: the link between nodes
   carries ``(W - 1) x 1 MiB`` per node in the world probe, a node's link inside ``(R - 1) x
   1 MiB`` per rank; bandwidth = bytes / time (latency taken as 50 us).
3. *Compute*: the profiled mean step less the seconds its training thread waited on the
   link (the trial's ``link_wait_s``, the ranks' mean; the per-call metadata checks' blocking
   round trips included, phase ``metadata``: left out, they made the 25M GPT's compute
   10.4 s of a 20.1 s step at 100 Mbit where it is 0.6-0.9 s): what the step spends
   when no byte is waited for. (Solving the step for the compute under the model's time rule,
   :func:`zpp.tune.cost.compute_from_step`, which a profile without waits still uses, made
   the compute the small remainder of a link-bound step: 0.03-0.78 s against 0.11 s on the
   0.8M GPT at 10 Mbit, perf/BENCHMARKS.md "The loss race".) The same compute for every
   candidate (its quantization and the optimizer's share are left to the confirming runs).
   Memory beside the model states: the profile's peak RSS less the model's ZeRO-3 state
   peak.
4. *Predict* every candidate (ZeRO stages 1-3 and the ZeRO++ switches) and drop those over
   ``--memory-gb``.
5. *Confirm* the ``tuner_num_trials`` (default 3) fastest predicted by running each as in 1;
   the winner is the fastest *measured*. The report (``--report``) lists every candidate,
   predicted and measured, and why the winner won; ``--out`` is the job's config (``--config``
   or empty) with the winner's sections, ready to run unchanged (the report advises turning
   the metadata check off where the winner waited in it for 5% of its step or more; the
   config keeps the job's setting). Each run's output goes to
   the report (``logs``), not to the terminal; a failed run's last lines are printed.
6. *Race to a loss* (``--loss-steps N``, on several nodes; see [Note: the loss race]).
7. *Micro-batch* (with ``autotuning.arg_mappings`` for ``train_micro_batch_size_per_gpu``; see
   [Note: the micro-batch search] in zpp/tune/microbatch.py): the winner at larger
   micro-batches, the highest throughput kept.

[Note: the loss race]
The ZeRO stages and ZeRO++ take the user's optimizer step on the averaged gradient, so a
step learns the same in each (ZeRO++ within its quantization) and step time decides. The
hierarchical mode (``zpp.outer``) trades loss per step for steps per second, so it is judged
by the time to a target loss. With ``--loss-steps N`` the winner of 5 (the *reference*) runs
N steps; its loss curve (every step's loss through ``engine.backward``: its micro-batches'
mean however the job scales for accumulation, averaged over the world; see [Note: tune
trials] in zpp/zero/trial.py) sets the target: the mean of its last ``w = max(1, min(20, N
// 5))`` losses. A run's steps to the target are the first step ``k >= w`` whose last ``w``
losses average at or below it, its time to the target ``k`` times its mean timed step (the
syncs' stalls included). The hierarchical candidate (stage 2 inside the node, int4, 4
fragments; ``outer-int4``) gets ``delay`` and H from the cost model's sync time on the
measured links and its predicted inner step (:func:`zpp.tune.outer.period`; H at most N //
2, so that every fragment syncs twice in the race, the row saying so where the period wanted
more, and N // 2 where the profile left no inner compute to hide a sync behind; H at least
``MIN_SYNC_EVERY`` = 5, the shortest H that did not lose loss in perf/BENCHMARKS.md "The
outer lr at short H"; the outer lr is the mode's rule for that H) and runs for as many steps
as the reference's time to the target and 10% (``RACE_MARGIN``) allow at its own measured
step time (decided, the same on every rank, after its first timed steps: the trial's
``budget_s``), at least N (equal tokens) and at most 2N; where it does not reach the target
in steps that took less than the reference's time (its later steps ran faster than its
first), the report says its race was cut short. The winner is the reference unless a
hierarchical run reached the target ``WIN_MARGIN`` (1.1) times sooner: a tie goes to the
ZeRO mode, whose steps are the job's own optimizer on the averaged gradient, while the
hierarchical mode's loss ratio to it can still drift later in the job (below). Both runs are
the job's own data in the same order, so the race compares the modes, not the batches; what
a race of N steps cannot say is whether the order holds over the whole job (on the 25M GPT
the mode's loss ratio to DDP's moved from 0.94 to 1.06 between steps 80 and 400 on one seed,
perf/BENCHMARKS.md): N should be a fair part of the job. 1-bit Adam is not raced: its
``freeze_step`` (the steps of exact Adam before the 1-bit phase) is a schedule decision
about the whole job.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zpp.bench.launch import free_port
from zpp.tune.metrics import mean_step_s, samples_per_micro_batch
from zpp.tune.microbatch import KEY, MicroBatchSearch, from_autotuning, search, with_argument

# torch-free at import (``zpp --help``): the cost model and the trial are imported where used

__all__ = ["CANDIDATES", "add_arguments", "links_from_probe", "run"]

CANDIDATES = ("zero1", "zero2", "zero3", "zero3-qwz", "zero3-hpz", "zero3-qgz", "zero3-zeropp", "zero3-zeropp-delta4")
LOSS_CANDIDATES = ("outer-int4",)
"""Raced by time to a target loss with ``--loss-steps`` (see [Note: the loss race])."""
RACE_MARGIN = 1.1
"""The hierarchical run's time budget over the reference's time to the target."""
WIN_MARGIN = 1.1
"""The hierarchical mode wins the race only when it reaches the target this many times sooner
than the reference: a tie goes to the ZeRO mode (see [Note: the loss race])."""
MIN_SYNC_EVERY = 5
"""The shortest H the loss race gives the hierarchical mode (see [Note: the loss race]): the
mode's default H, ``zpp.zero.outer_config.DEFAULT_SYNC_EVERY`` (written out: this module is
torch-free at import; a test holds them equal)."""
METADATA_ADVICE = 0.05
"""The report advises switching the metadata check off when the winner's training thread
waited in it for at least this share of its measured step (phase ``metadata`` of the
trial's link waits)."""
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
    g.add_argument("--loss-steps", type=int, default=0, metavar="N",
                   help="also race the hierarchical mode (outer-int4) by time to the loss the fastest ZeRO mode "
                        "reaches in N steps (0: off; default 0)")


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

    def __call__(self, mode: cost.Mode, *, end: int | None = None, tag: str = "",
                 budget: tuple[float, int] | None = None, micro_batch: tuple[MicroBatchSearch, int, dict] | None = None
                 ) -> dict[str, Any]:
        """Run the job as ``mode`` to its step ``end`` (default: the profile's end step); with
        ``budget = (seconds, max_end)`` to the step where its measured steps fill the seconds,
        between ``end`` and ``max_end`` (see [Note: tune trials] in zpp/zero/trial.py); with
        ``micro_batch = (search, size, config keys)`` at that micro-batch: the search's
        argument set in the command, the keys in the config ([Note: the micro-batch search])."""
        from zpp.zero.trial import TRIAL_ENV

        end = self.end if end is None else end
        name = mode.name + tag
        trial = self.tmp / f"{name}.trial.json"
        out = self.tmp / f"{name}.metrics.json"
        overrides = mode.config(self.rpn)
        command = self.command
        if micro_batch is not None:
            search, size, keys = micro_batch
            overrides.update(keys)
            command = with_argument(command, search.argument, size)
        spec: dict[str, Any] = {"overrides": overrides, "start": self.start, "end": end, "out": str(out)}
        steps = f"{end} steps"
        if budget is not None:
            spec.update(budget_s=budget[0], max_end=budget[1])
            steps = f"{end} to {budget[1]} steps, by its step time"
        trial.write_text(json.dumps(spec))
        env = {TRIAL_ENV: str(trial)}
        log = self.tmp / f"{name}.log"
        print(f"zpp tune --job: running {name} ({steps}) ...", file=sys.stderr, flush=True)
        with open(log, "w") as f:
            rc = self._launch(command, env, f)
        self.logs[name] = log.read_text()[-20000:]
        if rc != 0 or not out.exists():
            tail = "\n".join(self.logs[name].splitlines()[-15:])
            print(f"zpp tune --job: {name} failed (status {rc}); its last lines:\n{tail}", file=sys.stderr)
            return {"error": f"the job exited with status {rc}" + ("" if out.exists() else
                                                                      f" before the trial's last step ({steps})")}
        return json.loads(out.read_text())

    def _launch(self, command: list[str], env: dict[str, str], f) -> int:
        if self.args.cluster:
            from zpp import cluster

            return cluster.run(command, ranks_per_node=self.rpn, env=env, timeout=self.args.job_timeout,
                               stdout=f, stderr=f)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.nprocs}",
               f"--master-port={free_port()}"]
        if os.path.basename(command[0]).startswith("python"):
            cmd += command[1:]
        else:
            cmd += ["--no-python", *command]
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
    try:
        mb_search = from_autotuning(at)
    except ValueError as e:
        parser.error(str(e))
    report_path = Path(args.report)
    if args.report == DEFAULT_REPORT and at.get("results_dir"):  # DeepSpeed's autotuning.results_dir
        report_path = Path(at["results_dir"]) / DEFAULT_REPORT
        report_path.parent.mkdir(parents=True, exist_ok=True)
    if args.loss_steps < 0:
        parser.error(f"--loss-steps={args.loss_steps} must be 0 (off) or a number of steps")
    if args.loss_steps and args.loss_steps <= start:
        parser.error(f"--loss-steps={args.loss_steps} must be above the profile's start_profile_step={start}")
    names = args.candidates.split(",")
    for n in names:
        if n in LOSS_CANDIDATES and not args.loss_steps:
            parser.error(f"--candidates: {n!r} changes what a step learns and is raced by time to a target loss: "
                         "give --loss-steps N")
        if n not in CANDIDATES + LOSS_CANDIDATES:
            parser.error(f"--candidates: {n!r} is not one of {', '.join(CANDIDATES + LOSS_CANDIDATES)}")
    if not any(n in CANDIDATES for n in names):
        parser.error(f"--candidates={args.candidates!r}: the loss race needs a ZeRO mode to race against "
                     f"(one of {', '.join(CANDIDATES)})")
    if args.loss_steps and args.candidates == ",".join(CANDIDATES):  # the default list: race the outer mode
        names += list(LOSS_CANDIDATES)
    with tempfile.TemporaryDirectory(prefix="zpp-tune-job-") as tmp:
        runner = _Runner(args, command, Path(tmp), start, end)
        prof = runner(cost.MODES[PROFILE_MODE])
        if "error" in prof:
            print(f"zpp tune --job: the profiling run failed: {prof['error']}", file=sys.stderr)
            return 1
        if not prof.get("backward_seen", True):
            print("zpp tune --job: the job never called engine.backward (it calls loss.backward() itself?): "
                  "its losses are not seen and a step is taken as its gradient_accumulation_steps "
                  f"({prof['micro_steps']:g}) backward passes", file=sys.stderr)
        report = choose(prof, names, runner, confirm=confirm, memory_gb=args.memory_gb, loss_steps=args.loss_steps)
        sections = dict(report["winner_sections"])
        report["micro_batch"] = _micro_batch(runner, report, prof, base, mb_search, memory_gb=args.memory_gb)
        if "chosen" in report["micro_batch"]:
            sections.update(_micro_batch_keys(base, prof, report["micro_batch"]["chosen"]))
        report["logs"] = runner.logs
    tuned = apply(base, {"overrides": sections})
    tuned.pop("autotuning", None)
    Path(args.out).write_text(json.dumps(tuned, indent=2) + "\n")
    report.update(command=" ".join(shlex.quote(c) for c in command), config=args.config, out=args.out)
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(format_report(report))
    print(f"# wrote {args.out} (the job's config with {report['winner']}'s sections) and {report_path}")
    mb = report["micro_batch"]
    if "chosen" in mb and mb["chosen"] != mb["job_micro_batch"]:
        print(f"# run the job with {mb['argument']} {mb['chosen']}: "
              + " ".join(shlex.quote(c) for c in with_argument(command, mb["argument"], mb["chosen"])))
    return 0


def _micro_batch_keys(base: dict[str, Any], prof: dict[str, Any], size: int) -> dict[str, Any]:
    """The config keys of a micro-batch of ``size``: ``train_micro_batch_size_per_gpu`` (kept
    "auto" where the job's config says so: the front-end fills it from the argument) and, where
    the job's config has one, a ``train_batch_size`` that agrees with it."""
    keys: dict[str, Any] = {}
    if base.get(KEY) != "auto":
        keys[KEY] = size
    if isinstance(base.get("train_batch_size"), int):
        keys["train_batch_size"] = size * samples_per_micro_batch(prof)
    return keys


def _micro_batch(runner, report: dict[str, Any], prof: dict[str, Any], base: dict[str, Any],
                 s: MicroBatchSearch | None, *, memory_gb: float | None) -> dict[str, Any]:
    """The micro-batch search of [Note: the micro-batch search] for the winner, or why none ran."""
    if s is None:
        return {"skipped": "no autotuning.arg_mappings for train_micro_batch_size_per_gpu: the job's micro-batch "
                           "stays (see [Note: the micro-batch search] in zpp/tune/microbatch.py)"}
    mine = prof.get("micro_batch")
    if not isinstance(mine, int):
        return {"skipped": f"the job's micro-batch is not known (the engine reports {mine!r})"}
    winner = _Sections(report["winner"], report["winner_sections"])

    def run(size: int) -> dict[str, Any]:
        return runner(winner, tag=f"-mb{size}", micro_batch=(s, size, _micro_batch_keys(base, prof, size)))
    first = run(mine)
    if "error" in first:
        return {"skipped": f"the winner at the job's micro-batch {mine} failed: {first['error']}"}
    return search(run, s, mine=mine, first=first, memory_gb=memory_gb)


@dataclasses.dataclass(frozen=True)
class _Sections:
    """A chosen mode as the runner takes it: its name and its config sections."""

    name: str
    sections: dict[str, Any]

    def config(self, ranks_per_node: int) -> dict[str, Any]:
        return json.loads(json.dumps(self.sections))


def loss_window(steps: int) -> int:
    """Steps averaged for a loss target and a run's loss at a step (see [Note: the loss race])."""
    return max(1, min(20, steps // 5))


def steps_to(curve: list[float | None], target: float, w: int) -> int | None:
    """The first step ``k >= w`` (1-based) whose last ``w`` losses average at or below
    ``target``; None when none does (a step without a loss breaks its windows)."""
    for k in range(w, len(curve) + 1):
        win = curve[k - w:k]
        if all(x is not None and math.isfinite(x) for x in win) and sum(win) / w <= target:  # type: ignore[arg-type]
            return k
    return None


def _race(rows: dict, modes: dict, best: dict, names: list[str], runner, *, units, cluster, profile, rpn: int,
          loss_steps: int, memory_gb: float | None, micro: int) -> dict[str, Any]:
    """The loss race of [Note: the loss race]: the reference ``best`` for ``loss_steps`` steps,
    then each hierarchical candidate; updates ``rows``, returns the race's summary."""
    from zpp.tune import cost
    from zpp.tune.outer import period

    w = loss_window(loss_steps)
    outer = [n for n in names if n in LOSS_CANDIDATES]
    if not outer:
        return {"error": "no hierarchical candidate in --candidates (" + ", ".join(LOSS_CANDIDATES) + ")"}
    if cluster.nodes < 2:  # nothing to race: not worth the reference's N steps
        for n in outer:
            rows[n] = {"mode": n, "skipped": "one node: the hierarchical mode has no link between nodes to save"}
        return {"error": "one node"}
    ref = runner(modes[best["mode"]], end=loss_steps, tag="-loss")
    if "error" in ref:
        best["race_error"] = ref["error"]
        return {"error": f"the reference run ({best['mode']}, {loss_steps} steps) failed: {ref['error']}"}
    curve = ref["loss_curve"]
    tail = curve[-w:]
    if len(tail) < w or any(x is None for x in tail):
        return {"error": f"the reference run ({best['mode']}) gave no loss for its last {w} steps: does the job "
                         "call engine.backward(loss)?"}
    if not all(math.isfinite(x) for x in tail):
        return {"error": f"the reference run ({best['mode']}) diverged: its last {w} losses are {tail}"}
    target = sum(tail) / w
    k = steps_to(curve, target, w)
    best.update(race_steps=loss_steps, race_step_s=mean_step_s(ref), steps_to_target=k,
                time_to_target_s=k * mean_step_s(ref), loss_curve=curve)
    race = {"target_loss": target, "window": w, "reference": best["mode"], "loss_steps": loss_steps}
    longest = max(MIN_SYNC_EVERY, loss_steps // 2)  # every fragment syncs at least twice in the N steps
    for n in outer:
        base = cost.MODES[n]
        inner_s, sync_s = cost.outer_times(base, units, cluster, profile, micro_steps=micro)
        if inner_s > 0:
            delay, every = period(inner_s, sync_s, base.outer.fragments, min_sync_every=MIN_SYNC_EVERY)
        else:  # the profile's step is all communication: no inner time to hide a sync behind
            delay, every = longest - 1, longest
        capped = every > longest
        if capped:
            every, delay = longest, min(delay, longest - 1)
        mode = dataclasses.replace(base, outer=dataclasses.replace(base.outer, sync_every=every, delay=delay))
        modes[n] = mode
        p = cost.predict([mode], units=units, cluster=cluster, profile=profile, micro_steps=micro)[0]
        budget = RACE_MARGIN * best["time_to_target_s"]
        row = rows[n] = {"mode": n, "pred_step_s": p.step_s, "pred_inter_bytes": p.inter_bytes,
                         "pred_intra_bytes": p.intra_bytes, "pred_peak_bytes": p.peak_bytes,
                         "fits": memory_gb is None or p.peak_bytes <= memory_gb * 1e9,
                         "outer": mode.config(rpn)["zpp"]["outer"], "pred_inner_step_s": inner_s,
                         "pred_sync_s": sync_s, "pred_sync_bytes": p.inter_bytes * every / base.outer.fragments,
                         "race_budget_s": budget}
        if capped:  # the sync needs a longer H than the race can judge: the syncs will stall the steps
            row["sync_every_capped"] = (f"H={every}, half the race's {loss_steps} steps; the cost model's period "
                                        "needs more (a longer --loss-steps races it)")
        if not row["fits"]:
            continue
        m = runner(mode, end=loss_steps, budget=(budget, 2 * loss_steps))
        if "error" in m:
            row["error"] = m["error"]
            continue
        k = steps_to(m["loss_curve"], target, w)
        row.update(measured_step_s=m["step_s"], measured_inter_bytes=m["inter_bytes"],
                   measured_peak_bytes=m["peak_rss_bytes"], race_step_s=mean_step_s(m), steps_to_target=k,
                   time_to_target_s=None if k is None else k * mean_step_s(m), loss_curve=m["loss_curve"],
                   race_steps=m["end"], measured_syncs=m.get("outer_syncs"))
        if m.get("outer_syncs"):  # a window holds whole fragment syncs, not whole periods: bytes per sync
            row["measured_sync_bytes"] = m["inter_bytes"] * len(m["step_times"]) / m["outer_syncs"]
        # not reached in steps that took less than the reference's time to the target (its
        # first steps were slower than the rest): a longer run might have won
        row["race_short"] = (k is None and m["end"] < 2 * loss_steps
                             and m["end"] * mean_step_s(m) < best["time_to_target_s"])
    return race


def choose(prof: dict[str, Any], names: list[str], runner, *, confirm: int, memory_gb: float | None,
           loss_steps: int = 0) -> dict:
    """Predict every candidate from the profile, run the ``confirm`` best, pick the fastest
    measured (see [Note: tuning a job]); with ``loss_steps``, race it against the
    hierarchical candidates in ``names`` by time to a target loss ([Note: the loss race])."""
    from zpp.tune import cost

    intra, inter = links_from_probe(prof)
    cluster = cost.Cluster(prof["nodes"], prof["ranks_per_node"], intra, inter)
    units = _units(prof)
    micro = max(1, round(prof.get("micro_steps", 1)))  # backward passes per optimizer step
    z3 = cost.MODES[PROFILE_MODE]
    if prof.get("link_wait_s") is not None:  # measured: the step less its waits on the link
        compute, source = max(0.0, mean_step_s(prof) - prof["link_wait_s"]), "step less its link waits"
    else:  # a profile without waits: the cost model's step inverted
        compute = cost.compute_from_step(prof["step_s"], cost.traffic(z3, units, cluster, micro_steps=micro),
                                         cluster)
        source = "the cost model's step inverted"
    other = int(prof["peak_rss_bytes"] - cost.memory(z3, units, cluster)["peak"])
    profile = cost.Profile(compute, other)
    rows: dict[str, dict[str, Any]] = {}
    modes = {n: cost.MODES[n] for n in names}
    for n in names:
        if n in LOSS_CANDIDATES:
            continue
        p = cost.predict([cost.MODES[n]], units=units, cluster=cluster, profile=profile, micro_steps=micro)[0]
        rows[n] = {"mode": n, "pred_step_s": p.step_s, "pred_inter_bytes": p.inter_bytes,
                   "pred_intra_bytes": p.intra_bytes, "pred_peak_bytes": p.peak_bytes,
                   "fits": memory_gb is None or p.peak_bytes <= memory_gb * 1e9}
    if PROFILE_MODE in rows:
        rows[PROFILE_MODE].update(measured_step_s=prof["step_s"], measured_inter_bytes=prof["inter_bytes"],
                                  measured_peak_bytes=prof["peak_rss_bytes"],
                                  measured_metadata_s=(prof.get("link_waits") or {}).get("metadata"))
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
                 measured_peak_bytes=m["peak_rss_bytes"], measured_metadata_s=(m.get("link_waits") or {}).get("metadata"))
    measured = [r for r in rows.values() if "measured_step_s" in r and r.get("fits", True)]
    if not measured:
        raise RuntimeError("zpp tune --job: no candidate ran")
    best = min(measured, key=lambda r: r["measured_step_s"])
    pred_best = ranked[0]["mode"] if ranked else best["mode"]
    why = (f"{best['mode']} is the fastest measured ({best['measured_step_s']:.3f} s/step) of "
           f"{', '.join(r['mode'] for r in measured)}; the cost model ranked {pred_best} first")
    winner, race = best, None
    if loss_steps:
        race = _race(rows, modes, best, names, runner, units=units, cluster=cluster, profile=profile,
                     rpn=prof["ranks_per_node"], loss_steps=loss_steps, memory_gb=memory_gb, micro=micro)
        if "error" in race:
            why += f"; no loss race: {race['error']}"
        else:
            raced = [r for r in rows.values() if r["mode"] in LOSS_CANDIDATES and r.get("time_to_target_s") is not None]
            fastest = min(raced, key=lambda r: r["time_to_target_s"], default=None)
            if fastest is not None and fastest["time_to_target_s"] * WIN_MARGIN <= best["time_to_target_s"]:
                winner = fastest
            lost = [f"{r['mode']} " + (f"{r['time_to_target_s']:.1f} s" if r.get("time_to_target_s") is not None
                                       else f"not in its {r['race_steps']} steps"
                                       + (f" ({r['race_steps'] * r['race_step_s']:.1f} s: the race was cut short "
                                          "by its first steps' time)" if r.get("race_short")
                                          else "") if "race_step_s" in r
                                       else r.get("skipped") or r.get("error") or "not run")
                    for r in rows.values() if r["mode"] in LOSS_CANDIDATES]
            why += (f"; to {best['mode']}'s loss after {loss_steps} steps ({race['target_loss']:.4f}, mean of "
                    f"{race['window']}): {best['mode']} {best['time_to_target_s']:.1f} s, " + ", ".join(lost)
                    + f": {winner['mode']} wins"
                    + ("" if winner is not best or fastest is None
                       or fastest["time_to_target_s"] > best["time_to_target_s"]
                       else f" (a tie: {fastest['mode']} is not {WIN_MARGIN:g}x sooner)"))
    return {"winner": winner["mode"], "winner_sections": modes[winner["mode"]].config(prof["ranks_per_node"]),
            "why": why, "links": {"intra_Bps": intra.bandwidth, "inter_Bps": inter.bandwidth},
            "compute_s": compute, "compute_source": source, "other_bytes": other, "nodes": prof["nodes"],
            "micro_steps": micro,
            "ranks_per_node": prof["ranks_per_node"], "profile": prof, "race": race,
            "candidates": list(rows.values())}


def format_report(rep: dict[str, Any]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    lines = [f"# zpp tune --job: {rep['nodes']} nodes x {rep['ranks_per_node']} ranks; measured links: inside "
             f"{rep['links']['intra_Bps'] / 1e6:.1f} MB/s, between nodes {rep['links']['inter_Bps'] / 1e6:.2f} MB/s "
             f"per node; compute {rep['compute_s']:.3f} s/step",
             f"{'mode':<14}{'pred_s':>9}{'measured_s':>11}{'pred_inter_MB':>14}{'meas_inter_MB':>14}"
             f"{'pred_peak_MB':>13}"]
    if rep.get("race") and "error" not in rep["race"]:
        lines[1] += f"{'race_steps':>11}{'to_target':>10}{'to_target_s':>12}"
    for r in sorted(rep["candidates"], key=lambda r: r.get("pred_step_s", 0)):
        mark = "  <- winner" if r["mode"] == rep["winner"] else ("  (over --memory-gb)" if not r.get("fits", True)
                                                                  else "")
        pi, mi = r.get("pred_inter_bytes"), r.get("measured_inter_bytes")
        lines.append(f"{r['mode']:<14}{f(r.get('pred_step_s'), '.3f'):>9}{f(r.get('measured_step_s'), '.3f'):>11}"
                     f"{f(pi and pi / 1e6, '.2f'):>14}{f(mi and mi / 1e6, '.2f'):>14}"
                     f"{f(r.get('pred_peak_bytes') and r['pred_peak_bytes'] / 2**20, '.0f'):>13}"
                     + (f"{f(r.get('race_steps'), 'd'):>11}{f(r.get('steps_to_target'), 'd'):>10}"
                        f"{f(r.get('time_to_target_s'), '.1f'):>12}" if rep.get("race") and "error" not in rep["race"]
                        else "")
                     + mark + (f"  error: {r['error']}" if "error" in r else "")
                     + (f"  skipped: {r['skipped']}" if "skipped" in r else ""))
    lines.append(f"# {rep['why']}")
    won = next((r for r in rep["candidates"] if r["mode"] == rep["winner"]), {})
    meta, step = won.get("measured_metadata_s"), won.get("measured_step_s")
    if meta is not None and step and meta >= METADATA_ADVICE * step:
        lines.append(f"# {rep['winner']}'s training thread waited {meta:.3f} s of its {step:.3f} s step in the per-call "
                     "metadata check (see [Note: metadata check] in zpp/comm/transport.py); once the job runs, "
                     '"zpp": {"check_metadata": false} removes the checks')
    mb = rep.get("micro_batch") or {}
    if "why" in mb:
        lines.append(f"# {mb['why']}")
    elif "skipped" in mb:
        lines.append(f"# micro-batch: {mb['skipped']}")
    return "\n".join(lines)
