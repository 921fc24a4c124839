"""A trial run of ``zpp tune --job``: the user's own script, its config overridden by one
candidate mode, timed for a few steps; the script is stopped after them.

    ZPP_TUNE_TRIAL=/tmp/trial.json python train.py ...   # set by `zpp tune --job` (zpp/tune/job.py)

[Note: tune trials]
``zpp tune --job`` runs the job the user would run, as DeepSpeed's autotuner does, with
``$ZPP_TUNE_TRIAL`` naming a JSON file ``{"overrides": {...}, "start": S, "end": E, "out":
path}`` (and for a race against a time, ``"budget_s": T, "max_end": M``: after
``DECIDE_AFTER`` timed steps every rank takes the slowest rank's mean step ``t`` and the
trial ends at step ``min(M, max(E, k, ceil(T / t)))``, ``k`` the step reached, the same on
every rank). :func:`zpp.initialize` then (:func:`apply`) merges the overrides into the job's
DeepSpeed config (the switches that make a mode are the candidate's alone, so none of the
job's survives into another mode; its buckets, thresholds and offload stay), and
:func:`attach` wraps ``engine.step``: steps ``1..S`` are untimed, ``S+1..E`` are timed from
one step's end to the next (the whole iteration: forward, backward, step), and
``engine.backward``: the loss of every step, the sum of the shares its backward passes
returned (``loss / gradient_accumulation_steps`` each, or the loss as given with
``scale_wrt_gas=False``, the Hugging Face Trainer's way of passing a loss it divided
itself): the mean over the step's micro-batches either way, read off the device at the end
and averaged over the world, so every node's replica counts in the hierarchical mode. A step
is an optimizer step: a ``step()`` call off the accumulation boundary (a micro-step of
gradient accumulation, however the front-end sets the boundary) only counts its backward
pass (``micro_steps``: backward passes per timed step; the job's
``gradient_accumulation_steps`` where none went through ``engine.backward``, with
``backward_seen`` false). In the hierarchical mode the syncs in flight when the timing
starts are finished first (their bytes stay out of the window), and the syncs started in the
timed steps are finished and counted (``outer_syncs``): a window holds whole fragment syncs,
not a whole number of periods. Then every rank measures the links with one all-gather over
the world and one inside the node (1 MiB per rank each; the cost model turns their times
into bandwidths), rank 0 writes the metrics to ``out`` (step times, wire counters, node-link
bytes of the kernel where the emulated cluster runs, units and gather trace, model-state
bytes, the ranks' largest peak RSS, the loss curve, and the seconds per step the training
thread waited on the link, per phase of :meth:`ZeroEngine.link_waits`, averaged over the
ranks), the engine closes and the process exits with status 0. Everything is over the job's
world (``engine.job_world``): in the hierarchical mode ``engine.world`` is the node. Nothing
else of the job changes: its data, model, micro-batch and optimizer are its own.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zpp.zero.engine import ZeroEngine

__all__ = ["DECIDE_AFTER", "LINK_PROBE_BYTES", "MODE_KEYS", "TRIAL_ENV", "active", "apply", "attach",
           "probe_all_gather"]

TRIAL_ENV = "ZPP_TUNE_TRIAL"
DECIDE_AFTER = 5
"""Timed steps after which a trial with a ``budget_s`` fixes its last step."""
LINK_PROBE_BYTES = 1 << 20
"""Bytes per rank of each link probe (an all-gather over the world, one inside the node)."""


def active() -> dict[str, Any] | None:
    """The trial this process runs, or None."""
    path = os.environ.get(TRIAL_ENV)
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


#: The ``zero_optimization`` keys that make a mode: a candidate's replace the job's, every other
#: key of the job's section (buckets, persistence threshold, offload) stays.
MODE_KEYS = ("stage", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")


def apply(config: Mapping[str, Any], trial: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a DeepSpeed dict, copied) with the trial's sections: in
    ``zero_optimization`` the :data:`MODE_KEYS` are the trial's alone, in ``zpp`` the keys are
    merged, any other section replaces the job's."""
    out = json.loads(json.dumps(dict(config)))
    for section, value in trial.get("overrides", {}).items():
        if section == "zpp":
            out["zpp"] = {**(out.get("zpp") or {}), **value}
        elif section == "zero_optimization":
            keep = {k: v for k, v in (out.get(section) or {}).items() if k not in MODE_KEYS}
            out[section] = {**keep, **value}
        else:
            out[section] = value
    return out


def probe_all_gather(transport, nbytes: int) -> float:
    """Seconds of one all-gather of ``nbytes`` per rank (after one untimed), on every rank."""
    if transport.world_size == 1:
        return 0.0
    inp = torch.zeros(nbytes // 4, dtype=torch.float32)
    out = torch.empty(transport.world_size * inp.numel(), dtype=torch.float32)
    transport.all_gather(out, inp)
    transport.barrier()
    t0 = time.perf_counter()
    transport.all_gather(out, inp)
    return time.perf_counter() - t0


class _Timer:
    def __init__(self, engine: ZeroEngine, trial: Mapping[str, Any]) -> None:
        self.engine, self.trial = engine, trial
        self.start, self.end = int(trial.get("start", 1)), int(trial.get("end", 3))
        self.budget_s = trial.get("budget_s")
        if self.budget_s is not None:  # ends between "end" and "max_end", decided after DECIDE_AFTER timed steps
            self.min_end, self.end = self.end, max(self.end, int(trial["max_end"]))
        self.count = 0
        self.times: list[float] = []
        self.last = 0.0
        self.link0 = None  # the node link's counters at the start of the timed steps (zpp cluster)
        self.syncs0 = 0  # the outer sync's fragment syncs started before the timed steps
        self.losses: list[torch.Tensor | None] = []  # per step: the sum of its backward passes' loss shares
        self.pending: torch.Tensor | None = None
        self.micro = 0  # backward passes since the timing began
        self.step, self.backward = engine.step, engine.backward

    def record_backward(self, loss, *args, **kwargs):
        out = self.backward(loss, *args, **kwargs)  # the loss the step's gradient is of: a 1/gas share, or as given
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            share = out.detach().reshape(()).double()  # no host sync here: read at the end
            self.pending = share if self.pending is None else self.pending + share
        self.micro += 1
        return out

    def __call__(self, *args, **kwargs):
        boundary = self.engine.is_gradient_accumulation_boundary()
        out = self.step(*args, **kwargs)
        if not boundary:  # a micro-step of an accumulation: the optimizer step is the boundary's
            return out
        self.count += 1
        self.losses.append(self.pending)
        self.pending = None
        now = time.perf_counter()
        if self.count == self.start:
            from zpp.cluster.linkstats import read_link

            if self.engine.outer is not None:  # a sync started before the window sends nothing in it
                self.engine.outer.wait()
            self.engine.job_world.barrier()
            now = time.perf_counter()
            self.engine.job_world.counters.reset()
            self.link0 = read_link()
            self.engine.link_waits()  # the waits so far: not the window's
            self.syncs0 = self.engine.outer.stats.started if self.engine.outer is not None else 0
            self.micro = 0
        elif self.count > self.start:
            self.times.append(now - self.last)
            if self.budget_s is not None and len(self.times) == DECIDE_AFTER:
                self._decide_end()
        self.last = now
        if self.count >= self.end:
            self.finish()
        return out

    def _decide_end(self) -> None:
        mean = torch.tensor([sum(self.times) / len(self.times)], dtype=torch.float64)
        self.engine.job_world.all_reduce(mean, "max")  # every rank the same number: the same last step
        self.end = min(self.end, max(self.min_end, self.count, math.ceil(float(self.budget_s) / float(mean[0]))))

    def finish(self) -> None:
        from zpp.cluster.linkstats import read_link
        from zpp.comm.topology import topology_of
        from zpp.zero.reduce.overlap import LinkWaits

        e, w = self.engine, self.engine.job_world
        n = max(1, len(self.times))
        syncs = None
        if e.outer is not None:  # the syncs started in the window, finished: all their bytes counted
            e.outer.wait()
            syncs = e.outer.stats.started - self.syncs0
        total = w.counters.total()
        waits = e.link_waits()  # this rank's training thread, blocked on the link in the window
        phases = LinkWaits.PHASES
        mine = torch.tensor([sum(waits.values()), *(waits.get(k, 0.0) for k in phases)], dtype=torch.float64) / n
        w.all_reduce(mine, "sum")
        mine /= w.world_size
        link = read_link()
        eth_per_step = (link - self.link0).tx_bytes / n if link is not None and self.link0 is not None else None
        topo = topology_of(w)
        t_world = probe_all_gather(w, LINK_PROBE_BYTES)
        t_intra = probe_all_gather(topo.intra, LINK_PROBE_BYTES) if topo.ranks_per_node > 1 else 0.0
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
        w.all_reduce(peak, "max")
        losses = torch.tensor([math.nan if x is None else float(x) for x in self.losses], dtype=torch.float64)
        w.all_reduce(losses, "sum")  # NaN where some rank gave no loss
        losses /= w.world_size
        trace = e._prefetch.trace() or ()
        metrics = {
            "overrides": self.trial.get("overrides", {}), "world": w.world_size, "end": self.count,
            "micro_batch": e.train_micro_batch_size_per_gpu(),
            # backward passes per step; none through engine.backward (the job calls loss.backward()
            # itself): its accumulation steps, and no losses
            "micro_steps": self.micro / n if self.micro else float(e.train_config.gradient_accumulation_steps),
            "backward_seen": self.micro > 0,
            "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
            "step_times": self.times, "step_s": sorted(self.times)[len(self.times) // 2] if self.times else None,
            "inter_bytes": total.inter_bytes / n, "intra_bytes": total.intra_bytes / n,
            "outer_syncs": syncs,
            "eth_tx_bytes": eth_per_step,
            "units": [[u.layout.numel, not u.shards_params] for u in e.units],
            "gather_trace": [[i, phase.value] for i, phase in trace],
            "model_state_bytes": sum(e.model_state_bytes().values()), "peak_rss_bytes": float(peak[0]),
            "probe_bytes": LINK_PROBE_BYTES, "probe_world_s": t_world, "probe_intra_s": t_intra,
            # seconds per timed step the training thread waited on communication, the ranks' mean
            "link_wait_s": float(mine[0]), "link_waits": {k: float(v) for k, v in zip(phases, mine[1:].tolist())},
            "loss_curve": [None if math.isnan(x) else x for x in losses.tolist()],  # inf stays: a diverged run
        }
        if w.rank == 0:
            tmp = self.trial["out"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(metrics, f, indent=1)
            os.replace(tmp, self.trial["out"])
        w.barrier()
        e.close()
        sys.exit(0)


def attach(engine: ZeroEngine, trial: Mapping[str, Any]) -> None:
    """Time ``engine.step``, record the losses given to ``engine.backward``, and end the process
    after the trial's last step."""
    timer = _Timer(engine, trial)
    engine.step = timer  # type: ignore[method-assign]
    engine.backward = timer.record_backward  # type: ignore[method-assign]
