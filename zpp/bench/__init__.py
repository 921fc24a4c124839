"""``zpp bench``: nccl-tests style benchmarks of zpp's plain and compressed collectives.

One harness (:mod:`zpp.bench.harness`) times every variant (:mod:`zpp.bench.variants`);
:mod:`zpp.bench.report` prints the table and writes JSON, :mod:`zpp.bench.launch` finds or
starts the ranks, :mod:`zpp.bench.command` is the command line. In a program that already
has a transport::

    from zpp.bench import BenchConfig, run_sweep
    rows = run_sweep(BenchConfig(ops=("all_gather",), sizes=(1 << 20,)), world, topology_of(world))

The harness names load on first use, so the command line parses its arguments (and
reports bad ones) without importing torch.
"""
import importlib

from zpp.bench.config import BenchConfig, parse_sizes

__all__ = ["BenchConfig", "Row", "parse_sizes", "run_sweep"]


def __getattr__(name: str):
    if name in ("Row", "run_sweep"):
        return getattr(importlib.import_module("zpp.bench.harness"), name)
    raise AttributeError(f"module 'zpp.bench' has no attribute {name!r}")
