"""A trial run of ``zpp tune --job``: the user's own script, its config overridden by one
candidate mode, timed for a few steps; the script is stopped after them.

    ZPP_TUNE_TRIAL=/tmp/trial.json python train.py ...   # set by `zpp tune --job` (zpp/tune/job.py)

[Note: tune trials]
``zpp tune --job`` runs the job the user would run, as DeepSpeed's autotuner does, with
``$ZPP_TUNE_TRIAL`` naming a JSON file ``{"overrides": {...}, "start": S, "end": E, "out":
path}``. :func:`zpp.initialize` then (:func:`apply`) merges the overrides into the job's
DeepSpeed config (the switches that make a mode are the candidate's alone, so none of the
job's survives into another mode; its buckets, thresholds and offload stay), and :func:`attach` wraps ``engine.step``:
steps ``1..S`` are untimed, ``S+1..E`` are timed from one step's end to the next (the
whole iteration: forward, backward, step), then every rank measures the links with one
all-gather over the world and one inside the node (1 MiB per rank each; the cost model
turns their times into bandwidths), rank 0 writes the metrics to ``out`` (step times, wire
counters, node-link bytes of the kernel where the emulated cluster runs, units and gather
trace, model-state bytes, the ranks' largest peak RSS), the engine closes and the process
exits with status 0. Nothing else of the job changes: its data, model, micro-batch and
optimizer are its own.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zpp.zero.engine import ZeroEngine

__all__ = ["LINK_PROBE_BYTES", "MODE_KEYS", "TRIAL_ENV", "active", "apply", "attach", "probe_all_gather"]

TRIAL_ENV = "ZPP_TUNE_TRIAL"
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
        self.count = 0
        self.times: list[float] = []
        self.last = 0.0
        self.link0 = None  # the node link's counters at the start of the timed steps (zpp cluster)
        self.step = engine.step

    def __call__(self, *args, **kwargs):
        out = self.step(*args, **kwargs)
        self.count += 1
        now = time.perf_counter()
        if self.count == self.start:
            from zpp.cluster.linkstats import read_link

            self.engine.world.barrier()
            now = time.perf_counter()
            self.engine.world.counters.reset()
            self.link0 = read_link()
        elif self.count > self.start:
            self.times.append(now - self.last)
        self.last = now
        if self.count >= self.end:
            self.finish()
        return out

    def finish(self) -> None:
        from zpp.cluster.linkstats import read_link
        from zpp.comm.topology import topology_of

        e, w = self.engine, self.engine.world
        n = max(1, len(self.times))
        total = w.counters.total()
        link = read_link()
        eth_per_step = (link - self.link0).tx_bytes / n if link is not None and self.link0 is not None else None
        topo = topology_of(w)
        t_world = probe_all_gather(w, LINK_PROBE_BYTES)
        t_intra = probe_all_gather(topo.intra, LINK_PROBE_BYTES) if topo.ranks_per_node > 1 else 0.0
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
        w.all_reduce(peak, "max")
        trace = e._prefetch.trace() or ()
        metrics = {
            "overrides": self.trial.get("overrides", {}), "world": w.world_size,
            "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
            "step_times": self.times, "step_s": sorted(self.times)[len(self.times) // 2] if self.times else None,
            "inter_bytes": total.inter_bytes / n, "intra_bytes": total.intra_bytes / n,
            "eth_tx_bytes": eth_per_step,
            "units": [[u.layout.numel, not u.shards_params] for u in e.units],
            "gather_trace": [[i, phase.value] for i, phase in trace],
            "model_state_bytes": sum(e.model_state_bytes().values()), "peak_rss_bytes": float(peak[0]),
            "probe_bytes": LINK_PROBE_BYTES, "probe_world_s": t_world, "probe_intra_s": t_intra,
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
    """Time ``engine.step`` for the trial and end the process after its last step."""
    engine.step = _Timer(engine, trial)  # type: ignore[method-assign]
