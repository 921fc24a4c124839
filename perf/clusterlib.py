"""What the emulated-cluster drivers (perf/cluster_bench.py, perf/train_cluster.py) share: the
record of a run, the cluster brought up at each rate in turn and always taken down, and the
record written as JSON at the end."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import runinfo  # noqa: E402
from zpp import cluster  # noqa: E402


def new_record(nodes: int, ranks_per_node: int, **fields) -> dict:
    """A run's record: when, where, what ran at which git revision (:func:`runinfo.provenance`),
    the cluster's shape, ``fields``, and an empty ``runs``."""
    return {**runinfo.provenance(), "nodes": nodes, "ranks_per_node": ranks_per_node, **fields, "runs": []}


def at_each_rate(nodes: int, rates: str, body: Callable[[str, int], None]) -> None:
    """For each of the comma-separated ``rates``: ``zpp cluster up`` at that rate, then
    ``body(rate, bits per second)``. The cluster is taken down after the last rate, or at
    the first error."""
    try:
        for rate in rates.split(","):
            cluster.up(nodes, rate)
            body(rate, cluster.parse_rate(rate))
    finally:
        cluster.down()


def save(record: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
