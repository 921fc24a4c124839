"""One MPI rank of a :func:`tests.dist.run_world` world.

    mpiexec -n N python -m tests._mpi_worker module:qualname RESULTDIR
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} module:qualname RESULTDIR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mpi4py import MPI  # initializes MPI; the rank names this process's result file

    from tests.dist import run_rank

    run_rank(argv[2], MPI.COMM_WORLD.Get_rank(), target=argv[1])


if __name__ == "__main__":
    main(sys.argv)
