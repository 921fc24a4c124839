"""Record a ``zpp bench`` sweep under perf/results/ as JSON (a thin wrapper over zpp.bench).

    python perf/comm_bench.py                                  # the default sweep, 2 nodes x 2 ranks
    python perf/comm_bench.py --sizes 1K:64M --op all_gather --compress all
    python perf/comm_bench.py --backend mpi --nprocs 4
    mpiexec -n 4 python perf/comm_bench.py                     # or under any launcher

Every argument goes to ``zpp bench`` (see ``zpp bench --help``); ``--json`` defaults to
``perf/results/comm_bench-<host>-<UTC time>.json``. The table still goes to stdout.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from zpp.cli import main  # noqa: E402


def record_path(now: datetime.datetime | None = None) -> Path:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return HERE / "results" / f"comm_bench-{platform.node()}-{now:%Y%m%dT%H%M%SZ}.json"


def run(argv: list[str]) -> int:
    if not any(a == "--json" or a.startswith("--json=") for a in argv):
        path = record_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = [*argv, "--json", os.path.relpath(path)]
    return main(["bench", *argv])


if __name__ == "__main__":  # not when a spawned rank re-imports this file
    raise SystemExit(run(sys.argv[1:]))
